"""Bad inputs, table-driven: each is one line on stderr naming the key or path, exit code 2, and the
existing run directory byte-identical afterwards.

The CLI's function (`lumen_jax.train.cli.main`) runs in-process: every case is rejected before anything
compiles. Only a platform this machine lacks needs a subprocess (JAX's platform is chosen once per
process). The run directory every case points at is one tiny trained run shared by the module.
"""

import os
import shutil
import subprocess
import sys

import pytest

from helpers.paths import REPO
from helpers.faults import RUN_STEPS, args, fill, snapshot, tmpfs, trained_run
from lumen_jax.train import cli as train_cli
from lumen_jax.config.checks import warnings
from lumen_jax.config.files import load_config


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return trained_run(str(tmp_path_factory.mktemp("shared") / "run"))


def _write(tmp, name, text):
    path = os.path.join(tmp, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def _alias_bomb(depth: int = 9) -> str:
    """A YAML file whose data.paths is 10^depth strings through `depth` levels of 10 aliases each."""
    lines = ["a0: &a0 [" + ", ".join(["x"] * 10) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, depth)]
    return "\n".join(lines + [f"data: {{paths: *a{depth - 1}}}"]) + "\n"


def _a_file(tmp):
    return _write(tmp, "afile", "not a directory\n")


# name: (overrides, the fragments the one line must hold); {tmp} is the test's tmp_path, {run} the
# shared run directory. Cases the issue found BAD or WEAK first, then ones that were already good.
FIXED = {
    "resume: model shape changed": (["model.d_model=128"], ["model.d_model: checkpoint 64, now 128", "train.run_dir"]),
    "resume: kv heads changed": (["model.num_kv_heads=4"], ["model.num_kv_heads: checkpoint 2, now 4"]),
    "resume: optional state dropped": (["optim.grad_clip=0"], ["optim.grad_clip: checkpoint 1.0, now 0.0"]),
    "resume: data stream changed": (["data.seq_len=64"], ["seq_len: saved 32, now 64"]),
    "train.steps below the step reached": (["train.steps=1"], ["train.steps=1", f"step {RUN_STEPS}", "{run}"]),
    "infinite lr": (["optim.lr=1e999"], ["optim.lr=inf", "finite"]),
    "nan lr": (["optim.lr=.nan"], ["optim.lr=nan", "finite"]),
    "zero adam eps": (["optim.eps=0"], ["optim.eps=0.0 must be > 0"]),
    "negative adam eps": (["optim.eps=-1e-8"], ["optim.eps=-1e-08 must be > 0"]),
    "run dir is a file": (["train.run_dir={afile}"], ["train.run_dir={afile} is a file"]),
    "run dir's parent is a file": (["train.run_dir={afile}/sub/run"], ["{afile} is a file"]),
    "run dir read-only": (["train.run_dir={ro}/run"], ["{ro}/run", "Read-only file system"]),
    "disk full at start": (["train.run_dir={full}/run"], ["{full}/run", "No space left on device"]),
    "odd head_dim": (["model.head_dim=15"], ["model.head_dim=15 must be even", "RoPE"]),
    "odd derived head_dim": (["model.d_model=72", "model.num_heads=8", "model.num_kv_heads=4"],
                             ["model.head_dim=0 derives d_model/num_heads=72/8=9"]),
    "decay ends before warmup": (["optim.schedule=cosine", "optim.warmup_steps=10", "optim.decay_steps=5"],
                                 ["optim.decay_steps=5", "optim.warmup_steps=10"]),
    "paths with builtin source": (["data.paths=[{tmp}/*.txt]"], ["data.paths=", "data.source='builtin'"]),
    "all-empty txt": (["data.source=files", "data.paths=[{empty_txt}]"], ["{empty_txt}", "no documents"]),
    "all-empty jsonl": (["data.source=files", "data.paths=[{empty_jsonl}]"], ["{empty_jsonl}", "2 empty documents"]),
    "yaml duplicate key": (["--config={dup}"], ["{dup}", "d_model twice (lines 3 and 5)"]),
    "config is a directory": (["--config={tmp}"], ["{tmp} is a directory"]),
    "binary config": (["--config={binary}"], ["{binary} is not UTF-8 text", "a YAML file"]),
    # before: start-up hung starting threads for 100,000 devices, deaf to SIGTERM
    "cpu devices": (["runtime.cpu_devices=100000"], ["runtime.cpu_devices=100000 must be <= 256"]),
    # 1.1 kB of aliases of aliases: 10^9 values once expanded (before: a hang, then gigabytes of message)
    "yaml alias bomb": (["--config={bomb}"], ["{bomb} expands to more than 100,000 values", "write the values out"]),
    # before: passed the check, then start-up built 10^12 packed streams (a hang)
    "batch far too big": (["data.global_batch_size=1000000000000"],
                          ["data.global_batch_size=1000000000000 puts 125000000000 sequences per step on each of "
                           "the mesh.data*mesh.fsdp*mesh.expert=8 batch shards, more than 4096", "at most 32768"]),
    # before: passed the check and died in JAX's random code (a C long)
    "seed past int64": (["train.seed=340282366920938463463374607431768211456"],
                        ["train.seed=340282366920938463463374607431768211456 must be < 9223372036854775808"]),
    "negative seed": (["train.seed=-1"], ["train.seed=-1 must be >= 0"]),
    "unknown flag": (["--steps", "20"], ["--steps", "train.steps=20"]),
    "run dir is a folder of the user's": (["train.run_dir={mine}"], ["train.run_dir={mine} is not empty and is not a run "
                                                                     "directory", "notes.txt"]),
    "run dir holds a Hugging Face config.json": (["train.run_dir={hf}"], ["train.run_dir={hf} holds a config.json "
                                                                          "that lumen_jax did not write"]),
    "model far too big for the machine": (["model.num_layers=1000000000", "train.run_dir={tmp}/big"],
                                          ["the planner puts this run at", "GiB per device",
                                           "runtime.memory_check=off"]),
    "sequence far too long for the machine": (["data.seq_len=1000000", "train.run_dir={tmp}/long"],
                                              ["the planner puts this run at", "data.seq_len"]),
    # before: found at the first save, and then the write-failure handler crashed (a traceback)
    "checkpoints is a file": (["train.run_dir={ckfile}"], ["train.run_dir={ckfile}: {ckfile}/checkpoints is a file, "
                                                           "not the checkpoints folder"]),
    # before: at the save that deleted it as an old step, "writing checkpoint step 2 failed ... free disk space"
    "symlinked checkpoint step": (["train.run_dir={cklink}", "checkpoint.keep=1"],
                                  ["train.run_dir={cklink}: {cklink}/checkpoints/2 is a symbolic link (to {tmp}/step-2)",
                                   "put the folder itself there"]),
    "symlinked metrics.jsonl": (["train.run_dir={linked}"], ["train.run_dir={linked}: metrics.jsonl is a symbolic link",
                                                             "{afile}"]),
}
ALREADY_GOOD = {
    "unknown key": (["model.d_modle=1"], ["model.d_modle", "did you mean model.d_model"]),
    "unknown section": (["modle.d_model=1"], ["modle", "model"]),
    "wrong type": (["model.d_model=abc"], ["model.d_model", "must be an int"]),
    "bad enum": (["model.attention=fast"], ["model.attention='fast'", "xla"]),
    "malformed override": (["optim.lr"], ["'optim.lr'", "section.key=value"]),
    "moved key": (["optim.zero_stage=1"], ["optim.zero_stage moved to mesh.zero_stage"]),
    "missing config file": (["--config={tmp}/nope.yaml"], ["{tmp}/nope.yaml does not exist"]),
    "config suffix": (["--config={notes}"], ["{notes}", "must end in .yaml"]),
    "invalid yaml": (["--config={broken}"], ["{broken}", "not valid YAML"]),
    "mesh product": (["mesh.fsdp=3", "mesh.tensor=1"], ["fsdp=3", "8 are available"]),
    "mesh -1 cannot fill": (["mesh.tensor=3"], ["mesh.fsdp=-1", "8 devices", "mesh.tensor=3 does not divide 8"]),
    "kv heads": (["model.num_kv_heads=3"], ["model.num_kv_heads=3 does not divide model.num_heads=4"]),
    "batch not divisible": (["data.global_batch_size=12"], ["data.global_batch_size=12", "multiple of 8"]),
    "negative lr": (["optim.lr=-1"], ["optim.lr=-1.0 must be > 0"]),
    "b1 of 1": (["optim.b1=1.0"], ["optim.b1=1.0 must be < 1"]),
    "zero steps": (["train.steps=0"], ["train.steps=0 must be >= 1"]),
    "keep 0": (["checkpoint.keep=0"], ["checkpoint.keep=0 must be >= 1"]),
    "files without paths": (["data.source=files"], ["data.source='files'", "data.paths"]),
    "missing data file": (["data.source=files", "data.paths=[/nonexistent/*.txt]"],
                          ["data.paths", "/nonexistent/*.txt", "matches no files"]),
    "missing tokenizer": (["data.tokenizer=/nonexistent/tokenizer.json"],
                          ["data.tokenizer='/nonexistent/tokenizer.json'"]),
    "zero stage": (["mesh.zero_stage=4"], ["mesh.zero_stage=4"]),
    "experts over mesh.expert": (["model.moe.num_experts=6", "mesh.expert=4"],
                                 ["mesh.expert=4 does not divide model.moe.num_experts=6"]),
    "half a multi-process setup": (["distributed.coordinator=nohost:1234"], ["distributed.num_processes"]),
}
DIAGNOSTICS = {  # issue 30's settings
    "profile window past the end": (["train.profile_steps=[1,9]"], ["train.profile_steps=[1, 9]", "train.steps+1=3"]),
    "profile window of one step number": (["train.profile_steps=[2]"], ["train.profile_steps=[2]", "[start, stop]"]),
    "profile window backwards": (["train.profile_steps=[2,1]"], ["train.profile_steps=[2, 1]", "start < stop"]),
    "slow step factor of 1": (["train.slow_step_factor=1"], ["train.slow_step_factor=1.0 must be > 1"]),
}
ATTENTION = {  # issue 43: an implementation named that this backend cannot run
    "cuDNN attention on CPU": (["model.attention=cudnn"], ["model.attention=cudnn: cuDNN runs on GPU; this is cpu",
                                                           "model.attention=flash"]),
}
CASES = {**FIXED, **ALREADY_GOOD, **DIAGNOSTICS, **ATTENTION}


@pytest.fixture(scope="module")
def places(tmp_path_factory, shared):
    """The files and filesystems the cases name; a read-only and a full tmpfs where mounting works."""
    tmp = str(tmp_path_factory.mktemp("inputs"))
    p = {"tmp": tmp, "afile": _a_file(tmp), "empty_txt": _write(tmp, "empty/e.txt", ""),
         "empty_jsonl": _write(tmp, "ej/e.jsonl", '{"text": ""}\n\n{"text": ""}\n'),
         "dup": _write(tmp, "dup.yaml", "base: " + os.path.join(REPO, "configs", "base.yaml") + "\nmodel:\n"
                       "  d_model: 64\n  num_layers: 2\n  d_model: 128\n"),
         "notes": _write(tmp, "notes.txt", "x"), "broken": _write(tmp, "broken.yaml", "model: [1, 2\n"),
         "binary": _write(tmp, "binary.yaml", ""), "bomb": _write(tmp, "bomb.yaml", _alias_bomb()),
         "mine": os.path.dirname(_write(tmp, "mine/notes.txt", "mine\n")),
         "hf": os.path.dirname(_write(tmp, "hf/config.json", '{"model_type": "llama", "hidden_size": 64}\n')),
         "linked": os.path.dirname(_write(tmp, "linked/config.json", open(os.path.join(shared, "config.json")).read()))}
    p["ckfile"] = os.path.dirname(_write(tmp, "ckfile/config.json", open(os.path.join(shared, "config.json")).read()))
    _write(p["ckfile"], "checkpoints", "not a folder\n")
    p["cklink"] = os.path.join(tmp, "cklink")
    shutil.copytree(shared, p["cklink"])
    shutil.move(os.path.join(p["cklink"], "checkpoints", "2"), os.path.join(tmp, "step-2"))  # the step, elsewhere
    os.symlink(os.path.join(tmp, "step-2"), os.path.join(p["cklink"], "checkpoints", "2"))
    os.symlink(p["afile"], os.path.join(p["linked"], "metrics.jsonl"))
    with open(p["binary"], "wb") as f:
        f.write(bytes(range(128, 256)))
    with tmpfs(os.path.join(tmp, "ro"), 1 << 16, read_only=True) as ro, \
            tmpfs(os.path.join(tmp, "full"), 1 << 16) as full:
        if full:
            fill(os.path.join(tmp, "full"))
        p.update(ro=os.path.join(tmp, "ro"), full=os.path.join(tmp, "full"), mounted=ro and full)
        yield p


def _inject_faults(monkeypatch, places):
    """Where no tmpfs could be mounted: the same call (the run directory's probe write) fails as they would."""
    import errno
    from lumen_jax.runtime import rundir

    real = rundir.os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        for key, code in (("ro", errno.EROFS), ("full", errno.ENOSPC)):
            if path.startswith(places[key] + "/"):
                raise OSError(code, os.strerror(code))
        return real(fd)

    monkeypatch.setattr(rundir.os, "fsync", fsync)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_nothing_changed(name, shared, places, capfd, monkeypatch):
    overrides, fragments = CASES[name]
    if not places["mounted"]:
        _inject_faults(monkeypatch, places)
    fmt = {**places, "run": shared}
    overrides = [o.format(**fmt) for o in overrides]
    config = next((o.split("=", 1)[1] for o in overrides if o.startswith("--config=")), "configs/tiny.yaml")
    overrides = [o for o in overrides if not o.startswith("--config=")]
    before, before_file, before_tmp = snapshot(shared), snapshot(places["afile"]), snapshot(places["tmp"])
    capfd.readouterr()
    rc = train_cli.main(args(shared, *overrides, config=config))
    err = capfd.readouterr().err
    assert rc == train_cli.EXIT_BAD_INPUT, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment.format(**fmt) in lines[0], (fragment, lines[0])
    assert snapshot(shared) == before, "the run directory changed"
    assert snapshot(places["afile"]) == before_file
    assert snapshot(places["tmp"]) == before_tmp, "a file of the user's changed"
    for key in ("ro", "full"):
        assert not os.path.exists(os.path.join(places[key], "run")), "a folder was left behind"
    assert not {"big", "long"} & set(os.listdir(places["tmp"])), "a folder was left behind"


def test_platform_this_machine_lacks_is_one_line(shared):
    # A subprocess: JAX picks its platform once per process.
    before = snapshot(shared)
    proc = subprocess.run([sys.executable, "-m", "lumen_jax.train", *args(shared, "runtime.platform=gpu")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: runtime.platform=gpu cannot start") and "runtime.platform=cpu" in lines[0]
    assert snapshot(shared) == before


def test_no_config_says_the_defaults_are_used(shared, capfd):
    before = snapshot(shared)
    rc = train_cli.main(args(shared, "train.steps=0", config=None))
    out, err = capfd.readouterr()
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "train.steps=0" in err, err
    assert "no --config given" in out and "configs/base.yaml" in out, out
    assert snapshot(shared) == before


def test_legal_but_suspicious_settings_warn():
    tiny = os.path.join(REPO, "configs", "tiny.yaml")
    [line] = warnings(load_config(tiny, ["train.steps=5"]))
    assert "optim.warmup_steps=10 >= train.steps=5" in line
    assert warnings(load_config(tiny, ["train.steps=11"])) == []


def test_some_empty_documents_are_skipped_with_a_count(tmp_path, capsys):
    from lumen_jax.data import file_documents
    _write(tmp_path, "a.txt", "")
    _write(tmp_path, "b.txt", "text")
    _write(tmp_path, "c.jsonl", '{"text": ""}\n{"text": "more"}\n')
    docs = file_documents([str(tmp_path / "*.txt"), str(tmp_path / "*.jsonl")], "text")
    assert [docs[i] for i in range(len(docs))] == ["text", "more"]
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "skipped 2 empty documents" in line and "other 2" in line


def test_a_run_directory_has_one_trainer(shared, capfd):
    """A second trainer on a run directory a live one holds is refused, naming the holder (host, pid,
    start), and writes nothing there; once the holder is gone (killed: its lock goes with it), a
    restart trains."""
    import signal
    import socket
    from lumen_jax.runtime import rundir
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from lumen_jax.runtime.rundir import claim; "
                               f"claim({shared!r}); print('held', flush=True); time.sleep(120)"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(shared)
        capfd.readouterr()
        assert train_cli.main(args(shared)) == train_cli.EXIT_BAD_INPUT
        [line] = capfd.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: train.run_dir={shared} is in use by another trainer"), line
        assert f"host {socket.gethostname()}, pid {holder.pid}, started " in line, line
        assert snapshot(shared) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert os.path.exists(os.path.join(shared, rundir.LOCK))  # a killed holder leaves its file: stale, not held
    assert train_cli.main(args(shared)) == 0, capfd.readouterr().err
    assert not os.path.exists(os.path.join(shared, rundir.LOCK))  # given back at the end


def test_slurm_tasks_without_a_task_id_is_one_line(shared, capfd, monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    capfd.readouterr()
    assert train_cli.main(args(shared)) == train_cli.EXIT_BAD_INPUT
    [line] = capfd.readouterr().err.strip().splitlines()
    assert "SLURM_NTASKS=4 but SLURM_PROCID is not set" in line and "distributed.num_processes=1" in line, line
    monkeypatch.setenv("JAX_NUM_PROCESSES", "1")  # said on purpose: one process
    assert train_cli.main(args(shared)) == 0


def test_changed_data_files_are_named_on_resume(tmp_path, capfd):
    """A resume on data files whose content changed, the document count kept (a .txt file is one
    document), is refused naming the file and the key that restarts the data; that key resumes the model
    on the data from its first batch. A checkpoint written before files were fingerprinted resumes."""
    import glob
    import json
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        (data / f"d{i}.txt").write_text(f"document {i} " * 40)
    run = str(tmp_path / "run")
    files = ["data.source=files", f"data.paths=[{data}/*.txt]"]
    assert train_cli.main(args(run, *files)) == 0
    with open(data / "d1.txt", "a") as f:
        f.write("more text")
    before = snapshot(run)
    capfd.readouterr()
    assert train_cli.main(args(run, *files)) == train_cli.EXIT_BAD_INPUT
    [line] = capfd.readouterr().err.strip().splitlines()
    assert f"{data}/d1.txt changed (440 bytes, now 449)" in line and "data.on_change=restart" in line, line
    assert snapshot(run) == before
    # a checkpoint of before the fingerprint: its settings alone are compared
    [meta] = glob.glob(os.path.join(run, "checkpoints", "*", "meta", "metadata"))
    with open(meta) as f:
        saved = json.load(f)
    files_fp = saved["data"]["config"].pop("files")
    with open(meta, "w") as f:
        json.dump(saved, f)
    assert train_cli.main(args(run, *files)) == 0, capfd.readouterr().err
    saved["data"]["config"]["files"] = files_fp
    with open(meta, "w") as f:
        json.dump(saved, f)
    capfd.readouterr()
    assert train_cli.main(args(run, *files, f"train.steps={RUN_STEPS + 1}", "data.on_change=restart")) == 0
    assert "the data starts again from its first batch" in capfd.readouterr().err


def _line_17_cut_short(tmp_path) -> tuple[str, list[str]]:
    """Unshuffled, 8 streams of 40-token documents in 33-token rows: 2 steps read lines 1-16, the third
    batch line 17 first, which is cut short. Returns the file and the data overrides."""
    path = tmp_path / "corpus.jsonl"
    text = ['{"text": "document %02d: ' % i + "x" * 23 + '"}' for i in range(1, 40)]  # 38 bytes: 40 tokens
    text[16] = '{"text": "cut short'
    path.write_text("\n".join(text) + "\n")
    return str(path), ["data.source=files", f"data.paths=[{path}]", "data.shuffle=false"]


def test_a_corrupt_data_line_met_mid_run_keeps_and_records_the_last_checkpoint(tmp_path, capfd):
    """Met while step 2 runs (the loop reads batch 3 then): one line, exit 2, step 1's checkpoint committed
    and its `checkpoint` event written, which the supervisor and a rerun read (the save was still in
    flight when the error came: only closing the checkpointer waited for it, and it wrote no event)."""
    import json
    from lumen_jax.checkpoint.layout import checkpoints_dir, committed_steps
    path, files = _line_17_cut_short(tmp_path)
    run = str(tmp_path / "run")
    assert train_cli.main(args(run, *files, "train.steps=4", "checkpoint.every_steps=1")) == train_cli.EXIT_BAD_INPUT
    [line] = capfd.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: data file {path} line 17: not valid JSON"), line
    assert committed_steps(checkpoints_dir(run)) == [1]
    events = [json.loads(e) for e in open(os.path.join(run, "events.jsonl"))]
    assert [e.get("step") for e in events if e["event"] == "checkpoint"] == [1], events


def test_a_corrupt_data_line_met_on_resume_changes_nothing(tmp_path, capfd):
    """A corrupt line the first batch after a resume reads: one line naming the file and line, exit 2, and
    the run directory as it was, bytes and mtimes (config.json was rewritten and a start event appended
    before the first read)."""
    path, files = _line_17_cut_short(tmp_path)
    run = str(tmp_path / "run")
    assert train_cli.main(args(run, *files)) == 0, capfd.readouterr().err
    before = snapshot(run)
    mtimes = {p: os.stat(os.path.join(run, p)).st_mtime_ns for p in before}
    capfd.readouterr()
    assert train_cli.main(args(run, *files, f"train.steps={RUN_STEPS + 2}")) == train_cli.EXIT_BAD_INPUT
    [line] = capfd.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: data file {path} line 17: not valid JSON") and "fix or remove the line" in line
    assert snapshot(run) == before
    assert {p: os.stat(os.path.join(run, p)).st_mtime_ns for p in before} == mtimes
