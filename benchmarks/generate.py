"""Generation speed with the KV cache: prefill and decode tokens/s, batch 1 and 8, on one device.

    .venv/bin/python benchmarks/generate.py [--models tiny,100m] [--batches 1,8] [--prompt-len 128] [--new 32]

Random fp32 weights (the speed does not depend on them); `tiny` is configs/tiny.yaml's model, `100m`
a 12-layer d_model=768 Llama (GQA 12/4 heads, 32k vocabulary, tied: 0.10B parameters). Prefill is
timed as generate(max_new_tokens=1) (prefill plus reading one token); decode as the rest of
generate(1 + new) over `new` tokens. Every shape runs once to compile first, then best of `--repeats`.
Results and the command go in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lumen_jax.runtime.process import prepare_cpu_backend  # noqa: E402

prepare_cpu_backend()
import jax  # noqa: E402
import numpy as np  # noqa: E402

from lumen_jax.checkpoint import weights  # noqa: E402
from lumen_jax.config import Config, ModelConfig  # noqa: E402
from lumen_jax.config.files import load_config  # noqa: E402
from lumen_jax.metrics.flops import param_counts  # noqa: E402
from lumen_jax.generate import ONE_DEVICE, Generator, Sampling  # noqa: E402
from lumen_jax.model import abstract_model, init_params  # noqa: E402
from lumen_jax.parallel.mesh import make_mesh  # noqa: E402
from lumen_jax.parallel.rules import Rules  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {
    "tiny": lambda: load_config(os.path.join(REPO, "configs", "tiny.yaml")).model,
    "100m": lambda: ModelConfig(d_model=768, num_layers=12, num_heads=12, num_kv_heads=4, ffn_dim=2048,
                                vocab_size=32000, tie_embeddings=True, compute_dtype="float32"),
}


def loaded_for(m: ModelConfig) -> weights.Loaded:
    mesh = make_mesh(ONE_DEVICE, jax.devices()[:1])
    params = jax.device_put(init_params(m, 0), jax.devices()[0])
    return weights.Loaded(cfg=Config(model=m), step=0, mesh=mesh, rules=Rules(), model=abstract_model(m),
                          params=params)


def best(fn, repeats: int) -> float:
    fn()  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,100m")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(f"{jax.devices()[0].platform} x1, prompt {args.prompt_len} tokens, {args.new} new tokens, greedy, fp32")
    print(f"{'model':>6} {'params':>8} {'batch':>5} {'prefill tok/s':>14} {'decode tok/s':>13} {'ms/token':>9}")
    rng = np.random.default_rng(0)
    for name in args.models.split(","):
        m = MODELS[name]()
        gen = Generator(loaded_for(m), Sampling())
        for b in map(int, args.batches.split(",")):
            prompts = rng.integers(0, m.vocab_size, (b, args.prompt_len)).tolist()
            prefill = best(lambda: gen.generate(prompts, 1), args.repeats)
            total = best(lambda: gen.generate(prompts, 1 + args.new), args.repeats)
            decode = max(total - prefill, 1e-9)
            print(f"{name:>6} {param_counts(m)['total'] / 1e6:7.1f}M {b:>5} {b * args.prompt_len / prefill:14.0f} "
                  f"{b * args.new / decode:13.1f} {1e3 * decode / args.new:9.2f}", flush=True)


if __name__ == "__main__":
    main()
