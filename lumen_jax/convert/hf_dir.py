"""A Hugging Face directory read into our config and parameters: `config.json` and
`model.safetensors` (or the shards its index names). Used by `convert from-hf` and by
`train.init_from` of a Hugging Face directory (checkpoint/weights.py); the name and shape
mapping is hf.py's (Llama, Qwen2, Qwen3, ...), hf_moe.py's (Mixtral, Qwen2-MoE, Qwen3-MoE) or
hf_deepseek.py's (DeepSeek-V3), chosen by
`model_type`.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator

import numpy as np

from lumen_jax.config import Config, DataConfig
from lumen_jax.config.files import pin_tokenizer
from lumen_jax.convert import hf, hf_deepseek, hf_moe
from lumen_jax.runtime.paths import escape

INDEX = "model.safetensors.index.json"
# config.json counts of things that each have their own tensors: none can exceed the tensors the files
# hold, which bounds what a crafted config can make us build (a table of names per layer and expert).
COUNTS = ("num_hidden_layers", "num_experts", "num_local_experts")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")


def member(hf_dir: str, name: Any, named_by: str | None = None) -> str:
    """`hf_dir/name`, refused (ConvertError) unless it is a regular file inside `hf_dir` or missing.

    A link may point into the Hugging Face cache's `blobs/` when `hf_dir` is one of its snapshots
    (`.../snapshots/<revision>`), as `huggingface_hub` writes them; any other link out is refused, so a
    crafted directory cannot have us read (and copy into a run, then an export) a file from elsewhere.
    """
    real = os.path.realpath(hf_dir)
    roots = [os.path.join(os.path.dirname(os.path.dirname(real)), "blobs")] if (
        os.path.basename(os.path.dirname(real)) == "snapshots") else []
    why = escape(hf_dir, name, roots)
    if why is not None:
        where = f"{os.path.join(hf_dir, named_by)} names {name!r}, which" if named_by else os.path.join(hf_dir, name)
        raise hf.ConvertError(f"{where} {why}; put the file itself in {hf_dir} and name it there")
    return os.path.join(hf_dir, name)


def tokenizer_files(hf_dir: str) -> list[str]:
    """The names of TOKENIZER_FILES that `hf_dir` holds, each checked (`member`; the JSON ones parse,
    tokenizer.json as a Hugging Face tokenizer) before anything is copied."""
    names = [n for n in TOKENIZER_FILES if os.path.lexists(os.path.join(hf_dir, n))]
    for n in names:
        path = member(hf_dir, n)
        if n == "tokenizer.json":
            import tokenizers  # only a model with a tokenizer needs it

            try:
                tokenizers.Tokenizer.from_file(path)
            except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
                raise hf.ConvertError(f"{path} is not a Hugging Face tokenizers JSON file ({str(e)[:120]}); "
                                      "put the model's own tokenizer.json there") from None
        elif n.endswith(".json") and not isinstance(_read_json(path), dict):
            raise hf.ConvertError(f"{path} is not a JSON object; put the model's own {n} there")
    return names


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise hf.ConvertError(f"{path}: cannot read ({e.strerror})") from None
    except ValueError as e:
        raise hf.ConvertError(f"{path}: not valid JSON ({e})") from None


def _tensor_files(hf_dir: str) -> dict[str, str]:
    """{tensor name: safetensors file} from the index or the single model.safetensors."""
    index = member(hf_dir, INDEX)
    if os.path.lexists(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise hf.ConvertError(f"{index} has no weight_map; the index is damaged")
        return {name: member(hf_dir, f, INDEX) for name, f in weight_map.items()}
    single = member(hf_dir, "model.safetensors")
    if not os.path.isfile(single):
        raise hf.ConvertError(f"--hf-dir={hf_dir!r} has neither model.safetensors nor {INDEX}; "
                              "from-hf reads safetensors checkpoints (save with safe_serialization=True)")
    with _opened(single) as f:
        return {name: single for name in f.keys()}


@contextlib.contextmanager
def _opened(path: str) -> Iterator[Any]:
    """`safe_open(path)`; a truncated or damaged file is a ConvertError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise hf.ConvertError(f"{path} is not a readable safetensors file ({' '.join(str(e).split())[:160]}); "
                              "it may be truncated: download or save it again") from None


def _bound_counts(config: dict, tensors: int, path: str) -> None:
    """ConvertError for a COUNTS field of `config` below 1 or above `tensors`, the number of tensors the
    safetensors files hold (each layer and each expert has its own), before anything is built from it."""
    for field in COUNTS:
        value = config.get(field)
        if isinstance(value, int) and not 1 <= value <= tensors:
            raise hf.ConvertError(f"{path}: {field}={value} is not between 1 and {tensors}, the number of "
                                  "tensors the safetensors files hold (each has its own), so it does "
                                  "not describe these weights; fix it or download the model again")


def read_hf_config(hf_dir: str) -> tuple[Config, dict[str, str], dict]:
    """(the run config, {tensor name: safetensors file}, the raw config.json) of the HF directory
    `hf_dir`; no tensor is read. `data.tokenizer` is its tokenizer.json when it has one."""
    if not os.path.isdir(hf_dir):
        raise hf.ConvertError(f"--hf-dir={hf_dir!r} is not a directory; give a Hugging Face model directory")
    config_path = member(hf_dir, "config.json")
    config = _read_json(config_path)
    files = _tensor_files(hf_dir)
    for path in sorted(set(files.values())):
        if not os.path.isfile(path):
            raise hf.ConvertError(f"{os.path.join(hf_dir, INDEX)} names {os.path.basename(path)}, which is missing")
    _bound_counts(config, len(files), config_path)
    dtype = config.get("dtype") or config.get("torch_dtype")
    if dtype is None:  # older configs: the first tensor's
        with _opened(next(iter(files.values()))) as f:
            stored = str(f.get_slice(next(iter(f.keys()))).get_dtype())
        dtype = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(stored, stored)
    if dtype not in hf.DTYPES:
        raise hf.ConvertError(f"config.json dtype={dtype!r} is not supported; use float32, bfloat16 or float16")
    kind = config.get("model_type", "llama")
    if kind == "deepseek_v3":
        m = hf_deepseek.model_config(config, hf.DTYPES[dtype], frozenset(files))
    elif kind in hf_moe.FAMILIES:
        m = hf_moe.model_config(config, hf.DTYPES[dtype])
    elif kind in hf.FAMILIES:
        m = hf.model_config(config, hf.DTYPES[dtype])
    else:
        known = ", ".join([*(f.architecture for f in (*hf.FAMILIES.values(), *hf_moe.FAMILIES.values())),
                           hf_deepseek.ARCHITECTURE])
        raise hf.ConvertError(f"config.json: model_type={kind!r} architectures={config.get('architectures')} is "
                              f"not supported; from-hf reads {known}")
    tokenizer = os.path.join(hf_dir, "tokenizer.json")
    data = pin_tokenizer(DataConfig(tokenizer=tokenizer)) if "tokenizer.json" in tokenizer_files(hf_dir) else (
        DataConfig())
    name = os.path.basename(os.path.normpath(hf_dir)) or "imported"
    return Config(model=m, data=data, name=name), files, config


def read_hf(hf_dir: str) -> tuple[Config, dict, dict]:
    """(the run config, our float32 parameter tree, the model state its weights come with: a DeepSeek-V3
    router's selection bias, else {}) of the HF directory `hf_dir`."""
    cfg, files, raw = read_hf_config(hf_dir)
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}

        def get(name: str) -> np.ndarray:
            from safetensors import SafetensorError

            path = files[name]
            if path not in handles:
                handles[path] = stack.enter_context(_opened(path))
            try:
                return handles[path].get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise hf.ConvertError(f"{path}: cannot read tensor {name} ({e}); it may be truncated: "
                                      "download or save it again") from None

        kind = raw.get("model_type")
        if kind == "deepseek_v3":
            return cfg, *hf_deepseek.params_from_hf(get, set(files), cfg.model, raw)
        if kind not in hf_moe.FAMILIES:
            return cfg, hf.params_from_hf(get, set(files), cfg.model), {}
        m = cfg.model
        read = hf.checked_reader(get, set(files), hf_moe.expected_tensors(m, kind), m.tie_embeddings,
                                 f"a {hf_moe.FAMILIES[kind].architecture}")
        return cfg, hf_moe.params_from_hf(read, m, kind), {}
