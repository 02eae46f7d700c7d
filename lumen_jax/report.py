"""`python -m lumen_jax.report RUN_DIR [RUN_DIR ...] --out report.png [--html report.html]`: a run's curves.

Reads each run directory's metrics.jsonl (the newest row of each step: a resumed attempt logs some
steps again), events.jsonl (starts, slow steps, stragglers), config.json, compile.json and, when the
run was supervised, goodput.json (launch/supervise.py), and draws one figure: loss and eval loss,
learning rate, gradient norm, tokens/s, MFU, the time per step (the loop's and the device's), the data
wait and the loop's other host time, with each restart (a dashed line at the step it resumed from)
and each interruption (a cross at the last step it reached, with its cause) on the step axis, and a
summary per run (goodput among it). Several runs overlay, one colour each, with a legend. `--html`
writes one self-contained page: the same figure, the summary, the interruptions and each run's
resolved config. No JAX import.

Exit codes: 0 written; 2 bad input (a missing run directory or metrics.jsonl, a corrupt line, an
output path that cannot be written), in one line.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import html
import io
import json
import math
import os
import statistics
import sys
from typing import Any, Sequence

from lumen_jax.metrics.memory import size

EXIT_BAD_INPUT = 2
WIDTH_IN, HEIGHT_IN, DPI = 16, 10, 100  # the PNG: 1600 x 1000 pixels


class ReportError(ValueError):
    """Bad input: printed in one line, exit code 2."""


@dataclasses.dataclass
class Run:
    path: str
    label: str
    rows: list[dict]  # one per logged step, by step; the newest attempt's where a step was logged twice
    events: list[dict]
    config: dict | None
    compile: dict | None
    goodput: dict | None
    notes: list[str]  # what the reader skipped (a torn last line)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the rows that have `key` as a finite number."""
        pairs = [(r["step"], float(r[key])) for r in self.rows
                 if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def restarts(self) -> list[int]:
        """The step each later attempt resumed from (its `start` event)."""
        starts = [e for e in self.events if e.get("event") == "start"]
        return [int(e.get("resume_step", 0)) for e in starts[1:]]

    def interruptions(self) -> list[tuple[int, str]]:
        """(last step reached, cause) of every attempt that did not end the run: the supervisor's causes
        (goodput.json) where it ran, else "interrupted" for each attempt followed by another."""
        attempts: dict[Any, list[int]] = {}
        for e in self.events:
            key = e.get("attempt") or e.get("pid")
            if e.get("event") == "start":
                attempts.setdefault(key, [int(e.get("resume_step", 0))])
            elif e.get("event") == "step" and key in attempts:
                attempts[key].append(int(e["step"]))
        reached = [max(steps) for steps in attempts.values()]
        if self.goodput:
            causes = {i["attempt"]: i["cause"] for i in self.goodput.get("interruptions", [])}
            return [(reached[a], cause) for a, cause in sorted(causes.items()) if a < len(reached)]
        return [(r, "interrupted") for r in reached[:-1]]

    def flagged(self, event: str) -> list[dict]:
        return [e for e in self.events if e.get("event") == event]


_NUMBER = (int, float)
# The fields the report reads of each kind of event (events.jsonl) and their types; `start` may
# lack `resume_step` (a fresh run).
EVENT_FIELDS = {"start": {"resume_step": int}, "step": {"step": int},
                "slow_step": {"step": int, "step_time_s": _NUMBER}, "straggler": {"step": int, "process": int}}
OPTIONAL_FIELDS = {("start", "resume_step")}
GOODPUT_FIELDS = {"goodput": _NUMBER, "wall_s": _NUMBER, "attempts": list, "interruptions": list}
INTERRUPTION_FIELDS = {"attempt": int, "cause": str, "steps_lost": int, "time_lost_s": _NUMBER}


def _field_problem(value: dict, fields: dict, optional: set[str] = frozenset()) -> str | None:
    """What is wrong with `value`'s `fields` ({name: type}), or None."""
    for name, kind in fields.items():
        if name not in value:
            if name not in optional:
                return f"has no {name!r}"
        elif not isinstance(value[name], kind) or isinstance(value[name], bool):
            return f"has {name}={value[name]!r}, not a {getattr(kind, '__name__', 'number')}"
    return None


def event_problem(event: dict) -> str | None:
    """What is wrong with one line of events.jsonl for the report, or None (unknown events pass)."""
    kind = event.get("event")
    fields = EVENT_FIELDS.get(kind)
    if fields is None:
        return None
    problem = _field_problem(event, fields, {f for k, f in OPTIONAL_FIELDS if k == kind})
    return problem and f"a {kind!r} event {problem}"


def goodput_problem(value: dict) -> str | None:
    """What is wrong with goodput.json for the report, or None."""
    problem = _field_problem(value, GOODPUT_FIELDS)
    for item in value.get("interruptions", []) if problem is None else ():
        problem = (_field_problem(item, INTERRUPTION_FIELDS) if isinstance(item, dict)
                   else "an interruption is not an object")
        if problem:
            return f"an interruption {problem}" if not problem.startswith("an ") else problem
    return problem


def _read_jsonl(path: str, notes: list[str], check=None) -> list[dict]:
    """The JSON objects of a .jsonl file; a torn last line (a kill mid-write) is skipped with a note,
    any other line that is not a JSON object, or that `check` (object -> problem or None) finds
    wrong, is a ReportError naming the file and the line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ReportError(f"cannot read {path} ({getattr(e, 'strerror', None) or e}); check the file") from None
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
            if not isinstance(value, dict):
                raise ValueError("not an object")
        except ValueError:
            if n == len(lines):
                notes.append(f"{os.path.basename(path)}: its last line is incomplete (skipped)")
                continue
            raise ReportError(f"{path} line {n} is not a JSON object: {line[:60]!r}; delete or fix that line") from None
        problem = check(value) if check else None
        if problem:
            raise ReportError(f"{path} line {n}: {problem}: {line[:60]!r}; delete or fix that line")
        out.append(value)
    return out


def _read_json(path: str, check=None) -> dict | None:
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ReportError(f"{path} is not readable JSON ({e}); delete or fix it") from None
    if not isinstance(value, dict):
        return None
    problem = check(value) if check else None
    if problem:
        raise ReportError(f"{path}: {problem}; delete or fix it")
    return value


def read_run(path: str, label: str | None = None) -> Run:
    """The run in directory `path`; ReportError when it is not one."""
    if not os.path.isdir(path):
        raise ReportError(f"{path} is not a directory; give run directories (train.run_dir), e.g. runs/tiny")
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.exists(metrics):
        raise ReportError(f"{path} has no metrics.jsonl: not a run directory, or no step was logged yet "
                          "(log.jsonl=false writes none)")
    notes: list[str] = []
    by_step: dict[int, dict] = {}
    for row in _read_jsonl(metrics, notes):
        if isinstance(row.get("step"), int):
            by_step[row["step"]] = row  # the newest row of a step: a resumed attempt logs it again
    if not by_step:
        raise ReportError(f"{metrics} holds no logged step yet; rerun the report once the run has logged one")
    events_path = os.path.join(path, "events.jsonl")
    events = _read_jsonl(events_path, notes, event_problem) if os.path.exists(events_path) else []
    return Run(path=path, label=label or os.path.basename(os.path.normpath(path)),
               rows=[by_step[s] for s in sorted(by_step)], events=events,
               config=_read_json(os.path.join(path, "config.json")),
               compile=_read_json(os.path.join(path, "compile.json")),
               goodput=_read_json(os.path.join(path, "goodput.json"), goodput_problem), notes=notes)


def labels(paths: Sequence[str]) -> list[str]:
    """Each run's name in the legend: its folder, or its whole path where two folders share a name."""
    names = [os.path.basename(os.path.normpath(p)) for p in paths]
    return [p if names.count(n) > 1 else n for p, n in zip(paths, names)]


# --------------------------------------------------------------------------------------------------
# The summary
# --------------------------------------------------------------------------------------------------

def _median(run: Run, key: str) -> float | None:
    _, values = run.series(key)
    return statistics.median(values) if values else None


def summary(run: Run) -> list[str]:
    """A few lines about the run: steps, loss, pace, goodput, interruptions, alarms, memory."""
    last = run.rows[-1]
    lines = [f"steps 1-{last['step']}" + (f", loss {last['loss']:.4f}" if "loss" in last else "")]
    _, evals = run.series("eval_loss")
    if evals:
        lines[-1] += f", eval loss {evals[-1]:.4f}"
    tps, mfu, loop = _median(run, "tokens_per_sec"), _median(run, "mfu"), _median(run, "loop_time_s")
    pace = [f"{tps:,.0f} tokens/s" if tps else "", f"MFU {mfu:.1%}" if mfu is not None else "",
            f"{loop * 1e3:,.0f} ms/step" if loop else ""]
    if any(pace):
        lines.append("median " + ", ".join(p for p in pace if p))
    wait = _median(run, "data_wait_s")
    if wait is not None and loop:
        lines.append(f"data wait {wait / loop:.1%} of the step (median)")
    if run.goodput:
        g = run.goodput
        lines.append(f"goodput {100 * g['goodput']:.1f}% of {g['wall_s']:,.0f} s, {len(g['attempts'])} attempt(s)")
        lines += [f"  attempt {i['attempt'] + 1}: {i['cause']}, {i['steps_lost']} steps and "
                  f"{i['time_lost_s']:,.0f} s lost" for i in g.get("interruptions", [])]
    elif run.restarts():
        lines.append(f"{len(run.restarts())} restart(s) (not supervised: no goodput.json)")
    slow, stragglers = run.flagged("slow_step"), run.flagged("straggler")
    if slow:
        lines.append(f"{len(slow)} slow step(s): " + ", ".join(str(e["step"]) for e in slow[:8])
                     + (" ..." if len(slow) > 8 else ""))
    if stragglers:
        named = sorted({e["process"] for e in stragglers})
        lines.append(f"straggler at {len(stragglers)} logged step(s): process " + ", ".join(map(str, named)))
    if run.compile:
        c, p = run.compile.get("compiled_bytes_per_device", {}), run.compile.get("planned_bytes_per_device")
        if c:
            lines.append(f"memory per device {size(c['total'])} compiled" + (f", {size(p['total'])} planned" if p else ""))
    return lines + run.notes


# --------------------------------------------------------------------------------------------------
# The figure
# --------------------------------------------------------------------------------------------------

# (title, y label, [(metrics key, line style, name in the legend)], scale of the values)
PANELS = (
    ("loss", "loss", [("loss", "-", "train"), ("eval_loss", "o--", "eval")], 1.0),
    ("learning rate", "lr", [("lr", "-", None)], 1.0),
    ("gradient norm", "global norm", [("grad_norm", "-", None)], 1.0),
    ("throughput", "tokens/s", [("tokens_per_sec", "-", None)], 1.0),
    ("MFU", "% of peak", [("mfu", "-", None)], 100.0),
    ("time per step", "seconds", [("loop_time_s", "-", "loop"), ("step_time_s", "--", "device")], 1.0),
    ("data wait", "% of the loop's time", [("data_wait_s", "-", None)], 100.0),
    ("the loop's other host time", "seconds per step",
     [("host_overhead_s", "-", "host overhead"), ("checkpoint_stall_s", ":", "checkpoint stall")], 1.0),
)


def render(runs: Sequence[Run]) -> bytes:
    """The figure as PNG bytes (WIDTH_IN x HEIGHT_IN inches at DPI)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.lines import Line2D

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, grid = plt.subplots(3, 3, figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI)
    axes = list(grid.flat)
    for ax, (title, ylabel, lines, scale) in zip(axes, PANELS):
        for i, run in enumerate(runs):
            color = colors[i % len(colors)]
            for key, style, _ in lines:
                steps, values = run.series(key)
                if key == "data_wait_s":  # as a share of the loop's time per step
                    loop = dict(zip(*run.series("loop_time_s")))
                    steps = [s for s in steps if loop.get(s)]
                    values = [dict(zip(*run.series(key)))[s] / loop[s] for s in steps]
                if steps:
                    ax.plot(steps, [v * scale for v in values], style, color=color, linewidth=1.4,
                            markersize=4, label=run.label if key == lines[0][0] else None)
            _mark_events(ax, run, color, label_causes=title == "loss")
        if title != "loss":  # quantities that start at zero: a flat line is not magnified into noise
            ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=12)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if title == "time per step":  # slow steps and stragglers where they happened, along the bottom
            for i, run in enumerate(runs):
                for event, marker, y in (("slow_step", "^", 0.04), ("straggler", "s", 0.11)):
                    hits = run.flagged(event)
                    if hits:
                        ax.plot([e["step"] for e in hits], [y] * len(hits), marker, linestyle="none",
                                color=colors[i % len(colors)], markersize=7, markeredgecolor="black",
                                transform=ax.get_xaxis_transform())
        named = [(style, name) for key, style, name in lines if name and any(r.series(key)[0] for r in runs)]
        if title == "time per step":
            named += [(marker, label) for event, marker, label in (("slow_step", "^", "slow step"),
                                                                   ("straggler", "s", "straggler"))
                      if any(r.flagged(event) for r in runs)]
        if len(named) > 1:  # which line is which: one entry per line style
            handles = [Line2D([], [], color="gray", linestyle="none" if style in "^s" else style.lstrip("o") or "-",
                              marker=style if style in "^s" else ("o" if style.startswith("o") else None), label=name)
                       for style, name in named]
            ax.legend(handles=handles, fontsize=8, loc="center left" if title == "loss" else "upper left")
    if len(runs) > 1 or any(r.restarts() or r.interruptions() for r in runs):
        handles = [Line2D([], [], color=colors[i % len(colors)], linewidth=2.5, label=r.label)
                   for i, r in enumerate(runs)]
        handles += [Line2D([], [], color="gray", linestyle="--", label="restart (resumed from)"),
                    Line2D([], [], color="gray", marker="X", linestyle="none", markersize=9, label="interrupted")]
        styles = axes[0].get_legend()  # train / eval, kept beside the runs' legend
        axes[0].legend(handles=handles, fontsize=9, loc="lower left")
        if styles is not None:
            axes[0].add_artist(styles)
            styles.set_loc("center left")
    fig.suptitle("lumen_jax: " + ", ".join(r.label for r in runs), fontsize=14)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    _summaries(fig, axes[-1], runs, colors)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=DPI)
    plt.close(fig)
    return out.getvalue()


def _summaries(fig: Any, ax: Any, runs: Sequence[Run], colors: Sequence[str]) -> None:
    """Each run's name (in its colour) and summary, one below the other in the last panel."""
    ax.axis("off")
    renderer = fig.canvas.get_renderer()
    to_axes = ax.transAxes.inverted()
    y = 1.0
    for i, run in enumerate(runs):
        for text, style in ((run.label, {"color": colors[i % len(colors)], "fontsize": 11, "fontweight": "bold"}),
                            ("\n".join(summary(run)), {"fontsize": 9, "family": "monospace"})):
            drawn = ax.text(0.0, y, text, va="top", transform=ax.transAxes, **style)
            box = to_axes.transform(drawn.get_window_extent(renderer=renderer))
            y = box[0][1] - 0.02  # the bottom of what was just drawn
        y -= 0.05


def _mark_events(ax: Any, run: Run, color: str, label_causes: bool) -> None:
    """Restarts as dashed lines at the step resumed from, interruptions as crosses at the step reached."""
    for step in run.restarts():
        ax.axvline(step, color=color, linestyle="--", linewidth=1.0, alpha=0.8)
    for step, cause in run.interruptions():
        ax.axvline(step, color=color, linestyle=":", linewidth=0.8, alpha=0.6)
        ax.plot([step], [0.94], "X", color=color, markersize=9, markeredgecolor="black",
                transform=ax.get_xaxis_transform(), clip_on=False)
        if label_causes:
            ax.annotate(cause, (step, 0.94), xycoords=("data", "axes fraction"), xytext=(-8, 0),
                        textcoords="offset points", fontsize=8, ha="right", va="center", color=color,
                        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})


# --------------------------------------------------------------------------------------------------
# The HTML page
# --------------------------------------------------------------------------------------------------

def page(runs: Sequence[Run], png: bytes) -> str:
    """One self-contained HTML page: the figure (inline), and per run its summary, interruptions,
    alarms and resolved config."""
    esc = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>lumen_jax report</title>",
             "<style>body{font-family:sans-serif;margin:2em;max-width:1700px} img{width:100%} "
             "pre{background:#f6f6f6;padding:1em;overflow:auto} td,th{padding:2px 10px;text-align:left}</style>",
             "</head><body>", f"<h1>lumen_jax: {esc(', '.join(r.label for r in runs))}</h1>",
             f"<img alt='curves' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"]
    for run in runs:
        parts.append(f"<h2>{esc(run.label)}</h2><p>{esc(run.path)}</p>")
        parts.append("<pre>" + esc("\n".join(summary(run))) + "</pre>")
        flagged = ([("restart", f"resumed from step {s}") for s in run.restarts()]
                   + [("interruption", f"step {s}: {c}") for s, c in run.interruptions()]
                   + [("slow step", f"step {e['step']}: {e['step_time_s']:.3f} s, median {e['median_s']:.3f} s")
                      for e in run.flagged("slow_step")]
                   + [("straggler", f"step {e['step']}: process {e['process']}, {e['own_s']:.3f} s of its own "
                                    f"per step, the others {e['others_s']:.3f} s") for e in run.flagged("straggler")])
        if flagged:
            parts.append("<table><tr><th>event</th><th>detail</th></tr>" + "".join(
                f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in flagged) + "</table>")
        if run.config is not None:
            parts.append("<details><summary>resolved config (config.json)</summary><pre>"
                         + esc(json.dumps(run.config, indent=2)) + "</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------

def _write(path: str, data: bytes, what: str) -> None:
    """Writes `data` to `path` through a temporary file: whole or not at all."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ReportError(f"{what} {path}: the folder {folder} does not exist; create it or choose another path")
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise ReportError(f"{what} {path}: cannot write it ({e.strerror}); free disk space, fix permissions "
                          "or choose another path") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        raise ReportError(f"{message}; usage: python -m lumen_jax.report RUN_DIR [RUN_DIR ...] --out report.png "
                          "[--html report.html]")


def main(argv: Sequence[str] | None = None) -> int:
    p = _Parser(prog="python -m lumen_jax.report", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run directories (train.run_dir); several overlay")
    p.add_argument("--out", default="report.png", help="the PNG to write (default: report.png)")
    p.add_argument("--html", help="also write this self-contained HTML page")
    try:
        args = p.parse_args(argv)
        if not args.out.lower().endswith(".png"):
            raise ReportError(f"--out {args.out} must end in .png (the figure is a PNG; --html writes the page)")
        if args.html and not args.html.lower().endswith((".html", ".htm")):
            raise ReportError(f"--html {args.html} must end in .html (nothing is written over another kind of file)")
        runs = [read_run(path, label) for path, label in zip(args.runs, labels(args.runs))]
        png = render(runs)
        _write(args.out, png, "--out")
        if args.html:
            _write(args.html, page(runs, png).encode("utf-8"), "--html")
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"report: {args.out}" + (f" and {args.html}" if args.html else "")
          + f" ({len(runs)} run(s), {sum(len(r.rows) for r in runs)} logged steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
