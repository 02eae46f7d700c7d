"""Model weights in and out of a run directory, for the commands that need parameters but no optimizer.

A run directory's checkpoints (manager.py) hold the whole training state; an imported model
(`python -m lumen_jax.convert from-hf`) holds `{"params": ...}` at step 0, with `weights_only` in its
JSON, and the model state its weights come with (a DeepSeek-V3 router's selection bias) as
`model_state` beside them (an import without one, or an older import: the fresh state, zeros).
`load_params` reads the parameters of either straight into the target shardings (a partial Orbax
restore: the optimizer state is never read), so generate, evaluate, to-hf and `train.init_from` work
on any mesh. The model config comes from the checkpoint's JSON (`read_config`).

Every read is verified as the trainer's restore verifies (manager.py): a file that does not read back
and an array whose checksum differs from the one recorded at save time make the step unusable
(`UnusableCheckpoint`, one line naming the step and the file or array). A reader asked for a step
stops there; asked for the latest (`newest_usable`), it names each unusable step in a warning and
takes the previous one. Nothing on disk is moved (that is the trainer's restore's job).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
from typing import Any, Callable, Sequence, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp

from lumen_jax.checkpoint.layout import STATE, checkpoints_dir, committed_steps, item_dir, meta_path
from lumen_jax.config import Config, ConfigError, from_dict, to_dict
from lumen_jax.runtime import logs as runlog
from lumen_jax.runtime.checksums import checksum_list, nonfinite_paths


T = TypeVar("T")


class UnusableCheckpoint(ConfigError):
    """A checkpoint step whose files do not read back as they were written (one line, exit 2)."""


def steps(run_dir: str) -> list[int]:
    """Committed checkpoint steps of `run_dir` that hold their arrays, oldest first."""
    return committed_steps(checkpoints_dir(run_dir), STATE)


def resolve_step(run_dir: str, step: int | None, what: str = "--run-dir") -> int:
    """`step` if `run_dir` holds it, else the latest; ConfigError naming the folder when there is none."""
    have = steps(run_dir)
    if not have:
        raise ConfigError(f"{what}={run_dir!r} has no checkpoints (no {checkpoints_dir(run_dir)}/N/state); "
                          "give a run directory written by lumen_jax.train or lumen_jax.convert from-hf")
    if step is None:
        return have[-1]
    if step not in have:
        raise ConfigError(f"--step={step} is not among the checkpoints of {run_dir} ({', '.join(map(str, have))}); "
                          "choose one of those steps")
    return step


def _meta(run_dir: str, step: int) -> dict:
    path = meta_path(checkpoints_dir(run_dir), step)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UnusableCheckpoint(f"checkpoint step {step}: {path} cannot be read ({type(e).__name__})") from None


def is_weights_only(run_dir: str, step: int) -> bool:
    """Whether step `step` holds imported weights (False when its JSON is unreadable: the restore reports that)."""
    try:
        return bool(_meta(run_dir, step).get("weights_only"))
    except UnusableCheckpoint:
        return False


def newest_usable(run_dir: str, step: int | None, load: Callable[[int], T], what: str = "--run-dir") -> tuple[int, T]:
    """(step, load(step)): the step asked for, or with `step` None the newest whose `load` succeeds.

    `load(s)` raises UnusableCheckpoint for a damaged step. An asked-for step that is unusable stops
    here (one line); otherwise each newer unusable step is named in a warning and the previous one
    is tried, and when none is usable the error names the newest.
    """
    have = steps(run_dir)
    resolve_step(run_dir, step, what)
    if step is not None:
        try:
            return step, load(step)
        except UnusableCheckpoint as e:
            others = [s for s in have if s != step]
            raise UnusableCheckpoint(f"{e}; choose another --step" + (f" ({', '.join(map(str, others))})"
                                                                       if others else "")) from None
    skipped = []
    for s in reversed(have):
        try:
            value = load(s)
        except UnusableCheckpoint as e:
            skipped.append(str(e))
            continue
        for line in skipped:
            print(f"warning: {line}; using step {s}", file=runlog.console(), flush=True)
        return s, value
    older = f" ({len(skipped) - 1} older {'ones are' if len(skipped) > 2 else 'one is'} unusable too)"
    raise UnusableCheckpoint(f"no checkpoint of {run_dir} is usable: {skipped[0]}" + (older if len(skipped) > 1 else ""))


def read_config(run_dir: str, step: int) -> Config:
    """The config the checkpoint at `step` was written with (its JSON, else `run_dir/config.json`)."""
    d = _meta(run_dir, step).get("config")
    if d is None:
        try:
            with open(os.path.join(run_dir, "config.json")) as f:
                d = json.load(f)
        except (OSError, ValueError):
            raise ConfigError(f"{run_dir}: neither checkpoint {step} nor config.json records the config") from None
    return from_dict(d)


def imported_context(run_dir: str, step: int) -> int | None:
    """An imported model's `max_position_embeddings` (from-hf records it with the weights), else None."""
    imported = _meta(run_dir, step).get("max_position_embeddings")
    return imported if isinstance(imported, int) and imported > 0 else None


def context_length(run_dir: str, step: int, cfg: Config) -> tuple[int, str]:
    """(tokens, where the figure comes from): the longest sequence the model at `step` was made for, an
    imported model's `max_position_embeddings`, else the `data.seq_len` the run trained at."""
    imported = imported_context(run_dir, step)
    if imported:
        return imported, "max_position_embeddings of the imported model"
    return cfg.data.seq_len, f"data.seq_len={cfg.data.seq_len}, the length it was trained at"


def save_weights(run_dir: str, cfg: Config, params: dict, extra: dict | None = None,
                 model_state: dict | None = None) -> str:
    """Writes `params` (and `model_state`, the non-parameter model state the weights come with: ops/state.py)
    as the weights-only step 0 of `run_dir` (and `run_dir/config.json`); returns the folder.

    Each array's checksum is recorded (`checksums` for the parameters, `model_state_checksums`) and
    verified at every read. Refuses a run directory that already has checkpoints: nothing there is overwritten.
    """
    if steps(run_dir):
        raise ConfigError(f"--out={run_dir!r} already holds checkpoints; choose a new directory")
    os.makedirs(run_dir, exist_ok=True)
    tree = {"params": params}
    meta = {"config": to_dict(cfg), "weights_only": True, "checksums": checksum_list(tree), **(extra or {})}
    if model_state:
        tree["model_state"] = model_state
        meta["model_state_checksums"] = checksum_list(model_state)
    mgr = ocp.CheckpointManager(checkpoints_dir(run_dir), options=ocp.CheckpointManagerOptions(create=True))
    mgr.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)))
    mgr.wait_until_finished()
    mgr.close()
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(to_dict(cfg), f, indent=2)
    return os.path.join(checkpoints_dir(run_dir), "0")


def saved_shapes(run_dir: str, step: int, field: str = "params") -> dict[str, tuple[int, ...]] | None:
    """{'a/b/c': shape} of the saved state's `field` at `step` (from Orbax's metadata; nothing is read);
    None when the checkpoint has no such field (the model_state of an import that has none)."""
    where = item_dir(checkpoints_dir(run_dir), step, STATE)
    try:
        with _quiet_absl(), runlog.library_output(run_dir):  # Orbax logs a damaged file and returns None
            meta = ocp.PyTreeCheckpointer().metadata(where)
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        if field != "params" and field not in tree:
            return None
        flat = jax.tree_util.tree_flatten_with_path(tree[field], is_leaf=lambda x: hasattr(x, "shape"))[0]
    except Exception:  # noqa: BLE001 - any damaged metadata file: name it
        raise UnusableCheckpoint(f"checkpoint step {step}: {_damaged_metadata(where)}") from None
    return {path_key(p): tuple(v.shape) for p, v in flat}


def _damaged_file(where: str) -> str | None:
    """Which of Orbax's metadata files in the item folder `where` is missing or not JSON (None: all read)."""
    import glob

    names = ["_METADATA", "_sharding", *sorted(os.path.relpath(p, where) for p in
                                              glob.glob(os.path.join(where, "array_metadatas", "*")))]
    for name in names:
        path = os.path.join(where, name)
        if not os.path.isfile(path):
            if name != "_sharding":  # optional: the restore target gives the shardings
                return f"{path} is missing"
            continue
        try:
            with open(path, encoding="utf-8") as f:
                json.load(f)
        except (OSError, ValueError) as e:
            return f"{path} is damaged ({type(e).__name__}: not the JSON Orbax wrote)"
    if not os.path.isfile(os.path.join(where, "manifest.ocdbt")):
        return f"{os.path.join(where, 'manifest.ocdbt')} is missing"
    return None


def _damaged_metadata(where: str) -> str:
    return _damaged_file(where) or f"the array index of {where} (manifest.ocdbt, ocdbt.process_*/) does not read back"


def _read_error(error: BaseException) -> str:
    """The reason a restore failed, from the error that names it (TensorStore names the array)."""
    chain = []
    while error is not None:
        chain.append((type(error).__name__, " ".join(str(error).split())))
        error = error.__cause__ or error.__context__
    for _, text in chain:
        m = re.search(r'Error reading "([^"/]+)/[^"]*" in OCDBT database at local file "[^"]*": (.*)', text)
        if m:
            return f"array {m.group(1).replace('.', '/')} is damaged ({m.group(2)[:160]})"
    kind, text = chain[0]
    return f"it does not read back ({kind}: {text[:200]})"


def _verify(run_dir: str, step: int, tree: dict, field: str = "params") -> None:
    """UnusableCheckpoint when `tree` (the state's `field`: params or model_state) differs from the
    checksums step `step` recorded, or holds inf/NaN."""
    meta = _meta(run_dir, step)
    recorded, shapes = meta.get("checksums"), meta.get("state_shapes")
    where = item_dir(checkpoints_dir(run_dir), step, STATE)
    paths = [path_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    if shapes is None and field != "params":  # an import: its model state's own list (None: not recorded)
        recorded = meta.get("model_state_checksums")
    if recorded is not None:
        if shapes is not None:  # a training state: this field's entries, in the same (sorted) order
            recorded = [c for c, (path, *_) in zip(recorded, shapes) if path.startswith(f".{field}[")]
        got = checksum_list(tree)
        if len(recorded) != len(got):
            raise UnusableCheckpoint(f"checkpoint step {step}: {where} holds {len(got)} {field} arrays, "
                                     f"its checksums name {len(recorded)}")
        bad = [p for p, a, b in zip(paths, got, recorded) if a != b]
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise UnusableCheckpoint(f"checkpoint step {step}: array {field}/{bad[0]}{more} in {where} differs from "
                                     "the checksum recorded when it was saved (the files are damaged)")
    bad = nonfinite_paths(tree)
    if bad:
        raise UnusableCheckpoint(f"checkpoint step {step}: {bad[0]} in {where} holds inf or NaN")


def path_key(path: Any) -> str:
    """A tree path as `a/b/c` (the names shape errors and checksums use)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def check_shapes(expected: dict, got: dict[str, tuple[int, ...]], source: str, fix: str) -> None:
    """ConfigError naming the first parameter that is missing, extra or of another shape."""
    want = {path_key(p): tuple(v.shape) for p, v in jax.tree_util.tree_flatten_with_path(expected)[0]}
    for k, shape in want.items():
        if k not in got:
            raise ConfigError(f"{source} has no parameter {k} (shape {shape}); {fix}")
        if got[k] != shape:
            raise ConfigError(f"{source}: parameter {k} has shape {got[k]}, the config needs {shape}; {fix}")
    extra = sorted(set(got) - set(want))
    if extra:
        raise ConfigError(f"{source} has parameter {extra[0]} (shape {got[extra[0]]}) that the config lacks; {fix}")


def load_params(run_dir: str, step: int, abstract_params: dict, source: str | None = None,
                fix: str = "use the model config the run was trained with") -> dict:
    """The parameters of checkpoint `step`, read into `abstract_params`' shardings and dtypes.

    Args:
      run_dir: a run directory (a training run or an imported model).
      step: one of `steps(run_dir)`.
      abstract_params: {path: jax.ShapeDtypeStruct with `sharding`} of the target model.
      source, fix: how a shape mismatch names the checkpoint and the remedy (one line, ConfigError).
    """
    check_shapes(abstract_params, saved_shapes(run_dir, step), source or f"checkpoint {run_dir} step {step}", fix)
    return _restore_field(run_dir, step, "params", abstract_params)


def _restore_field(run_dir: str, step: int, field: str, abstract: dict) -> dict:
    """The saved state's `field` of checkpoint `step`, read into `abstract`'s shardings and verified."""
    target = {field: abstract}
    where = item_dir(checkpoints_dir(run_dir), step, STATE)
    try:
        # Orbax warns that the item folder has no checkpoint metadata (the step folder has); its
        # tracebacks of a damaged file (and asyncio's, later) go to the run's library.log.
        with _quiet_absl(), runlog.library_output(run_dir):
            restored = ocp.PyTreeCheckpointer().restore(
                where, args=ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                                   restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
    except Exception as e:  # noqa: BLE001 - a damaged data file: TensorStore's error names the array
        reason = _damaged_file(where) or f"{where}: {_read_error(e)}"
        raise UnusableCheckpoint(f"checkpoint step {step}: {reason}") from None
    _verify(run_dir, step, restored[field], field)
    return restored[field]


def stored_model_state(run_dir: str, step: int, abstract_state: dict) -> dict | None:
    """The model state that is not a parameter (ops/state.py: fp8 amax histories, an MoE router's
    balancing bias) of checkpoint `step`, in `abstract_state`'s shardings and verified; None when the
    checkpoint holds none (an import without one) or one of other paths or shapes."""
    saved = saved_shapes(run_dir, step, "model_state")
    want = {path_key(p): tuple(v.shape) for p, v in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
    if saved != want:
        return None
    return _restore_field(run_dir, step, "model_state", abstract_state)


def load_model_state(run_dir: str, step: int, abstract_state: dict) -> dict:
    """`stored_model_state`, else the fresh state (zeros, as a run starts with)."""
    if not abstract_state:
        return {}
    got = stored_model_state(run_dir, step, abstract_state)
    if got is None:
        return jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding), abstract_state)
    return got


@contextlib.contextmanager
def _quiet_absl():
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def to_numpy(params: dict) -> dict:
    """Host copies of (possibly sharded) parameters."""
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)


@dataclasses.dataclass
class Loaded:
    """A run's model on a mesh: its config (with the mesh asked for), parameters in their shards, rules."""

    cfg: Config
    step: int
    mesh: Any
    rules: Any
    model: Any  # model.AbstractModel
    params: dict
    model_state: dict = dataclasses.field(default_factory=dict)  # non-parameter model state (ops/state.py)


def mesh_overrides(cfg: Config, overrides: Sequence[str], base: dict | None = None) -> Config:
    """`cfg` with its mesh section replaced by `base` (None: keep it) and the `mesh.*` overrides applied."""
    from lumen_jax.config.files import apply_overrides

    raw = to_dict(cfg)
    if base is not None:
        raw["mesh"] = {**raw["mesh"], **base}
    bad = [o for o in overrides if not o.strip().startswith("mesh.")]
    if bad:
        raise ConfigError(f"override {bad[0]!r}: only mesh.* overrides apply here (e.g. mesh.tensor=2; on CPU with "
                          "runtime.cpu_devices=2)")
    return from_dict(apply_overrides(raw, overrides))


def load_onto_mesh(run_dir: str, step: int | None, overrides: Sequence[str] = (),
                   base_mesh: dict | None = None) -> Loaded:
    """The parameters of `run_dir`'s checkpoint `step` (None: the newest usable) sharded on the mesh of its
    config with `base_mesh` and the `mesh.*` overrides; the mesh spans the devices it needs (all for a -1 axis)."""
    from lumen_jax.model import abstract_model
    from lumen_jax.parallel.mesh import make_mesh
    from lumen_jax.parallel.rules import Rules

    def load(s: int) -> Loaded:
        cfg = mesh_overrides(read_config(run_dir, s), overrides, base_mesh)
        sizes = [getattr(cfg.mesh, a) for a in cfg.mesh.AXES]
        devices = jax.devices()
        n = len(devices) if -1 in sizes else int(np.prod(sizes))
        if n > len(devices):
            raise ConfigError(f"the mesh {dict(zip(cfg.mesh.AXES, sizes))} needs {n} devices, {len(devices)} are "
                              "available; lower the mesh.* overrides (on CPU: or add runtime.cpu_devices=N)")
        shape = cfg.mesh.shape(n)
        m = cfg.model
        for k in ("num_heads", "num_kv_heads", "vocab_size"):
            if getattr(m, k) % shape["tensor"]:
                raise ConfigError(f"mesh.tensor={shape['tensor']} does not divide model.{k}={getattr(m, k)}; "
                                  "choose a divisor")
        if m.d_model % shape["fsdp"]:
            raise ConfigError(f"mesh.fsdp={shape['fsdp']} does not divide model.d_model={m.d_model}; choose a divisor")
        if m.moe.enabled and m.moe.num_experts % shape["expert"]:
            raise ConfigError(f"mesh.expert={shape['expert']} does not divide model.moe.num_experts="
                              f"{m.moe.num_experts}; choose a divisor")
        mesh = make_mesh(shape, devices[:n])
        rules = Rules(zero_stage=cfg.mesh.zero_stage, sequence_parallel=False)
        model = abstract_model(m)
        def target(shapes: dict, names: dict) -> dict:
            return jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                     sharding=jax.sharding.NamedSharding(mesh, spec)),
                                shapes, rules.tree_specs(names, "params"),
                                is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))

        return Loaded(cfg=cfg, step=s, mesh=mesh, rules=rules, model=model,
                      params=load_params(run_dir, s, target(model.params, model.param_names)),
                      model_state=load_model_state(run_dir, s, target(model.state, model.state_names)))

    return newest_usable(run_dir, step, load)[1]


def has_readable_config(run_dir: str, step: int) -> bool:
    """Whether checkpoint `step` of `run_dir` records its config (a damaged one does not)."""
    try:
        return isinstance(_meta(run_dir, step).get("config"), dict)
    except UnusableCheckpoint:
        return False


def refuse_weights_only(run_dir: str) -> None:
    """ConfigError when `run_dir` holds imported weights (no optimizer state): a run cannot resume there."""
    have = steps(run_dir)
    if have and is_weights_only(run_dir, have[-1]):
        raise ConfigError(f"train.run_dir={run_dir!r} holds imported weights, not a training run; start a new "
                          f"run from them with train.init_from={run_dir} and another train.run_dir")
