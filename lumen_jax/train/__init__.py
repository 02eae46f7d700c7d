"""`python -m lumen_jax.train`: parse (cli.py) -> build (build.py) -> loop (loop.py); the step
(step.py, pure), the optimizer (optim.py) and evaluation (evaluate.py).

Importing this package imports no JAX: `cli.main` starts the distributed runtime before anything
touches a device.
"""
