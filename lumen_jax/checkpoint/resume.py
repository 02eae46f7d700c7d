"""Whether a run directory's checkpoints can resume under a new config, decided before anything is written.

A checkpoint records its resolved config and the shape and dtype of every state array
(`state_shapes`, written by the loop at each save). Rerunning on the same `train.run_dir` with a
changed config resumes when the state keeps its structure (steps, learning rate and schedule,
logging, checkpointing, mesh, micro-batches, model numerics such as remat or the attention kernel);
a change of the state's shapes or structure (model size, vocabulary, optional optimizer state) is a
ConfigError naming the first config key that differs (or, if no key explains it, the first array
whose shape differs), and nothing is moved or overwritten.
Checkpoints written before `state_shapes` existed are compared by the config keys that shape the state.

This module reads JSON only: no Orbax, so a refused resume costs nothing and touches nothing.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import jax

from lumen_jax.checkpoint.layout import committed_steps, meta_path
from lumen_jax.config import ConfigError, TrainConfig, show
from lumen_jax.data.errors import DataError

# Model keys that change numerics only, never the state's arrays.
_NUMERIC_MODEL_KEYS = frozenset({
    "model.norm_eps", "model.rope_theta", "model.rope_scaling", "model.rope_scaling_factor",
    "model.rope_low_freq_factor", "model.rope_high_freq_factor", "model.rope_original_max_len",
    "model.init_std", "model.attention", "model.flash_block_q", "model.flash_block_kv", "model.remat",
    "model.loss_chunk_tokens", "model.compute_dtype", "model.sliding_window", "model.global_every",
    "model.rope_local_theta", "model.query_scale_dim", "model.norm_scale", "model.mlp_activation",
    "model.embed_scale", "model.mtp_loss_weight", "model.rope_yarn_beta_fast", "model.rope_yarn_beta_slow",
    "model.rope_yarn_mscale", "model.rope_yarn_mscale_all_dim"})


def state_shapes(state: Any) -> list[list]:
    """[[path, shape, dtype], ...] of every array of `state` (concrete or abstract), in leaf order."""
    return [[jax.tree_util.keystr(path), list(x.shape), str(x.dtype)]
            for path, x in jax.tree_util.tree_leaves_with_path(state)]


def shapes_by_name(tree: Any) -> dict[str, list[int]]:
    """{"params/blocks/attn/wk": shape, ...} of every array of `tree`: the path as names only, so a
    TrainState and Orbax's metadata of it (dicts and lists where the state has fields and
    NamedTuples) name an array alike."""
    def name(key: Any) -> str:
        return str(next((getattr(key, a) for a in ("name", "key", "idx") if hasattr(key, a)), key))

    return {"/".join(map(name, path)): list(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(tree)
            if hasattr(x, "shape")}


def first_shape_change(old: dict[str, list[int]], new: dict[str, list[int]]) -> str | None:
    """The first array both {name: shape} maps hold with different shapes, as "NAME: checkpoint
    [..], now [..]"; None when every common array keeps its shape (arrays only one side has are a
    change of structure, which the restore's older layouts may explain)."""
    for name, shape in new.items():
        if name in old and list(old[name]) != list(shape):
            return f"{name}: checkpoint {list(old[name])}, now {list(shape)}"
    return None


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _shapes_state(key: str) -> bool:
    """Whether config key `key` can change the state's arrays (model shape keys, optional clipping)."""
    return (key.startswith("model.") and key not in _NUMERIC_MODEL_KEYS) or key == "optim.grad_clip"


def _differs(key: str, old: Any, new: Any) -> bool:
    if key == "optim.grad_clip":  # clipping on or off adds or drops its (empty) state
        return ((old or 0) > 0) != ((new or 0) > 0)
    return old != new


def _read_meta(checkpoint_dir: str, step: int) -> dict | None:
    try:
        with open(meta_path(checkpoint_dir, step), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None  # unreadable: the restore reports it and falls back
    return meta if isinstance(meta, dict) else None


def _fix() -> str:
    init_from = "init_from" in {f.name for f in dataclasses.fields(TrainConfig)}
    return "use a new train.run_dir" + (" or train.init_from" if init_from else "")


def check(config: dict, checkpoint_dir: str, abstract_state: Any, run_dir: str,
          check_data: Callable[[dict], None] | None = None) -> int | None:
    """Raises ConfigError when the newest checkpoint in `checkpoint_dir` cannot resume under `config`.

    Args:
      config: the new run's resolved config as JSON (`config.to_dict`), as checkpoints record it.
      checkpoint_dir: `<run_dir>/checkpoints`.
      abstract_state: the state the config builds (shapes and dtypes; `Trainer.abstract_state()`).
      run_dir: named in the messages.
      check_data: raises DataError when the checkpoint's data state does not fit the new data
        pipeline or its files changed (`TrainData.check_state`); the error is given the run and step.

    Returns:
      The newest committed step (None: no checkpoint, a fresh start).
    """
    steps = committed_steps(checkpoint_dir)
    if not steps:
        return None
    step = steps[-1]
    if config["train"]["steps"] < step:
        raise ConfigError(f"train.steps={config['train']['steps']} is below step {step}, which train.run_dir={run_dir} "
                          f"has already reached; set train.steps>={step} to continue, or {_fix()}")
    meta = next((m for m in (_read_meta(checkpoint_dir, s) for s in reversed(steps)) if m), None)
    if meta is None or not isinstance(meta.get("config"), dict):
        return step
    old, new = _flat(meta["config"]), _flat(config)
    data_state = meta.get("data")
    if check_data is not None and isinstance(data_state, dict) and "config" in data_state:
        try:
            check_data(data_state)
        except DataError as e:  # which checkpoint the data is compared with
            raise DataError(f"train.run_dir={run_dir} (step {step}): {e}") from None
    saved_shapes = meta.get("state_shapes")
    if saved_shapes is not None and saved_shapes == state_shapes(abstract_state):
        return step
    # The state differs (or an older checkpoint does not say): name the config key that explains it.
    # If none does, the restore finds out (`Checkpointer.restore_latest`: a ConfigError naming the array).
    changed = [k for k in new if k in old and _shapes_state(k) and _differs(k, old[k], new[k])]
    if changed:
        key = changed[0]
        raise ConfigError(f"{key}: checkpoint {show(old[key])}, now {show(new[key])}: the run in "
                          f"{run_dir} (step {step}) has a state of other shapes; {_fix()}, or resume "
                          f"with {key}={show(old[key])}")
    if saved_shapes is not None:  # no key explains it, but an array changed shape: never a restore to try
        moved = first_shape_change({p: shape for p, shape, _ in saved_shapes},
                                   {p: shape for p, shape, _ in state_shapes(abstract_state)})
        if moved:
            raise ConfigError(f"the run in {run_dir} (step {step}) has a state of other shapes ({moved}); "
                              f"{_fix()}, or resume with the config that checkpoint was written with "
                              f"({meta_path(checkpoint_dir, step)})")
    return step
