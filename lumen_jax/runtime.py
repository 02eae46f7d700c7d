"""Process set-up that must happen before the JAX backend starts."""

from __future__ import annotations

import os

from lumen_jax.config import RuntimeConfig


def configure(rc: RuntimeConfig) -> None:
    """Emulated CPU device count, platform choice and the persistent compilation cache.

    Call before anything creates a JAX array: the backend reads these once, at start-up.
    """
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
