"""The process around the step: XLA flags and devices (process.py), jax.distributed start-up
(distributed.py), SIGTERM/SIGINT (signals.py), the run directory (rundir.py), library logs
(logs.py) and exact array checksums (checksums.py).

Importing this package imports no JAX (train/cli.py reads `distributed.resolve` before JAX starts).
"""
