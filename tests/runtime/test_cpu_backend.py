"""The emulated CPU backend's thread pool: every device keeps a free thread while others wait in collectives."""

import os

import jax

from lumen_jax.runtime.process import CPU_THREADS_PER_DEVICE


def test_cpu_pool_has_threads_per_emulated_device():
    # XLA:CPU names its pool's threads tf_XLAEigen; with only max(cores, devices) of them, 8 devices
    # each waiting in two collectives at once held all 8 and the step aborted (runtime/process.py).
    jax.devices()  # the backend is started
    tasks = f"/proc/{os.getpid()}/task"
    names = []
    for t in os.listdir(tasks):
        try:  # a thread that ended since the listing (another test's) has no entry any more
            with open(f"{tasks}/{t}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:
            pass
    assert names.count("tf_XLAEigen") >= CPU_THREADS_PER_DEVICE * jax.device_count()
