"""Test set-up: 8 emulated CPU devices and a persistent compilation cache, before JAX starts."""

import os
import sys

# The repository's `kernels/` (installed as `lumen_jax.kernels`) shadows PyPI's `kernels`, which
# transformers 5.x imports, wherever the repository root is on sys.path: `python -m pytest` puts it
# there, and so do the benchmark scripts the tests load (`sys.path.insert(0, ROOT)`, some lazily).
# Without the root, PyPI's is imported here, once, so later path changes find it in sys.modules.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != ROOT]
try:
    import kernels  # noqa: F401
except ImportError:  # transformers 4.x does not need it
    pass

from lumen_jax.runtime.process import add_xla_flags, prepare_cpu_backend  # noqa: E402

prepare_cpu_backend()  # before the backend starts: see lumen_jax/runtime/process.py
# The tests' programs are tiny: compiling them is most of the suite's time, running them little.
# XLA's LLVM back end at -O0 compiles a 3-step mesh comparison in ~40% less time; the HLO, its
# collectives and buffers are the same program (only the machine code is less optimized; float32
# results moved by one ulp where measured: on fsdp=8 the first loss 5.5497184 -> 5.5497179, inside every
# fp32 tolerance; bit-for-bit tests compare runs under the same flags). Subprocesses inherit it
# through XLA_FLAGS. Tests that run hundreds of steps compile with helpers.run.FAST_RUN instead.
add_xla_flags(("--xla_backend_optimization_level=0",))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir",
                  os.path.join(os.path.dirname(os.path.dirname(__file__)), ".cache", "jax-tests"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    """Tests that build meshes need all 8 emulated devices: missing ones are a failure, not a skip."""
    assert jax.device_count() == 8, f"expected 8 emulated CPU devices, got {jax.device_count()}"

