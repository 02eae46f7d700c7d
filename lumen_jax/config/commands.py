"""The command-line parser every `python -m lumen_jax...` command uses: a bad flag or value is one
line and exit code 2 (a `ConfigError`, which each command's `main` prints), not argparse's usage block."""

from __future__ import annotations

import argparse

from lumen_jax.config.schema import ConfigError


class CommandParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors raise `ConfigError("<message>; <hint>")`; the hint
    defaults to `see <prog> --help`."""

    def __init__(self, *args, hint: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hint = hint

    def error(self, message: str) -> None:  # type: ignore[override]  (raises instead of exiting)
        raise ConfigError(f"{message}; {self.hint or f'see {self.prog} --help'}")
