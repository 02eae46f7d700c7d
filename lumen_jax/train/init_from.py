"""Where a new run's weights come from (`train.init_from`): a run directory (its newest usable
checkpoint, a training run's or an imported model's) or a Hugging Face directory converted in memory;
the model state they come with (a DeepSeek-V3 router's selection bias); and the settings those
weights define (rotary embedding, norm epsilon, routing, the tokenizer), which the run takes from them."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from lumen_jax.checkpoint import weights
from lumen_jax.config import Config, ConfigError
from lumen_jax.config.files import pin_tokenizer
from lumen_jax.convert.hf_dir import read_hf, read_hf_config
from lumen_jax.runtime import logs as runlog


def _is_hf_dir(path: str) -> bool:
    return not weights.steps(path) and any(os.path.isfile(os.path.join(path, f))
                                   for f in ("model.safetensors", "model.safetensors.index.json"))


# What the weights of `train.init_from` define besides their shapes: a run starting from them takes these
# from them (rotary embedding, norm epsilon, windows, Gemma's numerics, routing), and its tokenizer when they name one.
DEFINED_BY_WEIGHTS = ("norm_eps", "rope_theta", "rope_scaling", "rope_scaling_factor", "rope_low_freq_factor",
                      "rope_high_freq_factor", "rope_original_max_len",
                      "rope_yarn_beta_fast", "rope_yarn_beta_slow", "rope_yarn_mscale", "rope_yarn_mscale_all_dim",
                      "sliding_window", "global_every",
                      "rope_local_theta", "query_scale_dim", "norm_scale", "mlp_activation", "embed_scale",
                      "moe.top_k", "moe.router", "moe.normalize_top_k", "moe.routed_scaling", "moe.groups",
                      "moe.top_groups")
# Their shapes: the config must give the same (one line naming the key otherwise).
SHAPED_BY_WEIGHTS = ("vocab_size", "tie_embeddings", "d_model", "num_layers", "num_heads", "num_kv_heads",
                     "resolved_head_dim", "ffn_dim", "qkv_bias", "qk_norm", "block_norms", "moe.num_experts",
                     "moe.every_n_layers", "moe.shared_experts", "moe.shared_gate", "expert_ffn_dim",
                     "moe.first_dense_layers", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "mtp_depth")


def _get(model: Any, key: str) -> Any:
    for part in key.split("."):
        model = getattr(model, part)
    return model


def _source(path: str) -> tuple[Config, str | None, str]:
    """(the config the weights at `path` were written with, their tokenizer or None when they name none,
    how to call them)."""
    if _is_hf_dir(path):
        cfg = read_hf_config(path)[0]
        return cfg, (cfg.data.tokenizer if cfg.data.tokenizer != "byte" else None), f"the Hugging Face model {path}"
    step, cfg = weights.newest_usable(path, None, lambda s: weights.read_config(path, s), "train.init_from")
    copied = os.path.join(path, "tokenizer", "tokenizer.json")  # an import's, wherever the folder now lies
    tokenizer = copied if os.path.isfile(copied) else None if weights.is_weights_only(path, step) else cfg.data.tokenizer
    return cfg, (os.path.abspath(tokenizer) if tokenizer not in (None, "byte") else tokenizer), f"{path} step {step}"


def defined_by_init_from(cfg: Config, run_dir: str) -> tuple[Config, list[str]]:
    """`cfg` with the settings that `train.init_from`'s weights define (DEFINED_BY_WEIGHTS and the
    tokenizer) taken from them, and the lines to print: what changed, or that the run resumes instead.

    A run directory that has checkpoints resumes from them: the settings come from its own newest
    checkpoint (they were taken from the weights when it started), so a resume keeps them. A shape
    key (SHAPED_BY_WEIGHTS) that differs from the weights' is a ConfigError naming it.
    """
    notes = []
    source = cfg.train.init_from
    if weights.steps(run_dir):
        have = [s for s in weights.steps(run_dir) if weights.has_readable_config(run_dir, s)]
        if not have:  # the restore reports the damaged checkpoints
            return cfg, notes
        notes.append(f"note: train.init_from={source} is not used: {run_dir} has checkpoints and the run resumes "
                     f"from them (with the model settings they record)")
        source = run_dir
    theirs, tokenizer, name = _source(source)
    for key in SHAPED_BY_WEIGHTS if source != run_dir else ():  # a resume: resume.py names a changed shape
        mine, other = _get(cfg.model, key), _get(theirs.model, key)
        if mine != other:
            key = key.replace("resolved_head_dim", "head_dim").replace("expert_ffn_dim", "moe.expert_ffn_dim")
            raise ConfigError(f"model.{key}={mine} differs from the weights of train.init_from={cfg.train.init_from} "
                              f"({name}: {other}); set model.{key}={other}")
    changed, model = [], cfg.model
    for key in DEFINED_BY_WEIGHTS:
        mine, other = _get(model, key), _get(theirs.model, key)
        if mine != other:
            changed.append(f"model.{key}={other} (the config had {mine})")
            if key.startswith("moe."):
                model = dataclasses.replace(model, moe=dataclasses.replace(model.moe, **{key[4:]: other}))
            else:
                model = dataclasses.replace(model, **{key: other})
    data = cfg.data
    if tokenizer is not None and tokenizer != data.tokenizer:
        changed.append(f"data.tokenizer={tokenizer} (the config had {data.tokenizer})")
        data = pin_tokenizer(dataclasses.replace(data, tokenizer=tokenizer, tokenizer_sha256=""))
    elif tokenizer is None and data.tokenizer == "byte":
        notes.append(f"warning: train.init_from={cfg.train.init_from} names no tokenizer (no tokenizer.json): training "
                     "with data.tokenizer=byte, which is not the model's unless it was trained on bytes; give "
                     "data.tokenizer=PATH of its tokenizer.json")
    if changed and source != run_dir:
        notes.append(f"note: {name} defines " + ", ".join(changed) + "; the run uses those")
    return cfg.replace(model=model, data=data), notes


def init_from(path: str, abstract_params: dict, abstract_state: dict | None = None) -> tuple[dict, dict | None]:
    """(the parameters, the model state) a new run starts from (`train.init_from`), in `abstract_params`'
    and `abstract_state`'s shardings.

    `path` is a run directory (its latest usable checkpoint: a training run or an imported model) or a
    Hugging Face directory, converted in memory. The shapes must be those of the run's model config;
    else a ConfigError naming the first parameter that differs. The model state (ops/state.py) is the
    one the weights come with (a trained run's, an imported DeepSeek-V3's router bias); None (the run
    keeps its fresh state) when they come with none, or with another layout than `abstract_state`
    (e.g. another `model.moe.balance`: a one-line note says so).
    """
    fix = "make the model section of the config match the weights'"
    want = _shapes(abstract_state or {})
    if _is_hf_dir(path):
        _, params, state = read_hf(path)
        weights.check_shapes(abstract_params, _shapes(params), f"train.init_from={path!r}", fix)
        put = lambda tree, target: jax.tree.map(  # noqa: E731
            lambda x, a: jax.device_put(x.astype(a.dtype), a.sharding), tree, target)
        got = _shapes(state)
        model_state = put(state, abstract_state) if want and got == want else None
        params = put(params, abstract_params)
    else:
        def load(step: int) -> tuple:
            p = weights.load_params(path, step, abstract_params, f"train.init_from={path!r} (step {step})", fix)
            shapes = weights.saved_shapes(path, step, "model_state") or {}
            state = weights.stored_model_state(path, step, abstract_state) if want and shapes == want else None
            return p, shapes, state

        params, got, model_state = weights.newest_usable(path, None, load, "train.init_from")[1]
    if got and model_state is None:
        print(f"note: the model state of train.init_from={path} ({', '.join(sorted(got))}) is not laid out as this "
              f"run's ({', '.join(sorted(want)) or 'none'}): the run starts with its own fresh model state",
              file=runlog.console(), flush=True)
    return params, model_state


def _shapes(tree: dict) -> dict[str, tuple[int, ...]]:
    return {weights.path_key(p): tuple(v.shape) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
