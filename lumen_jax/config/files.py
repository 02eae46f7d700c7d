"""Reading config files: YAML (with `base:`), gin, and dotted command-line overrides.

`load_config` is the entry point. This module holds the file formats and imports the schema
(lumen_jax/config/schema.py) and the conversion of a mapping into it (conversion.py), neither of
which imports this module. No JAX import here either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import typing
from typing import Any, Mapping, Sequence

import yaml

from lumen_jax.config import (NESTED, SECTIONS, Config, ConfigError, DataConfig, check_key, from_dict, show,
                              unknown_section)


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `3e-4` as a float (YAML 1.1 wants a dot: `3.0e-4`)."""


class _DuplicateKey(Exception):
    """A mapping names a key twice: (key, first line, second line), 1-based."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise _DuplicateKey(key, seen[key], line)
        seen[key] = line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, lambda loader, node: (
    _construct_mapping(loader, node)))
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


# A YAML alias is the same object again, so a 1 kB file of aliases of aliases loads at once but is
# 10^10 values to anything that walks it (merging, checking, quoting it in an error message).
MAX_VALUES = 100_000


def expands_past(data: Any, limit: int) -> bool:
    """Whether `data`, its aliases expanded, holds more than `limit` values (stops counting there)."""
    stack, seen = [data], 0
    while stack:
        x = stack.pop()
        seen += 1
        if seen > limit:
            return True
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False


def _one_line(text: Any) -> str:
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _deep_merge(base: dict[str, Any], child: Mapping[str, Any]) -> dict[str, Any]:
    """`child` over `base`, recursing into mappings; an empty child section keeps the base one."""
    out = dict(base)
    for k, v in child.items():
        if isinstance(out.get(k), dict) and (v is None or isinstance(v, Mapping)):
            out[k] = _deep_merge(out[k], v or {})
        else:
            out[k] = v
    return out


def _read_yaml(path: str, chain: tuple[str, ...] = ()) -> dict[str, Any]:
    """The merged mapping of `path` and the `base:` files it extends (relative to its own folder)."""
    real = os.path.realpath(path)
    if real in chain:
        cycle = " -> ".join(os.path.basename(p) for p in (*chain, real))
        raise ConfigError(f"config {path} extends itself through base: ({cycle}); remove a base: line")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_Loader)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start}); pass a YAML file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {_one_line(e)}") from None
    except _DuplicateKey as e:
        key, first, second = e.args
        raise ConfigError(f"config file {path} sets {key!s} twice (lines {first} and {second}); "
                          "keep one: YAML would silently use the last") from None
    if data is None:
        data = {}
    if expands_past(data, MAX_VALUES):
        raise ConfigError(f"config file {path} expands to more than {MAX_VALUES:,} values (YAML aliases that "
                          "repeat aliases?); write the values out: a config is a few hundred")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of sections ({', '.join(SECTIONS)}); "
                          f"got {type(data).__name__}")
    if "name" in data:
        raise ConfigError(f"config file {path} sets name={show(data['name'])}; remove it: the name is "
                          "the file's stem")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or os.path.splitext(base)[1].lower() not in (".yaml", ".yml"):
        raise ConfigError(f"{path}: base={show(base)} must name a .yaml file relative to {path}")
    base_path = os.path.join(os.path.dirname(path), base)
    if not os.path.isfile(base_path):
        raise ConfigError(f"{path}: base={show(base)} does not exist (looked for {base_path}); "
                          "fix the path, relative to the file that names it")
    return _deep_merge(_read_yaml(base_path, (*chain, real)), data)


_GIN_MODULE = "lumen_jax.config"
_GIN_SEARCH_PATHS: list[str] = []  # in the order gin searches them, after the working directory


def _gin_refuse_code(path: str, seen: frozenset[str] = frozenset()) -> None:
    """Refuses an `import`/`from` line in the gin file `path` or a file it includes, before gin runs any.

    Gin executes a config file's import lines; a config file is data, so none may run. Includes are
    found as gin finds them: the working directory, then the search paths in the order they were added.
    """
    from gin import config_parser

    class _Placeholders(config_parser.ParserDelegate):  # `@name` and `%name` need no meaning to be scanned
        def configurable_reference(self, scoped_configurable_name: str, evaluate: bool) -> None:
            return None

        def macro(self, macro_name: str) -> None:
            return None

    real = os.path.realpath(path)
    if real in seen:
        raise ConfigError(f"config file {path} includes itself; remove an include line")
    with open(path, encoding="utf-8") as f:
        for statement in config_parser.ConfigParser(f, _Placeholders()):
            if isinstance(statement, config_parser.ImportStatement):
                raise ConfigError(f"{path}:{statement.location.line_num}: `{statement.format()}` would load "
                                  "code; a config file is data: remove the line")
            if isinstance(statement, config_parser.IncludeStatement):
                prefixes = [""] if os.path.isabs(statement.filename) else ["", *_GIN_SEARCH_PATHS]
                found = [p for p in (os.path.join(x, statement.filename) for x in prefixes) if os.path.isfile(p)]
                if found:  # gin itself names a missing include
                    _gin_refuse_code(found[0], seen | {real})


def _read_gin(path: str) -> dict[str, Any]:
    """Parses a gin file binding the section dataclasses (`model.d_model = 64`) into a mapping."""
    import gin  # only gin users pay for it

    for section, cls in {**SECTIONS, **NESTED}.items():  # `model.fp8` is `fp8` in module `...config.model`
        parent, _, name = f"{_GIN_MODULE}.{section}".rpartition(".")
        try:
            gin.register(name, module=parent)(cls)  # leaves the class itself untouched
        except ValueError:  # already registered (e.g. the module was reloaded)
            pass
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    if folder not in _GIN_SEARCH_PATHS:  # `include 'x.gin'` relative to this file
        gin.add_config_file_search_path(folder)
        _GIN_SEARCH_PATHS.append(folder)
    gin.clear_config()
    try:
        _gin_refuse_code(path)
        gin.parse_config_file(path)
        # Calling the configurable applies the bindings, macros and references included.
        sections = {s: dataclasses.asdict(gin.get_configurable(f"{_GIN_MODULE}.{s}")()) for s in SECTIONS}
        for dotted in NESTED:  # `model.fp8.recipe = 'delayed'` binds the sub-section's own configurable
            if gin.get_bindings(f"{_GIN_MODULE}.{dotted}"):
                section, key = dotted.split(".")
                sections[section][key] = dataclasses.asdict(gin.get_configurable(f"{_GIN_MODULE}.{dotted}")())
    except ConfigError:
        raise
    except (ValueError, TypeError, SyntaxError) as e:
        msg = _one_line(e)
        # Gin's own wording (pinned <0.6), turned into ours so both file formats read alike.
        m = re.match(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'", msg)
        if m:
            name = m.group(1).removeprefix(f"{_GIN_MODULE}.")
            check_key(name if name in NESTED else name.rsplit(".", 1)[-1], m.group(2), where=f"{path}: ")
        m = re.match(r"No configurable matching '([\w.]+)'", msg)
        if m:
            raise ConfigError(f"{path}: {unknown_section(m.group(1))}") from None
        raise ConfigError(f"config file {path} is not valid gin: {msg}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    finally:
        gin.clear_config()  # leave no global bindings behind: the next load starts clean
    return sections


def _parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value` -> (section, key, value); the value is read as YAML (`3e-4`, `true`, `[a, b]`)."""
    dotted, eq, raw = text.partition("=")
    section, dot, key = dotted.strip().rpartition(".")
    if section.count(".") == 1 and section.split(".")[0] in SECTIONS:  # model.fp8.recipe=delayed
        check_key(*section.split("."))  # model.fp9.recipe: did you mean model.fp8?
    if not eq or not dot or not section or not key or (section.count(".") > 1) or (
            "." in section and section not in NESTED):
        raise ConfigError(f"override {text!r} must look like section.key=value (e.g. optim.lr=3e-4)")
    raw = raw.strip()
    typ = check_key(section, key, raw)
    try:
        value = yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError:
        value = raw
    if typ is str and not isinstance(value, str):
        value = raw  # train.run_dir=2024 or data.tokenizer=null mean the text itself
    elif typ is float and isinstance(value, str) and raw.lower().lstrip("+-") in ("inf", "infinity", "nan"):
        value = float(raw)  # optim.lr=inf: YAML spells it .inf; validation names it as not finite
    elif typing.get_origin(typ) is tuple and isinstance(value, (str, *typing.get_args(typ)[:1])):
        value = [value]  # data.paths=corpus/*.txt, distributed.local_device_ids=0: one item
    return section, key, value


def load_config(path: str | None, overrides: Sequence[str] = ()) -> Config:
    """Loads a `.yaml`/`.yml` or `.gin` config file (None: all defaults) and applies dotted overrides.

    Args:
      path: config file. A YAML file may say `base: other.yaml` (relative to its own folder) to
        deep-merge over another file; a gin file binds `model.d_model = 64` and may `include`.
      overrides: `section.key=value` strings applied after the file, e.g. `optim.lr=3e-4`.

    Returns:
      The Config, named after the file's stem ("default" when path is None). Not yet checked
      against a device count: call `lumen_jax.config.checks.validate` for that.
    """
    raw: dict[str, Any] = {}
    name = "default"
    if path is not None:
        ext = os.path.splitext(path)[1].lower()
        if os.path.isdir(path):
            raise ConfigError(f"config file {path} is a directory; pass one .yaml or .gin file in it "
                              "(e.g. configs/tiny.yaml)")
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path} does not exist; pass a path to a .yaml or .gin file "
                              "(see configs/)")
        if ext in (".yaml", ".yml"):
            raw = _read_yaml(path)
        elif ext == ".gin":
            raw = _read_gin(path)
        else:
            raise ConfigError(f"config file {path} must end in .yaml, .yml or .gin; got {ext or 'no suffix'}")
        name = os.path.splitext(os.path.basename(path))[0]
    raw = apply_overrides(raw, overrides)
    raw["name"] = name
    cfg = from_dict(raw)
    return cfg.replace(data=pin_tokenizer(cfg.data))


def pin_tokenizer(data: DataConfig) -> DataConfig:
    """`data` with its tokenizer file named by absolute path and its sha256, so that a run records which
    file it used wherever a later command runs; a `tokenizer_sha256` already set must match the file.
    `byte` and a missing file (validation names it) are left as they are."""
    if data.tokenizer == "byte":
        return data
    path = os.path.abspath(os.path.expanduser(data.tokenizer))
    if not os.path.isfile(path):
        return data
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if data.tokenizer_sha256 and data.tokenizer_sha256 != digest:
        raise ConfigError(f"data.tokenizer={path!r} has sha256 {digest[:12]}, not data.tokenizer_sha256="
                          f"{data.tokenizer_sha256[:12]}...; give the tokenizer file with that hash, or clear "
                          "data.tokenizer_sha256 to take this file's")
    return dataclasses.replace(data, tokenizer=path, tokenizer_sha256=digest)


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`raw` (a nested config dict, changed in place and returned) with `section.key=value` overrides set."""
    for text in overrides:
        section, key, value = _parse_override(text)
        body = raw
        for part in section.split("."):  # `model`, or `model` then `fp8`
            if body.get(part) is None:
                body[part] = {}
            body = body[part]
            if not isinstance(body, dict):  # anything else fails in from_dict with its own message
                break
        else:
            body[key] = value
            if (section, key) == ("data", "tokenizer"):  # another file: its hash is taken anew
                body.pop("tokenizer_sha256", None)
    return raw
