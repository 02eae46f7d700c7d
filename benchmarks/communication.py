"""Collective bytes per step of the compiled train step, by mesh axes, kind and dtype (issue 13).

    python benchmarks/communication.py [MESH ...]      # e.g. data=8,m=4 fsdp=8,m=4,fsdp_regather=per_step

Each MESH is comma-separated `key=value`: mesh fields (data, fsdp, tensor, zero_stage,
fsdp_grad_reduce, ...), `m` (micro-batches) and `dt` (compute dtype). The model is a small fp32
config (CONFIG below: the mesh tests' BASE of tests/helpers/run.py, at batch 32); the step is compiled
on 8 emulated CPU devices and every collective counted with the trip counts of its loops
(`lumen_jax.compiler.hlo.on_mesh`). Collectives under 2 KB per step (loss scalars) are left out.
Figures: docs/PERFORMANCE.md.
"""

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lumen_jax.runtime.process import add_xla_flags, prepare_cpu_backend  # noqa: E402

# Before JAX starts: the CPU flags, and XLA's CPU back end at -O0 as the tests compile (the HLO, and so
# its collectives, is the same program; only the machine code is less optimized, and it compiles faster).
prepare_cpu_backend()
add_xla_flags(("--xla_backend_optimization_level=0",))
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from lumen_jax.config import Config, DataConfig, MeshConfig, ModelConfig, OptimConfig, TrainConfig  # noqa: E402
from lumen_jax.generate import ONE_DEVICE  # noqa: E402
from lumen_jax.compiler import hlo  # noqa: E402
from lumen_jax.compiler.compiled import compile_step  # noqa: E402
from lumen_jax.plan.hardware import layout_from_config  # noqa: E402

CONFIG = Config(
    model=ModelConfig(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=128,
                      vocab_size=256, compute_dtype="float32"),
    data=DataConfig(seq_len=32, global_batch_size=32),
    optim=OptimConfig(lr=1e-2, warmup_steps=0, z_loss=1e-4),
    train=TrainConfig(steps=3),
)
DEFAULT = ["data=8,m=1", "data=8,m=4", "fsdp=8,m=1", "fsdp=8,m=4", "fsdp=8,m=4,fsdp_grad_reduce=once",
           "fsdp=8,m=4,fsdp_regather=per_step", "data=2,fsdp=2,tensor=2,sequence_parallel=True,m=4",
           "zero_stage=1,data=2,fsdp=4,m=4", "zero_stage=2,data=2,fsdp=4,m=4"]


def parse(spec: str):
    kv = dict(x.split("=") for x in spec.split(","))
    m, dt = int(kv.pop("m", 1)), kv.pop("dt", "float32")
    mesh = {k: int(v) if v.isdigit() else (v == "True" if v in ("True", "False") else v) for k, v in kv.items()}
    return CONFIG.replace(mesh=MeshConfig(**{**ONE_DEVICE, **mesh}),  # an axis not given is 1
                          train=dataclasses.replace(CONFIG.train, micro_batches=m),
                          model=dataclasses.replace(CONFIG.model, compute_dtype=dt))


def main(specs: list[str]) -> None:
    print("| mesh | collective bytes per step (MB) |\n|---|---|")
    for spec in specs:
        cfg = parse(spec)
        compiled = compile_step(cfg, layout_from_config(cfg, jax.device_count()))
        shape = {a: getattr(cfg.mesh, a) for a in MeshConfig.AXES}
        totals = hlo.bytes_by_axes(hlo.on_mesh(hlo.parse(compiled.as_text()), shape))
        cells = [f"{axes} {kind} {dtype} {b / 1e6:.3f}" for (axes, kind, dtype), b in sorted(totals.items()) if b >= 2000]
        print(f"| {spec} | {', '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT)
