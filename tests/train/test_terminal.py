"""What a person sees: `python -m lumen_jax.train` under a pseudo-terminal draws the progress bar
(step, loss, tokens/s) on the terminal, and the library log holds none of it."""

import sys

import pytest

from helpers.faults import SUBPROCESS_SCHEDULE
from helpers.terminal import run_in_pty


@pytest.mark.parametrize("columns", [120, 0], ids=["120-columns", "no-width"])
def test_progress_bar_reaches_the_terminal_not_the_log(tmp_path, columns):
    """Also on a terminal that reports no width (0 columns: some CI consoles), where the issue saw
    the bar disappear: today's tqdm draws it (checked 2026-12-05); this keeps it so."""
    run_dir = tmp_path / "run"
    code, out = run_in_pty([sys.executable, "-m", "lumen_jax.train", "--config", "configs/tiny.yaml",
                            "train.steps=6", *SUBPROCESS_SCHEDULE, "log.every_steps=3", "log.tensorboard=false",
                            f"train.run_dir={run_dir}"], columns=columns)
    assert code == 0, out[-3000:]
    assert "6/6" in out and "tok/s" in out and "loss " in out, out[-3000:]
    assert "done: step 6 loss" in out and "no checkpoint was saved (checkpoint.every_steps=0)" in out
    log = run_dir / "library.log"
    logged = log.read_text() if log.exists() else ""
    assert "tok/s" not in logged and "step/s" not in logged, logged[-2000:]
