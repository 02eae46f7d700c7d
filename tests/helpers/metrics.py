"""A run directory's metrics.jsonl, as the tests read it."""

import json
import os


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of `run_dir/metrics.jsonl`, one per line (the writer writes no blank lines)."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def losses(run_dir: str) -> dict[int, float]:
    """{step: loss}; a resumed run logs some steps again: the same values, the last row kept."""
    return {row["step"]: row["loss"] for row in read_metrics(run_dir)}
