"""Pallas (and Triton) kernels, installed as `lumen_jax.kernels`.

(PyPI already has a package named `kernels`, hence the `package_dir` mapping in setup.cfg.)
Each kernel lives beside its `custom_vjp` wrapper; its pure-jnp reference is the one the trainer
runs (`lumen_jax/ops/reference.py`), and the model reaches kernels only through the dispatch in
`lumen_jax/ops/`. Kernels take `interpret` (Pallas's interpreter, the only mode on CPU) from their
caller; they never ask which backend runs.

- `flash_attention`: FlashAttention-2 forward and backward (dQ, dK/dV) in Pallas, lowered through
  Triton on GPU and run by Pallas's interpreter on CPU; GQA, causal and document (segment id)
  masking, any sequence length, and the log-sum-exp for merging partial results
  (`model.attention: flash`; `auto` picks it on GPU). Its shared building blocks (tile sizes,
  the static configuration, tile masks and loop bounds, the `pallas_call` wrapper) are in
  `flash_tiles`.
"""
