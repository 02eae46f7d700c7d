"""`python -m lumen_jax.generate`: text from a run directory's model, with a KV cache.

    python -m lumen_jax.generate --run-dir RUN_DIR --prompt "def main(" --max-new-tokens 64 \\
        [--temperature 0.8 --top-k 50 --top-p 0.9 --seed 0] [--dtype float32] [--step N] [mesh.tensor=2 ...]
    python -m lumen_jax.generate --run-dir RUN_DIR --prompt-ids 5,17,300 --max-new-tokens 8 --temperature 0
    python -m lumen_jax.generate --run-dir RUN_DIR --prompts prompts.txt   # one prompt a line, one batch

One jitted prefill fills the cache (model/decode.py), then one jitted decode step per token; the
host reads token i while step i+1 runs, and streams the text of a single prompt as it comes.
`--temperature 0` is greedy; otherwise temperature, then top-k, then top-p (nucleus) filter the
logits and a token is drawn with a key derived from `--seed` and the step. The mesh defaults to one
device; `mesh.tensor=N` splits heads, the vocabulary and the cache over N devices, `mesh.data=N`
the prompts (on a CPU machine add `runtime.cpu_devices=N` for N emulated devices). With
`--prompt-ids` the last line of stdout is the generated ids, space-separated, streamed as they come.
Text prompts start with the tokenizer's BOS (as every training document) and stop at its EOS.

A prompt and its new tokens fit the model's context: an imported model's `max_position_embeddings`,
else the `data.seq_len` the run trained at. `--max-new-tokens` beyond it is capped, with a note: past
it come positions the model never saw. A progress bar on a terminal's stderr counts the tokens
(when the text is not already streaming to that terminal). The checkpoint is verified as it is read
(checkpoint/weights.py): a damaged newest step is named and the previous one used; a damaged `--step`
is one line, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Callable, Sequence

import numpy as np

from lumen_jax.config import COMPUTE_DTYPES, ConfigError

from lumen_jax.config.schema import MeshConfig

ONE_DEVICE = {a: 1 for a in MeshConfig.AXES}  # whatever mesh the run trained on


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off


def sample(logits_bv, key, s: Sampling):
    """Next tokens [B] int32 from float32 logits [B, V]."""
    import jax
    import jax.numpy as jnp

    if s.temperature == 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logits = logits_bv / s.temperature
    if s.top_k:
        kth = jax.lax.top_k(logits, min(s.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.top_p < 1.0:
        desc = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(desc, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above each one
        cutoff = jnp.min(jnp.where(before < s.top_p, desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class Generator:
    """A loaded model (weights.Loaded) with its jitted prefill and decode step on the loaded mesh."""

    def __init__(self, loaded, sampling: Sampling):
        import jax
        from jax.sharding import NamedSharding

        from lumen_jax.model import decode as decode_lib
        from lumen_jax.parallel.rules import activate

        self.loaded, self.sampling = loaded, sampling
        mesh, rules, graphdef = loaded.mesh, loaded.rules, loaded.model.graphdef
        sh = lambda *names: NamedSharding(mesh, rules.spec(names))  # noqa: E731
        self.row_sh, self.rows_sh, self.scalar_sh = sh("batch"), sh("batch", None), sh()
        # MLA's latent cache has no heads axis (model/decode.py: the absorbed form)
        cache_sh = sh(None, *(decode_lib.LATENT_AXES if loaded.cfg.model.mla else decode_lib.CACHE_AXES))
        self.cache_sh = {"k": cache_sh, "v": cache_sh}
        # The parameters and the model state that is not a parameter (an MoE router's balancing bias).
        weights_sh = jax.tree.map(lambda x: x.sharding, (loaded.params, loaded.model_state))

        def model_of(weights):
            from flax import nnx
            return nnx.merge(graphdef, *weights)

        def prefill(weights, tokens_bt, valid_bt, seed, length):
            with activate(mesh, rules):
                model = model_of(weights)
                cache = decode_lib.init_cache(model, tokens_bt.shape[0], length)
                logits, cache = decode_lib.prefill(model, tokens_bt, valid_bt, cache)
            return sample(logits, jax.random.fold_in(jax.random.key(seed), 0), sampling), logits, cache

        def step(weights, tokens_b, positions_b, slot, valid_bs, seed, cache):
            with activate(mesh, rules):
                logits, cache = decode_lib.decode(model_of(weights), tokens_b, positions_b, slot, valid_bs, cache)
            return sample(logits, jax.random.fold_in(jax.random.key(seed), slot + 1), sampling), logits, cache

        self._prefill = jax.jit(prefill, static_argnums=4,
                                in_shardings=(weights_sh, self.rows_sh, self.rows_sh, self.scalar_sh),
                                out_shardings=(self.row_sh, self.rows_sh, self.cache_sh))
        self._step = jax.jit(step, in_shardings=(weights_sh, self.row_sh, self.row_sh, self.scalar_sh,
                                                 self.rows_sh, self.scalar_sh, self.cache_sh),
                             out_shardings=(self.row_sh, self.rows_sh, self.cache_sh), donate_argnums=6)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, seed: int = 0,
                 on_token: Callable[[int, np.ndarray], None] | None = None,
                 stop_id: int | None = None, return_logits: bool = False):
        """The new tokens of every prompt (rows stop after `stop_id`, which is kept).

        Args:
          prompts: token ids, one list per prompt (any lengths >= 1; left-padded into one batch).
          max_new_tokens: tokens to generate per prompt.
          seed: the sampling key's seed (step i draws with fold_in(key(seed), i)); unused when greedy.
          on_token: called with (i, tokens [B]) as token i of every row arrives.
          stop_id: a row that produced it is finished (its later tokens are dropped); None: never.
          return_logits: also return the float32 logits each token was chosen from, [B, new, V]
            (read back every step: for tests).
        """
        import jax

        rows = len(prompts)
        split = self.row_sh.spec[0] or ()  # the mesh axes the rows are split over (data, fsdp, expert)
        shards = math.prod(self.loaded.mesh.shape[a] for a in ((split,) if isinstance(split, str) else split))
        prompts = [*prompts, *[prompts[-1]] * (-rows % shards)]  # filler rows, dropped at the end
        b, t = len(prompts), max(len(p) for p in prompts)
        tokens = np.zeros((b, t), np.int32)
        valid = np.zeros((b, t + max_new_tokens), bool)
        for i, p in enumerate(prompts):
            tokens[i, t - len(p):] = p
            valid[i, t - len(p):] = True
        valid[:, t:] = True
        lengths = np.array([len(p) for p in prompts], np.int32)
        put = lambda x, sh: jax.device_put(x, sh)  # noqa: E731
        seed_dev = put(np.uint32(seed), self.scalar_sh)
        nxt, logits, cache = self._prefill((self.loaded.params, self.loaded.model_state), put(tokens, self.rows_sh),
                                      put(valid[:, :t], self.rows_sh), seed_dev, t + max_new_tokens)
        valid_dev = put(valid, self.rows_sh)
        out = np.zeros((b, max_new_tokens), np.int32)
        done = np.zeros(b, bool)
        all_logits = []
        for i in range(max_new_tokens):
            current = nxt
            if return_logits:
                all_logits.append(np.asarray(jax.device_get(logits))[:rows])
            if i + 1 < max_new_tokens:  # dispatched before reading `current`: the device keeps working
                nxt, logits, cache = self._step((self.loaded.params, self.loaded.model_state), current, put(lengths + i, self.row_sh),
                                           put(np.int32(t + i), self.scalar_sh), valid_dev, seed_dev, cache)
            out[:, i] = np.asarray(jax.device_get(current))
            if on_token is not None:
                on_token(i, out[:, i])
            if stop_id is not None:
                done |= out[:, i] == stop_id
                if done.all():
                    out = out[:, :i + 1]
                    break
        new = [list(map(int, r)) for r in out[:rows]]
        if stop_id is not None:
            new = [r[:r.index(stop_id) + 1] if stop_id in r else r for r in new]
        return (new, np.stack(all_logits, axis=1)) if return_logits else new


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lumen_jax.generate", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    src.add_argument("--prompts", help="a file of text prompts, one a line, generated as one batch")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=COMPUTE_DTYPES, default=None, help="compute dtype (default: the run's)")
    p.add_argument("overrides", nargs="*",
                   help="mesh overrides, e.g. mesh.tensor=2 (on CPU with runtime.cpu_devices=2)")
    return p.parse_args(argv)


def _check(args: argparse.Namespace) -> Sampling:
    for name, ok, rule in (("--max-new-tokens", args.max_new_tokens >= 1, ">= 1"),
                           ("--temperature", args.temperature >= 0, ">= 0"), ("--top-k", args.top_k >= 0, ">= 0"),
                           ("--top-p", 0 < args.top_p <= 1, "in (0, 1]")):
        if not ok:
            raise ConfigError(f"{name}={getattr(args, name[2:].replace('-', '_'))} must be {rule}")
    return Sampling(args.temperature, args.top_k, args.top_p)


def _prompts(args: argparse.Namespace, tokenizer, vocab: int) -> tuple[list[str] | None, list[list[int]]]:
    """(the text prompts, or None for --prompt-ids; the token ids of every prompt)."""
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--prompt-ids={args.prompt_ids!r} must be comma-separated integers") from None
        if not ids or not all(0 <= i < vocab for i in ids):
            raise ConfigError(f"--prompt-ids={args.prompt_ids!r}: give at least one id, each in [0, {vocab})")
        return None, [ids]
    texts = [args.prompt]
    if args.prompts is not None:
        try:
            with open(args.prompts, encoding="utf-8") as f:
                texts = [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompts={args.prompts!r}: cannot read ({e})") from None
        if not texts:
            raise ConfigError(f"--prompts={args.prompts!r} has no non-empty line")
    return texts, [[tokenizer.bos_id, *tokenizer.encode(t)] for t in texts]


class _Stream:
    """Prints the text of one row as its tokens arrive (decoding the whole row: multi-token characters)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def __call__(self, i: int, tokens_b: np.ndarray) -> None:
        self.ids.append(int(tokens_b[0]))
        text = self.tokenizer.decode(self.ids)
        print(text[len(self.shown):], end="", flush=True)
        self.shown = text


class _Ids:
    """Prints the ids of one row as they arrive (the line they make is the last line of stdout)."""

    def __call__(self, i: int, tokens_b: np.ndarray) -> None:
        print(("" if i == 0 else " ") + str(int(tokens_b[0])), end="", flush=True)


def _cap(max_new_tokens: int, prompts: list[list[int]], context: int, what: str) -> int:
    """`max_new_tokens`, capped so that the longest prompt and its new tokens fit the `context`."""
    longest = max(len(p) for p in prompts)
    room = context - longest
    if room < 1:
        raise ConfigError(f"the prompt has {longest} tokens and fills the model's context of {context} ({what}); "
                          "shorten the prompt")
    if max_new_tokens > room:
        print(f"note: --max-new-tokens={max_new_tokens} capped at {room}: the model's context is {context} tokens "
              f"({what}) and the prompt takes {longest}; beyond it come positions the model never saw",
              file=sys.stderr, flush=True)
    return min(max_new_tokens, room)


def _progress(total: int, streaming: bool):
    """A tqdm bar of the new tokens on stderr when it is a terminal and the text is not streaming there."""
    from tqdm import tqdm

    shown = sys.stderr.isatty() and not (streaming and sys.stdout.isatty())
    return tqdm(total=total, desc="generate", unit="tok", leave=False, disable=not shown, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from lumen_jax.data import DataError
    try:
        sampling = _check(args)
        from lumen_jax.checkpoint import weights
        from lumen_jax.data import build_tokenizer
        from lumen_jax.model import abstract_model

        from lumen_jax.runtime.process import apply_cpu_devices

        loaded = weights.load_onto_mesh(args.run_dir, args.step, apply_cpu_devices(args.overrides),
                                        base_mesh=ONE_DEVICE)
        if args.dtype:
            model_cfg = dataclasses.replace(loaded.cfg.model, compute_dtype=args.dtype)
            loaded = dataclasses.replace(loaded, cfg=loaded.cfg.replace(model=model_cfg),
                                         model=abstract_model(model_cfg))
        tokenizer = build_tokenizer(loaded.cfg.data.tokenizer, loaded.cfg.data.tokenizer_sha256)
        if args.prompt_ids is None and tokenizer.vocab_size > loaded.cfg.model.vocab_size:
            raise ConfigError(f"the run's tokenizer ({loaded.cfg.data.tokenizer!r}, {tokenizer.vocab_size} ids) is "
                              f"larger than model.vocab_size={loaded.cfg.model.vocab_size}; use --prompt-ids")
        texts, prompts = _prompts(args, tokenizer, loaded.cfg.model.vocab_size)
        new_tokens = _cap(args.max_new_tokens, prompts, *weights.context_length(args.run_dir, loaded.step, loaded.cfg))
        stream = _Ids() if texts is None else _Stream(tokenizer) if len(texts) == 1 else None
        generator = Generator(loaded, sampling)
        if isinstance(stream, _Stream):
            print(texts[0], end="", flush=True)
        with _progress(new_tokens, stream is not None) as bar:
            def on_token(i: int, tokens_b: np.ndarray) -> None:
                if stream is not None:
                    stream(i, tokens_b)
                bar.update(1)

            rows = generator.generate(prompts, new_tokens, args.seed, on_token=on_token,
                                      stop_id=None if texts is None else tokenizer.eos_id)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    if stream is not None:
        print()
    else:
        for text, row in zip(texts, rows):
            print(text + tokenizer.decode(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
