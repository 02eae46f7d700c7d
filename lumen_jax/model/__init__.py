"""Single-device model code: layers speak logical axis names, never mesh axes."""

from lumen_jax.model.transformer import Transformer, apply, init_params, param_shapes_and_names

__all__ = ["Transformer", "apply", "init_params", "param_shapes_and_names"]
