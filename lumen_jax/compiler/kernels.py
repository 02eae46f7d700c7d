"""The flash kernels compiled for a CUDA GPU on a machine without one: the Triton IR that a step
lowered for CUDA carries, compiled to a cubin by the `triton` package, and each kernel's shared
memory, registers and spills against the GPU's limits.

Lowering for CUDA (`python -m lumen_jax.lower`) leaves each Pallas kernel as a
`__gpu$xla.gpu.triton` custom call whose backend config holds the kernel's Triton IR as MLIR
bytecode, with `num_warps` and `num_stages`. On a GPU, XLA compiles that IR with the Triton it was
built with. Here the bytecode is read with jaxlib's own MLIR (which has the Triton dialect), printed
as text, and compiled by the `triton` package's compiler (`triton.compile` of a `.ttir` file with an
explicit `GPUTarget`: no driver needed) down to a cubin, whose resource usage `cuobjdump` (shipped in
the package) reports. The package's Triton is not XLA's (a newer upstream release against XLA's
pinned fork), so the figures are those of the same IR under upstream's passes: a check that the
tiles fit, not XLA's exact register allocation. The bytecode itself does not load in triton 3.9
("expected mlir::BoolAttr, but got: 1 : i32": an attribute that changed type between the two
dialect versions); the text form does. docs/PERFORMANCE.md has the versions and figures.

The PTX tells which tensor-core instructions each dot became: on sm_90 Triton makes a dot
`wgmma.mma_async` (a warpgroup of 4 warps, 64 rows per instruction) when its M dimension is a
multiple of 64, its N a multiple of 8 and the warps a multiple of 4; any other dot falls back to
Ampere's `mma.sync`, at a fraction of Hopper's rate. The counts are static instructions in
the kernel's text (an unrolled dot has several), not executions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess
import tempfile
from typing import Any

TRITON_TARGET = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-block limits of one GPU generation (CUDA programming guide, compute capabilities table)."""

    arch: int  # 90: sm_90
    shared_bytes: int  # shared memory per block (with the opt-in carve-out)
    registers_per_thread: int
    registers_per_block: int


LIMITS = {90: Limits(90, 227 * 1024, 255, 65536), 80: Limits(80, 163 * 1024, 255, 65536)}


def arch_of(compute_capability: str) -> int:
    major, _, minor = compute_capability.partition(".")
    return int(major) * 10 + int(minor or 0)


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    name: str  # the pallas_call's name: flash_fwd, flash_bwd_dkv, flash_bwd_dq (or flash_bwd_fused)
    ttir: str  # the Triton IR as text
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class KernelResources:
    kernel: str
    arch: int
    num_warps: int
    num_stages: int
    threads: int
    shared_bytes: int  # dynamic (Triton's buffers) + static
    registers: int  # per thread
    spill_bytes: int  # local memory per thread (register spills)
    wgmma: int  # Hopper's warpgroup matrix multiplies (`wgmma.mma_async`) in the PTX
    mma_sync: int  # Ampere-style warp matrix multiplies (`mma.sync`) in the PTX
    fits: bool
    problem: str  # why it does not fit ("" when it does)


def tensor_core_ops(ptx: str) -> tuple[int, int]:
    """(wgmma, mma.sync) instructions in a kernel's PTX."""
    return len(re.findall(r"\bwgmma\.mma_async\b", ptx)), len(re.findall(r"\bmma\.sync\b", ptx))


def triton_kernels(lowered: Any) -> list[TritonKernel]:
    """The distinct Triton kernels of a step lowered for CUDA (`jax.stages.Lowered`)."""
    from jaxlib.mlir import ir
    from jaxlib.triton import dialect as tt_dialect

    found: dict[str, TritonKernel] = {}

    def walk(op) -> None:
        for region in op.regions:
            for block in region:
                for child in block:
                    if (child.operation.name == "stablehlo.custom_call"
                            and ir.StringAttr(child.attributes["call_target_name"]).value == TRITON_TARGET):
                        add(child.attributes["mhlo.backend_config"])
                    walk(child.operation)

    def add(config) -> None:
        data = bytes(config["ir"].value_bytes)
        key = hashlib.sha1(data).hexdigest()
        if key in found:
            return
        ctx = ir.Context()
        tt_dialect.register_dialect(ctx)
        with ctx:
            text = ir.Module.parse(data).operation.get_asm(enable_debug_info=False)
        found[key] = TritonKernel(ir.StringAttr(config["name"]).value, text,
                                  ir.IntegerAttr(config["num_warps"]).value, ir.IntegerAttr(config["num_stages"]).value)

    walk(lowered.compiler_ir("stablehlo").operation)
    return list(found.values())


def compile_kernel(kernel: TritonKernel, arch: int = 90) -> KernelResources:
    """Compile one kernel for sm_`arch` with the triton package and read its resource usage.

    Raises:
      ImportError: the `triton` package is missing (`pip install triton`; Linux x86-64 wheels).
    """
    import triton
    from triton.backends.compiler import GPUTarget

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is its default
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{kernel.name}.ttir")
        with open(path, "w") as f:
            f.write(kernel.ttir)
        compiled = triton.compile(path, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": kernel.num_warps, "num_stages": kernel.num_stages})
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
    wgmma, mma_sync = tensor_core_ops(compiled.asm["ptx"])
    fields = dict(re.findall(r"\b(REG|SHARED|LOCAL):(\d+)", usage))
    regs, local = int(fields.get("REG", 0)), int(fields.get("LOCAL", 0))
    shared = int(compiled.metadata.shared) + int(fields.get("SHARED", 0))
    threads = 32 * kernel.num_warps
    lim = LIMITS.get(arch, LIMITS[90])
    problems = [msg for bad, msg in (
        (shared > lim.shared_bytes, f"{shared} B shared > {lim.shared_bytes}"),
        (regs > lim.registers_per_thread, f"{regs} registers per thread > {lim.registers_per_thread}"),
        (regs * threads > lim.registers_per_block, f"{regs} x {threads} registers > {lim.registers_per_block}"),
    ) if bad]
    return KernelResources(kernel.name, arch, kernel.num_warps, kernel.num_stages, threads, shared, regs, local,
                           wgmma, mma_sync, not problems, "; ".join(problems))


def compile_lowered(lowered: Any, arch: int = 90) -> list[KernelResources]:
    """Every distinct Triton kernel of a step lowered for CUDA, compiled for sm_`arch`."""
    return [compile_kernel(k, arch) for k in triton_kernels(lowered)]


def compile_flash(head_dim: int, blocks: Any, *, segments: bool = True, length: int = 1024,
                  arch: int = 90, window: int = 0, offset: bool = False) -> list[KernelResources]:
    """The flash kernels of a causal forward+backward with GQA (2 query heads, 1 kv head), bf16,
    [1, length] rows, lowered for CUDA with `blocks` (a `BlockSizes`) and compiled for sm_`arch`;
    with a sliding `window` and, with `offset`, the queries' position offset of a chunk pair under
    context parallelism (a traced scalar)."""
    import jax
    import jax.numpy as jnp

    from lumen_jax.kernels.flash_attention import flash_attention

    q = jax.ShapeDtypeStruct((1, length, 2, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, length, 1, head_dim), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, length), jnp.int32)

    def fwd_bwd(q, k, v, s, shift):
        attend = lambda q, k, v: flash_attention(q, k, v, segment_ids_bt=s if segments else None,  # noqa: E731
                                                 block_sizes=blocks, window=window,
                                                 q_offset=shift if offset else 0)
        out, vjp = jax.vjp(attend, q, k, v)
        return vjp(out)

    shift = jax.ShapeDtypeStruct((), jnp.int32)
    lowered = jax.jit(fwd_bwd).trace(q, kv, kv, seg, shift).lower(lowering_platforms=("cuda",))
    return compile_lowered(lowered, arch)
