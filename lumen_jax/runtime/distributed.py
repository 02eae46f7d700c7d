"""Several processes in one job: `jax.distributed` start-up, the device check, the node layout of the
mesh, each process's share of the batch, and small host-to-host exchanges.

One process runs per node (it sees all the node's GPUs) or per GPU. They find each other through
JAX's coordination service on process 0; XLA's collectives (NCCL on GPUs, gloo on CPUs) carry data.

Where the settings come from (`resolve`), first match wins:

- coordinator: distributed.coordinator, JAX_COORDINATOR_ADDRESS, SLURM (the step's first node, port
  JAX_COORDINATOR_PORT or 61440 + SLURM_JOB_ID % 4096); none of them: a single process.
- num_processes: distributed.num_processes, JAX_NUM_PROCESSES, SLURM_NTASKS; else 1.
- process_id: distributed.process_id, JAX_PROCESS_ID, JOB_COMPLETION_INDEX (an indexed Job), SLURM_PROCID.
- local_device_ids: distributed.local_device_ids, JAX_LOCAL_DEVICE_IDS, [SLURM_LOCALID] when several
  SLURM tasks share a node and CUDA_VISIBLE_DEVICES does not already give each one GPU; else all visible.

Failure. A process that dies stops sending heartbeats; the coordination service then stops every other
process within `distributed.heartbeat_timeout_s` (if process 0 dies, the others stop at once: they lose
the service). A process that stops with an error leaves without JAX's shutdown barrier (`leave`), so the
others, possibly waiting for it inside a collective, are stopped by the same heartbeat rule instead of
waiting for it there. The launcher (srun --kill-on-bad-exit, launch/local.py, a JobSet) ends the job and
the supervisor (launch/supervise.py) or the JobSet's failure policy restarts all processes together.

Nodes. A mesh axis of size n has n / k slices inside a node and k across nodes
(`distributed.across_nodes_<axis>` = k); `jax.experimental.mesh_utils.create_hybrid_device_mesh` places
them so the in-node part of every axis stays on NVLink. A node is a device's `slice_index` on GPUs (the
host, or the NVLink domain of a multi-node NVLink system) and a process on CPUs (`launch/local.py` runs
one emulated node per process).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import socket
import sys
import time
from typing import Any, Callable, Mapping, NoReturn, Sequence

from lumen_jax.config import ConfigError, DistributedConfig, MeshConfig, show
from lumen_jax.config.checks import address_problem

AXES = MeshConfig.AXES


# --------------------------------------------------------------------------------------------------
# Start-up
# --------------------------------------------------------------------------------------------------

def _first_slurm_host(nodelist: str) -> str:
    """'node[003-006,010],gpu7' -> 'node003': the first host of SLURM's compressed host list."""
    cut = next((i for i, ch in enumerate(nodelist) if ch in ",["), len(nodelist))
    if cut == len(nodelist) or nodelist[cut] == ",":
        return nodelist[:cut]
    first = nodelist[cut + 1:].replace("-", ",").replace("]", ",").split(",", 1)[0]
    return nodelist[:cut] + first


def _slurm_tasks_per_node(env: Mapping[str, str]) -> int:
    ntasks = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
    nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))
    return max(ntasks // max(nodes, 1), 1)


def _env_int(env: Mapping[str, str], var: str, default: int) -> int:
    """The environment variable `var` as a whole number >= 0 (`default` when unset or empty)."""
    value = env.get(var, "").strip()
    if not value:
        return default
    if not value.isdigit():
        raise ConfigError(f"{var}={show(value)} must be a whole number >= 0; set it to one or unset it")
    return int(value)


def resolve(cfg: DistributedConfig, env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The `jax.distributed.initialize` arguments for this process, or None for a single process.

    See the module docstring for where each setting comes from.

    Raises:
      ConfigError: some settings are given and others cannot be found.
    """
    env = os.environ if env is None else env
    # Inside an srun step (SLURM_STEP_NODELIST), as JAX's own detection: not the batch script itself.
    slurm = all(v in env for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID"))
    coordinator = cfg.coordinator or env.get("JAX_COORDINATOR_ADDRESS", "")
    num = cfg.num_processes or _env_int(env, "JAX_NUM_PROCESSES", 0)
    pid = cfg.process_id
    for var in ("JAX_PROCESS_ID", "JOB_COMPLETION_INDEX"):
        if pid < 0 and env.get(var, "") != "":
            pid = _env_int(env, var, pid)
    ids: list[int] | None = list(cfg.local_device_ids) or None
    if ids is None and env.get("JAX_LOCAL_DEVICE_IDS"):
        ids = [int(i) for i in env["JAX_LOCAL_DEVICE_IDS"].split(",")]
    if not num and env.get("SLURM_NTASKS", "1").strip() != "1" and "SLURM_PROCID" not in env:
        # Not one of srun's tasks (SLURM sets SLURM_PROCID in each): training alone would be a silent 1/N.
        raise ConfigError(f"SLURM_NTASKS={env['SLURM_NTASKS'][:20]} but SLURM_PROCID is not set: this process is "
                          "not one of the job's tasks; start every task with srun (srun python -m lumen_jax.train "
                          "...), or set distributed.num_processes=1 to train as one process")
    if slurm:
        num = num or int(env["SLURM_NTASKS"])
        pid = pid if pid >= 0 else int(env["SLURM_PROCID"])
        if not coordinator and num > 1:
            port = env.get("JAX_COORDINATOR_PORT") or str(61440 + int(env["SLURM_JOB_ID"]) % 4096)
            coordinator = f"{_first_slurm_host(env['SLURM_STEP_NODELIST'])}:{port}"
        visible = [v for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
        if ids is None and _slurm_tasks_per_node(env) > 1 and len(visible) != 1:
            ids = [int(env.get("SLURM_LOCALID", "0"))]  # one GPU per task, like JAX's own SLURM default
    if num == 1 or (num == 0 and not coordinator):
        return None
    missing = [name for name, ok in (("distributed.coordinator (or JAX_COORDINATOR_ADDRESS)", coordinator),
                                     ("distributed.num_processes (or JAX_NUM_PROCESSES)", num > 0),
                                     ("distributed.process_id (or JAX_PROCESS_ID)", pid >= 0)) if not ok]
    if missing:
        raise ConfigError(f"a multi-process run needs {', '.join(missing)}; got coordinator={coordinator!r}, "
                          f"num_processes={num}, process_id={pid}: set them in the config or the environment, "
                          "or launch with launch/local.py, srun, or a JobSet (see docs/CLUSTERS.md)")
    if not 0 <= pid < num:
        raise ConfigError(f"process_id={pid} must be in [0, num_processes={num}); number the processes "
                          f"0..{num - 1}")
    why = address_problem(coordinator)
    if why is not None:  # else jax.distributed.initialize raises deep in its client, or waits on a port it cannot use
        where = "distributed.coordinator" if cfg.coordinator else (
            "JAX_COORDINATOR_ADDRESS" if env.get("JAX_COORDINATOR_ADDRESS") else "JAX_COORDINATOR_PORT")
        raise ConfigError(f"{where} gives the coordinator {show(coordinator)}, which {why}")
    return {"coordinator_address": coordinator, "num_processes": num, "process_id": pid,
            "local_device_ids": ids}


def initialize(cfg: DistributedConfig) -> bool:
    """Starts `jax.distributed` when this is one of several processes; returns whether it did.

    Call after `runtime.configure` and before anything touches a JAX device.
    """
    args = resolve(cfg)
    if args is None:
        return False
    import jax

    # All four settings are resolved above: JAX's own auto-detection would give every process of a
    # process-per-node SLURM job only GPU 0 (it sets local_device_ids=[SLURM_LOCALID]).
    jax.distributed.initialize(**args, cluster_detection_method="deactivate",
                               initialization_timeout=cfg.initialization_timeout_s,
                               heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
    return True


def is_multiprocess() -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized() and jax.process_count() > 1


def leave(code: int) -> NoReturn:
    """Ends this process now with `code`, skipping JAX's shutdown barrier.

    At exit JAX waits for every process at a barrier (up to its shutdown timeout, 5 minutes); a process
    that stopped with an error would wait there for peers that wait for it inside a collective. Leaving
    at once stops the heartbeats instead, and the coordination service stops the others within
    `distributed.heartbeat_timeout_s`.

    Process 0 hosts the coordination service, so it leaves last: every other process marks its own
    leaving in the service, then leaves, and process 0 waits for those marks (up to LEAVE_GRACE_S in
    all) and LEAVE_LINGER_S more, the time a marked peer needs to be gone. Without the wait, a peer
    that reaches the same error a moment later (a device mismatch every process finds) loses the
    service first and dies of it (JAX's "Socket closed", SIGABRT, no message of its own). A peer
    stuck in a collective never marks: process 0 then leaves after the grace. A peer that is gone
    does not stop process 0 within the linger: the service counts it dead only after
    `distributed.heartbeat_timeout_s`.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    _mark_leaving_or_wait_for_peers()
    os._exit(code)


LEAVE_GRACE_S = 10
LEAVE_LINGER_S = 1


def _mark_leaving_or_wait_for_peers() -> None:
    import jax
    from jax._src import distributed as jax_distributed  # the client has no public accessor

    client = jax_distributed.global_state.client
    if client is None:
        return
    try:
        me = jax.process_index()
        if me != 0:
            client.key_value_set(f"lumen_jax/left/{me}", "1")
            return
        deadline = time.monotonic() + LEAVE_GRACE_S
        for p in range(1, jax.process_count()):
            client.blocking_key_value_get(f"lumen_jax/left/{p}", max(1, int((deadline - time.monotonic()) * 1000)))
        time.sleep(LEAVE_LINGER_S)
    except Exception:  # noqa: BLE001 - the grace ran out or the service is gone: leave anyway
        return


# --------------------------------------------------------------------------------------------------
# Host-to-host exchange (the coordination service's key-value store; no device collective)
# --------------------------------------------------------------------------------------------------

_exchanges = itertools.count()
EXCHANGE_TIMEOUT_S = 600


def gather_json(value: Any, *, to_all: bool = True) -> list[Any] | None:
    """Every process's JSON-serialisable `value`, in process order.

    Runs through the coordination service (the client Orbax also uses), not through the devices: it
    works before any mesh exists and whatever state the accelerators are in. Every process must call
    it, in the same order. With `to_all=False` only process 0 receives the list (others get None).
    """
    import jax

    if jax.process_count() == 1:
        return [value]
    from jax._src import distributed as jax_distributed  # the client has no public accessor

    client = jax_distributed.global_state.client
    n, me = next(_exchanges), jax.process_index()
    prefix, timeout_ms = f"lumen_jax/exchange/{n}/", EXCHANGE_TIMEOUT_S * 1000
    client.key_value_set(f"{prefix}{me}", json.dumps(value))
    client.wait_at_barrier(f"lumen_jax/exchange/{n}/written", timeout_ms)
    out = None
    if to_all or me == 0:
        entries = dict(client.key_value_dir_get(prefix))
        out = [json.loads(entries[f"{prefix}{p}"]) for p in range(jax.process_count())]
    if to_all:
        client.wait_at_barrier(f"lumen_jax/exchange/{n}/read", timeout_ms)
    if me == 0:
        client.key_value_delete(prefix)
    return out


# --------------------------------------------------------------------------------------------------
# The device check
# --------------------------------------------------------------------------------------------------

def node_name() -> str:
    """This process's host (`LUMEN_NODE` overrides it: launch/local.py names one emulated node per process)."""
    return os.environ.get("LUMEN_NODE") or socket.gethostname()


def describe_local_devices() -> dict[str, Any]:
    """What this process runs on: node, platform and the physical ids of its devices."""
    import jax

    devices = jax.local_devices()
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]

    def physical(d: Any) -> str:  # CUDA ordinals count within CUDA_VISIBLE_DEVICES; map them back
        hw = getattr(d, "local_hardware_id", None)
        hw = d.id if hw is None else hw
        return visible[hw] if d.platform == "gpu" and hw < len(visible) else str(hw)

    return {"process": jax.process_index(), "node": node_name(), "platform": devices[0].platform,
            "devices": [physical(d) for d in devices]}


def check_devices(infos: Sequence[Mapping[str, Any]]) -> None:
    """Raises ConfigError when the processes' devices cannot form one mesh.

    Args:
      infos: `describe_local_devices()` of every process, in process order.
    """
    def who(pids: Sequence[int]) -> str:
        if len(pids) == 1:
            return f"process {pids[0]}"
        shown = ", ".join(map(str, pids[:6])) + (f", ... ({len(pids)} in all)" if len(pids) > 6 else "")
        return f"processes {shown}"

    platforms: dict[str, list[int]] = {}
    counts: dict[int, list[int]] = {}
    for i in infos:
        platforms.setdefault(i["platform"], []).append(i["process"])
        counts.setdefault(len(i["devices"]), []).append(i["process"])
    if len(platforms) > 1:
        seen = "; ".join(f"{who(p)}: {k}" for k, p in platforms.items())
        raise ConfigError(f"processes run on different platforms ({seen}); a process on cpu usually cannot "
                          "see its GPUs: check CUDA_VISIBLE_DEVICES and the CUDA install on its node")
    users: dict[tuple[str, str], list[int]] = {}
    for i in infos:
        if i["platform"] != "cpu":  # emulated CPU devices are not physical: processes may repeat ids
            for d in i["devices"]:
                users.setdefault((i["node"], d), []).append(i["process"])
    shared = {k: p for k, p in users.items() if len(p) > 1}
    if shared:
        (node, dev), pids = next(iter(shared.items()))
        platform = next(iter(platforms))
        raise ConfigError(
            f"{who(pids)} on node {node} all use {platform} {dev} ({len(shared)} device(s) shared in all): "
            "every process sees the same device. Give each process its own: launch one task per GPU with "
            "srun --gpus-per-task=1, or set distributed.local_device_ids=[<local rank>] "
            "(JAX_LOCAL_DEVICE_IDS), or run one process per node that sees all its GPUs")
    if len(counts) > 1:
        seen = "; ".join(f"{who(p)}: {n}" for n, p in sorted(counts.items(), key=lambda kv: kv[1][0]))
        raise ConfigError(
            f"processes see different numbers of {next(iter(platforms))} devices ({seen}); every process must "
            "drive the same number: check CUDA_VISIBLE_DEVICES / distributed.local_device_ids on each node, or "
            "that every node has the same GPUs free")


def node_of(device: Any) -> int:
    """The node (fast-interconnect domain) a device belongs to: slice_index on accelerators, the
    process on CPUs (launch/local.py emulates one node per process)."""
    return device.process_index if device.platform == "cpu" else getattr(device, "slice_index", 0)


def across_nodes(cfg: DistributedConfig, shape: Mapping[str, int], devices: Sequence[Any]) -> dict[str, int]:
    """How many slices of each mesh axis lie across nodes (the rest stays inside a node).

    Args:
      cfg: the run's distributed settings (`across_nodes_<axis>`, all 1 means automatic).
      shape: the resolved mesh shape {data, fsdp, context, tensor}.
      devices: every device of the job (`jax.devices()`).

    Returns:
      {axis: slices across nodes}; all 1 on a single node.

    Raises:
      ConfigError: the nodes and the mesh do not fit, with the node layout in the message.
    """
    shape = {a: shape.get(a, 1) for a in AXES}  # an axis left out has size 1
    nodes: dict[int, list[Any]] = {}
    for d in devices:
        nodes.setdefault(node_of(d), []).append(d)
    sizes = sorted({len(v) for v in nodes.values()})
    layout = (f"{len(nodes)} node(s) with " + "/".join(map(str, sizes)) + f" {devices[0].platform} device(s) each")
    mesh = " ".join(f"{a}={shape[a]}" for a in AXES)
    if len(sizes) > 1:
        raise ConfigError(f"the job has {layout}: every node must bring the same number of devices for mesh "
                          f"{mesh}; give each node the same GPUs (or processes)")
    wanted = cfg.across_nodes()
    if math.prod(wanted.values()) == 1 and len(nodes) > 1:  # automatic: nodes on the outermost axes
        # Greedy gcd always places every node: the mesh has as many devices as the nodes together.
        left, wanted = len(nodes), {}
        for a in AXES:
            wanted[a] = math.gcd(left, shape[a])
            left //= wanted[a]
    if math.prod(wanted.values()) != len(nodes):
        asked = "*".join(f"distributed.across_nodes_{a}={n}" for a, n in wanted.items() if n > 1) or "1"
        raise ConfigError(f"{asked} = {math.prod(wanted.values())} nodes, but the job has {layout}; "
                          f"make the product of distributed.across_nodes_* equal {len(nodes)} "
                          "(or leave them all 1 to choose automatically)")
    return wanted


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------

def batch_share(sharding: Any, global_batch: int, seq_len: int, process: int | None = None,
                process_of: Callable[[Any], int] = lambda d: d.process_index) -> tuple[int, int]:
    """(index, count): `process` (default: this one) feeds block `index` of `count` equal blocks of the
    global batch's rows, the rows its devices hold under `sharding` (the [batch, seq] input sharding).

    Usually block p of P. When the batch is replicated across processes (e.g. `tensor` spans them),
    several processes feed the same rows. `process_of` maps a device to its process (tests fake it).

    Raises:
      ConfigError: the mesh gives a process rows that are not one block.
    """
    import jax

    rows: dict[int, set[tuple[int, int]]] = {}
    for device, index in sharding.devices_indices_map((global_batch, seq_len)).items():
        r = index[0]
        rows.setdefault(process_of(device), set()).add((r.start or 0, global_batch if r.stop is None else r.stop))
    blocks = {}
    for p, spans in rows.items():
        lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
        if sum(e - s for s, e in spans) != hi - lo:
            raise ConfigError(f"the mesh gives process {p} rows {sorted(spans)} of the global batch, which are "
                              "not one block; put the batch axes (data, fsdp) across nodes, outermost")
        blocks[p] = (lo, hi)
    size = {hi - lo for lo, hi in blocks.values()}
    if len(size) > 1 or any(lo % (hi - lo) for lo, hi in blocks.values()):
        raise ConfigError(f"the mesh gives processes unequal blocks of the global batch ({blocks}); "
                          "put the batch axes (data, fsdp) across nodes, outermost")
    lo, hi = blocks[jax.process_index() if process is None else process]
    return lo // (hi - lo), global_batch // (hi - lo)
