"""Metric writers (JSONL, TensorBoard) and the console progress bar."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import numpy as np


def _to_python(value: Any) -> Any:
    """numpy / jax scalars (and size-1 arrays) to Python numbers; other values unchanged."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    array = np.asarray(value)
    if array.size == 1 and array.dtype.kind in "biuf":
        return array.item()
    return value


class MetricsWriter:
    """Writes scalars to `<run_dir>/metrics.jsonl` and TensorBoard event files in `run_dir`.

    Only one process should write: construct with `enabled=jax.process_index() == 0`; a disabled
    writer creates no file. Usable as a context manager.
    """

    def __init__(self, run_dir: str, *, jsonl: bool = True, tensorboard: bool = True,
                 enabled: bool = True, attempt: int = 1, purge_step: int | None = None) -> None:
        """`attempt` > 1 (a resumed run) is written into every JSON row; `purge_step`: TensorBoard
        discards the earlier events of this step and later (the steps a resume logs again)."""
        self.run_dir = run_dir
        self.attempt = attempt
        self._jsonl = None
        self._tb = None
        if not enabled or not (jsonl or tensorboard):
            return
        os.makedirs(run_dir, exist_ok=True)
        if jsonl:  # append: a resumed run continues the same file
            self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter  # deferred: slow import, unused when disabled
            self._tb = SummaryWriter(logdir=run_dir, purge_step=purge_step)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes a JSON line `{"step": step, **metrics}` and one TB scalar per number."""
        record = {"step": int(step), **{k: _to_python(v) for k, v in metrics.items()}}
        if self._jsonl is not None:
            row = {**record, "attempt": self.attempt} if self.attempt > 1 else record
            self._jsonl.write(json.dumps(row, default=str) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
                if key != "step" and numeric:
                    self._tb.add_scalar(key, value, global_step=int(step))

    def flush(self) -> None:
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flushes and closes the files; safe to call twice."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


DATA_WAIT_SHOWN = 0.05  # the bar shows the data wait above this share of the loop's time per step


class Progress:
    """A tqdm bar showing step, loss, tokens/s and MFU, and, when they matter, the share of the step
    spent waiting for data (over 5% of `loop_time_s`) and the straggler; does nothing when disabled."""

    def __init__(self, total_steps: int, enabled: bool = True, initial_step: int = 0, file: Any = None) -> None:
        """`file`: where the bar is drawn (None: sys.stderr as it is now)."""
        from tqdm import tqdm

        self._bar = tqdm(total=total_steps, initial=initial_step, disable=not enabled,
                         unit="step", dynamic_ncols=True, file=file)

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Moves the bar to `step` (steps completed) and shows the known metrics."""
        if self._bar.disable:
            return
        shown = {"loss": "loss {:.4f}", "tokens_per_sec": "{:,.0f} tok/s", "mfu": "MFU {:.1%}"}
        parts = [fmt.format(_to_python(metrics[k])) for k, fmt in shown.items()
                 if metrics.get(k) is not None]
        wait, loop = metrics.get("data_wait_s"), metrics.get("loop_time_s")
        if wait is not None and loop and wait > DATA_WAIT_SHOWN * loop:
            parts.append(f"data wait {wait / loop:.0%}")
        if metrics.get("straggler") is not None:
            parts.append(f"straggler: process {metrics['straggler']}")
        self._bar.set_postfix_str(" ".join(parts), refresh=False)
        self._bar.update(step - self._bar.n)  # redraws with the new postfix

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
