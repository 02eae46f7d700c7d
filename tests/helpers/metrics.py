"""A run directory's metrics.jsonl, as the tests read it."""

import json
import os


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of `run_dir/metrics.jsonl`, one per line (the writer writes no blank lines)."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def losses_and_grad_norms(run_dir: str) -> dict[int, tuple[float, float]]:
    """{step: (loss, grad_norm)}; a resumed run logs some steps again: the same values, the last row
    kept. Runs are compared on both: Adam divides a gradient's scale out, so the losses stay close
    even where the gradients are off by a factor."""
    return {row["step"]: (row["loss"], row["grad_norm"]) for row in read_metrics(run_dir)}
