"""lumen_jax: JAX/XLA SPMD training for Llama-class transformer language models."""

__version__ = "0.1.0"
