"""Single-device model code: layers speak logical axis names, never mesh axes."""

from lumen_jax.model.transformer import (AbstractModel, Transformer, abstract_model, apply, apply_objective, init, init_params,
                                         param_shapes_and_names)

__all__ = ["AbstractModel", "Transformer", "abstract_model", "apply", "apply_objective", "init", "init_params",
           "param_shapes_and_names"]
