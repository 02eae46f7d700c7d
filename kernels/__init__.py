"""Pallas (and Triton) kernels, installed as `lumen_jax.kernels`.

(PyPI already has a package named `kernels`, hence the `package_dir` mapping in setup.cfg.)
Each kernel lives beside its `custom_vjp` wrapper and its pure-jnp reference; the model reaches
kernels only through the dispatch in `lumen_jax/ops/`. FlashAttention arrives with its own issue.
"""
