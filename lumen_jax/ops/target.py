"""Where the step being traced runs: the condition for the CPU-only formulations of the ops.

`ops.projection` (weight gradients over the tokens), `ops.attention`'s xla path (heads-first
layout, closed-form softmax gradient) and `ops.swiglu` (sigmoid recomputed) each have a
formulation that XLA:CPU runs faster on one device (docs/PERFORMANCE.md, CPU section). It is used
only while the trainer traces a step for a mesh of one CPU device (`rules.activate`, as
`lumen_jax.build` does). Everything else keeps the plain formulation, unchanged:

- programs partitioned over several devices: with the CPU formulations, the graph of an 8-device
  emulated CPU mesh hit XLA:CPU's collective-rendezvous abort far more often (5819d50); their HLO
  stays exactly what it was;
- other backends (the formulations were measured on CPU only);
- the model traced outside the trainer, e.g. `lumen_jax.plan`'s residual probe, whose counts
  describe the plain formulation that the partitioned and GPU programs run.
"""

from __future__ import annotations

import jax

from lumen_jax.parallel import rules as rules_lib


def one_cpu_device() -> bool:
    """True while the trainer traces a step for a mesh of one CPU device (see module docstring)."""
    active = rules_lib.active()
    if active is None:
        return False
    mesh = active[0]
    if mesh.size > 1 or not isinstance(mesh, jax.sharding.Mesh):
        return False
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty and abstract.size > 1:
        return False
    return mesh.devices.flat[0].platform == "cpu"
