"""Checkpoint stall and restore time for a ~1 GB training state on 8 emulated CPU devices.

    .venv/bin/python benchmarks/checkpoint.py [--d-model 1024 --layers 4 --vocab 16384] [--dir /tmp/x]

Prints: state size; the loop's stall per save with async saving (device-to-host copy only) against a
synchronous save (the whole write); restore time onto the same mesh (fsdp=8) and onto another one
(data=2, fsdp=2, tensor=2). Results and the command go in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lumen_jax.runtime.process import prepare_cpu_backend  # noqa: E402

prepare_cpu_backend()
import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from lumen_jax.train.build import build  # noqa: E402
from lumen_jax.checkpoint.manager import Checkpointer  # noqa: E402
from lumen_jax.config import CheckpointConfig, Config, MeshConfig, ModelConfig  # noqa: E402
from lumen_jax.parallel.mesh import make_mesh  # noqa: E402


def trainer_for(cfg: Config, **axes):
    shape = {"data": 1, "fsdp": 1, "context": 1, "tensor": 1, **axes}
    return build(cfg.replace(mesh=MeshConfig(**shape)), make_mesh(shape))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--dir", default="")
    args = p.parse_args()
    cfg = Config(model=ModelConfig(d_model=args.d_model, num_layers=args.layers, num_heads=8, num_kv_heads=8,
                                   ffn_dim=4 * args.d_model, vocab_size=args.vocab))
    trainer = trainer_for(cfg, fsdp=8)
    state = jax.block_until_ready(trainer.init())
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    root = args.dir or tempfile.mkdtemp(prefix="lumen-ckpt-bench-")
    rows = [("state size", f"{nbytes / 1e9:.2f} GB")]

    for mode, async_save in (("async", True), ("sync", False)):
        directory = os.path.join(root, mode)
        shutil.rmtree(directory, ignore_errors=True)
        ckpt = Checkpointer(directory, dataclasses.replace(CheckpointConfig(), async_save=async_save,
                                                           keep=args.saves))
        # Each save starts after the previous one is on disk, as in a loop whose save interval is
        # longer than one write: the stall is what save() blocks; "written" is save() + wait().
        stalls, written = [], []
        for step in range(1, args.saves + 1):
            t0 = time.perf_counter()
            at_step = state.replace(step=jax.device_put(np.int32(step), state.step.sharding))  # restore checks it
            stalls.append(ckpt.save(step, at_step, {"data": {}}))
            ckpt.wait()
            written.append(time.perf_counter() - t0)
        ckpt.close()
        mean = lambda xs: sum(xs[1:]) / max(len(xs) - 1, 1)  # noqa: E731 - the first includes compiles
        rows.append((f"{mode} save: loop stall per save", f"{mean(stalls):.2f} s (first {stalls[0]:.2f} s)"))
        rows.append((f"{mode} save: until written", f"{mean(written):.2f} s"))

    source = os.path.join(root, "async")
    for name, axes in (("restore, same mesh (fsdp=8)", dict(fsdp=8)),
                       ("restore, reshard to data=2,fsdp=2,tensor=2", dict(data=2, fsdp=2, tensor=2))):
        target = trainer_for(cfg, **axes)
        t0 = time.perf_counter()
        restored = Checkpointer(source, CheckpointConfig()).restore_latest(target.abstract_state())
        jax.block_until_ready(restored.state)
        rows.append((name, f"{time.perf_counter() - t0:.2f} s (checksums verified)"))

    width = max(len(k) for k, _ in rows)
    print(f"model d_model={args.d_model} layers={args.layers} vocab={args.vocab}, 8 CPU devices")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
