"""Hugging Face checkpoints (Llama, Qwen2, Qwen3 and three mixtures of experts) in and out: `python -m lumen_jax.convert from-hf|to-hf` (see __main__.py).

`hf.py` maps the config and the tensors both ways (pure, numpy); `__main__.py` reads and writes files.
"""
