"""The one place that decides how each op runs: `choose(model, devices)` -> `Ops`, when the step is built.

`lumen_jax.train.build` calls `choose` once, from the config and the devices of the mesh; the model
receives the `Ops` (a static part of its graph) and hands it to every op it calls, so no op asks at
trace time where it runs. What is decided:

- `attention`: `xla` (the reference, `ops.attention.reference`), `flash` (our Pallas kernels) or
  `cudnn` (cuDNN's fused attention, `ops/cudnn.py`). `model.attention=auto` on GPU is cudnn where
  cuDNN takes the case (bfloat16/float16, head dim a multiple of 8 up to 128, 256 on Hopper; the
  trainer's packed documents through cuDNN's packed layout, Hopper or later; no context
  parallelism): measured 2.1x faster than our kernel forward+backward at 8k causal
  (docs/PERFORMANCE.md). Else flash where the kernel takes the shapes, else xla; off GPU xla.
  `note` names the choice and why (the trainer's start-up line prints it). A sliding window
  (`model.sliding_window`) changes nothing here: every implementation takes it. An explicit `flash` or
  `cudnn` that cannot take the case is a `ConfigError` before anything compiles. On CPU the
  kernels run in Pallas's interpreter (`interpret`); the tiles come from the device
  (`flash_blocks`, also set under cudnn where flash takes the shapes: cuDNN's fallback for rows of
  more documents than its packed layout holds).
- `context`: the mesh splits sequences over `context` (`mesh.context > 1`): attention runs context
  parallelism (`parallel/context.py`: ring or all-gather), each chunk pair by `attention`'s kernel.
  An explicit `cudnn` runs cuDNN on each chunk pair through jax's private forward and backward
  (the backward from the merged output and log-sum-exp, `ops.cudnn.pair_forward`); `auto` runs
  flash there (or xla where flash cannot) until that path has been measured on a GPU, and `note`
  says so.
- `cpu`: the trainer's step on a mesh of one CPU device runs the formulations of `ops/cpu.py`,
  which XLA:CPU runs faster (docs/PERFORMANCE.md, CPU section). Everything else (partitioned
  programs, GPUs, the model traced outside the trainer, e.g. the planner's probe) keeps the plain
  formulations.
- `moe_exchange`: how a mixture of experts' rows cross the `expert` mesh axis
  (`parallel/expert.py`): `ragged` (`ragged_all_to_all`, only the rows) on GPU, `padded`
  (`all_to_all` of worst-case buffers) elsewhere: XLA:CPU does not implement the ragged op.
- `moe_matmul`: how the experts' grouped matmuls run (`ops/grouped.py`): `ragged`
  (`jax.lax.ragged_dot`, a grouped GEMM) on GPU, `blocks` (a loop over row blocks in use)
  elsewhere: XLA:CPU lowers `ragged_dot` as a dense matmul against every expert.
- `regather`: where the remat policy saves a projection's input (`model.remat=none`), the
  column-parallel projections under sequence parallelism keep their input's own rows, not the
  gathered input, and gather them again in the backward (`ops.projection.project_columns`;
  Megatron's choice, Korthikanti et al. 2022): d_model * (t - 1) / t elements less saved per token
  and input, one all-gather more per input in the backward. Whether the mesh gathers that input
  at all is the active rules' (`ops.projection.regathers`, at trace time, as collective matmuls).
- `fp8`: which layer types' projections run fp8 matmuls (`model.fp8`); `layer_runs` splits the
  layer stack into runs of equal setting (the first and last layers can stay in bf16), and
  `stage_runs` a pipeline stage's layer slots (the kept layers sit in some stages' slots only).

`Ops.plain(model)` is the choice without a backend: plain formulations, `model.attention` taken as
written (`auto` as xla), compiled kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from lumen_jax.config import ConfigError, Fp8Config, ModelConfig
from lumen_jax.kernels import flash_attention as flash_lib
from lumen_jax.ops import cudnn as cudnn_lib
from lumen_jax.ops import fp8 as fp8_lib

LAYER_TYPES = ("attention", "mlp")  # the layer types whose projections `model.fp8.layers` can pick


@dataclasses.dataclass(frozen=True)
class Ops:
    """How the ops of one traced program run (hashable: part of the model's static graph)."""

    attention: str = "xla"  # xla | flash | cudnn
    flash_blocks: flash_lib.BlockSizes | None = None  # flash (and cudnn's fallback): tiles; None: no flash
    interpret: bool = False  # flash: Pallas's interpreter (the only mode on CPU)
    context: bool = False  # sequences split over the `context` mesh axis (context-parallel attention)
    cpu: bool = False  # the ops/cpu.py formulations (the trainer's step on one CPU device)
    moe_exchange: str = "padded"  # padded | ragged: MoE rows over the `expert` axis (parallel/expert.py)
    moe_matmul: str = "blocks"  # blocks | ragged: the experts' grouped matmuls (ops/grouped.py)
    fp8: Fp8Config = Fp8Config()  # model.fp8
    fp8_types: tuple[str, ...] = ()  # layer types with fp8 projections in some layer
    fp8_on: bool = True  # False inside a run of layers kept in the compute dtype (`layer_runs`)
    # A traced bool inside a run of pipeline layer slots that hold a kept layer on some stages only
    # (`stage_runs`): where it holds, fp8's projections compute in the compute dtype (`ops.fp8.dot`).
    fp8_keep: Any = dataclasses.field(default=None, compare=False)
    # delayed: every amax history of the run is known not empty (`by_state`): scales from the
    # histories alone, not waiting for the current amaxes (`ops.fp8.delayed_scale`)
    fp8_warm: bool = False
    # the remat policy saves the projections' inputs (`remat: none`): under sequence parallelism the
    # column-parallel projections keep their input's local rows, not the gathered input, and gather
    # them again for the weight gradients (`ops.projection.project_columns`); True as `model.remat`'s default
    regather: bool = True
    note: str = dataclasses.field(default="", compare=False)  # how `auto` was resolved, for the start-up line

    @classmethod
    def plain(cls, model: ModelConfig, **changes: Any) -> Ops:
        """The choice without a backend (see the module docstring), with `changes` applied."""
        types = tuple(t for t in LAYER_TYPES if fp8_lib.runs_fp8(model.fp8, model.num_layers, t))
        attention = model.attention if model.attention in ("flash", "cudnn") else "xla"
        return cls(**{"attention": attention, "fp8": model.fp8, "fp8_types": types,
                      "regather": model.remat == "none", **changes})

    def projection(self, layer_type: str | None) -> str:
        """How a projection of `layer_type` (attention | mlp | None: the logits) runs:
        `fp8` (recipe `fp8.recipe`), `fp8_kept` (an fp8 layer type in a layer kept in the compute
        dtype), `token_grad` (ops/cpu.py) or `einsum`."""
        if layer_type in self.fp8_types:
            return "fp8" if self.fp8_on else "fp8_kept"
        return "token_grad" if self.cpu else "einsum"

    def weight_dtype(self, names: tuple[str | None, ...], compute_dtype: str) -> str:
        """The dtype the train step casts a parameter with logical axes `names` to while it is still
        sharded, before any gather ("": kept float32): `compute_dtype`, except norm scales (norms
        compute in float32) and, where fp8 runs, every weight (fp8 quantizes from the master copy)."""
        if "norm" in names or self.fp8_types or compute_dtype == "float32":
            return ""
        return compute_dtype

    def layer_runs(self, num_layers: int) -> list[tuple[int, int, Ops]]:
        """The layer stack as runs [start, stop) with the `Ops` of each run: one run, unless some
        layers keep the compute dtype among fp8 layers (`fp8.layer_runs`)."""
        runs = fp8_lib.layer_runs(self.fp8, num_layers) if self.fp8_types else []
        if len(runs) <= 1:
            return [(0, num_layers, self)]
        return [(start, stop, dataclasses.replace(self, fp8_on=on)) for start, stop, on in runs]

    def by_state(self, fn: Callable[..., Any], state: Any, *args: Any) -> Any:
        """`fn(ops, *args)` for a run of layers whose model state is `state` (the run's stacked
        layer state): with fp8's delayed recipe, one `lax.cond` per run between `fn` with
        `fp8_warm` (every history holds an amax, `ops.fp8.warm`: each step's program after the
        first) and `fn` as it is (the first step: an empty history's scale waits for the current
        amax). Both give the same values where both apply; the warm one quantizes each operand in
        the pass that produces it. A slot whose `fp8_keep` is traced (a kept layer on some pipeline
        stages, whose histories stay empty) and the other recipes: `fn(self, *args)`."""
        if not (self.fp8_types and self.fp8_on and self.fp8_keep is None and self.fp8.recipe == "delayed"):
            return fn(self, *args)
        warm_ops = dataclasses.replace(self, fp8_warm=True)
        histories = nnx.filter_state(state, fp8_lib.Fp8History)
        if not jax.tree.leaves(histories):
            return fn(self, *args)
        def hot(*a: Any) -> Any:
            with jax.named_scope(fp8_lib.WARM_SCOPE):  # names the branch that runs after the first step
                return fn(warm_ops, *a)
        return jax.lax.cond(fp8_lib.warm(histories), hot, lambda *a: fn(self, *a), *args)

    def stage_runs(self, split: Sequence[int], stage: Any) -> list[tuple[int, int, Ops]]:
        """`layer_runs` of one virtual pipeline stage's layer slots: `split` the real layers of each
        virtual stage (summing to the model's), `stage` its index (traced: every stage runs this one
        program). A slot that holds a kept layer on no stage runs fp8; one that holds it on some
        (slot 0 of stage 0: the first layer; the last real slot of the last stage: the last layer)
        runs with `fp8_keep` = whether `stage` is one of them, fp8 elsewhere, as one GEMM in the
        compute dtype on every stage. A tick lasts as long as the dearest stage, which runs that
        slot in the compute dtype anyway: the first layer costs nothing more; each other such slot
        costs one layer's projections at the compute dtype's rate instead of fp8's per tick."""
        slots = max(split)
        if not self.fp8_types:
            return self.layer_runs(slots)
        mask = fp8_lib.layer_mask(self.fp8, sum(split))
        starts = [sum(split[:w]) for w in range(len(split))]
        kept_on = [[w for w in range(len(split)) if j < split[w] and not mask[starts[w] + j]] for j in range(slots)]
        runs: list[tuple[int, int, Ops]] = []
        for j, stages in enumerate(kept_on):
            if runs and not stages and runs[-1][2].fp8_keep is None:
                runs[-1] = (runs[-1][0], j + 1, runs[-1][2])
                continue
            keep = jnp.isin(stage, jnp.asarray(stages)) if stages else None
            runs.append((j, j + 1, dataclasses.replace(self, fp8_keep=keep)))
        return runs


def choose(model: ModelConfig, devices: Sequence[Any], context: int = 1) -> Ops:
    """The `Ops` of the trainer's step on a mesh over `devices` whose `context` axis has `context`
    devices (see the module docstring).

    Raises:
      ConfigError: `model.attention=flash` or `cudnn` on a case that implementation cannot take on
        this backend.
    """
    device = devices[0]
    platform = device.platform
    interpret = platform == "cpu"
    h = model.resolved_head_dim
    flash_problem = flash_lib.check_supported((1, 1, model.num_heads, h), (1, 1, model.num_kv_heads, h),
                                              interpret=interpret)
    cudnn_problem = cudnn_lib.check_supported(platform, getattr(device, "compute_capability", "0.0"),
                                              model.compute_dtype, h)
    attention, note = _attention(model.attention, platform, flash_problem, cudnn_problem, context > 1)
    blocks = None
    if attention == "flash" or (attention == "cudnn" and flash_problem is None):
        blocks = flash_lib.BlockSizes.default(h, device).with_overrides(model.flash_block_q, model.flash_block_kv)
    return Ops.plain(model, attention=attention, flash_blocks=blocks, interpret=interpret, context=context > 1,
                     cpu=platform == "cpu" and len(devices) == 1, note=note,
                     moe_exchange="ragged" if platform == "gpu" else "padded",
                     moe_matmul="ragged" if platform == "gpu" else "blocks")


_CONTEXT = ("under context parallelism cuDNN runs only when asked (model.attention=cudnn): its chunk-pair path "
            "has not been measured on a GPU yet")


def _attention(asked: str, platform: str, flash_problem: str | None, cudnn_problem: str | None,
               context: bool) -> tuple[str, str]:
    """(implementation, note) for `model.attention=asked` (module docstring)."""
    if asked == "flash" and flash_problem:
        raise ConfigError(f"model.attention=flash: {flash_problem}; choose a model shape the kernel takes, "
                          "or model.attention=xla (or auto: the fastest that takes it)")
    if asked == "cudnn" and cudnn_problem:
        raise ConfigError(f"model.attention=cudnn: {cudnn_problem}; use model.attention=flash, xla "
                          "or auto (cuDNN where it takes the case)")
    on_gpu_flash = "flash" if flash_problem is None and platform == "gpu" else "xla"
    if asked == "cudnn" and context:
        return "cudnn", ("attention=cudnn: cuDNN on each chunk pair of context parallelism (forward and backward "
                         f"from the merged output and log-sum-exp; a sliding window through {on_gpu_flash})")
    if asked != "auto":
        return asked, ""
    if platform != "gpu":
        return "xla", f"attention=auto: xla (cudnn and flash run on GPU; this is {platform})"
    if cudnn_problem is None and not context:
        return "cudnn", "attention=auto: cudnn (cuDNN takes this dtype, head dim and the packed documents; faster than flash)"
    why = f"cuDNN: {_CONTEXT if cudnn_problem is None else cudnn_problem}"
    if flash_problem is None:
        return "flash", f"attention=auto: flash ({why})"
    return "xla", f"attention=auto: xla ({why}; the flash kernel: {flash_problem})"
