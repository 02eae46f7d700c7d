"""Several processes: start-up settings, the device check, hybrid meshes, each process's batch share,
and real 2-process x 4-device runs on CPU (losses, checkpoints across process counts, a killed process).

Every subprocess runs in its own session under a timeout that kills the whole group, and every port is
chosen at run time, so a hang or a failure cannot block CI.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import types

import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers.metrics import losses_and_grad_norms
from helpers.faults import run_group as _run
from helpers.paths import REPO, load_script
from helpers.tolerances import FP32_RTOL
from lumen_jax.runtime import distributed as D
from lumen_jax.config import ConfigError, DistributedConfig
from lumen_jax.config.checks import validate
from lumen_jax.config.files import load_config
from lumen_jax.parallel.mesh import hybrid_device_grid, make_mesh

PY = sys.executable
HEARTBEAT_S = 10  # distributed.heartbeat_timeout_s in the runs below: the documented bound on stopping
# 8 steps of the tiny model; the schedule is pinned to 8 steps so shorter legs of a resumed run agree.
COMMON = ["--config", "configs/tiny.yaml", "mesh.fsdp=8", "optim.decay_steps=8", "optim.warmup_steps=4", "log.every_steps=1",
          "log.progress=false", "log.tensorboard=false", "checkpoint.every_steps=2",
          f"distributed.heartbeat_timeout_s={HEARTBEAT_S}"]




def _local(processes: int, devices: int, run_dir: str, *extra: str) -> list[str]:
    return [PY, "launch/local.py", "--num-processes", str(processes), "--devices-per-process", str(devices),
            "--grace", "20", "--", *COMMON, f"train.run_dir={run_dir}", *extra]


def _assert_losses(got: dict[int, tuple[float, float]], want: dict[int, tuple[float, float]], steps: range) -> None:
    """Losses and grad norms ({step: (loss, grad_norm)}) of every step."""
    assert sorted(got) == list(steps), got
    # float32 (tiny.yaml computes in float32); gloo may add up in another order than one process
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=FP32_RTOL)


def _fake_device(id: int, node: int, platform: str = "gpu") -> types.SimpleNamespace:
    return types.SimpleNamespace(id=id, process_index=node, slice_index=node, platform=platform,
                                 device_kind="fake")


# --------------------------------------------------------------------------------------------------
# Start-up settings
# --------------------------------------------------------------------------------------------------

def test_single_process_needs_no_initialization():
    assert D.resolve(DistributedConfig(), env={}) is None
    assert D.resolve(DistributedConfig(), env={"JAX_NUM_PROCESSES": "1"}) is None


def test_settings_from_config_environment_and_kubernetes():
    explicit = DistributedConfig(coordinator="10.0.0.1:1234", num_processes=4, process_id=2,
                                 local_device_ids=(0, 1))
    assert D.resolve(explicit, env={"JAX_PROCESS_ID": "3"}) == {
        "coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 2, "local_device_ids": [0, 1]}
    env = {"JAX_COORDINATOR_ADDRESS": "lumen-workers-0-0.lumen:1234", "JAX_NUM_PROCESSES": "16",
           "JOB_COMPLETION_INDEX": "5"}  # an indexed Job / JobSet pod
    assert D.resolve(DistributedConfig(), env=env) == {
        "coordinator_address": "lumen-workers-0-0.lumen:1234", "num_processes": 16, "process_id": 5,
        "local_device_ids": None}


def test_settings_from_slurm_process_per_node_and_per_gpu():
    node = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
            "SLURM_STEP_NODELIST": "gpu[017-018]", "SLURM_STEP_NUM_NODES": "2"}
    args = D.resolve(DistributedConfig(), env=node)
    # one task per node sees every GPU of its node (JAX's own default would give it only GPU 0)
    assert args == {"coordinator_address": f"gpu017:{61440 + 4242 % 4096}", "num_processes": 2,
                    "process_id": 1, "local_device_ids": None}
    gpu = {**node, "SLURM_NTASKS": "16", "SLURM_PROCID": "11", "SLURM_LOCALID": "3",
           "JAX_COORDINATOR_PORT": "5000"}
    assert D.resolve(DistributedConfig(), env=gpu)["local_device_ids"] == [3]
    assert D.resolve(DistributedConfig(), env=gpu)["coordinator_address"] == "gpu017:5000"
    bound = {**gpu, "CUDA_VISIBLE_DEVICES": "3"}  # srun --gpus-per-task=1 already picked the GPU
    assert D.resolve(DistributedConfig(), env=bound)["local_device_ids"] is None


def test_incomplete_settings_name_what_is_missing():
    with pytest.raises(ConfigError, match=r"distributed.num_processes \(or JAX_NUM_PROCESSES\)"):
        D.resolve(DistributedConfig(coordinator="h:1"), env={"JAX_PROCESS_ID": "0"})
    with pytest.raises(ConfigError, match=r"process_id=4 must be in \[0, num_processes=4\)"):
        D.resolve(DistributedConfig(coordinator="h:1", num_processes=4, process_id=4), env={})


@pytest.mark.parametrize("address", ["node001", "node001:", "node001:abc", "node001:0", "node001:70000", "a b:1"])
def test_a_malformed_coordinator_address_is_one_line_before_jax_starts(address):
    """Before: no port was a traceback from JAX's client, a non-numeric one a silent hang of minutes."""
    env = {"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}
    with pytest.raises(ConfigError, match=rf"JAX_COORDINATOR_ADDRESS gives the coordinator '{address}', which must "
                                          r"be host:port of process 0, the port a number from 1 to 65535"):
        D.resolve(DistributedConfig(), env=env)
    with pytest.raises(ConfigError, match=r"JAX_NUM_PROCESSES='two' must be a whole number"):
        D.resolve(DistributedConfig(), env={**env, "JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two"})
    assert D.resolve(DistributedConfig(), env={**env, "JAX_COORDINATOR_ADDRESS": "[::1]:65535"})["process_id"] == 0


def test_config_keys():
    cfg = load_config("configs/tiny.yaml", ["distributed.local_device_ids=3", "distributed.across_nodes_fsdp=2"])
    assert cfg.distributed.local_device_ids == (3,)
    assert validate(cfg, 8)["fsdp"] == 8
    bad = load_config("configs/tiny.yaml", ["distributed.across_nodes_fsdp=3"])
    with pytest.raises(ConfigError, match=r"distributed.across_nodes_fsdp=3 does not divide mesh.fsdp=8"):
        validate(bad, 8)
    with pytest.raises(ConfigError, match="must be host:port"):
        validate(load_config("configs/tiny.yaml", ["distributed.coordinator=node001"]), 8)


# --------------------------------------------------------------------------------------------------
# Device check and node layout
# --------------------------------------------------------------------------------------------------

def test_every_process_seeing_gpu_0_is_named():
    infos = [{"process": p, "node": "gpu017", "platform": "gpu", "devices": ["0"]} for p in range(8)]
    with pytest.raises(ConfigError) as e:
        D.check_devices(infos)
    msg = str(e.value)
    assert "processes 0, 1, 2, 3, 4, 5, ... (8 in all) on node gpu017 all use gpu 0" in msg
    assert "srun --gpus-per-task=1" in msg and "distributed.local_device_ids" in msg
    # one GPU each on the node: fine; emulated CPU devices may repeat ids across processes
    D.check_devices([{**i, "devices": [str(i["process"])]} for i in infos])
    D.check_devices([{"process": p, "node": "h", "platform": "cpu", "devices": ["0", "1"]} for p in range(2)])


def test_uneven_or_mixed_devices_are_named():
    infos = [{"process": 0, "node": "a", "platform": "gpu", "devices": [str(i) for i in range(8)]},
             {"process": 1, "node": "b", "platform": "gpu", "devices": ["0"]}]
    with pytest.raises(ConfigError, match=r"different numbers of gpu devices \(process 0: 8; process 1: 1\)"):
        D.check_devices(infos)
    with pytest.raises(ConfigError, match=r"different platforms \(process 0: gpu; process 1: cpu\)"):
        D.check_devices([infos[0], {**infos[1], "platform": "cpu"}])


def test_nodes_go_to_the_outermost_axes_unless_told():
    devices = [_fake_device(i, i // 4) for i in range(8)]  # 2 nodes x 4 GPUs
    auto = DistributedConfig()
    assert D.across_nodes(auto, dict(data=1, fsdp=8, context=1, tensor=1), devices) == \
        dict(data=1, fsdp=2, pipeline=1, expert=1, context=1, tensor=1)
    assert D.across_nodes(auto, dict(data=2, fsdp=2, context=1, tensor=2), devices) == \
        dict(data=2, fsdp=1, pipeline=1, expert=1, context=1, tensor=1)
    told = DistributedConfig(across_nodes_tensor=2)
    assert D.across_nodes(told, dict(data=1, fsdp=4, context=1, tensor=2), devices)["tensor"] == 2
    assert D.across_nodes(auto, dict(data=1, fsdp=8, context=1, tensor=1), devices[:4]) == \
        dict(data=1, fsdp=1, pipeline=1, expert=1, context=1, tensor=1)


def test_mesh_that_does_not_fit_the_nodes_is_named():
    devices = [_fake_device(i, i // 4, "cpu") for i in range(8)]
    with pytest.raises(ConfigError) as e:
        D.across_nodes(DistributedConfig(across_nodes_fsdp=4), dict(data=1, fsdp=8, pipeline=1, context=1, tensor=1), devices)
    assert str(e.value) == ("distributed.across_nodes_fsdp=4 = 4 nodes, but the job has 2 node(s) with 4 cpu "
                            "device(s) each; make the product of distributed.across_nodes_* equal 2 (or leave "
                            "them all 1 to choose automatically)")
    with pytest.raises(ConfigError, match="every node must bring the same number of devices"):
        D.across_nodes(DistributedConfig(), dict(data=1, fsdp=6, pipeline=1, context=1, tensor=1), devices[:6])
    three = [_fake_device(i, i // 2) for i in range(6)]  # 3 nodes of 2: only tensor=3 can cross them
    assert D.across_nodes(DistributedConfig(), dict(data=1, fsdp=2, pipeline=1, context=1, tensor=3), three)["tensor"] == 3


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_hybrid_grid_keeps_the_in_node_part_on_one_node(platform):
    devices = [_fake_device(i, i // 4, platform) for i in range(8)]
    grid = hybrid_device_grid(dict(data=1, fsdp=4, context=1, tensor=2), devices,
                              dict(data=1, fsdp=2, context=1, tensor=1))
    assert grid.shape == (1, 4, 1, 1, 1, 2)  # data, fsdp, pipeline, expert, context, tensor
    nodes = np.vectorize(lambda d: d.process_index)(grid)
    assert nodes[0, :, 0, 0, 0, :].tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]  # fsdp's outer half crosses nodes


# --------------------------------------------------------------------------------------------------
# Each process's share of the batch
# --------------------------------------------------------------------------------------------------

def test_batch_share_follows_the_mesh():
    sharding = lambda mesh: NamedSharding(mesh, P(("data", "fsdp"), "context"))  # noqa: E731
    fsdp8 = make_mesh(dict(data=1, fsdp=8, pipeline=1, context=1, tensor=1))
    by_half = lambda d: d.id // 4  # noqa: E731 - devices 0-3 are process 0, 4-7 process 1
    assert [D.batch_share(sharding(fsdp8), 16, 128, p, by_half) for p in (0, 1)] == [(0, 2), (1, 2)]
    # tensor across the two processes: both hold every row, so both read the whole batch
    tp_across = make_mesh(dict(data=1, fsdp=4, context=1, tensor=2))
    by_tensor = lambda d: int(np.argwhere(tp_across.devices == d)[0][-1])  # noqa: E731 - tensor: the last axis
    assert [D.batch_share(sharding(tp_across), 16, 128, p, by_tensor) for p in (0, 1)] == [(0, 1), (0, 1)]
    with pytest.raises(ConfigError, match="not one block"):
        D.batch_share(sharding(fsdp8), 16, 128, 0, lambda d: d.id % 2)
    assert D.batch_share(sharding(fsdp8), 16, 128) == (0, 1)  # this single process


# --------------------------------------------------------------------------------------------------
# Real processes
# --------------------------------------------------------------------------------------------------

# Process 1 reaches its error 2 s after process 0. Process 0 hosts the coordination service: had it left at
# once, process 1 would lose the service mid-way (exit 1, JAX's "Socket closed") instead of printing its own
# line. CI once lost that race with no delay planted, process 1's last barrier reply still in flight.
_SLOW_TO_ITS_ERROR = """
import sys, time
from lumen_jax.runtime import distributed
check = distributed.check_devices
distributed.check_devices = lambda infos: (time.sleep(2), check(infos))[1]
from lumen_jax.train.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_device_mismatch_stops_every_process_with_its_message(tmp_path):
    """Two SLURM-style tasks (the SLURM start-up path) where one sees 4 devices and the other 2, the
    second slower to reach the error."""
    port = str(_load_launcher().free_port())
    procs = []
    for i, devices in enumerate((4, 2)):
        env = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2", "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i),
               "SLURM_STEP_NODELIST": "localhost", "SLURM_NNODES": "1", "JAX_COORDINATOR_PORT": port}
        start = ["-m", "lumen_jax.train"] if i == 0 else ["-c", _SLOW_TO_ITS_ERROR]
        cmd = [PY, *start, *COMMON, f"train.run_dir={tmp_path}", "runtime.platform=cpu",
               f"runtime.cpu_devices={devices}"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 2, err[-2000:]
        assert ("error: processes see different numbers of cpu devices (process 0: 4; process 1: 2); every "
                "process must drive the same number") in err
    events = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert [(e["event"], e["code"]) for e in events] == [("exit", 2)]  # for the supervisor, whatever srun says


def _load_launcher():
    return load_script("launch/local.py", "local_launcher")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses and grad norms of 8 steps in one process with 8 devices."""
    run_dir = str(tmp_path_factory.mktemp("one_process"))
    out = _run(_local(1, 8, run_dir, "train.steps=8"), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return losses_and_grad_norms(run_dir)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """2 processes x 4 devices under the supervisor; process 1 is SIGKILLed after step 3."""
    run_dir = str(tmp_path_factory.mktemp("two_processes"))
    env = {"LUMEN_FAULT_SIGKILL_AFTER_STEPS": "3", "LUMEN_FAULT_PROCESS": "1"}
    cmd = [PY, "launch/supervise.py", "--run-dir", run_dir, "--max-restarts", "2", "--backoff", "0.1", "--",
           *_local(2, 4, run_dir, "train.steps=4")]
    return run_dir, _run(cmd, timeout=420, env=env)


@pytest.mark.heavy
def test_two_processes_match_one_and_a_killed_process_restarts_the_job(reference, killed_run):
    run_dir, out = killed_run
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "local: process 1 ended (killed by SIGKILL)" in out.stderr
    # process 0 stops by itself (gloo loses its peer at once on CPU; the heartbeat bounds it everywhere)
    line = next(x for x in out.stderr.splitlines() if x.startswith("local: process 0 ended (") and "after" in x)
    assert float(line.split(", ")[-1].split("s after")[0]) <= HEARTBEAT_S + 5, line
    assert "still running" not in out.stderr  # the launcher did not have to kill it
    assert "attempt 1: killed by SIGKILL" in out.stdout and "final: done" in out.stdout
    starts = [e for e in map(json.loads, open(os.path.join(run_dir, "events.jsonl"))) if e["event"] == "start"]
    assert len(starts) == 2 and starts[0]["attempt"] != starts[1]["attempt"]
    _assert_losses(losses_and_grad_norms(run_dir), reference, range(1, 5))
    logs = sorted(os.listdir(os.path.join(run_dir, "logs")))
    assert logs == ["process-0.log", "process-1.log"]


@pytest.mark.heavy
def test_checkpoint_moves_between_process_counts(reference, killed_run, tmp_path):
    """Written by 2 processes, resumed by 1 (steps 5-6), then by 2 again (steps 7-8, process 0 killed
    once on the way), data position kept."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(killed_run[0], run_dir)
    meta = json.load(open(os.path.join(run_dir, "checkpoints", "4", "meta", "metadata")))
    assert sorted(map(int, meta["data"]["streams"])) == list(range(16))  # both processes' streams
    one = _run(_local(1, 8, run_dir, "train.steps=6"), timeout=240)
    assert one.returncode == 0 and "resumed from step 4" in one.stdout, one.stderr[-3000:]
    # By 2 again under the supervisor, and this time process 0 (the coordination service's host) is
    # SIGKILLed after step 7: process 1 stops by itself, the job restarts from step 6.
    env = {"LUMEN_FAULT_SIGKILL_AFTER_STEPS": "7", "LUMEN_FAULT_PROCESS": "0"}
    two = _run([PY, "launch/supervise.py", "--run-dir", run_dir, "--max-restarts", "2", "--backoff", "0.1", "--",
                *_local(2, 4, run_dir, "train.steps=8")], timeout=420, env=env)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-4000:]
    assert "resumed from step 6" in two.stdout and "local: process 0 ended (killed by SIGKILL)" in two.stderr
    line = next(x for x in two.stderr.splitlines() if x.startswith("local: process 1 ended (") and "after" in x)
    assert float(line.split(", ")[-1].split("s after")[0]) <= HEARTBEAT_S + 5, line
    assert "attempt 1: killed by SIGKILL" in two.stdout and "final: done" in two.stdout
    _assert_losses(losses_and_grad_norms(run_dir), reference, range(1, 9))
