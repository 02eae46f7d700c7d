"""Model state that is not a parameter: the one path for the variables an op keeps between steps.

An op that needs state across steps (fp8's amax histories; a router's statistics next) stores it in
a subclass of `ModelState` instead of `nnx.Param`. The train step treats every such variable alike:

- it is split from the parameters by its NNX type (`nnx.split(model, nnx.Param, ModelState)`), lives
  in `TrainState.model_state`, gets no optimizer state and no weight decay;
- its next value is the "gradient" of the loss with respect to it (overwrite-with-gradient, as
  flax's fp8 ops: the op's custom VJP emits the updated state as the cotangent), so the step needs
  no op-specific code to update it;
- with gradient accumulation each micro-batch produces a next value, and its type's `combine`
  merges them (fp8 histories: the max; the default keeps the last);
- it is kept unchanged when a step is skipped (non-finite), like the parameters.
"""

from __future__ import annotations

import jax
from flax import nnx


class ModelState(nnx.Variable):
    """A non-parameter model variable (see the module docstring). Subclasses set `combine`."""

    @staticmethod
    def combine(earlier: jax.Array, later: jax.Array) -> jax.Array:
        """The next value after two micro-batches that produced `earlier` and `later`."""
        return later


def combine_rules(abstract_state: nnx.State) -> dict:
    """The `combine` of every ModelState variable of `abstract_state`, as a pure dict of functions."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return nnx.to_pure_dict(jax.tree.map(lambda v: type(v).combine, abstract_state, is_leaf=is_var))


def combine(rules: dict, earlier: dict, later: dict) -> dict:
    """Merges two micro-batches' next values of the model state, leaf by leaf with its `rules`."""
    return jax.tree.map(lambda rule, a, b: rule(a, b), rules, earlier, later)


__all__ = ["ModelState", "combine", "combine_rules"]
