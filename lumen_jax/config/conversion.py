"""A mapping (a YAML file's, gin's bindings, dotted overrides) into the `schema.Config` dataclasses,
strictly: every key known (or named where it moved), every value of its field's type and among its
allowed values, and back (`to_dict`). Every problem is a `ConfigError` naming the key, the value
and the fix; `show` quotes a value in such a message. No JAX import.
"""

from __future__ import annotations

import dataclasses
import difflib
import reprlib
import types
import typing
from typing import Any, Mapping, Sequence

from lumen_jax.config.schema import CHOICES, ITEMS, MOVED, NESTED, SECTIONS, Config, ConfigError

__all__ = ["show", "suggest_key", "unknown_section", "check_key", "from_dict", "to_dict"]


def _field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation (annotations are strings under `from __future__`)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_TYPES = {section: _field_types(cls) for section, cls in {**SECTIONS, **NESTED}.items()}
_ITEM_TYPES = {key: _field_types(cls) for key, cls in ITEMS.items()}

def show(value: Any) -> str:
    """A value as the user would write it back in a message (`'abc'`, `64`, `[1, 2]`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        value = list(value)
    text = _SHOWN.repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text):,} characters)"


def _shown() -> reprlib.Repr:
    """What an error message quotes of a value: enough to recognise it, never the whole of a huge
    one (a list of 10^8 paths, nested 9 deep)."""
    r = reprlib.Repr()
    r.maxlist = r.maxdict = r.maxtuple = r.maxset = 20
    r.maxstring = r.maxother = r.maxlong = SHOWN_CHARS
    r.maxlevel = 4
    return r


SHOWN_CHARS = 200
_SHOWN = _shown()


def _close(word: Any, candidates: Sequence[str], cutoff: float = 0.6) -> str | None:
    close = difflib.get_close_matches(str(word), list(candidates), n=1, cutoff=cutoff)
    return close[0] if close else None


def suggest_key(section: Any, key: Any) -> str | None:
    """`model.d_modle` -> `model.d_model`; `modle.d_model` -> `model.d_model`; `model.seq_len` -> `data.seq_len`."""
    s = section if section in _TYPES else _close(section, _TYPES)
    k = _close(key, _TYPES[s]) if s else None
    if k:
        return f"{s}.{k}"
    k = _close(key, [k for fields in _TYPES.values() for k in fields], cutoff=0.8)
    return next((f"{s}.{k}" for s, fields in _TYPES.items() if k in fields), None)


def unknown_section(section: Any) -> ConfigError:
    """The error for a section that does not exist, with a did-you-mean."""
    close = _close(section, SECTIONS)
    hint = f"; did you mean {close}?" if close else ""
    return ConfigError(f"unknown config section {section!r}{hint}"
                       f" (sections: {', '.join(SECTIONS)})")


def check_key(section: Any, key: Any, shown: str | None = None, where: str = "") -> Any:
    """The type of `section.key`, or a ConfigError (showing `section.key=shown`) with a did-you-mean.

    A key listed in `MOVED` gives the one-line error `optim.zero_stage moved to mesh.zero_stage`
    whichever format names it (YAML, gin, a dotted override): old keys are not aliases.
    """
    if section in _TYPES and key in _TYPES[section]:
        return _TYPES[section][key]
    dotted = f"{section}.{key}"
    if dotted in MOVED:
        raise ConfigError(f"{dotted} moved to {MOVED[dotted]}")
    close = suggest_key(section, key)
    hint = f"; did you mean {close}?" if close else ""
    if not close and section in _TYPES:
        hint = f"; keys of {section}: {', '.join(_TYPES[section])}"
    value = "" if shown is None else f"={shown}"
    raise ConfigError(f"{where}unknown config key {dotted}{value}{hint}")


def _convert(key: str, value: Any, typ: Any) -> Any:
    """Checks `value` against the field type: ints widen to floats, lists become tuples, nothing else."""
    def wrong(what: str) -> ConfigError:
        return ConfigError(f"{key}={show(value)} must be {what}; got {type(value).__name__}")

    if typing.get_origin(typ) in (typing.Union, types.UnionType):  # `float | None`: null allowed
        if value is None:
            return None
        typ = next(t for t in typing.get_args(typ) if t is not type(None))
    if typ is bool:
        if not isinstance(value, bool):
            raise wrong("a bool (true or false)")
    elif typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an int")
    elif typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong("a float")
        value = float(value)
    elif typ is str:
        if not isinstance(value, str):
            raise wrong("a str")
    elif key in ITEMS:  # a list of sub-sections (data.mixture): mappings of the item's keys
        return tuple(_convert_item(f"{key}[{i}]", v, key) for i, v in enumerate(_listed(key, value, wrong)))
    elif typing.get_origin(typ) is tuple:  # tuple[str, ...] or tuple[int, ...]
        item = typing.get_args(typ)[0]
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, item) and not isinstance(v, bool) for v in value):
            raise wrong(f"a list of {item.__name__}")
        value = tuple(value)
    elif key in NESTED:  # a sub-section (model.fp8): a mapping of its own keys
        if isinstance(value, typ):
            value = dataclasses.asdict(value)
        if not isinstance(value, Mapping):
            raise wrong(f"a mapping of keys ({', '.join(_TYPES[key])}), e.g. {key}: "
                        f"{{{next(iter(_TYPES[key]))}: ...}}")
        return typ(**{k: _convert(f"{key}.{k}", v, check_key(key, k, show(v))) for k, v in value.items()})
    else:  # a field type this function was not taught: our bug, not the user's
        raise TypeError(f"config field {key} has unsupported type {typ!r}")
    allowed = CHOICES.get(key)
    if allowed is not None and isinstance(value, tuple):  # a list field: every item must be allowed
        bad = [v for v in value if v not in allowed]
        if bad:
            raise ConfigError(f"{key}={show(value)} has {', '.join(show(v) for v in bad)}, not among the "
                              f"allowed values; choose the items of {key} from "
                              f"{', '.join(show(a) for a in allowed)}")
    elif allowed is not None and value not in allowed:
        raise ConfigError(f"{key}={show(value)} is not one of the allowed values; "
                          f"choose {key} from {', '.join(show(a) for a in allowed)}")
    return value


def _listed(key: str, value: Any, wrong: Any) -> Sequence[Any]:
    if not isinstance(value, (list, tuple)):
        keys = ", ".join(_ITEM_TYPES[key])
        raise wrong(f"a list of mappings ({keys}), e.g. {key}=[{{paths: [a], weight: 0.7}}, "
                    "{paths: [b], weight: 0.3}]")
    return value


def _convert_item(where: str, value: Any, key: str) -> Any:
    """One item of a list of sub-sections, e.g. `data.mixture[0]`: a mapping of the item class's keys."""
    cls, types_ = ITEMS[key], _ITEM_TYPES[key]
    if isinstance(value, cls):
        value = dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}={show(value)} must be a mapping of {', '.join(types_)}; "
                          f"got {type(value).__name__}")
    fields = {}
    for k, v in value.items():
        if k not in types_:
            close = _close(k, types_)
            raise ConfigError(f"unknown key {where}.{k}" + (f"; did you mean {close}?" if close else "")
                              + f" (keys of {key} items: {', '.join(types_)})")
        if types_[k] == tuple[str, ...] and isinstance(v, str):
            v = [v]  # paths: data/web, one item
        fields[k] = _convert(f"{where}.{k}", v, types_[k])
    return cls(**fields)


def from_dict(d: Mapping[str, Any]) -> Config:
    """Builds a `Config` from a nested mapping `{model: {...}, mesh: {...}, ..., name: str}`.

    Missing sections and keys keep their defaults. Unknown sections or keys, wrong types and values
    outside an enum raise ConfigError.
    """
    if not isinstance(d, Mapping):
        raise ConfigError(f"a config must be a mapping of sections ({', '.join(SECTIONS)}); "
                          f"got {type(d).__name__}")
    kwargs: dict[str, Any] = {}
    for section, body in d.items():
        if section == "name":
            if not isinstance(body, str):
                raise ConfigError(f"name={show(body)} must be a str; got {type(body).__name__}")
            kwargs["name"] = body
            continue
        if section not in SECTIONS:
            raise unknown_section(section)
        if body is None:  # `model:` with nothing under it
            body = {}
        if not isinstance(body, Mapping):
            raise ConfigError(f"config section {section}={show(body)} must be a mapping of keys "
                              f"(e.g. {section}: {{{next(iter(_TYPES[section]))}: ...}}); "
                              f"got {type(body).__name__}")
        fields = {k: _convert(f"{section}.{k}", v, check_key(section, k, show(v))) for k, v in body.items()}
        kwargs[section] = SECTIONS[section](**fields)
    return Config(**kwargs)


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of `cfg` (tuples as lists), ready for yaml.safe_dump / json.dumps."""
    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    return plain(dataclasses.asdict(cfg))

# `from lumen_jax.config import ...` (the package re-exports these)
