"""runtime/logs.py: the hook that sends late unraisable exceptions to library.log never raises."""

import builtins
import types

from lumen_jax.runtime import logs


def _unraisable():
    try:
        raise RuntimeError("Event loop is closed")
    except RuntimeError as e:
        return types.SimpleNamespace(err_msg=None, object="loop", exc_type=RuntimeError, exc_value=e,
                                     exc_traceback=e.__traceback__)


def test_the_unraisable_hook_works_at_interpreter_exit_and_without_its_folder(tmp_path, monkeypatch):
    """At exit the name `open` may be gone (before: a NameError per late exception, on the terminal); a
    removed run dir drops the text."""
    path = str(tmp_path / "library.log")
    monkeypatch.delattr(builtins, "open")
    logs._log_unraisable(path, _unraisable())
    monkeypatch.undo()
    assert "Event loop is closed" in open(path).read()
    logs._log_unraisable(str(tmp_path / "gone" / "library.log"), _unraisable())
