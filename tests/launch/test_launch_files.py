"""The launch files of launch/ (SLURM, Kubernetes JobSet) against the start-up rules of
lumen_jax.runtime.distributed; what launch/local.py shows of process 0's output."""

import os
import subprocess
import time

import yaml

from helpers.paths import REPO
from lumen_jax.config import DistributedConfig
from lumen_jax.runtime import distributed as D


def test_launch_files_agree_with_the_start_up_rules():
    """The SLURM script parses and the JobSet's process count matches its pod count."""
    assert subprocess.run(["bash", "-n", "launch/slurm.sbatch"], cwd=REPO, timeout=30).returncode == 0
    jobset = yaml.safe_load(open(os.path.join(REPO, "launch", "k8s-jobset.yaml")))
    job = jobset["spec"]["replicatedJobs"][0]
    pod = job["template"]["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert int(env["JAX_NUM_PROCESSES"]) == job["template"]["spec"]["completions"] * job["replicas"]
    name, sub = jobset["metadata"]["name"], jobset["spec"]["network"]["subdomain"]
    assert env["JAX_COORDINATOR_ADDRESS"].startswith(f"{name}-{job['name']}-0-0.{sub}:")
    args = D.resolve(DistributedConfig(), env={**env, "JOB_COMPLETION_INDEX": "1"})
    assert args["process_id"] == 1 and args["num_processes"] == 2


def test_local_console_shows_process_0_without_gloos_lines(tmp_path, monkeypatch):
    """launch/local.py's copy of process 0's output: all of it in the log; on the console every line but
    gloo's, and a progress bar's updates (no newline) as they come."""
    import io
    import threading

    from helpers.paths import load_script

    local = load_script("launch/local.py")
    console = io.BytesIO()
    monkeypatch.setattr(local.sys, "stdout", type("Out", (), {"buffer": console})())
    read, write = os.pipe()
    log = open(tmp_path / "log", "wb")
    tee = threading.Thread(target=local._tee, args=(os.fdopen(read, "rb"), log), daemon=True)
    tee.start()
    chunks = [b"lumen_jax: 8 cpu devices\n[Gl", b"oo] Rank 0 is connected to 1 peer ranks.\n",
              b"\r 10%|# | 2/20", b"\r 20%|## | 4/20", b"\n[Gloo] Rank 1\n", b"done: step 20"]
    try:
        for chunk in chunks:
            os.write(write, chunk)
            if chunk.startswith(b"\r 10%"):  # the bar reaches the console before its line ends
                deadline = time.monotonic() + 10
                while b"2/20" not in console.getvalue():
                    assert time.monotonic() < deadline, console.getvalue()
                    time.sleep(0.01)
    finally:
        os.close(write)
        tee.join(timeout=10)
    log.close()
    assert (tmp_path / "log").read_bytes() == b"".join(chunks)
    assert console.getvalue() == b"lumen_jax: 8 cpu devices\n\r 10%|# | 2/20\r 20%|## | 4/20\ndone: step 20"


def test_local_refuses_numbers_that_would_start_too_much(capsys, monkeypatch):
    """--num-processes 100000 started hundreds of trainers: bounded by the machine, one line, exit 2,
    nothing started; likewise bad counts and absurd emulated devices per process."""
    from helpers.paths import load_script

    local = load_script("launch/local.py")
    started = []
    monkeypatch.setattr(local, "launch", lambda *a, **k: started.append(a) or 0)
    tiny = ["--", "--config", os.path.join(REPO, "configs", "tiny.yaml")]
    for argv, message in ((["--num-processes", "100000"], "--num-processes 100000 would start that many trainers"),
                          (["--num-processes", "0"], "must be >= 1"),
                          (["--devices-per-process", "100000"], "--devices-per-process 100000 emulated CPU devices"),
                          (["--num-processes", "two"], "argument --num-processes: invalid int value: 'two'")):
        assert local.main([*argv, *tiny]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err
    assert not started
