"""The flash kernels' default Hopper tiles compiled for sm_90 on a machine without a GPU: one table row
per (head dim, segment ids, kernel) for docs/PERFORMANCE.md.

    python benchmarks/flash_sm90.py                    # head dims 64, 128, 256, with and without segment ids
    python benchmarks/flash_sm90.py --backward fused   # the one-kernel backward instead
    python benchmarks/flash_sm90.py --window 256        # a sliding window and a chunk pair's position offset

Each row: the kernel's tile (rows it owns x rows it streams), warps/stages, shared memory, registers
per thread, spilled bytes, and the tensor-core instructions in its PTX (wgmma against Ampere's
mma.sync), from `lumen_jax.compiler.kernels.compile_flash` (a causal forward+backward at L=1024,
GQA 2 heads over 1 kv head, bf16). Needs the `triton` package.
"""

from __future__ import annotations

import argparse
import dataclasses

from lumen_jax.compiler import kernels as kernel_compile
from lumen_jax.compiler.lower import TargetGpu
from lumen_jax.kernels.flash_attention import BlockSizes


def tiles(blocks: BlockSizes, kernel: str) -> str:
    own, stream = {"flash_fwd": (blocks.block_q, blocks.block_kv),
                   "flash_bwd_dkv": (blocks.block_kv_dkv, blocks.block_q_dkv),
                   "flash_bwd_fused": (blocks.block_kv_dkv, blocks.block_q_dkv),
                   "flash_bwd_dq": (blocks.block_q_dq, blocks.block_kv_dq)}[kernel]
    return f"{own}x{stream}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--compute-capability", default="9.0")
    parser.add_argument("--backward", default="split", choices=("split", "fused"),
                        help="fused: one backward kernel, dQ by float32 atomic adds (BlockSizes.backward)")
    parser.add_argument("--window", type=int, default=0,
                        help="a sliding window (with a traced query position offset, as context parallelism "
                             "runs a chunk pair); 0: none")
    a = parser.parse_args()
    arch = kernel_compile.arch_of(a.compute_capability)
    print("| head dim | segment ids | kernel | tile | warps/stages | shared KiB | registers | spills | "
          "wgmma / mma.sync | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for head_dim in (int(h) for h in a.head_dims.split(",")):
        blocks = dataclasses.replace(BlockSizes.default(head_dim, TargetGpu(a.compute_capability)), backward=a.backward)
        for segments in (True, False):
            for r in kernel_compile.compile_flash(head_dim, blocks, segments=segments, arch=arch, window=a.window,
                                                  offset=a.window > 0):
                print(f"| {head_dim} | {'yes' if segments else 'no'} | {r.kernel} | {tiles(blocks, r.kernel)} | "
                      f"{r.num_warps}/{r.num_stages} | {r.shared_bytes / 1024:.1f} | {r.registers} | "
                      f"{r.spill_bytes} | {r.wgmma} / {r.mma_sync} | {'yes' if r.fits else 'NO: ' + r.problem} |",
                      flush=True)


if __name__ == "__main__":
    main()
