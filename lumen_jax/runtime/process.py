"""Process set-up that must happen before the JAX backend starts."""

from __future__ import annotations

import ctypes
import os
from typing import Any, Sequence

from lumen_jax.config import ConfigError, MeshConfig, ModelConfig, RuntimeConfig
from lumen_jax.config.checks import MAX_CPU_DEVICES
from lumen_jax.metrics.flops import param_counts

# XLA:CPU's concurrency-optimized scheduler lets one emulated device run two independent
# collectives at once (e.g. an FSDP all-gather beside a gradient all-reduce). Each waits in a
# rendezvous on a thread of a pool sized to the device count, so another device can be left
# without a thread and XLA aborts after 40 s ("Expected 8 threads to join the rendezvous").
# Seen on 2 cores with 8 emulated devices in 3 of 4 tiny runs; 0 of 4 with the scheduler off.
CPU_XLA_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)

# The same pool runs every emulated device's thunks, and XLA:CPU's thunk executor runs independent
# thunks of one device at once: a device can wait in a top-level all-gather and in an all-reduce
# inside a loop at the same time, each holding a thread. With max(cores, devices) threads, 8 devices
# can block all 8 threads while the devices they wait for have none left (the fine-grained MoE step
# on expert=2 tensor=2 fsdp=2 aborted so in 1 of 3 runs beside another compile on 2 cores: 2 threads
# in all-gathers, 6 in a loop's all-reduce, each group one device short). PJRT_NPROC sizes the pool
# (read when the CPU client starts); CPU_THREADS_PER_DEVICE threads per device leave every device
# one free. 0 of 5 runs aborted with it, and the test ran no slower (64-74 s against 70-80 s).
# One device waits in no rendezvous: its pool is the cores (4 threads on 2 cores cost one device's
# step about 10%: 5.9-6.1k tokens/s against 6.5-6.7k with 2, benchmarks/cpu_throughput.py's shape).
CPU_THREADS_PER_DEVICE = 4


def cpu_threads(devices: int, cores: int | None = None) -> int:
    """The CPU thread pool (`PJRT_NPROC`) for `devices` emulated devices on `cores` cores (default:
    this machine's): the cores for one device, else CPU_THREADS_PER_DEVICE per device (at least the
    cores), so every device keeps a thread while others wait in collectives."""
    cores = cores or os.cpu_count() or 1
    return cores if devices <= 1 else max(cores, CPU_THREADS_PER_DEVICE * devices)


def prepare_cpu_backend(devices: int = 8) -> None:
    """Before the backend starts: CPU_XLA_FLAGS into XLA_FLAGS (the GPU backend ignores them) and a
    CPU thread pool sized by `cpu_threads`; values the user set win."""
    add_xla_flags(CPU_XLA_FLAGS)
    os.environ.setdefault("PJRT_NPROC", str(cpu_threads(devices)))


# `runtime.xla_gpu_flags: overlap`: what the best GPU recipes set so collectives run under compute.
# Each line says why; `gpu_xla_flags` adds the combine thresholds sized from the config.
GPU_OVERLAP_FLAGS = (
    # Schedule by estimated latency, starting each async collective as early as its inputs allow
    # and finishing it as late as its users allow, so it runs beside the matmuls in between.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # Inside the layer scan, start the next iteration's weight all-gather (and finish this one's
    # gradient reduce-scatter / all-reduce) in the current iteration: FSDP prefetch.
    # (Pipelined reduce-scatter is already XLA's default on this jaxlib.)
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    # Unroll the layer loop by two so the pipelined collectives of one layer overlap the other's compute.
    "--xla_gpu_enable_while_loop_double_buffering=true",
)
# XLA's defaults already give collectives a high-priority stream and combine gathers and scatters
# across dimensions; the debug options of a compiled program list only what differs from them.
GRADIENT_BUCKET_BYTES = 32 * 2**20  # all-reduce buckets "a few tens of MB", launched as they fill


def gpu_xla_flags(choice: str, model: ModelConfig, mesh: MeshConfig) -> tuple[str, ...]:
    """The XLA flags `runtime.xla_gpu_flags` (`choice`) asks for: `overlap` (GPU_OVERLAP_FLAGS and
    combine thresholds of one layer's weights per device, so the next layer's weights arrive as one
    all-gather while this layer computes), `none`, or the literal flags of any other string."""
    if choice == "none":
        return ()
    if choice != "overlap":
        return tuple(choice.split())
    shards = max(mesh.tensor, 1)
    compute = 4 if model.compute_dtype == "float32" else 2
    layer = param_counts(model)["layer_matmul"]  # a float with experts (the active share)
    layer_weights = int(layer * compute // shards)
    layer_grads = int(layer * (4 if mesh.reduce_dtype == "float32" else 2) // shards)
    return GPU_OVERLAP_FLAGS + (
        f"--xla_gpu_all_gather_combine_threshold_bytes={layer_weights}",
        f"--xla_gpu_reduce_scatter_combine_threshold_bytes={layer_grads}",
        f"--xla_gpu_all_reduce_combine_threshold_bytes={max(GRADIENT_BUCKET_BYTES, layer_grads)}",
    )


def parse_flags(flags: Any) -> dict[str, Any]:
    """XLA options {name: value} from "--name=value ..." text or a list of such strings (a dict is
    kept as it is): "true"/"false" and "" are booleans, digits integers, the rest strings."""
    if isinstance(flags, dict):
        return dict(flags)
    words = flags.split() if isinstance(flags, str) else [w for f in flags for w in str(f).split()]
    out: dict[str, Any] = {}
    for w in words:
        name, _, value = w.lstrip("-").partition("=")
        low = value.lower()
        out[name] = True if low in ("", "true") else False if low == "false" else int(value) if value.isdigit() else value
    return out


def known_options(options: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the options this XLA compiles with, the names it has no such option for), each tried on a
    one-instruction program (XLA's options are one set for every backend, so any backend tells).
    XLA's options come and go between jaxlib releases
    (`xla_gpu_enable_pipelined_all_gather` is an option of jaxlib 0.10.2 and none of 0.11.2, whose
    XLA_FLAGS parser takes the name and ignores it; 0.10.2's aborts on a name it lacks), so the step's
    options are checked here first and a stale one is said, not silently dropped."""
    import jax
    import numpy as np

    lowered = jax.jit(lambda x: x + 1).lower(np.float32(0))
    kept, unknown = {}, []
    for name, value in options.items():
        try:
            lowered.compile({name: value})
        except Exception as e:  # noqa: BLE001 - only "No such compile option" is sorted out here
            if "No such compile option" not in str(e):
                raise
            unknown.append(name)
        else:
            kept[name] = value
    return kept, unknown


def step_compile_options(rc: RuntimeConfig, model: ModelConfig, mesh: MeshConfig, platform: str) -> dict[str, Any]:
    """The XLA options of the train step on `platform`'s devices: `runtime.xla_gpu_flags` on GPUs (none
    elsewhere), as per-compile options, those this XLA lacks left out of `overlap` with a note on
    stderr; an unknown flag the user named is a ConfigError."""
    if platform != "gpu":
        return {}
    kept, unknown = known_options(parse_flags(gpu_xla_flags(rc.xla_gpu_flags, model, mesh)))
    if unknown and rc.xla_gpu_flags != "overlap":
        raise ConfigError(f"runtime.xla_gpu_flags: this XLA has no option {', '.join(unknown)}; "
                          "remove it (runtime.xla_gpu_flags=none leaves XLA's defaults)")
    if unknown:
        import sys

        import jax

        print(f"note: runtime.xla_gpu_flags=overlap: this XLA (jax {jax.__version__}) has no option "
              f"{', '.join(unknown)}; left out", file=sys.stderr, flush=True)
    return kept


def add_xla_flags(flags: tuple[str, ...]) -> None:
    """Adds `flags` to XLA_FLAGS (read once, when the backend starts); a flag already set there wins."""
    current = os.environ.get("XLA_FLAGS", "")
    for flag in flags:
        if flag.split("=")[0] not in current:
            current = f"{current} {flag}".strip()
    os.environ["XLA_FLAGS"] = current


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def keep_freed_memory() -> bool:
    """glibc: one arena, no mmap for large blocks, no trimming: a freed block is reused, not unmapped.

    XLA:CPU allocates a step's temporary buffer (hundreds of MB) afresh on every call; with glibc's
    defaults that is an mmap/munmap pair per step and every page faults in again (measured: ~93k
    faults, ~0.18 s of kernel time per step of benchmarks/cpu_throughput.py). Must run before JAX's
    threads start (an existing thread keeps its arena). Returns False where libc is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return all(libc.mallopt(param, value) == 1
               for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))


def configure(rc: RuntimeConfig) -> None:
    """The CPU backend's XLA flags, emulated CPU device count, platform choice, the allocator of CPU
    runs and the persistent compilation cache. (`runtime.xla_gpu_flags` are the step's compile
    options, `step_compile_options`, each checked against this jaxlib, not XLA_FLAGS.)

    Call before anything creates a JAX array: the backend reads these once, at start-up.

    Raises:
      ConfigError: more emulated CPU devices than one process may start (`MAX_CPU_DEVICES`).
    """
    _check_cpu_devices(rc.cpu_devices)
    prepare_cpu_backend(max(rc.cpu_devices, 1))
    if rc.malloc == "reuse" and (rc.platform == "cpu" or rc.cpu_devices > 0):  # a CPU run
        keep_freed_memory()
    import jax

    if rc.platform:
        jax.config.update("jax_platforms", rc.platform)
    if rc.cpu_devices:
        # Only the CPU backend reads this; on a GPU machine the GPUs stay the default devices.
        jax.config.update("jax_num_cpu_devices", rc.cpu_devices)
    if rc.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.abspath(rc.compilation_cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _check_cpu_devices(n: int) -> None:
    """Before the backend starts (the config's bounds are checked later, against the devices)."""
    if n > MAX_CPU_DEVICES:
        raise ConfigError(f"runtime.cpu_devices={n} must be <= {MAX_CPU_DEVICES} (XLA starts threads for every "
                          f"emulated device); set runtime.cpu_devices to at most {MAX_CPU_DEVICES}")


def apply_cpu_devices(overrides: Sequence[str]) -> list[str]:
    """Applies a `runtime.cpu_devices=N` among `overrides` (emulated CPU devices for a command that reads
    a run, e.g. generate with mesh.tensor=2 on a CPU machine) before the backend starts; returns the others."""
    from lumen_jax.config import from_dict
    from lumen_jax.config.files import apply_overrides

    cpu = [o for o in overrides if o.strip().startswith("runtime.cpu_devices=")]
    if cpu:
        import jax

        n = from_dict(apply_overrides({}, cpu[-1:])).runtime.cpu_devices
        if n < 1:
            raise ConfigError(f"runtime.cpu_devices={n} must be >= 1 here")
        _check_cpu_devices(n)
        jax.config.update("jax_num_cpu_devices", n)
    return [o for o in overrides if o not in cpu]


def device_count(rc: RuntimeConfig) -> int:
    """Starts JAX's backend and returns the device count; a platform this machine lacks is a ConfigError."""
    import jax

    try:
        return jax.device_count()
    except RuntimeError as e:
        if not rc.platform:
            raise
        reason = " ".join(str(e).split())[:200]
        raise ConfigError(f"runtime.platform={rc.platform} cannot start on this machine ({reason}); "
                          "set runtime.platform=cpu, or leave it empty to let JAX choose") from None


def device_memory(devices: Sequence[Any], host: str = "available") -> tuple[float, str] | None:
    """(bytes one of `devices` can hold, what that is): a GPU's `bytes_limit`; on CPU the host's memory
    shared by its devices of `devices`: `host`=available (free now) or physical (all of it, whatever
    other processes use now); None when unknown."""
    stats = devices[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), f"the {devices[0].device_kind} memory"
    if devices[0].platform != "cpu":
        return None
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES" if host == "available" else "SC_PHYS_PAGES")
        memory = pages * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    local = sum(d.process_index == devices[0].process_index for d in devices)
    what = "available memory" if host == "available" else "memory"
    return memory / local, f"the host's {what} shared by {local} CPU device(s)"


def check_fits(compiled: Any, devices: Sequence[Any], what: str, fix: str) -> None:
    """ConfigError when the compiled program needs more memory per device than `devices` have
    (XLA's `memory_analysis()`: arguments, outputs and temporaries), before it runs."""
    have = device_memory(devices)
    ma = compiled.memory_analysis()
    if have is None or ma is None:
        return
    need = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes
    if need > have[0]:
        raise ConfigError(f"{what} needs {need / 2**30:.1f} GiB per device, more than {have[1]} "
                          f"({have[0] / 2**30:.1f} GiB); {fix}")
