"""Attention on one GPU: our Pallas FlashAttention against cuDNN's fused attention and the XLA path.

Part (a) of `benchmarks/gpu_check.py`, which imports its timing (`measure`, `flops`, `inputs`);
runnable on its own for more lengths, the Mosaic forward and the block-size sweep:

    python benchmarks/attention_gpu.py                    # the table for docs/PERFORMANCE.md (< 5 min)
    python benchmarks/attention_gpu.py --sweep            # also time alternative flash block sizes
    python benchmarks/attention_gpu.py --lengths 256 --tokens 512 --impls flash,xla   # CPU smoke run

For each sequence length L (default 2k, 4k, 8k, 16k), causal and not, head dim 128, bfloat16,
batch = tokens // L (tokens default 16384) and 16 heads, so every length does the same number of
rows and fills the chip: forward and forward+backward time, TFLOP/s and the compiled memory
(arguments + outputs + temporaries, from XLA's memory analysis) of

- `flash`: lumen_jax.kernels.flash_attention (Pallas, Triton lowering), the default block sizes;
- `flash-mosaic`: the same with the forward through JAX's Mosaic GPU (Hopper) kernel;
- `cudnn`: jax.nn.dot_product_attention(implementation="cudnn");
- `xla`: lumen_jax.ops.reference.reference, what `model.attention=xla` runs (materialises the L x L scores; OOM is reported).

FLOPs: forward 4*B*N*L^2*H, forward+backward 3.5x that (the backward's 5 matmuls against the
forward's 2; recomputation not counted), causal counted as half. A wall-clock budget
(--budget-s) skips the rows it cannot reach rather than overrun. The targets of the kernel's
issue are checked at the end: forward+backward >= 1.0x cuDNN at L=8k causal, forward >= 450 TFLOP/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from lumen_jax.kernels import flash_attention as fa  # noqa: E402
from lumen_jax.ops.reference import reference  # noqa: E402

INTERPRET = jax.default_backend() == "cpu"  # the kernels run in Pallas's interpreter there

IMPLS = ("flash", "flash-mosaic", "cudnn", "xla")


def attention_fn(impl: str, causal: bool, blocks: fa.BlockSizes | None):
    if impl == "flash":
        return functools.partial(fa.flash_attention, causal=causal, block_sizes=blocks, interpret=INTERPRET)
    if impl == "flash-mosaic":
        mosaic = dataclasses.replace(blocks or fa.BlockSizes.default(128), forward="mosaic",
                                     block_q=64, block_kv=128)
        return functools.partial(fa.flash_attention, causal=causal, block_sizes=mosaic, interpret=INTERPRET)
    if impl == "cudnn":
        return functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn")
    if impl == "xla":
        return lambda q, k, v: reference(q, k, v, causal=causal)[0]
    raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")


def timed(fn, args, min_time_s: float = 0.3, max_reps: int = 50) -> tuple[float, int]:
    """(median seconds per call, compiled bytes); compiles and warms up first."""
    compiled = fn.lower(*args).compile()
    m = compiled.memory_analysis()
    nbytes = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
              - m.alias_size_in_bytes) if m is not None else -1
    jax.block_until_ready(compiled(*args))
    times, start = [], time.perf_counter()
    while len(times) < max_reps and (time.perf_counter() - start < min_time_s or len(times) < 3):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), nbytes


def measure(impl, mode, causal, q, k, v, do, blocks=None) -> tuple[float, int]:
    attn = attention_fn(impl, causal, blocks)
    if mode == "fwd":
        return timed(jax.jit(attn), (q, k, v))
    fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))
    return timed(fwd_bwd, (q, k, v, do))


def flops(mode: str, b: int, n: int, length: int, h: int, causal: bool) -> float:
    f = 4 * b * n * length * length * h * (0.5 if causal else 1.0)
    return f if mode == "fwd" else 3.5 * f


def inputs(b, length, n, kh, h, dtype, seed=0):
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(kq, (b, length, n, h), dtype), jax.random.normal(kk, (b, length, kh, h), dtype),
            jax.random.normal(kv, (b, length, kh, h), dtype), jax.random.normal(kd, (b, length, n, h), dtype))


def short_error(e: Exception) -> str:
    text = str(e)
    if "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text:
        return "OOM"
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return f"error: {type(e).__name__}: {first[:60]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096,8192,16384")
    p.add_argument("--tokens", type=int, default=16384, help="batch = tokens // length")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--budget-s", type=float, default=270.0, help="skip rows once this much time is spent")
    p.add_argument("--sweep", action="store_true", help="time alternative flash block sizes at L=8k causal")
    a = p.parse_args()
    dtype = jnp.dtype(a.dtype)
    impls = a.impls.split(",")
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"tokens {a.tokens}, heads {a.heads}/{a.kv_heads}, head dim {a.head_dim}, {dtype.name}")
    if jax.default_backend() == "cpu":
        print("no GPU: flash runs in Pallas's interpreter and cudnn/flash-mosaic are unavailable "
              "(a smoke run of this script, not a measurement)")
    print(f"flash default blocks: {fa.BlockSizes.default(a.head_dim)}")
    start = time.perf_counter()
    results: dict[tuple, tuple[float, int] | str] = {}
    header = f"{'L':>6} {'B':>4} {'causal':>6} {'impl':<13} {'mode':<8} {'ms':>9} {'TFLOP/s':>8} {'GiB':>7}"
    print(header)
    print("-" * len(header))

    # Correctness against cuDNN once (bf16 tolerance), when both are there.
    check_len = int(a.lengths.split(",")[0])
    for length in (int(x) for x in a.lengths.split(",")):
        b = max(1, a.tokens // length)
        q, k, v, do = inputs(b, length, a.heads, a.kv_heads, a.head_dim, dtype)
        for causal in (True, False):
            if length == check_len and "flash" in impls and "cudnn" in impls:
                try:
                    o1 = jax.jit(attention_fn("flash", causal, None))(q, k, v).astype(jnp.float32)
                    o2 = jax.jit(attention_fn("cudnn", causal, None))(q, k, v).astype(jnp.float32)
                    err = float(jnp.max(jnp.abs(o1 - o2)) / jnp.max(jnp.abs(o2)))
                    print(f"check L={length} causal={causal}: max |flash - cudnn| / max|cudnn| = {err:.2e}")
                except Exception as e:  # noqa: BLE001 - a benchmark reports and goes on
                    print(f"check L={length} causal={causal}: {short_error(e)}")
            for impl in impls:
                for mode in ("fwd", "fwd+bwd"):
                    key = (length, causal, impl, mode)
                    if time.perf_counter() - start > a.budget_s:
                        results[key] = "skipped (budget)"
                    elif jax.default_backend() != "gpu" and impl in ("cudnn", "flash-mosaic"):
                        results[key] = "n/a (GPU only)"
                    else:
                        try:
                            results[key] = measure(impl, mode, causal, q, k, v, do)
                        except Exception as e:  # noqa: BLE001
                            results[key] = short_error(e)
                    r = results[key]
                    if isinstance(r, str):
                        print(f"{length:>6} {b:>4} {str(causal):>6} {impl:<13} {mode:<8} {r}")
                    else:
                        sec, nbytes = r
                        tf = flops(mode, b, a.heads, length, a.head_dim, causal) / sec / 1e12
                        print(f"{length:>6} {b:>4} {str(causal):>6} {impl:<13} {mode:<8} {sec * 1e3:>9.3f} "
                              f"{tf:>8.1f} {nbytes / 2**30:>7.2f}")
        del q, k, v, do

    if a.sweep and time.perf_counter() - start < a.budget_s:
        sweep(a, dtype, start)

    # The targets.
    print()
    key_f, key_c = (8192, True, "flash", "fwd+bwd"), (8192, True, "cudnn", "fwd+bwd")
    if isinstance(results.get(key_f), tuple) and isinstance(results.get(key_c), tuple):
        ratio = results[key_c][0] / results[key_f][0]
        print(f"target fwd+bwd >= 1.0x cuDNN at L=8k causal: {ratio:.2f}x  "
              f"{'met' if ratio >= 1.0 else 'NOT met'}")
    fwd = [(flops("fwd", max(1, a.tokens // L), a.heads, L, a.head_dim, c) / r[0] / 1e12, L, c)
           for (L, c, i, m), r in results.items() if i == "flash" and m == "fwd" and isinstance(r, tuple)]
    if fwd:
        best = max(fwd)
        print(f"target forward >= 450 TFLOP/s: best {best[0]:.0f} (L={best[1]}, causal={best[2]})  "
              f"{'met' if best[0] >= 450 else 'NOT met'}")
    print(f"total {time.perf_counter() - start:.0f} s")


def sweep_variants() -> tuple[list[dict], list[dict]]:
    """The flash tiles a sweep tries: (forward changes, backward changes) to `BlockSizes`."""
    fwd = [dict(block_q=bq, block_kv=bk, num_warps=w, num_stages=s)
           for bq, bk in ((128, 64), (128, 128), (64, 64), (64, 128)) for w in (4, 8) for s in (2, 3)]
    bwd = [dict(block_q_dkv=a_, block_kv_dkv=b_, block_q_dq=c_, block_kv_dq=d_, num_warps_bwd=w)
           for a_, b_, c_, d_ in ((32, 128, 128, 32), (64, 128, 128, 64), (64, 64, 64, 64), (32, 64, 64, 32))
           for w in (4, 8)]
    bwd += [dict(backward="fused", num_warps_bwd=w) for w in (4, 8)]  # one backward kernel, dQ by atomic adds
    return fwd, bwd


def sweep(a, dtype, start) -> None:
    """Alternative flash tiles at L=8k causal (forward tiles, then backward tiles)."""
    length = 8192
    b = max(1, a.tokens // length)
    q, k, v, do = inputs(b, length, a.heads, a.kv_heads, a.head_dim, dtype)
    base = fa.BlockSizes.default(a.head_dim)
    fwd, bwd = sweep_variants()
    print(f"\nsweep at L={length} causal (default {base})")
    for mode, variants in (("fwd", fwd), ("fwd+bwd", bwd)):
        for changes in variants:
            if time.perf_counter() - start > a.budget_s + 120:
                print(f"{mode:<8} {changes}: skipped (budget)")
                continue
            try:
                sec, _ = measure("flash", mode, True, q, k, v, do, dataclasses.replace(base, **changes))
                tf = flops(mode, b, a.heads, length, a.head_dim, True) / sec / 1e12
                print(f"{mode:<8} {changes}: {sec * 1e3:.3f} ms {tf:.1f} TFLOP/s")
            except Exception as e:  # noqa: BLE001
                print(f"{mode:<8} {changes}: {short_error(e)}")


if __name__ == "__main__":
    main()
