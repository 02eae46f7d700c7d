"""The emulated CPU backend's thread pool: every device keeps a free thread while others wait in collectives."""

import os
import subprocess
import sys

import jax

from lumen_jax.runtime.process import CPU_THREADS_PER_DEVICE, cpu_threads


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


def test_one_emulated_device_gets_a_pool_of_the_cores():
    """One device waits in no rendezvous: 4 threads on 2 cores cost its step about 10% (issue 43)."""
    assert cpu_threads(1, cores=2) == 2 and cpu_threads(1, cores=16) == 16
    assert cpu_threads(8, cores=2) == 32 and cpu_threads(2, cores=16) == 16  # the rendezvous fix stays
    # The trainer's set-up (`runtime.configure`) of a one-device CPU run, in a fresh process.
    code = ("import os; from lumen_jax.config import RuntimeConfig; from lumen_jax.runtime import process\n"
            "process.configure(RuntimeConfig(cpu_devices=1, platform='cpu', compilation_cache_dir=''))\n"
            "import jax; jax.devices()\n"
            "names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')]\n"
            "print(os.environ['PJRT_NPROC'], names.count('tf_XLAEigen'), jax.device_count())")
    env = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(os.cpu_count())] * 2 + ["1"], out.stdout + out.stderr
