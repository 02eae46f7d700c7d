"""Docs that cannot rot silently. README.md and docs/*.md are read, and:

(a) every relative markdown link resolves to a file, and its `#anchor` to a heading of that file;
(b) every `python -m lumen_jax...` command shown (in a code block or inline code; also `make train
    ARGS="..."` and the trainer's arguments after `python launch/local.py ... --`) parses its arguments with that command's own parser, and the config and overrides
    it names load (`load_config`): a dry parse, nothing is built or compiled;
(c) every config key named as `section.key` (`mesh.fsdp_regather`, `model.fp8.recipe`) is a field of
    the dataclasses in lumen_jax/config/schema.py (or a key the schema says has moved).

Placeholders in commands (`X.yaml`, `N`, `[--search]`, `...`) are replaced by real values from the
tables below; a command the test cannot parse is listed in KNOWN_UNPARSED with the reason, never
skipped silently."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import pathlib
import re
import shlex
import unittest.mock
from typing import Callable, Iterator

from lumen_jax.config.files import load_config
from lumen_jax.config.schema import MOVED, Config, ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECTIONS = tuple(f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(getattr(Config(), f.name)))

# Placeholder words of the docs' commands and what stands for them in the dry parse ("" drops the word).
PLACEHOLDERS = {
    "X.yaml": "configs/tiny.yaml", "FILE": "configs/tiny.yaml", "N": "8", "RUN_DIR": "runs/tiny",
    "$SLURM_ARRAY_TASK_ID": "0", "...": "", "overrides": "", "key=value": "",
}
# Words that end a command in a shell line.
SHELL_ENDS = {"|", "||", "&&", ";", ">", ">>", "2>&1", "&"}
# Commands the test cannot parse, as (page, the command as shown), each with the reason. Empty today.
KNOWN_UNPARSED: dict[tuple[str, str], str] = {
    ("docs/CONFIGURATION.md", "python -m lumen_jax.train --config configs/tiny.yaml model.d_modle=64"):
        "shows the error a misspelt key gives",
}


# ------------------------------------------------------------------------------------------------
# Reading the pages
# ------------------------------------------------------------------------------------------------

def pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")


def code_blocks(text: str) -> list[str]:
    return FENCE.findall(text)


def prose(text: str) -> str:
    """The page without its fenced code blocks and inline code (links inside code are not links)."""
    return INLINE.sub("", FENCE.sub("", text))


def inline_code(text: str) -> list[str]:
    return [" ".join(span.split()) for span in INLINE.findall(FENCE.sub("", text))]


# ------------------------------------------------------------------------------------------------
# (a) links
# ------------------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor, with GitHub's `-1`, `-2` suffixes for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            s = slug(m.group(1))
            out.add(f"{s}-{seen[s]}" if s in seen else s)
            seen[s] = seen.get(s, 0) + 1
    return out


def broken_links(page: pathlib.Path, text: str) -> list[str]:
    """`target: why` for each relative link of `text` (the page at `page`) that does not resolve."""
    bad = []
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if path and not file.exists():
            bad.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(
                text if file == page else file.read_text(encoding="utf-8")):
            bad.append(f"{target}: no heading with the anchor #{anchor} in {file.relative_to(ROOT)}")
    return bad


def test_every_relative_link_resolves():
    bad = [f"{name(p)}: {b}" for p in pages() for b in broken_links(p, p.read_text(encoding="utf-8"))]
    assert not bad, "links that do not resolve:\n" + "\n".join(bad)


def test_link_check_sees_a_broken_link_and_a_wrong_anchor():
    page = ROOT / "docs" / "X.md"
    text = "# Top\n\n## A `b` c\n\n[ok](#a-b-c) [ok](PLATFORM.md) [x](NOPE.md) [y](PLATFORM.md#nope) [z](#top)\n"
    assert broken_links(page, text) == ["NOPE.md: no file docs/NOPE.md",
                                        "PLATFORM.md#nope: no heading with the anchor #nope in docs/PLATFORM.md"]


# ------------------------------------------------------------------------------------------------
# (b) commands
# ------------------------------------------------------------------------------------------------

def logical_lines(block: str) -> Iterator[str]:
    """The lines of a code block with `\\` continuations joined."""
    buf = ""
    for line in block.splitlines():
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
        else:
            yield buf + line
            buf = ""
    if buf:
        yield buf


def commands(text: str) -> list[str]:
    """Every `python -m lumen_jax...`, `make train ARGS=...` and `python launch/local.py` command of a page,
    as shown: a line of a
    code block or an inline code span that starts with one (after a `$ ` prompt, or after the `-- ` of
    a wrapper such as launch/supervise.py). A line that only names a command (ARCHITECTURE.md's Layout:
    `lumen_jax/report.py   python -m lumen_jax.report: ...`) shows none, nor does a command without
    arguments (`python -m lumen_jax.generate` names the command) or a family (`python -m lumen_jax...`)."""
    found = []
    for line in [*(ln for b in code_blocks(text) for ln in logical_lines(b)), *inline_code(text)]:
        m = re.search(r"(?:[\w.-]*/)*python -m lumen_jax(\.\w+)*\s+\S|make train ARGS=|python launch/local.py .* -- ",
                      line)
        if m and (line[:m.start()].strip() in ("", "$") or line[:m.start()].rstrip().endswith(" --")):
            found.append(" ".join(line[m.start():].split()))
    return found


def words(command: str) -> list[str]:
    """The command's words after `python -m`, cut at the shell's operators and comments, placeholders
    replaced and optional `[...]` brackets removed (a list value such as `data.paths=[a]` is kept)."""
    out = []
    for word in shlex.split(command, comments=True):
        if word in SHELL_ENDS:
            break
        if word.startswith("["):  # `[--search]`, `[key=value`: a value never starts a word with `[`
            word = word[1:]
        if word.endswith("]") and word.count("]") > word.count("["):
            word = word[:-1]
        word = PLACEHOLDERS.get(word, word)
        if word:
            out.append(word)
    return out


class Parsed(BaseException):
    """Raised by the patched `ArgumentParser.parse_args` to stop a command's `main` right after its parse."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__()
        self.namespace = namespace


def parse_in_main(main: Callable[[list[str]], int], argv: list[str]) -> argparse.Namespace:
    """`main(argv)` stopped as soon as its parser has parsed `argv` (for commands whose parser lives in main)."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(real(self, args, namespace))

    with unittest.mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        try:
            main(argv)
        except Parsed as done:
            return done.namespace
    raise AssertionError("the command's main returned without parsing its arguments")


def _with_config(parse_args: Callable[[list[str]], argparse.Namespace]) -> Callable[[list[str]], None]:
    def dry(argv: list[str]) -> None:
        args = parse_args(argv)
        load_config(args.config, args.overrides)
    return dry


def _overrides_only(parse: Callable[[list[str]], argparse.Namespace]) -> Callable[[list[str]], None]:
    def dry(argv: list[str]) -> None:
        load_config(None, parse(argv).overrides)
    return dry


def dry_parsers() -> dict[str, Callable[[list[str]], None]]:
    """The module after `python -m` -> a dry parse of its arguments (raises on a bad one)."""
    from lumen_jax import generate, report
    from lumen_jax.compiler import lower
    from lumen_jax.convert.__main__ import main as convert_main
    from lumen_jax.data import prepare
    from lumen_jax.plan import cli as plan_cli
    from lumen_jax.train import cli as train_cli
    from lumen_jax.train.evaluate import main as evaluate_main

    return {
        "lumen_jax.train": _with_config(train_cli.parse_args),
        "lumen_jax.plan": _with_config(plan_cli.parse_args),
        "lumen_jax.lower": _with_config(lower.parse_args),
        "lumen_jax.generate": _overrides_only(generate.parse_args),
        "lumen_jax.evaluate": _overrides_only(lambda argv: parse_in_main(evaluate_main, argv)),
        "lumen_jax.convert": lambda argv: parse_in_main(convert_main, argv) and None,
        "lumen_jax.report": lambda argv: parse_in_main(report.main, argv) and None,
        "lumen_jax.data.prepare": prepare.parse_args,
    }


def parse_error(command: str, parsers: dict[str, Callable[[list[str]], None]]) -> str | None:
    """None when `command` parses; else why not, in one line."""
    argv = words(command)
    if argv[:2] == ["make", "train"]:  # the Makefile: python -m lumen_jax.train --config $(CONFIG) $(ARGS)
        settings = dict(w.split("=", 1) for w in argv[2:] if "=" in w and w.split("=", 1)[0].isupper())
        argv = ["python", "-m", "lumen_jax.train", "--config", settings.get("CONFIG", "configs/tiny.yaml"),
                *words(settings.get("ARGS", ""))]
    if argv[1] == "launch/local.py":  # everything after its `--` goes to python -m lumen_jax.train
        argv = ["python", "-m", "lumen_jax.train", *argv[argv.index("--") + 1:]]
    module, argv = argv[2], argv[3:]
    if module not in parsers:
        return f"no dry parser for {module}: add it to dry_parsers()"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parsers[module](argv)
    except SystemExit as e:  # argparse's own error() (its message is on stderr), or --help: exit 0
        return f"exit {e.code}: {err.getvalue().strip().splitlines()[-1]}" if e.code else None
    except Exception as e:  # noqa: BLE001 - ConfigError, ReportError, ...: the one line the user would see
        return f"{type(e).__name__}: {e}"
    return None


def test_every_command_shown_parses():
    parsers = dry_parsers()
    shown = {(name(p), c) for p in pages() for c in commands(p.read_text(encoding="utf-8"))}
    assert len(shown) > 50, f"only {len(shown)} commands found: is the extraction broken?"
    bad = [f"{page}: {c}\n    {why}" for page, c in sorted(shown - set(KNOWN_UNPARSED))
           if (why := parse_error(c, parsers))]
    assert not bad, "commands in the docs that do not parse:\n" + "\n".join(bad)
    gone = set(KNOWN_UNPARSED) - shown
    assert not gone, f"KNOWN_UNPARSED lists commands the docs no longer show: {sorted(gone)}"
    fixed = [k for k in KNOWN_UNPARSED if parse_error(k[1], parsers) is None]
    assert not fixed, f"KNOWN_UNPARSED lists commands that now parse (remove them): {fixed}"


def test_command_check_sees_a_bad_flag_a_bad_key_and_keeps_list_values():
    parsers = dry_parsers()
    text = ("```\npython -m lumen_jax.plan --config X.yaml --devices N [--search]  # a comment\n"
            "python -m lumen_jax.train --config configs/tiny.yaml \\\n    data.paths=[a/*.jsonl] | tee log\n```\n"
            "and `python -m lumen_jax.generate --run-dir runs/a --prompt x --top-kk 5`, "
            "`python -m lumen_jax.train --config configs/tiny.yaml mesh.tensr=2`, "
            "`make train ARGS=\"train.steps=20 mesh.data=2\"`.\n")
    shown = commands(text)
    assert words(shown[0]) == ["python", "-m", "lumen_jax.plan", "--config", "configs/tiny.yaml", "--devices", "8",
                               "--search"]
    assert words(shown[1])[-1] == "data.paths=[a/*.jsonl]"
    assert [parse_error(c, parsers) is None for c in shown] == [True, True, False, False, True]
    assert "--top-kk" in parse_error(shown[2], parsers)
    assert "mesh.tensr" in parse_error(shown[3], parsers)
    assert "no dry parser" in parse_error("python -m lumen_jax.nothing --x", parsers)


# ------------------------------------------------------------------------------------------------
# (c) config keys
# ------------------------------------------------------------------------------------------------

KEY = re.compile(r"(?<![\w./-])(" + "|".join(SECTIONS) + r")\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?(<)?")
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "yaml", "yml", "gin", "txt", "log", "bin", "idx", "png", "html",
                 "safetensors"}
# Misspelt on purpose: the error a page shows for it.
SHOWN_AS_ERRORS = {"model.d_modle"}


def key_errors(text: str) -> list[str]:
    """Each `section.key` (or `section.sub.key`) named in `text` that the schema does not have."""
    bad = []
    for m in KEY.finditer(text):
        section, key, sub_key, prefix = m.groups()
        node = getattr(Config(), section)
        dotted = f"{section}.{key}"
        fields = {f.name for f in dataclasses.fields(node)}
        if key in FILE_SUFFIXES or dotted in MOVED or dotted in SHOWN_AS_ERRORS:  # train.py: a file name
            continue
        if key not in fields and ((ROOT / "lumen_jax" / section / f"{key}.py").exists()
                                  or (ROOT / "lumen_jax" / section / key).is_dir()):
            continue  # `train.hooks.Profiler`, `runtime.process`: code in lumen_jax/<section>/, not a key
        if prefix:  # distributed.across_nodes_<axis>: some field starts with it
            if not any(f.startswith(key) for f in fields):
                bad.append(f"{dotted}<...>")
            continue
        if key not in fields:
            bad.append(dotted)
        elif sub_key and dataclasses.is_dataclass(getattr(node, key)):
            if sub_key not in {f.name for f in dataclasses.fields(getattr(node, key))}:
                bad.append(f"{dotted}.{sub_key}")
    return bad


def test_every_config_key_named_exists():
    bad = [f"{name(p)}: {k}" for p in pages() for k in key_errors(p.read_text(encoding="utf-8"))]
    assert not bad, "config keys the docs name that lumen_jax/config/schema.py does not have:\n" + "\n".join(bad)


def test_key_check_sees_a_misspelt_key():
    text = ("`mesh.fsdp_regather`, model.fp8.recipe, optim.zero_stage (moved), train.py, `lumen_jax.data.prepare`, "
            "distributed.across_nodes_<axis>, `mesh.fsdp_regahter`, model.fp8.recipie, model.moe.top_kk, data.seqlen.")
    assert key_errors(text) == ["mesh.fsdp_regahter", "model.fp8.recipie", "model.moe.top_kk", "data.seqlen"]
    assert SECTIONS == ("model", "mesh", "optim", "data", "train", "checkpoint", "log", "runtime", "distributed")
    try:
        load_config(None, ["mesh.fsdp_regahter=per_step"])
    except ConfigError:
        pass
    else:
        raise AssertionError("the schema took a key key_errors refuses")
