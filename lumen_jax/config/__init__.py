"""The run's configuration: frozen dataclasses, one per component (schema.py), converted from mappings
(conversion.py), read from YAML/gin
files and dotted overrides (files.py), checked against a device count before any mesh exists
(checks.py). No JAX import.

The schema's names are the package's: `from lumen_jax.config import Config, ConfigError`.
"""

from lumen_jax.config import conversion, schema
from lumen_jax.config.conversion import *  # noqa: F401,F403  (conversion.__all__)
from lumen_jax.config.schema import *  # noqa: F401,F403  (schema.__all__)

__all__ = [*schema.__all__, *conversion.__all__]
