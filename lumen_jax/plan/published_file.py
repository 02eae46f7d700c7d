"""Published runs read from a file: `python -m lumen_jax.plan --calibration FILE` checks the planner
on runs no one here chose (docs/PLANNING.md, "Your own published runs").

A YAML file is a list of runs (or a mapping with `runs:` holding one), each a mapping of the fields
of `published.Published`: `model` a mapping of model shape fields (d_model, num_layers, num_heads,
num_kv_heads, ffn_dim, vocab_size, ...) or a name of `published.MODELS`; `ours` a mapping of mesh
fields (the layout of our program that stands for the run). A CSV file has one run per line under
a header of the same field names; there `model` is a name of `published.MODELS` and `ours` is
`key=value` pairs separated by spaces. Every problem is a one-line `ConfigError` naming the file,
the run and the field. `program` (optional in the built-in table, where the name says it) names
the framework that ran the run, whose memory model the table uses (`plan.recipe_memory.FAMILIES`).
"""

from __future__ import annotations

import csv
import dataclasses
import os
from typing import Any

import yaml

from lumen_jax.config import ConfigError, MeshConfig, ModelConfig
from lumen_jax.config.files import MAX_VALUES, expands_past
from lumen_jax.plan.recipe_memory import FAMILIES
from lumen_jax.plan.published import CONVENTIONS, HARDWARE, MODELS, TABLE, Published  # noqa: F401 (TABLE: the default)

MAX_BYTES = 1 << 20  # a table of published runs is a few kB; refuse what cannot be one
FIELDS = {f.name: f for f in dataclasses.fields(Published)}
REQUIRED = [name for name, f in FIELDS.items()
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
UNITS = ("tokens/s", "TFLOP/s")


def read_table(path: str) -> tuple[Published, ...]:
    """The runs of the YAML or CSV file at `path` (see the module docstring)."""
    try:
        if os.path.getsize(path) > MAX_BYTES:
            raise ConfigError(f"--calibration {path} is over {MAX_BYTES >> 10} kB; a table of published runs is a "
                              "few lines")
        with open(path, encoding="utf-8", newline="") as f:
            if os.path.splitext(path)[1].lower() == ".csv":
                raw = [dict(r) for r in csv.DictReader(f)]
            else:
                raw = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--calibration {path}: cannot read it: {e.strerror}") from None
    except (UnicodeDecodeError, yaml.YAMLError, csv.Error) as e:
        raise ConfigError(f"--calibration {path} is not a YAML or CSV table: {' '.join(str(e).split())[:200]}") from None
    if expands_past(raw, MAX_VALUES):
        raise ConfigError(f"--calibration {path} expands to more than {MAX_VALUES:,} values (YAML aliases that "
                          "repeat aliases?); write the runs out")
    if isinstance(raw, dict) and set(raw) == {"runs"}:
        raw = raw["runs"]
    if not isinstance(raw, list) or not raw or not all(isinstance(r, dict) for r in raw):
        raise ConfigError(f"--calibration {path} must hold a list of runs (mappings of {', '.join(REQUIRED)}); "
                          "see docs/PLANNING.md")
    return tuple(_run(path, i + 1, r) for i, r in enumerate(raw))


def _run(path: str, number: int, raw: dict[str, Any]) -> Published:
    where = f"--calibration {path} run {number}" + (f" ({raw['name']})" if isinstance(raw.get("name"), str) else "")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}; the fields are {', '.join(FIELDS)}")
    missing = [k for k in REQUIRED if raw.get(k) in (None, "")]
    if missing:
        raise ConfigError(f"{where}: field {missing[0]!r} is missing")
    values = {k: _value(where, k, v) for k, v in raw.items() if v not in (None, "") or k not in REQUIRED}
    if values["hardware"] not in HARDWARE:
        raise ConfigError(f"{where}: hardware={values['hardware']!r}; use one of {', '.join(HARDWARE)}")
    if values["unit"] not in UNITS:
        raise ConfigError(f"{where}: unit={values['unit']!r}; use one of {', '.join(UNITS)}")
    if values["convention"] not in CONVENTIONS:
        raise ConfigError(f"{where}: convention={values['convention']!r}; use one of {', '.join(CONVENTIONS)}")
    for key in ("gpus", "seq_len", "global_batch", "micro_batches"):
        if values[key] < 1:
            raise ConfigError(f"{where}: {key}={values[key]} must be at least 1")
    if not values["measured"] > 0:
        raise ConfigError(f"{where}: measured={values['measured']} must be a positive number")
    run = Published(**values)
    if run.family not in FAMILIES:
        raise ConfigError(f"{where}: program={run.program!r}; name the framework that ran it, one of "
                          f"{', '.join(FAMILIES)} (its memory model)")
    try:
        ModelConfig(**run.model, remat=run.remat)
        mesh = MeshConfig(**{"fsdp": 1, **run.ours})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {' '.join(str(e).split())[:200]}") from None
    devices = mesh.data * mesh.fsdp * mesh.pipeline * mesh.expert * mesh.context * mesh.tensor
    if devices != run.gpus:
        raise ConfigError(f"{where}: ours {run.ours} spans {devices} devices, not gpus={run.gpus}; give our "
                          "mesh the run's device count")
    return run


def _value(where: str, key: str, value: Any) -> Any:
    """`value` of field `key` as `Published` holds it (a CSV cell is text)."""
    kind = FIELDS[key].type
    try:
        if key == "model":
            if isinstance(value, str):
                if value not in MODELS:
                    raise ValueError(f"a model name must be one of {', '.join(MODELS)} (or a mapping of its shape)")
                return dict(MODELS[value])
            if not isinstance(value, dict):
                raise ValueError("must be a mapping of model shape fields or a model name")
            return dict(value)
        if key == "ours":
            if isinstance(value, str):
                pairs = [p.split("=", 1) for p in value.split()]
                if any(len(p) != 2 for p in pairs):
                    raise ValueError("must be key=value pairs separated by spaces")
                return {k: yaml.safe_load(v) for k, v in pairs}
            if not isinstance(value, dict):
                raise ValueError("must be a mapping of mesh fields")
            return dict(value)
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("must be a whole number")
            return int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError("must be a number")
            return float(value)
        if kind == "bool":
            if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
                return value.lower() in ("true", "yes", "1")
            if not isinstance(value, bool):
                raise ValueError("must be true or false")
            return value
        return str(value)
    except ValueError as e:
        raise ConfigError(f"{where}: {key}={str(value)[:80]!r} {e}") from None
