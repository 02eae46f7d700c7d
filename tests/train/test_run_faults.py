"""Faults during a run and what is on disk afterwards: a config change on resume, every checkpoint
unusable, an overflowing update, a non-finite state, a full disk mid-run, SIGTERM during start-up
(the supervisor's accounting of steps and time lost: tests/launch/test_supervise.py)."""

import errno
import glob
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from helpers.data import packed_batch
from helpers.faults import RUN_STEPS, args, snapshot, tmpfs, trained_run
from helpers.meshes import mesh_shape, one_device_mesh
from helpers.metrics import losses_and_grad_norms, read_metrics
from helpers.paths import REPO
from helpers.run import BASE, with_mesh
from lumen_jax.train import cli as train_cli
from lumen_jax.train.build import build
from lumen_jax.checkpoint.manager import Checkpointer, NonFiniteState
from lumen_jax.runtime.checksums import nonfinite_paths
from lumen_jax.config import CheckpointConfig, OptimConfig
from lumen_jax.parallel.mesh import make_mesh


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return trained_run(str(tmp_path_factory.mktemp("shared") / "run"))


def _copy(shared, tmp_path) -> str:
    run = str(tmp_path / "run")
    shutil.copytree(shared, run)
    return run


def _restores_finite(run_dir, step):
    """The checkpoint `step` of `run_dir` restores (checksums verified) and holds only finite values."""
    cfg = train_cli.load_config(os.path.join(REPO, "configs/tiny.yaml"), args(run_dir)[2:])
    trainer = build(cfg, make_mesh(mesh_shape(fsdp=8)))
    restored = Checkpointer(os.path.join(run_dir, "checkpoints"), cfg.checkpoint).restore_latest(
        trainer.abstract_state())
    assert restored.step == step
    assert nonfinite_paths(restored.state) == []


def test_a_change_that_keeps_the_state_resumes_and_marks_its_rows(shared, tmp_path, capfd):
    run = _copy(shared, tmp_path)
    rc = train_cli.main(args(run, f"train.steps={RUN_STEPS + 1}", "optim.lr=1e-3"))
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert f"resumed from step {RUN_STEPS}" in out
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == [str(RUN_STEPS), str(RUN_STEPS + 1)]
    rows = read_metrics(run)
    assert [(r["step"], r.get("attempt")) for r in rows] == [
        *((s, None) for s in range(1, RUN_STEPS + 1)), (RUN_STEPS + 1, 2)]
    with open(os.path.join(run, "config.json")) as f:
        assert json.load(f)["optim"]["lr"] == 1e-3


@pytest.mark.parametrize("recorded", [True, False], ids=["shapes-recorded", "older-checkpoint"])
def test_a_shape_key_taken_for_numeric_still_exits_2_and_moves_nothing(shared, tmp_path, capfd, monkeypatch,
                                                                       recorded):
    """The review's plant, as a user meets it: model.num_kv_heads listed as a numeric-only key, and
    a rerun with model.num_kv_heads=4. With the checkpoint's recorded state shapes the start-up check
    names the array; without them (a checkpoint of an older version) the restore fails on shapes,
    which is a config error too: exit 2, one line, the checkpoint where it was (before: moved to
    corrupt-2, and the next rerun started from step 0). The rerun with the old config resumes."""
    from lumen_jax.checkpoint import resume
    from lumen_jax.checkpoint.layout import meta_path

    run = _copy(shared, tmp_path)
    ckpts = os.path.join(run, "checkpoints")
    if not recorded:
        with open(meta_path(ckpts, RUN_STEPS)) as f:
            meta = json.load(f)
        del meta["state_shapes"]
        with open(meta_path(ckpts, RUN_STEPS), "w") as f:
            json.dump(meta, f)
    monkeypatch.setattr(resume, "_NUMERIC_MODEL_KEYS", resume._NUMERIC_MODEL_KEYS | {"model.num_kv_heads"})
    # Refused at start-up or at the restore: nothing in the run directory changes (config.json is written
    # once the restore and the first batch have succeeded).
    before = snapshot(run)
    rc = train_cli.main(args(run, f"train.steps={RUN_STEPS + 1}", "model.num_kv_heads=4"))
    lines = capfd.readouterr().err.strip().splitlines()
    assert rc == train_cli.EXIT_BAD_INPUT and len(lines) == 1, lines
    assert "other shapes" in lines[0] and "[2, 64, 2, 16]" in lines[0] and "[2, 64, 4, 16]" in lines[0], lines[0]
    assert snapshot(run) == before
    if not recorded:
        monkeypatch.undo()
        assert train_cli.main(args(run)) == 0  # train.steps reached: restores step 2, trains nothing
        assert "nothing to train" in capfd.readouterr().out
        assert sorted(os.listdir(ckpts)) == [str(RUN_STEPS)]


def test_a_resumed_run_continues_the_data_stream_where_its_checkpoint_was(tmp_path, capfd):
    """4 steps with a checkpoint after step 2 (and 4); the copy without step 4 resumes from step 2: its
    steps 3 and 4 log the uninterrupted run's loss and grad norm bit for bit, which they do only if
    the checkpoint recorded the data position after step 2's batch (not the batch prefetched for step
    3) and the resume restored it (not the stream's start). In seconds, where before only the
    SIGKILL test under the supervisor (heavy) saw it."""
    reference = str(tmp_path / "reference")
    assert train_cli.main(args(reference, f"train.steps={2 * RUN_STEPS}")) == 0
    run = str(tmp_path / "run")
    shutil.copytree(reference, run)
    shutil.rmtree(os.path.join(run, "checkpoints", str(2 * RUN_STEPS)))
    capfd.readouterr()
    assert train_cli.main(args(run, f"train.steps={2 * RUN_STEPS}")) == 0
    assert f"resumed from step {RUN_STEPS}" in capfd.readouterr().out
    want, got = losses_and_grad_norms(reference), losses_and_grad_norms(run)
    assert sorted(got) == list(range(1, 2 * RUN_STEPS + 1))
    assert got == want


def test_every_checkpoint_unusable_stops_with_exit_2(shared, tmp_path, capfd):
    run = _copy(shared, tmp_path)
    chunk = max(glob.glob(os.path.join(run, "checkpoints", str(RUN_STEPS), "state", "**", "d", "*"),
                          recursive=True), key=os.path.getsize)
    data = bytearray(open(chunk, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(chunk, "wb").write(data)
    metrics = snapshot(os.path.join(run, "metrics.jsonl"))
    rc = train_cli.main(args(run, "train.steps=4"))
    lines = capfd.readouterr().err.strip().splitlines()
    assert rc == train_cli.EXIT_BAD_INPUT and len(lines) == 1, lines
    assert "every checkpoint in" in lines[0] and f"corrupt-{RUN_STEPS}" in lines[0], lines[0]
    assert os.listdir(os.path.join(run, "checkpoints")) == [f"corrupt-{RUN_STEPS}"]  # no restart from 0
    assert snapshot(os.path.join(run, "metrics.jsonl")) == metrics


@pytest.fixture(scope="module")
def one_device_trainer():
    cfg = with_mesh(BASE.replace(optim=OptimConfig(lr=1e38, warmup_steps=0, schedule="constant")))
    return build(cfg, one_device_mesh())


def test_an_overflowing_update_is_a_skipped_step(one_device_trainer):
    # A finite loss and gradient norm, but lr * update overflows: the new parameters would be inf/NaN.
    trainer = one_device_trainer
    state = trainer.init()
    before = jax.device_get((state.params, state.opt_state))
    after, m = trainer.step(state, trainer.shard_batch(packed_batch(16, 32, 256, seed=0)))
    assert np.isfinite(float(m["loss"])) and np.isfinite(float(m["grad_norm"]))
    assert not np.isfinite(float(m["update_norm"])) and int(m["skipped"]) == 1
    for got, want in zip(jax.tree.leaves((after.params, after.opt_state)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_a_run_whose_every_step_was_skipped_is_not_done(tmp_path, capfd):
    """optim.lr=1e38 (finite in float32) overflows every update: RUN_STEPS steps, fewer than
    train.max_nonfinite_steps, all skipped. Not "done": the divergence exit, one line, no checkpoint."""
    run = str(tmp_path / "run")
    capfd.readouterr()
    rc = train_cli.main(args(run, "optim.lr=1e38"))
    out, err = capfd.readouterr()
    assert rc == train_cli.EXIT_DIVERGED and "done:" not in out, out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"every step of this run ({RUN_STEPS}, up to step {RUN_STEPS})" in lines[0], lines
    assert not glob.glob(os.path.join(run, "checkpoints", "[0-9]*"))


def test_a_nonfinite_state_is_never_saved_nor_restored(one_device_trainer, tmp_path, capsys):
    state = one_device_trainer.init()
    state = state.replace(step=state.step + 1)  # a checkpoint's step is the state's (the restore checks)
    poisoned = state.replace(step=state.step + 1,
                             params={**state.params, "lm_head": state.params["lm_head"] * np.nan})
    ckpt = Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig())
    ckpt.save(1, state, {})
    with pytest.raises(NonFiniteState, match=r"after step 2 holds inf or NaN in \.params\['lm_head'\].*step 1 in"):
        ckpt.save(2, poisoned, {})
    ckpt.wait()
    assert ckpt.steps() == [1]
    # As an earlier version would have: step 2 written with NaN (checksums of its own bits).
    import orbax.checkpoint as ocp
    from lumen_jax.runtime.checksums import checksum_list
    ckpt._manager.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(poisoned), meta=ocp.args.JsonSave(
        {"checksums": checksum_list(poisoned)})), force=True)
    ckpt.wait()
    ckpt.close()
    restored = Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig()).restore_latest(
        one_device_trainer.abstract_state())
    assert restored.step == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "holds inf or NaN" in line and "resumed from step 1" in line
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "corrupt-2"]


# A subprocess with the test session's devices and compilation cache (the shared run compiled this step).
SUBPROCESS = ["runtime.cpu_devices=8", f"runtime.compilation_cache_dir={os.path.join(REPO, '.cache', 'jax-tests')}"]


def _checkpoint_bytes(run_dir: str, step: int) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(run_dir, "checkpoints", str(step), "**"),
                                                      recursive=True) if os.path.isfile(p))


def _inject_async_write_failure(monkeypatch, failing_step: int):
    """Without a tmpfs: the background write of `failing_step` fails as on a full disk, leaving Orbax's
    temporary folder; the failure surfaces when the next save or wait waits for it."""
    import orbax.checkpoint as ocp
    real_save, real_wait = ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished
    pending = []

    def save(self, step, *a, **kw):
        if step != failing_step:
            return real_save(self, step, *a, **kw)
        os.makedirs(os.path.join(str(self.directory), f"{step}.orbax-checkpoint-tmp-0", "state"))
        pending.append(OSError(errno.ENOSPC, "No space left on device"))
        return True

    def wait(self):
        real_wait(self)
        if pending:
            raise pending.pop()

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", wait)


def test_disk_full_mid_run_is_one_line_and_leaves_the_last_checkpoint(shared, tmp_path, capfd, monkeypatch):
    # Room for one checkpoint and the run's small files, not for two.
    size = int(1.5 * _checkpoint_bytes(shared, RUN_STEPS)) + (256 << 10)
    mount = str(tmp_path / "disk")
    with tmpfs(mount, size) as mounted:
        run = os.path.join(mount, "run")
        argv = args(run, f"train.steps={3 * RUN_STEPS}")
        if mounted:  # a real process: what reaches its terminal (pytest would capture Orbax's logging)
            proc = subprocess.run([sys.executable, "-m", "lumen_jax.train", *argv, *SUBPROCESS], cwd=REPO,
                                  capture_output=True, text=True, timeout=300)
            rc, lines = proc.returncode, proc.stderr.strip().splitlines()
        else:
            _inject_async_write_failure(monkeypatch, 2 * RUN_STEPS)
            rc = train_cli.main(argv)
            lines = capfd.readouterr().err.strip().splitlines()
        assert rc == train_cli.EXIT_BAD_INPUT and len(lines) == 1, lines
        assert f"writing checkpoint step {2 * RUN_STEPS} " in lines[0], lines[0]
        assert "No space left on device" in lines[0] and f"last committed checkpoint is step {RUN_STEPS}" in lines[0]
        assert os.listdir(os.path.join(run, "checkpoints")) == [str(RUN_STEPS)]  # the temporary folder is gone
        if mounted:  # Orbax's own report went to the log, not the terminal
            assert "No space left on device" in open(os.path.join(run, "library.log")).read()
        monkeypatch.undo()
        _restores_finite(run, RUN_STEPS)


def test_the_run_dir_removed_mid_run_is_one_line(tmp_path, capfd, monkeypatch):
    """Before: a traceback from the events write, then NameErrors from the log's shutdown hook."""
    from lumen_jax.train import hooks
    run, real = str(tmp_path / "run"), hooks.Events.write

    def write(self, event, **fields):
        if event == "step" and fields.get("step") == 1:
            shutil.rmtree(run)
        return real(self, event, **fields)

    monkeypatch.setattr(hooks.Events, "write", write)
    capfd.readouterr()
    assert train_cli.main(args(run, "train.steps=3")) == train_cli.EXIT_BAD_INPUT
    [line] = capfd.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: train.run_dir={run} was removed while the run wrote to it"), line


def test_sigterm_during_start_up_exits_75(shared, tmp_path, capfd, monkeypatch):
    run = _copy(shared, tmp_path)
    before = snapshot(os.path.join(run, "checkpoints"))
    monkeypatch.setenv("LUMEN_FAULT_SIGTERM_AT_STARTUP", "1")
    rc = train_cli.main(args(run, "train.steps=4"))
    lines = capfd.readouterr().err.strip().splitlines()
    assert rc == train_cli.EXIT_PREEMPTED and len(lines) == 1, lines
    assert f"during start-up, before step {RUN_STEPS + 1}" in lines[0] and f"step {RUN_STEPS} in" in lines[0]
    assert snapshot(os.path.join(run, "checkpoints")) == before
    events = [json.loads(line) for line in open(os.path.join(run, "events.jsonl"))]
    assert [e["event"] for e in events if e["event"] in ("start", "compiled")][-2:] == ["start", "compiled"]
