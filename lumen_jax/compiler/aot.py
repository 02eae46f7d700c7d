"""The trainer's real step compiled for an H100 or H200 on a machine without a GPU (deviceless
ahead-of-time compilation), and what XLA's GPU passes made of it.

`compile_step(cfg, "h100")` builds the step as `python -m lumen_jax.lower` does (`lower.lower_step`,
the ops a Hopper GPU gets) on the devices of a topology that `jax.experimental.topologies` makes
from a `GpuTargetConfigProto` (`TARGETS`: the device description the CUDA plugin would read from
the GPU, with the CUDA runtime and cuDNN versions), and compiles it with XLA's GPU compiler: the
GEMM rewriter (cuBLAS / cuBLASLt custom calls, the fp8 GEMMs with their scales), the fusions, the
scheduler, the buffer assignment (`memory_analysis()`). Nothing runs and no GPU is needed; it
needs the CUDA plugin (`pip install "jax[cuda12]"`, docs/GPU.md), which this module imports only
when compiling.

What differs from the program a GPU compiles: nothing is autotuned (no device to time on), so every
GEMM takes its default (cuBLAS's heuristic algorithm; with `xla_gpu_enable_triton_gemm` on, XLA's
Triton GEMM fusions with default tiles instead of cuBLAS). On a GPU the autotuner chose cuBLASLt
for all 42 fp8 GEMMs of llama3_1b (docs/PERFORMANCE.md), so `COMPILER_OPTIONS` turns Triton GEMMs
off. `gemm_report` reads the compiled text (`hlo.parse`): GEMMs by operand dtype, the fp8 GEMMs'
epilogues, the fusions around the fp8 operands, and the bytes the non-GEMM fusions move.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
from typing import Any, Iterator

from lumen_jax.compiler import hlo
from lumen_jax.config import Config
from lumen_jax.ops.fp8 import WARM_SCOPE

PLUGIN = "jax_plugins.xla_cuda12"  # the module `pip install "jax[cuda12]"` adds
INSTALL = 'pip install "jax[cuda12]==<this jax version>" (docs/GPU.md, "Compile for a GPU without one")'

_HOPPER = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 9 }}
device_description_str: "{name}"
"""

# GpuTargetConfigProto text per GPU (SXM parts: 132 SMs, 50 MiB L2; the device memory XLA may use
# is a little under the datasheet's). `runtime_version` must be set: without it XLA's GPU compiler
# takes CUDA 0.0 and refuses features (command buffers, some cuBLASLt epilogues) by version.
BANDWIDTH = {"h100": 3352320000000, "h200": 4800000000000}  # HBM bytes/s (datasheet)
TARGETS = {
    "h100": _HOPPER.format(bandwidth=BANDWIDTH["h100"], memory=84929347584, name="NVIDIA H100 80GB HBM3"),
    "h200": _HOPPER.format(bandwidth=BANDWIDTH["h200"], memory=150754820096, name="NVIDIA H200"),
}
# Triton GEMM fusions off: without a device to autotune on they would replace every cuBLAS(Lt) call
# with an untuned Triton GEMM, which is not what the GPU ran (module docstring).
COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}

GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")


class PluginMissing(RuntimeError):
    """The CUDA plugin, which holds XLA's GPU compiler, is not installed."""


def plugin_installed() -> bool:
    try:
        return importlib.util.find_spec(PLUGIN) is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


def gpu_devices(gpu: str) -> list[Any]:
    """The devices of a one-GPU topology of `gpu` (h100 | h200); they compile, they cannot run.

    Raises:
      PluginMissing: no CUDA plugin.
    """
    if not plugin_installed():
        raise PluginMissing(f"compiling for a GPU needs the CUDA plugin ({PLUGIN}): {INSTALL}")
    # The plugin checks the CUDA libraries against the GPUs when JAX starts its backends; with no
    # GPU (no driver) that check fails and the plugin is dropped: skip it (set before JAX starts).
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="cuda", target_config=TARGETS[gpu], topology="1x1x1").devices)


@contextlib.contextmanager
def _cudnn_without_gpu() -> Iterator[None]:
    """With the CUDA plugin installed, jax's cuDNN attention finds a cuDNN library but no GPU to ask
    for its compute capability; `ops.cudnn.lowering_without_gpu` answers for it only when the
    library is absent, so hide the library for the time of the lowering."""
    from lumen_jax.ops import cudnn

    fused = cudnn._fused
    if fused is None:
        yield
        return
    saved = fused.cuda_versions
    fused.cuda_versions = None
    try:
        yield
    finally:
        fused.cuda_versions = saved


def compile_step(cfg: Config, gpu: str = "h100", options: dict | None = None) -> Any:
    """The trainer's step for `cfg` on one `gpu`, compiled without a GPU (a `jax.stages.Compiled`:
    `as_text()`, `memory_analysis()`). `options`: XLA options over `COMPILER_OPTIONS`.

    Raises:
      PluginMissing: no CUDA plugin.
      ConfigError: the config does not build on one device.
    """
    from lumen_jax.compiler.lower import lower_step

    devices = gpu_devices(gpu)
    with _cudnn_without_gpu():
        lowered, _ = lower_step(cfg, "cuda", devices, "9.0")
    return lowered.compile(compiler_options={**COMPILER_OPTIONS, **(options or {})})


# --------------------------------------------------------------------------------------------------
# What the compiled program holds
# --------------------------------------------------------------------------------------------------

_OPERANDS = re.compile(r"%([\w.\-]+)")
_BACKEND = re.compile(r'"gemm_backend_config":(\{.*?\}),"force_earliest')


def operands(instr: hlo.Instr) -> list[str]:
    """The names of an instruction's operands (the text inside its opcode's parentheses)."""
    line = instr.line
    start = line.index(instr.op + "(") + len(instr.op) + 1
    depth, end = 1, start
    while depth and end < len(line):
        depth += {"(": 1, ")": -1}.get(line[end], 0)
        end += 1
    return _OPERANDS.findall(line[start:end - 1])


def _fused_computations(module: hlo.Module) -> set[str]:
    """Computations that run inside a fusion or as a reducer (not scheduled instructions)."""
    called = collections.defaultdict(set)
    roots: set[str] = set()
    for i in module.instrs:
        for key, comp in re.findall(r"\b(calls|to_apply)=%?([\w.\-]+)", i.line):
            called[i.computation].add(comp)
            if i.op == "fusion" or key == "to_apply":
                roots.add(comp)
    fused, todo = set(), list(roots)
    while todo:
        c = todo.pop()
        if c not in fused:
            fused.add(c)
            todo += called.get(c, ())
    return fused


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One cuBLAS(Lt) GEMM custom call."""

    name: str
    target: str
    operand_dtypes: tuple[str, ...]  # the two matrices
    output: str  # the result array, e.g. f32[16384,8192]
    scales: int  # scalar operands (fp8: a_scale, b_scale)
    beta: float  # 1: the GEMM adds a matrix operand C to its product (a sum fused into the epilogue)
    alpha: float
    epilogue: str
    amax_output: bool
    per_step: int


@dataclasses.dataclass
class Report:
    """`gemm_report` of one compiled step (counts per step: loops counted)."""

    gemms: dict[str, int]  # "f8e4m3fn x f8e4m3fn -> f32" -> per step
    fp8_epilogues: dict[str, int]  # "out=f32 scales=2 alpha=1 beta=0 epilogue=DEFAULT amax=False" -> per step
    f32_outputs: int  # GEMMs (per step) writing an f32 [>= tokens, N] result
    f32_output_bytes: int  # their bytes per step
    quantize_fusions: int  # fusions (per step) that write an fp8 array from a wider one
    fp8_copies: int  # fusions (per step) that read fp8 and write fp8 (transposes for cuBLASLt's TN layout)
    sources: int  # distinct wide arrays quantized into fp8 GEMM operands (per step)
    source_reads: int  # scheduled instructions (per step) that read those arrays: passes over them
    fusion_bytes: int  # operand + output bytes of every non-GEMM fusion, per step
    fusions: int  # non-GEMM fusions per step
    by_kind: dict[str, int] = dataclasses.field(default_factory=dict)  # fusion bytes by name stem
    # per `ROLES` entry: [non-GEMM fusions per step, their bytes per step] (`fusion_role`)
    by_role: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


ROLES = ("quantize", "fp8 move", "amax", "small", "other")
SMALL = 1 << 20  # bytes: a fusion whose arrays are all at most this is scalar/history work


def _one_byte(a: hlo.Array) -> bool:  # an fp8 array, or one named as its bits (u8/s8)
    return a.dtype.startswith("f8") or a.dtype in ("u8", "s8")


def fusion_role(ins: list[hlo.Array], outs: list[hlo.Array], body: list[hlo.Instr], reducers: dict[str, str],
                small: int = SMALL) -> str:
    """What a non-GEMM fusion does around the fp8 GEMMs, from its arrays and its fused body:

    - `small`: every array it reads or writes is at most `small` bytes (scales, amax histories,
      saved scalars, the last stage of a reduction): its cost is a launch, not bytes;
    - `fp8 move`: it reads and writes one-byte arrays only (scalars aside): fp8 operands copied,
      transposed for cuBLASLt's TN layout, written into or read from the stacks saved for the backward;
    - `quantize`: it writes an fp8 array from a wider one (with whatever else it fuses);
    - `amax`: a max-reduction of a large array whose outputs are all small (an amax's first pass
      over a tensor, fused with nothing that writes a full-size array);
    - `other`: everything else (the model, the loss, the optimizer), as in the bf16 step.
    `reducers`: computation name -> the opcode of its root (a reduce's `to_apply`)."""
    arrays = ins + outs
    if max((a.nbytes for a in arrays), default=0) <= small:
        return "small"
    wide = [a for a in arrays if a.nbytes > 8]
    if wide and all(_one_byte(a) for a in wide):
        return "fp8 move"
    if any(a.dtype.startswith("f8") for a in outs):
        return "quantize"
    is_max = any(i.op == "reduce" and reducers.get(m.group(1)) == "maximum"
                 for i in body if (m := re.search(r"to_apply=%?([\w.\-]+)", i.line)))
    if is_max and max(a.nbytes for a in outs) <= small:
        return "amax"
    return "other"


def _stem(name: str) -> str:
    """A fusion's kind from its name: `loop_convert_fusion.12.remat` -> loop_convert_fusion."""
    return re.sub(r"([._](\d+|remat\d*|double_buffer_clone|clone))+$", "", name)


_PARAM = re.compile(r"\bparameter\((\d+)\)")


def _moved(fusion: hlo.Instr, ins: list[tuple[hlo.Array, ...]], body: list[hlo.Instr]) -> int:
    """Bytes a fusion reads and writes. `ins`: its operands' arrays; `body`: its fused computation.
    An operand the fusion only dynamic-slices is read for the slices; the buffer a
    dynamic-update-slice writes into is updated in place (the update written, the buffer not read)."""
    names = {i.name: i for i in body}
    params = {int(m.group(1)): i.name for i in body if i.op == "parameter" and (m := _PARAM.search(i.line))}
    users: dict[str, list[tuple[hlo.Instr, int]]] = collections.defaultdict(list)
    for i in body:
        for k, o in enumerate(operands(i)):
            users[o].append((i, k))

    def uses_of(name: str) -> list[tuple[hlo.Instr, int]]:  # through bitcasts
        return [v for u, pos in users.get(name, []) for v in (uses_of(u.name) if u.op == "bitcast" else [(u, pos)])]

    read = 0
    for k, arrays in enumerate(ins):
        uses = uses_of(params.get(k, ""))
        if uses and all(u.op == "dynamic-slice" and pos == 0 for u, pos in uses):
            read += sum(u.nbytes for u, _ in uses)
        elif uses and all(u.op == "dynamic-update-slice" and pos == 0 for u, pos in uses):
            continue
        else:
            read += sum(a.nbytes for a in arrays)
    root = body[-1] if body else None  # the text ends a computation with its ROOT
    outs = [names[o] for o in operands(root) if o in names] if root is not None and root.op == "tuple" else [root]
    written = 0
    for o in outs:
        if o is not None and o.op == "dynamic-update-slice" and len(operands(o)) > 1 and operands(o)[1] in names:
            written += names[operands(o)[1]].nbytes
        else:
            written += o.nbytes if o is not None else 0
    return read + written


def gemm_report(text: str, tokens: int, small: int = SMALL) -> Report:
    """What `compiled.as_text()` of a GPU program holds around its GEMMs (see `Report`); `tokens`:
    the rows of a step's activations (batch x sequence), for the f32 [tokens, N] outputs; `small`:
    `fusion_role`'s bound in bytes of a small fusion."""
    module = hlo.parse(text, prefer=WARM_SCOPE)  # fp8 delayed: the branch of every step after the first
    fused = _fused_computations(module)
    top = [i for i in module.instrs if i.computation not in fused and module.executions(i)]
    by_name = {i.name: i for i in module.instrs if i.computation not in fused}
    readers: dict[str, list[hlo.Instr]] = collections.defaultdict(list)
    for i in top:
        if i.op not in ("tuple", "get-tuple-element", "bitcast", "while"):  # these move no bytes
            for o in operands(i):
                readers[o].append(i)

    def arrays(name: str) -> tuple[hlo.Array, ...]:
        i = by_name.get(name)
        return i.arrays if i else ()

    def dims(name: str) -> tuple[int, ...] | None:
        a = arrays(name)
        return a[0].dims if a else None

    def dtype(name: str) -> str:
        a = arrays(name)
        return a[0].dtype if a else "?"

    def producer(name: str) -> hlo.Instr | None:  # through bitcasts and tuple elements
        i = by_name.get(name)
        while i is not None and i.op in ("bitcast", "get-tuple-element", "copy") and operands(i):
            i = by_name.get(operands(i)[0])
        return i

    gemms = []
    for i in top:
        target = hlo.target_of(i.line)
        if i.op != "custom-call" or target not in GEMM_TARGETS:
            continue
        ops = operands(i)
        cfg = json.loads(m.group(1)) if (m := _BACKEND.search(i.line)) else {}
        gemms.append(Gemm(name=i.name, target=target, operand_dtypes=tuple(dtype(o) for o in ops[:2]),
                          output=str(i.arrays[0]), scales=sum(dims(o) == () for o in ops[2:]),
                          beta=float(cfg.get("beta", 0.0)), alpha=float(cfg.get("alpha_real", 1.0)),
                          epilogue=str(cfg.get("epilogue", "?")), amax_output=bool(cfg.get("damax_output", False)),
                          per_step=module.executions(i)))

    count: dict[str, int] = collections.Counter()
    epilogues: dict[str, int] = collections.Counter()
    f32_n = f32_bytes = 0
    for g in gemms:
        out = hlo.Array(g.output.split("[")[0], tuple(int(d) for d in g.output.split("[")[1].rstrip("]").split(",") if d))
        count[f"{' x '.join(g.operand_dtypes)} -> {out.dtype}"] += g.per_step
        if g.target.endswith("$f8"):
            epilogues[f"out={out.dtype} scales={g.scales} alpha={g.alpha:g} beta={g.beta:g} epilogue={g.epilogue} "
                      f"amax={g.amax_output}"] += g.per_step
        if out.dtype == "f32" and len(out.dims) >= 2 and out.dims[0] >= tokens:
            f32_n += g.per_step
            f32_bytes += out.nbytes * g.per_step

    gemm_names = {g.name for g in gemms}
    quantize = copies = 0
    sources: dict[str, tuple[int, int]] = {}  # array -> (readers, executions per step)
    fusion_bytes = fusions = 0
    kinds: dict[str, int] = collections.Counter()
    roles: dict[str, list[int]] = {r: [0, 0] for r in ROLES}
    bodies: dict[str, list[hlo.Instr]] = collections.defaultdict(list)
    for i in module.instrs:
        if i.computation in fused:
            bodies[i.computation].append(i)
    reducers = {c: body[-1].op for c, body in bodies.items() if body}
    for i in top:
        if i.op != "fusion":
            continue
        ins = [a for o in operands(i) for a in arrays(o)]
        called = re.search(r"\bcalls=%?([\w.\-]+)", i.line)
        body = bodies.get(called.group(1) if called else "", [])
        moved = _moved(i, [arrays(o) for o in operands(i)], body) * module.executions(i)
        fusions += module.executions(i)
        fusion_bytes += moved
        kinds[_stem(i.name)] += moved
        role = roles[fusion_role(ins, list(i.arrays), body, reducers, small)]
        role[0] += module.executions(i)
        role[1] += moved
        writes_f8 = any(a.dtype.startswith("f8") for a in i.arrays)
        reads_f8 = any(a.dtype.startswith("f8") for a in ins)
        if writes_f8 and reads_f8:
            copies += module.executions(i)
        elif writes_f8:
            quantize += module.executions(i)
    for g in (i for i in top if i.name in gemm_names and hlo.target_of(i.line).endswith("$f8")):
        for o in operands(g)[:2]:
            p = producer(o)
            if p is None or p.op != "fusion":
                continue
            for s in operands(p):
                src = by_name.get(s)
                if src is not None and src.arrays and max(a.nbytes for a in src.arrays) >= tokens \
                        and not any(a.dtype.startswith("f8") for a in src.arrays):
                    sources[s] = (len({r.name for r in readers[s]}), module.executions(p))
    return Report(gemms=dict(count), fp8_epilogues=dict(epilogues), f32_outputs=f32_n,
                  f32_output_bytes=f32_bytes, quantize_fusions=quantize, fp8_copies=copies,
                  sources=sum(n for _, n in sources.values()),
                  source_reads=sum(r * n for r, n in sources.values()), fusion_bytes=fusion_bytes,
                  fusions=fusions, by_kind=dict(kinds), by_role=roles)
