"""What a run says about itself, end to end: the profiler trace of the asked steps, where the step
time goes (a slowed data source), the memory line and compile.json, slow steps and stragglers in
events.jsonl, checkpoint start and commit events, and `python -m lumen_jax.report` over real runs.

One supervised run of configs/tiny.yaml serves most tests: attempt 1 profiles steps 2-3, sleeps 1 s
after step 7 (a slow step 8), and is SIGKILLed right after the save of step 10 started; attempt 2
resumes and trains to step 12. Its two start-ups take ~20 s: the tests that read it are `heavy`.
"""

import glob
import gzip
import html
import json
import os
import struct
import sys
import time

import pytest

from helpers.faults import args as run_args, run_group as _run
from helpers.metrics import read_metrics
from helpers.paths import REPO
from lumen_jax import report
from lumen_jax.config.checks import validate
from lumen_jax.config.files import load_config
from lumen_jax.metrics import memory
from lumen_jax.train import cli as train_cli

PY = sys.executable
SMALL = ["data.seq_len=32", "data.global_batch_size=8", "optim.schedule=constant", "optim.warmup_steps=0",
         "log.tensorboard=false"]
SUPERVISED = ["train.steps=12", "log.every_steps=2", "checkpoint.every_steps=5", "train.profile_steps=[2,4]", *SMALL]
SLEEP_S, SLOW_AFTER, KILL_AFTER = 1.0, 7, 10
STRAGGLE_S = 0.8  # a quarter of a step even when the 2 cores are shared (steps took up to 1.4 s)
TIME_KEYS = ("loop_time_s", "step_time_s", "data_wait_s", "checkpoint_stall_s", "host_overhead_s")




def events_of(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [json.loads(line) for line in f]


def traced_steps(folder: str) -> list[set[int]]:
    """The `train_step` annotations of each capture under a process's profile folder."""
    out = []
    for trace in sorted(glob.glob(os.path.join(folder, "plugins", "profile", "*", "perfetto_trace.json.gz"))):
        with gzip.open(trace) as f:
            data = json.load(f)
        events = data["traceEvents"] if isinstance(data, dict) else data
        out.append({int(e["args"]["step_num"]) for e in events if e.get("name") == "train_step"})
    return out


def png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", head
    return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def supervised(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("diagnosed") / "tiny")
    env = {"LUMEN_FAULT_SIGKILL_AFTER_STEPS": str(KILL_AFTER), "LUMEN_FAULT_SLEEP_S": str(SLEEP_S),
           "LUMEN_FAULT_SLEEP_AFTER_STEPS": str(SLOW_AFTER)}
    cmd = [PY, "launch/supervise.py", "--run-dir", run_dir, "--max-restarts", "2", "--backoff", "0.1", "--",
           PY, "-m", "lumen_jax.train", "--config", "configs/tiny.yaml", f"train.run_dir={run_dir}", *SUPERVISED]
    proc = _run(cmd, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "attempt 1: killed by SIGKILL" in proc.stdout and "final: done" in proc.stdout, proc.stdout
    return run_dir, proc


@pytest.fixture(scope="module")
def slow_data(tmp_path_factory):
    """In this process: the data source sleeps 0.2 s per batch; the progress bar is on."""
    from lumen_jax import data as data_lib

    class SlowData(data_lib.TrainData):
        def __next__(self):
            time.sleep(0.2)
            return super().__next__()

    run_dir = str(tmp_path_factory.mktemp("slow_data") / "run")
    mp = pytest.MonkeyPatch()
    mp.setattr(data_lib, "TrainData", SlowData)
    stderr = tmp_path_factory.mktemp("slow_data_stderr") / "stderr"
    try:
        with open(stderr, "w") as err:
            mp.setattr(sys, "stderr", err)  # the progress bar draws on the terminal's stderr
            rc = train_cli.main(run_args(run_dir, "train.steps=4", "log.every_steps=2", "log.progress=true",
                                         "checkpoint.every_steps=0"))
    finally:
        mp.undo()
    assert rc == 0
    return run_dir, stderr.read_text()


@pytest.mark.heavy
def test_the_trace_holds_the_asked_steps_of_one_capture(supervised):
    run_dir, proc = supervised
    folder = os.path.join(run_dir, "profile", "process-0")
    assert traced_steps(folder) == [{2, 3}]  # attempt 2 resumed past the window: no second capture
    [xplane] = glob.glob(os.path.join(folder, "plugins", "profile", "*", "*.xplane.pb"))  # TensorBoard's
    assert os.path.getsize(xplane) > 0
    assert f"profile of steps 2-3 in {folder}" in proc.stdout


def test_a_run_without_profile_steps_writes_no_trace(slow_data):
    run_dir, _ = slow_data
    assert not os.path.exists(os.path.join(run_dir, "profile")), os.listdir(run_dir)


@pytest.mark.heavy
def test_the_memory_line_is_the_compiled_steps_memory_analysis(supervised):
    """The same config's step compiled here: its memory_analysis() is compile.json's and the line's."""
    from lumen_jax.parallel.mesh import make_mesh
    from lumen_jax.compiler.compiled import abstract_step_args
    from lumen_jax.train.build import build

    run_dir, proc = supervised
    cfg = load_config(os.path.join(REPO, "configs/tiny.yaml"), SUPERVISED)
    trainer = build(cfg, make_mesh(validate(cfg, 8)))
    compiled = trainer.step.lower(*abstract_step_args(trainer, cfg)).compile()
    ma = compiled.memory_analysis()
    with open(os.path.join(run_dir, "compile.json")) as f:
        saved = json.load(f)
    assert saved["compiled_bytes_per_device"] == {
        "arguments": ma.argument_size_in_bytes, "outputs": ma.output_size_in_bytes,
        "temporaries": ma.temp_size_in_bytes, "aliased": ma.alias_size_in_bytes,
        "total": ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes}
    planned = saved["planned_bytes_per_device"]
    size = memory.size  # the line's unit and rounding; the figures are memory_analysis()'s
    total = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes
    line = (f"lumen_jax: memory per device: compiled {size(total)} (arguments {size(ma.argument_size_in_bytes)} + "
            f"outputs {size(ma.output_size_in_bytes)} + temporaries {size(ma.temp_size_in_bytes)} - aliased "
            f"{size(ma.alias_size_in_bytes)}), planned {size(planned['total'])}")
    assert proc.stdout.count(line) == 2, proc.stdout  # once per attempt
    assert planned["total"] > 0 and set(planned) >= {"params", "grads", "optimizer", "activations"}


@pytest.mark.heavy
def test_the_slept_step_is_a_slow_step_event(supervised):
    run_dir, _ = supervised
    slow = [e for e in events_of(run_dir) if e["event"] == "slow_step"]
    # The step after the sleep: it started a second late (less what was left of step 7 when the hook
    # began to sleep); the only step of half a second or more.
    [slept] = [e for e in slow if e["step_time_s"] >= SLEEP_S / 2]
    assert slept["step"] == SLOW_AFTER + 1 and slept["median_s"] < SLEEP_S / 10, slow


@pytest.mark.heavy
def test_checkpoint_events_say_start_and_commit(supervised):
    """Attempt 1 logged the start of step 10's save but not its commit: it was killed first."""
    run_dir, _ = supervised
    events = events_of(run_dir)
    attempts = list(dict.fromkeys(e["attempt"] for e in events))
    assert len(attempts) == 2
    saves = [[(e["event"], e["step"]) for e in events if e["attempt"] == a and e["event"].startswith("checkpoint")]
             for a in attempts]
    assert saves[0] == [("checkpoint_start", 5), ("checkpoint", 5), ("checkpoint_start", 10)], saves[0]
    assert saves[1][-2:] == [("checkpoint_start", 12), ("checkpoint", 12)], saves[1]
    resumed = next(e["resume_step"] for e in events if e["attempt"] == attempts[1] and e["event"] == "start")
    assert resumed in (5, 10)  # 10 only if its write was committed in the moment before the kill


@pytest.mark.heavy
def test_metrics_rows_say_where_the_time_went(supervised, slow_data):
    run_dir, _ = supervised
    first = [r for r in read_metrics(run_dir) if "attempt" not in r]  # attempt 1's rows
    for r in first:
        assert all(r[k] >= 0 for k in TIME_KEYS), r
        assert r["step_time_s"] <= r["loop_time_s"] + 1e-9, r  # the device's time is within the loop's
        assert r["tokens_per_sec"] == pytest.approx(8 * 32 / r["loop_time_s"])
    [slept] = [r for r in first if r["step"] == SLOW_AFTER + 1]  # steps 7-8: the second after step 7
    assert slept["host_overhead_s"] >= SLEEP_S / 2, slept
    assert max(r["data_wait_s"] for r in first) < 0.05  # the builtin source keeps up
    slow_dir, stderr = slow_data
    rows = read_metrics(slow_dir)
    assert [r["step"] for r in rows] == [2, 4]
    # The source's sleep per step; the last step fetches no batch after it (nothing left to train).
    assert rows[0]["data_wait_s"] >= 0.2 and rows[1]["data_wait_s"] >= 0.2 / 2, rows
    assert "data wait" in stderr, stderr[-2000:]  # the progress bar says so (over 5% of the step)


@pytest.mark.heavy
def test_the_report_draws_a_run_and_two_overlaid(supervised, slow_data, tmp_path, capsys):
    run_dir, _ = supervised
    out, page = str(tmp_path / "one.png"), str(tmp_path / "one.html")
    assert report.main([run_dir, "--out", out, "--html", page]) == 0
    assert png_size(out) == (report.WIDTH_IN * report.DPI, report.HEIGHT_IN * report.DPI)
    text = html.unescape(open(page).read())
    assert "data:image/png;base64," in text and '"profile_steps": [\n      2,\n      4\n    ]' in text  # config.json
    assert "attempt 1: killed by SIGKILL" in text and "restart" in text
    both = str(tmp_path / "two.png")
    assert report.main([run_dir, slow_data[0], "--out", both]) == 0
    assert png_size(both) == (report.WIDTH_IN * report.DPI, report.HEIGHT_IN * report.DPI)
    assert "report: " in capsys.readouterr().out


@pytest.mark.heavy
def test_two_processes_name_the_slowed_one_and_each_writes_its_trace(tmp_path):
    """2 processes x 4 devices; process 1 sleeps STRAGGLE_S after every step: it is the straggler at the
    logged steps, and each process traced steps 2-3 into its own folder."""
    run_dir = str(tmp_path / "run")
    cmd = [PY, "launch/local.py", "--num-processes", "2", "--devices-per-process", "4", "--grace", "20", "--",
           "--config", "configs/tiny.yaml", f"train.run_dir={run_dir}", "train.steps=6", "log.every_steps=2",
           "train.profile_steps=[2,4]", "log.progress=false", "distributed.heartbeat_timeout_s=10", *SMALL]
    proc = _run(cmd, timeout=300, env={"LUMEN_FAULT_SLEEP_S": str(STRAGGLE_S), "LUMEN_FAULT_PROCESS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    named = [e for e in events_of(run_dir) if e["event"] == "straggler"]
    assert named and {e["process"] for e in named} == {1}, named
    # own time per step: at least one sleep in every 2 steps; process 0 only waits
    assert all(e["own_s"] >= STRAGGLE_S / 2 and e["others_s"] < STRAGGLE_S / 10 for e in named), named
    for i in (0, 1):
        assert traced_steps(os.path.join(run_dir, "profile", f"process-{i}")) == [{2, 3}]
