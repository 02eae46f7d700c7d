"""Checkpoints and fault tolerance: exact resume, reshard on restore, atomicity, corruption,
preemption, a run under the supervisor, the non-finite and silent-data-corruption guards (the
supervisor's own logic: tests/launch/test_supervise.py)."""

import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest

from helpers.data import packed_batch
from helpers.faults import IN_PROCESS, SUBPROCESS_SCHEDULE, args as fault_args
from helpers.meshes import mesh_shape, small_mesh
from helpers.metrics import losses_and_grad_norms, read_metrics
from helpers.paths import REPO
from lumen_jax.train import cli as train_cli
from lumen_jax.train.build import build
from lumen_jax.checkpoint.manager import Checkpointer
from lumen_jax.runtime.checksums import nonfinite_paths
from lumen_jax.config import CheckpointConfig, Config, MeshConfig, ModelConfig
from lumen_jax.parallel.sdc import find_divergent_replicas

CFG = Config(model=ModelConfig(compute_dtype="float32"))


def _mesh(**axes):
    shape = mesh_shape(**axes)
    return shape, small_mesh(**shape)


def _trainer(**axes):
    shape, mesh = _mesh(**axes)
    return build(CFG.replace(mesh=MeshConfig(**shape)), mesh)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint written on fsdp=8 after one step, and the state it holds."""
    directory = str(tmp_path_factory.mktemp("ckpt"))
    trainer = _trainer(fsdp=8)
    state, _ = trainer.step(trainer.init(), trainer.shard_batch(packed_batch(16, 128, 512, seed=0)))
    ckpt = Checkpointer(directory, CheckpointConfig())
    ckpt.save(1, state, {"data": {"position": 17}})
    ckpt.wait()
    ckpt.close()
    return directory, jax.device_get(state)


@pytest.mark.parametrize("axes", [dict(data=2, fsdp=2, tensor=2), dict(fsdp=4, tensor=2), dict()],
                         ids=["data2-fsdp2-tensor2", "fsdp4-tensor2", "one-device"])
def test_restore_onto_another_mesh(saved, axes, tmp_path):
    directory, expected = saved
    copy = str(tmp_path / "ckpt")
    shutil.copytree(directory, copy)
    trainer = _trainer(**axes)
    restored = Checkpointer(copy, CheckpointConfig()).restore_latest(trainer.abstract_state())
    assert restored.step == 1 and restored.meta["data"] == {"position": 17}
    for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), want)
    for got, sh in zip(jax.tree.leaves(restored.state.params), jax.tree.leaves(trainer.state_shardings.params)):
        assert got.sharding == sh


def test_corrupted_file_falls_back_to_previous_step(saved, tmp_path):
    directory, _ = saved
    copy = str(tmp_path / "ckpt")
    shutil.copytree(directory, copy)
    shutil.copytree(os.path.join(copy, "1"), os.path.join(copy, "2"))
    chunk = max((f for f in glob.glob(os.path.join(copy, "2", "state", "**", "d", "*"), recursive=True)),
                key=os.path.getsize)
    data = bytearray(open(chunk, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(chunk, "wb").write(data)
    restored = Checkpointer(copy, CheckpointConfig()).restore_latest(_trainer(fsdp=8).abstract_state())
    assert restored.step == 1
    assert sorted(os.listdir(copy)) == ["1", "corrupt-2"]


def test_a_step_folder_holding_another_step_is_not_trusted_and_earlier_corrupt_folders_stay(saved, tmp_path):
    """Step 1's folder copied as step 2: its content says step 1, so it is set aside (not resumed as
    step 2) and step 1 restored; a corrupt-2 already there is kept beside it."""
    directory, _ = saved
    copy = str(tmp_path / "ckpt")
    shutil.copytree(directory, copy)
    shutil.copytree(os.path.join(copy, "1"), os.path.join(copy, "2"))
    os.makedirs(os.path.join(copy, "corrupt-2"))
    open(os.path.join(copy, "corrupt-2", "earlier"), "w").close()
    restored = Checkpointer(copy, CheckpointConfig()).restore_latest(_trainer(fsdp=8).abstract_state())
    assert restored.step == 1
    assert sorted(os.listdir(copy)) == ["1", "corrupt-2", "corrupt-2.1"]
    assert os.listdir(os.path.join(copy, "corrupt-2")) == ["earlier"]


def test_an_empty_numbered_folder_is_no_step(saved, tmp_path):
    """A folder named like a step but never committed by Orbax (empty, a huge number) neither
    counts as the run's last step nor blocks the resume: set aside, and step 1 restored."""
    from lumen_jax.checkpoint.layout import committed_steps
    directory, _ = saved
    copy = str(tmp_path / "ckpt")
    shutil.copytree(directory, copy)
    os.makedirs(os.path.join(copy, "99999999999999999999999"))
    assert committed_steps(copy) == [1]
    restored = Checkpointer(copy, CheckpointConfig()).restore_latest(_trainer(fsdp=8).abstract_state())
    assert restored.step == 1


def test_missing_file_falls_back_and_half_written_save_is_ignored(saved, tmp_path):
    directory, _ = saved
    copy = str(tmp_path / "ckpt")
    shutil.copytree(directory, copy)
    shutil.copytree(os.path.join(copy, "1"), os.path.join(copy, "2"))
    os.remove(os.path.join(copy, "2", "meta", "metadata"))
    # A save killed midway: Orbax's temporary folder, never renamed to its step.
    shutil.copytree(os.path.join(copy, "1"), os.path.join(copy, "3.orbax-checkpoint-tmp-1234"))
    ckpt = Checkpointer(copy, CheckpointConfig())
    assert ckpt.steps() == [1, 2]
    assert ckpt.restore_latest(_trainer(fsdp=8).abstract_state()).step == 1
    ckpt.close()  # Orbax removes temporary folders in the background from the start; done by close
    assert sorted(os.listdir(copy)) == ["1", "corrupt-2"]


# Orbax's other array reads, still in flight when the first fails on its shape, fail too in its threads
# (a CLI run sends them to library.log).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("change,names", [
    (dict(num_kv_heads=4), "params/blocks/attn/wk: checkpoint [2, 64, 2, 16], now [2, 64, 4, 16]"),
    (dict(tie_embeddings=True), "params/lm_head is in the checkpoint only"),
])
def test_a_checkpoint_of_other_shapes_is_a_config_error_and_stays(saved, tmp_path, change, names):
    """Restoring onto a state of other shapes fails in Orbax; that is another run's checkpoint, not a
    corrupt one: one ConfigError naming the first array that differs, and nothing is moved (before,
    the good checkpoint went to corrupt-1 and the next rerun started from step 0)."""
    from lumen_jax.config import ConfigError

    directory, _ = saved
    copy = str(tmp_path / "ckpt")
    shutil.copytree(directory, copy)
    shape, mesh = _mesh()
    other = build(CFG.replace(model=dataclasses.replace(CFG.model, **change), mesh=MeshConfig(**shape)), mesh)
    with pytest.raises(ConfigError) as e:
        Checkpointer(copy, CheckpointConfig()).restore_latest(other.abstract_state())
    assert names in str(e.value) and "nothing was moved" in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert sorted(os.listdir(copy)) == ["1"]


class _RecordingManager:
    """Stands in for Orbax's manager: records the steps saved, writes nothing."""

    def __init__(self):
        self.saved = []

    def save(self, step, args, force):
        self.saved.append(step)

    def wait_until_finished(self):
        pass

    def is_saving_in_progress(self):
        return False

    def close(self):
        pass


def _decisions(cfg: CheckpointConfig, steps: int, tmp_path, force_at=(), time_passes=None) -> list[int]:
    """The steps `maybe_save` saves at; `time_passes` {step: fraction of every_minutes} before it."""
    ckpt = Checkpointer(str(tmp_path / "ckpt"), cfg)
    ckpt._manager.close()
    ckpt._manager = manager = _RecordingManager()
    metas = []
    for step in range(1, steps + 1):
        ckpt._last_save_time -= 60 * cfg.every_minutes * (time_passes or {}).get(step, 0.0)
        stall = ckpt.maybe_save(step, {"w": np.arange(3.0)}, lambda: metas.append(step) or {},
                                last=step == steps, force=step in force_at)
        assert (stall is None) == (step not in manager.saved[-1:])
    assert metas == manager.saved  # meta is built only for a save
    return manager.saved


def test_a_save_is_reported_when_it_starts_and_again_only_once_committed(tmp_path):
    """The background write of step 2 is still in flight after step 3: no commit yet (a kill there loses
    step 2); step 4 finds it finished. A wait (the end of the run, preemption) reports the last one."""
    heard = []
    ckpt = Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig(every_steps=2),
                        notify=lambda event, step: heard.append((event, step)))
    ckpt._manager.close()
    ckpt._manager = manager = _RecordingManager()
    writing = [True]  # an async write goes on in the background until the test ends it
    manager.is_saving_in_progress = lambda: writing[0]
    for step in (1, 2):
        ckpt.maybe_save(step, {"w": np.arange(3.0)}, lambda: {}, last=False)
    assert heard == [("checkpoint_start", 2)]
    ckpt.maybe_save(3, {"w": np.arange(3.0)}, lambda: {}, last=False)
    assert heard == [("checkpoint_start", 2)]
    writing[0] = False
    ckpt.maybe_save(4, {"w": np.arange(3.0)}, lambda: {}, last=False)  # step 2 done; step 4's is written at once
    assert heard == [("checkpoint_start", 2), ("checkpoint", 2), ("checkpoint_start", 4), ("checkpoint", 4)]
    writing[0] = True
    ckpt.maybe_save(6, {"w": np.arange(3.0)}, lambda: {}, last=True)
    assert heard[-1] == ("checkpoint_start", 6)
    ckpt.wait()
    assert heard[-1] == ("checkpoint", 6) and len(heard) == 6


def test_maybe_save_decides_when_a_save_is_due(tmp_path):
    every3 = CheckpointConfig(every_steps=3)
    assert _decisions(every3, 7, tmp_path) == [3, 6, 7]  # the schedule, and the last step
    assert _decisions(every3, 7, tmp_path, force_at=(4,)) == [3, 4, 6, 7]  # preemption
    off = CheckpointConfig()
    assert _decisions(off, 5, tmp_path) == []  # off: not even the last step
    assert _decisions(off, 5, tmp_path, force_at=(2,)) == [2]  # preemption saves anyway
    assert _decisions(off, 5, tmp_path, force_at=(5,)) == []  # ... but not at the end of a run without
    minutes = CheckpointConfig(every_minutes=1.0)
    assert _decisions(minutes, 6, tmp_path, time_passes={2: 1.0, 4: 1.0}) == [2, 4, 6]
    assert _decisions(minutes, 6, tmp_path, time_passes={2: 0.5, 4: 0.5}) == [4, 6]
    # Any save restarts the clock: after the forced one at 3, only half the time passes by 4.
    assert _decisions(minutes, 6, tmp_path, time_passes={2: 0.5, 4: 0.5}, force_at=(3,)) == [3, 6]


def test_nan_gradient_skips_the_update():
    trainer = _trainer(fsdp=8)
    state = trainer.init()
    before = jax.device_get(state)
    poisoned = state.replace(loss_scale=state.loss_scale * np.nan)  # every gradient becomes NaN
    after, metrics = trainer.step(poisoned, trainer.shard_batch(packed_batch(16, 128, 512, seed=0)))
    assert int(metrics["skipped"]) == 1
    for got, want in zip(jax.tree.leaves((after.params, after.opt_state)),
                         jax.tree.leaves((before.params, before.opt_state))):
        np.testing.assert_array_equal(np.asarray(got), want)


def _perturb_one_replica(params: dict) -> tuple[dict, int]:
    """`params` with one device's copy of `lm_head` off by one ulp; and that device's id."""
    x = params["lm_head"]
    shards = [s.data for s in x.addressable_shards]
    victim = x.addressable_shards[5]
    shards[5] = jax.device_put(np.asarray(victim.data) * np.float32(1.0000001) + np.float32(1e-7), victim.device)
    return ({**params, "lm_head": jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)},
            victim.device.id)


def test_sdc_check_names_the_perturbed_replica():
    shape, mesh = _mesh(data=4, fsdp=2)
    trainer = build(CFG.replace(mesh=MeshConfig(data=4, fsdp=2)), mesh)
    params = trainer.init().params
    assert find_divergent_replicas(mesh, params) == []
    params, device = _perturb_one_replica(params)
    problems = find_divergent_replicas(mesh, params)
    assert len(problems) == 1 and problems[0].startswith(f"device {device} ")
    assert "['lm_head']" in problems[0]


def _as_process_0_of_several(monkeypatch) -> None:
    """train.main ends as process 0 of a multi-process run does: it records its exit code in
    events.jsonl (what the supervisor trusts over a launcher's), then leaves (here: SystemExit)."""
    from lumen_jax.runtime import distributed

    def leave(code: int):
        raise SystemExit(code)

    monkeypatch.setattr(distributed, "is_multiprocess", lambda: True)
    monkeypatch.setattr(distributed, "leave", leave)


def _exit_events(run_dir: str) -> list[int]:
    return [e["code"] for e in map(json.loads, open(os.path.join(run_dir, "events.jsonl"))) if e["event"] == "exit"]


def test_sdc_check_in_a_real_run_exits_4_and_records_it(tmp_path, capsys, monkeypatch):
    """data=4 fsdp=2: one of the 4 replicas of an lm_head shard goes bad after step 3 (its arithmetic,
    say); the check every 2 steps finds it at step 4, names the device (the majority of its replica
    group disagrees with it), and the run stops with exit code 4."""
    from lumen_jax.train import build as build_lib
    real_build, bad = build_lib.build, []

    def build_with_a_bad_replica(cfg, mesh):
        trainer = real_build(cfg, mesh)
        jitted = trainer.step

        def lower(state, batch):
            compiled, calls = jitted.lower(state, batch).compile(), []

            def step(state, batch):
                state, m = compiled(state, batch)
                calls.append(1)
                if len(calls) == 3:
                    params, device = _perturb_one_replica(state.params)
                    bad.append(device)
                    state = state.replace(params=params)
                return state, m
            return types.SimpleNamespace(compile=lambda: step)

        trainer.step = types.SimpleNamespace(lower=lower)
        return trainer

    monkeypatch.setattr(build_lib, "build", build_with_a_bad_replica)
    _as_process_0_of_several(monkeypatch)
    run_dir = str(tmp_path / "run")
    with pytest.raises(SystemExit) as stopped:
        train_cli.main(["--config", "configs/tiny.yaml", f"train.run_dir={run_dir}", "train.steps=6",
                        "mesh.data=4", "mesh.fsdp=2", "train.sdc_check_every=2", "log.every_steps=1", "optim.warmup_steps=0", *IN_PROCESS])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == train_cli.EXIT_CORRUPTION, err
    assert len(err) == 1 and err[0].startswith(f"error: silent data corruption at step 4: device {bad[0]} "), err
    assert "['lm_head']" in err[0]
    assert _exit_events(run_dir) == [train_cli.EXIT_CORRUPTION]


def test_nonfinite_steps_in_a_row_stop_the_run(tmp_path, capsys, monkeypatch):
    _as_process_0_of_several(monkeypatch)
    run_dir = str(tmp_path / "run")
    # helpers.faults' small run at lr=1e38: the step tests/train/test_run_faults.py's
    # test_a_run_whose_every_step_was_skipped_is_not_done compiles (a constant schedule: any train.steps).
    with pytest.raises(SystemExit) as stopped:
        train_cli.main(fault_args(run_dir, "train.steps=12", "optim.lr=1e38", "train.max_nonfinite_steps=3",
                                  "checkpoint.every_steps=1"))
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == train_cli.EXIT_DIVERGED, err
    assert len(err) == 1 and "3 steps in a row" in err[0] and "train.max_nonfinite_steps=3" in err[0]
    assert _exit_events(run_dir) == [train_cli.EXIT_DIVERGED]
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), CheckpointConfig())
    steps = ckpt.steps()
    assert steps, "the checkpoints written before divergence are intact"
    assert f"the last checkpoint, step {steps[-1]} in" in err[0], err[0]  # named, and it is finite:
    restored = ckpt.restore_latest(_trainer(fsdp=8).abstract_state())
    assert restored.step == steps[-1] and nonfinite_paths(restored.state) == []
    # lr=1e38: the first update's norm already overflows float32 (issue 18's guard), so every step is
    # skipped; skipped_total counts the skipped steps before each row (one step late): 0, 1, 2.
    rows = read_metrics(run_dir)
    skipped = [int(r["skipped"]) for r in rows]
    assert skipped == [1] * len(rows) and len(rows) == 3, skipped
    assert [r["skipped_total"] for r in rows] == [sum(skipped[:k]) for k in range(len(rows))], rows


def test_disk_full_during_save_is_a_clear_error(tmp_path, capsys, monkeypatch):
    import orbax.checkpoint as ocp
    run_dir = str(tmp_path / "run")
    real_save = ocp.CheckpointManager.save

    def full_after_first(self, step, *args, **kwargs):
        if step > 2:
            raise OSError(28, "No space left on device")
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_after_first)
    # keep=1: step 2 is the one step kept, so deleting it before step 4 is committed would lose it.
    # (data=4 fsdp=2: the step test_sdc_check_in_a_real_run_exits_4_and_records_it compiles.)
    rc = train_cli.main(["--config", "configs/tiny.yaml", f"train.run_dir={run_dir}", "train.steps=6",
                         "mesh.data=4", "mesh.fsdp=2", "checkpoint.every_steps=2", "checkpoint.keep=1",
                         "optim.warmup_steps=0", *IN_PROCESS])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == train_cli.EXIT_BAD_INPUT
    assert len(err) == 1 and "No space left on device" in err[0] and "step 4" in err[0]
    assert "the last committed checkpoint is step 2" in err[0], err[0]
    monkeypatch.undo()
    restored = Checkpointer(os.path.join(run_dir, "checkpoints"), CheckpointConfig()).restore_latest(
        _trainer(fsdp=8).abstract_state())
    assert restored.step == 2


def _train_cmd(run_dir: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lumen_jax.train", "--config", "configs/tiny.yaml",
            f"train.run_dir={run_dir}", "log.every_steps=1", "log.progress=false", *SUBPROCESS_SCHEDULE, *extra]


@pytest.mark.heavy
def test_sigkill_at_three_steps_resumes_bit_for_bit_under_the_supervisor(tmp_path):
    common = ["train.steps=14", "checkpoint.every_steps=2"]
    reference = str(tmp_path / "reference")
    ref = subprocess.run(_train_cmd(reference, *common), cwd=REPO, timeout=300, capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-2000:]
    run_dir = str(tmp_path / "killed")
    env = {**os.environ, "LUMEN_FAULT_SIGKILL_AFTER_STEPS": "5,8,11"}
    out = subprocess.run([sys.executable, "launch/supervise.py", "--run-dir", run_dir, "--max-restarts", "5",
                          "--backoff", "0.1", "--", *_train_cmd(run_dir, *common)],
                         cwd=REPO, env=env, timeout=600, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("killed by SIGKILL") == 3, out.stdout
    assert "goodput" in out.stdout
    goodput = float(out.stdout.split("goodput ")[1].split("%")[0])
    assert 0 < goodput < 100
    want, got = losses_and_grad_norms(reference), losses_and_grad_norms(run_dir)
    assert sorted(got) == list(range(1, 15))
    assert got == want  # losses and grad norms bit for bit: JSON keeps every float exactly
    starts = [e["resume_step"] for e in map(json.loads, open(os.path.join(run_dir, "events.jsonl")))
              if e["event"] == "start"]
    assert len(starts) == 4 and starts[0] == 0, (starts, out.stdout, out.stderr[-3000:])
    assert starts[0] == 0 and all(0 < s <= k for s, k in zip(starts[1:], (5, 8, 11)))
    # Steps lost: those taken after the checkpoint the next attempt resumed from (every step counts,
    # not only logged ones).
    lost = [int(line.split("steps lost ")[1].split(",")[0]) for line in out.stdout.splitlines() if "steps lost" in line]
    assert lost == [k - s for s, k in zip(starts[1:], (5, 8, 11))], out.stdout


@pytest.mark.heavy
def test_sigterm_writes_a_checkpoint_and_exits_75(tmp_path):
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen(_train_cmd(run_dir, "train.steps=100000"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events = os.path.join(run_dir, "events.jsonl")
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(events) and '"step"' in open(events).read()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == train_cli.EXIT_PREEMPTED, err[-2000:]
    assert "stopped by signal SIGTERM" in err
    steps = Checkpointer(os.path.join(run_dir, "checkpoints"), CheckpointConfig()).steps()
    assert len(steps) == 1 and f"after step {steps[0]};" in err
