"""`python -m lumen_jax.convert from-hf|to-hf`: Hugging Face directories <-> run directories.

    python -m lumen_jax.convert from-hf --hf-dir PATH --out RUN_DIR
    python -m lumen_jax.convert to-hf --run-dir RUN_DIR [--step N] --out PATH [--max-shard-gb 5]

from-hf reads `config.json` and `model.safetensors` (or the shards named by
`model.safetensors.index.json`) with the `safetensors` package, writes the weights as step 0 of a
run directory (weights.py; any mesh restores it), with the model state they come with (DeepSeek-V3's
router bias), and copies the tokenizer files to
`RUN_DIR/tokenizer/`, which becomes `data.tokenizer`. It reads LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM (hf.py), MixtralForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM (hf_moe.py),
DeepseekV3ForCausalLM (hf_deepseek.py); to-hf
writes what their `from_pretrained` loads (a model as the family that expresses it, hf.family_of and
hf_moe.family_of). Bad input: one line, exit 2, nothing written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from typing import Sequence

import numpy as np

from lumen_jax.config import ConfigError
from lumen_jax.convert import hf, hf_deepseek, hf_moe
from lumen_jax.convert.hf_dir import INDEX, read_hf, read_hf_config, tokenizer_files

def from_hf(hf_dir: str, out: str) -> str:
    if os.path.exists(out) and os.listdir(out):
        raise hf.ConvertError(f"--out={out!r} exists and is not empty; choose a new run directory")
    cfg, params, model_state = read_hf(hf_dir)
    _, _, raw = read_hf_config(hf_dir)
    from lumen_jax.checkpoint import weights
    copied = _copy_tokenizer(hf_dir, os.path.join(out, "tokenizer"))
    if "tokenizer.json" in copied:
        cfg = cfg.replace(data=dataclasses.replace(cfg.data, tokenizer=os.path.abspath(
            os.path.join(out, "tokenizer", "tokenizer.json"))))
    else:
        print(f"warning: {hf_dir} has no tokenizer.json: the imported run uses data.tokenizer=byte, which is not "
              "this model's tokenizer unless it was trained on bytes; add the model's tokenizer.json there and "
              "import again", file=sys.stderr, flush=True)
    extra = {"imported_from": os.path.abspath(hf_dir)}
    if isinstance(raw.get("max_position_embeddings"), int):
        extra["max_position_embeddings"] = raw["max_position_embeddings"]  # generate's context
    return weights.save_weights(out, cfg, params, extra=extra, model_state=model_state)


def _copy_tokenizer(src: str, dst: str) -> list[str]:
    names = tokenizer_files(src)  # each a checked regular file inside `src`
    if names:
        os.makedirs(dst, exist_ok=True)
    for n in names:
        shutil.copyfile(os.path.join(src, n), os.path.join(dst, n))
    return names


def to_hf(run_dir: str, step: int | None, out: str, max_shard_bytes: float) -> str:
    import jax
    from safetensors.numpy import save_file

    from lumen_jax.checkpoint import weights
    from lumen_jax.model import abstract_model

    if not max_shard_bytes > 0:  # NaN too
        raise hf.ConvertError(f"--max-shard-gb={max_shard_bytes / 2**30:g} must be > 0 (the most a safetensors "
                              "file holds, e.g. 5)")
    if os.path.exists(out) and os.listdir(out):
        raise hf.ConvertError(f"--out={out!r} exists and is not empty; choose a new directory")
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])

    def load(s: int) -> tuple:
        cfg = weights.read_config(run_dir, s)
        if cfg.model.mla:  # one line before any read when none fits
            hf_deepseek.check_exportable(cfg.model)
        else:
            (hf_moe if cfg.model.moe.enabled else hf).family_of(cfg.model)
        a = abstract_model(cfg.model)
        on_cpu = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu), tree)
        state = weights.load_model_state(run_dir, s, on_cpu(a.state)) if cfg.model.mla else {}
        return cfg, weights.to_numpy(weights.load_params(run_dir, s, on_cpu(a.params))), state

    step, (cfg, params, state) = weights.newest_usable(run_dir, step, load)
    dtype = cfg.model.compute_dtype
    if cfg.model.mla:  # the routers' selection bias is model state (balance=bias), zeros otherwise
        rate = cfg.model.moe.bias_update_rate
        biases = [hf_deepseek.choice_bias(np.asarray(b["bias"]), np.asarray(b["load"]), rate) for b in (
            _at(state, "moe_blocks", "mlp", "balance"), _at(state, "mtp", "block", "mlp", "balance")) if b is not None]
        tensors = hf_deepseek.hf_from_params(params, cfg.model, jax.numpy.dtype(dtype),
                                             np.concatenate(biases) if biases else None)
        config = hf_deepseek.hf_config(cfg.model, dtype)
    else:
        layout = hf_moe if cfg.model.moe.enabled else hf
        tensors = layout.hf_from_params(params, cfg.model, jax.numpy.dtype(dtype))
        config = layout.hf_config(cfg.model, dtype)
    # An imported model's own context goes back out as it came in; a trained one's: at least its data.seq_len.
    config["max_position_embeddings"] = (weights.imported_context(run_dir, step)
                                         or max(config["max_position_embeddings"], cfg.data.seq_len))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, t in tensors.items():  # greedy shards of at most max_shard_bytes (a bigger tensor alone)
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out, fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in shard})
        with open(os.path.join(out, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                       "weight_map": weight_map}, f, indent=2)
    if not _copy_tokenizer(os.path.join(run_dir, "tokenizer"), out) and os.path.isfile(cfg.data.tokenizer):
        shutil.copyfile(cfg.data.tokenizer, os.path.join(out, "tokenizer.json"))
    _one_mode(out)
    return out


def _at(tree: dict, *keys: str) -> object:
    """tree[k1][k2]..., or None where a key is missing."""
    for k in keys:
        if not isinstance(tree, dict) or k not in tree:
            return None
        tree = tree[k]
    return tree


def _one_mode(folder: str) -> None:
    """Every file of an export gets the mode a new file gets here (0666 less the umask): safetensors
    writes through a private temporary file (0600) where json.dump's config.json is 0644."""
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and not os.path.islink(path):
            os.chmod(path, 0o666 & ~umask)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lumen_jax.convert", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("from-hf", help="a Hugging Face directory (Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE, "
                       "Qwen3-MoE) -> a run directory")
    a.add_argument("--hf-dir", required=True)
    a.add_argument("--out", required=True, help="the new run directory")
    b = sub.add_parser("to-hf", help="a run directory's checkpoint -> a Hugging Face directory")
    b.add_argument("--run-dir", required=True)
    b.add_argument("--step", type=int, default=None, help="default: the latest")
    b.add_argument("--out", required=True)
    b.add_argument("--max-shard-gb", type=float, default=5.0, help="above this, safetensors shards + index")
    args = p.parse_args(argv)
    try:
        if args.command == "from-hf":
            where = from_hf(args.hf_dir, args.out)
        else:
            where = to_hf(args.run_dir, args.step, args.out, args.max_shard_gb * 2**30)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"wrote {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
