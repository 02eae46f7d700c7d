"""`python -m lumen_jax.evaluate`: mean loss and perplexity of a run's model over a data source.

    python -m lumen_jax.evaluate --run-dir RUN_DIR [--step N] [--data eval|train|GLOB,...] [--batches 50] \\
        [mesh.* and data.* overrides]

`--data eval` (the default) reads the run's held-out documents (data.eval_paths, else the
data.eval_share held out of its training source; a run with neither is an error that names the
other choices); `train` the training stream itself, from its first batch, in the order training
read it; a comma-separated list of globs, those files. The loss is the token-weighted mean
cross-entropy over `--batches` batches of data.global_batch_size x data.seq_len (the quantity
`train_step` logs as `loss`), perplexity its exp. The same `Evaluator` runs inside training every
`train.eval_every` steps (eval_loss, eval_ppl in metrics.jsonl and TensorBoard).

The mesh is not the training mesh: FSDP over every device at hand (`mesh.fsdp=-1`, the other axes 1;
`mesh.*` overrides change it, `runtime.cpu_devices=N` gives a CPU machine N devices), without
micro-batches. The checkpoint is verified as it is read (checkpoint/weights.py), and the compiled
loss's memory is checked against the devices' before it runs (one line when it does not fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
from typing import Any, Iterator, Sequence

from lumen_jax.config import ConfigError, DataConfig, MeshConfig, TrainConfig


class Evaluator:
    """The jitted loss of a Trainer's model, summed over batches of the Trainer's batch shape."""

    def __init__(self, trainer: Any):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        from lumen_jax.train import step as step_lib
        from lumen_jax.data import BATCH_KEYS
        from lumen_jax.parallel.rules import activate

        self.trainer = trainer

        def loss(params: dict, model_state: dict, batch: dict):
            with activate(trainer.mesh, trainer.rules):
                return step_lib.eval_loss(params, model_state, batch, trainer.step_cfg)

        sh = trainer.state_shardings
        batch_sh = {k: trainer.batch_sharding for k in BATCH_KEYS}
        replicated = NamedSharding(trainer.mesh, P())
        self._loss = jax.jit(loss, in_shardings=(sh.params, sh.model_state, batch_sh),
                             out_shardings=(replicated, replicated))

    def check_memory(self, params: dict, model_state: dict, batch: dict, fix: str) -> None:
        """Compiles the loss for `batch`'s shapes; ConfigError when it needs more memory than a device has."""
        from lumen_jax.runtime.process import check_fits

        t = self.trainer
        compiled = self._loss.lower(params, model_state, t.shard_batch(batch)).compile()
        rows, length = batch["inputs"].shape
        check_fits(compiled, list(t.mesh.devices.flat), f"evaluating a batch of {rows} x {length} tokens", fix)
        self._loss = compiled

    def __call__(self, params: dict, model_state: dict, batches: Iterator[dict], num_batches: int,
                 progress: bool = False) -> dict[str, float]:
        """{eval_loss, eval_ppl, eval_tokens} over `num_batches` local batches from `batches`."""
        from tqdm import tqdm

        ce, tokens = 0.0, 0.0
        for _ in tqdm(range(num_batches), desc="evaluate", disable=None if progress else True, leave=False):
            c, t = self._loss(params, model_state, self.trainer.shard_batch(next(batches)))
            ce, tokens = ce + float(c), tokens + float(t)
        loss = ce / max(tokens, 1.0)
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": tokens}


def eval_data(data: DataConfig, seed: int, which: str, process_index: int = 0, process_count: int = 1):
    """A TrainData over the documents `which` names (eval | train | comma-separated globs); `eval` of a
    run that holds nothing out is a ConfigError. `seed`: the run's `train.seed`."""
    from lumen_jax.data import TrainData

    data_cfg, split = data, "eval"
    if which == "train":
        split = "train"
    elif which != "eval":
        data_cfg = dataclasses.replace(data, eval_paths=tuple(p for p in which.split(",") if p))
    elif not data.eval_paths and not data.eval_share:
        raise ConfigError("the run holds no documents out (data.eval_paths, data.eval_share are unset); evaluate on "
                          "its training data with --data train, or on files with --data GLOB[,GLOB]")
    loader = TrainData(data_cfg, seed=seed, process_index=process_index, process_count=process_count, split=split)
    return loader


def during_training(data: DataConfig, train: TrainConfig, trainer: Any, process_index: int, process_count: int):
    """`evaluate(state) -> {eval_loss, eval_ppl, eval_tokens}` for the loop (`train.eval_every`), over the
    same first `train.eval_batches` held-out batches every time; None when `train.eval_every` is 0."""
    if not train.eval_every:
        return None
    evaluator = Evaluator(trainer)

    def evaluate(state: Any) -> dict[str, float]:
        held_out = eval_data(data, train.seed, "eval", process_index, process_count)
        try:
            return evaluator(state.params, state.model_state, held_out, train.eval_batches)
        finally:
            held_out.close()

    return evaluate


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lumen_jax.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--data", default="eval", help="eval (held-out, default) | train | comma-separated globs")
    p.add_argument("--batches", type=int, default=None, help="default: the run's train.eval_batches")
    p.add_argument("overrides", nargs="*", help="mesh.* / data.* overrides, e.g. mesh.tensor=2 data.seq_len=256 "
                                                "(on CPU: runtime.cpu_devices=N)")
    args = p.parse_args(argv)
    from lumen_jax.data import DataError
    try:
        from lumen_jax.runtime.process import apply_cpu_devices

        result = evaluate(args.run_dir, args.step, args.data, args.batches, apply_cpu_devices(args.overrides))
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"step {result['step']}: eval_loss {result['eval_loss']:.6f} eval_ppl {result['eval_ppl']:.4f} "
          f"over {int(result['eval_tokens'])} tokens")
    return 0


EVAL_MESH = {**{a: 1 for a in MeshConfig.AXES}, "fsdp": -1}  # every device at hand, whatever the training mesh


def evaluate(run_dir: str, step: int | None, which: str, batches: int | None,
             overrides: Sequence[str] = ()) -> dict[str, Any]:
    """{step, eval_loss, eval_ppl, eval_tokens} of `run_dir`'s checkpoint `step` (None: the newest usable)."""
    import jax
    import numpy as np

    from lumen_jax.checkpoint import weights
    from lumen_jax.train.build import build
    from lumen_jax.config import from_dict, to_dict
    from lumen_jax.config.checks import validate
    from lumen_jax.config.files import apply_overrides
    from lumen_jax.parallel.mesh import make_mesh

    bad = [o for o in overrides if not o.strip().startswith(("mesh.", "data."))]
    if bad:
        raise ConfigError(f"override {bad[0]!r}: only mesh.*, data.* and runtime.cpu_devices overrides apply "
                          "to evaluate")
    if batches is not None and batches < 1:
        raise ConfigError(f"--batches={batches} must be >= 1")

    def load(s: int) -> tuple:
        raw = to_dict(weights.read_config(run_dir, s))
        raw["mesh"] = {**raw["mesh"], **EVAL_MESH}
        raw["train"].update(micro_batches=1, init_from="")  # the weights are the checkpoint's
        cfg = from_dict(apply_overrides(raw, overrides))
        sizes = [getattr(cfg.mesh, a) for a in cfg.mesh.AXES]
        n = jax.device_count() if -1 in sizes else int(np.prod(sizes))
        trainer = build(cfg, make_mesh(validate(cfg, n), jax.devices()[:n]))
        stored = trainer.stored.target(trainer.abstract_state())  # uneven stages: the real layers on disk
        return (cfg, trainer, *trainer.stored.load_model(weights.load_params(run_dir, s, stored.params),
                                                         weights.load_model_state(run_dir, s, stored.model_state)))

    step, (cfg, trainer, params, model_state) = weights.newest_usable(run_dir, step, load)
    batches = cfg.train.eval_batches if batches is None else batches
    data = eval_data(cfg.data, cfg.train.seed, which)
    first = next(data)
    evaluator = Evaluator(trainer)
    evaluator.check_memory(params, model_state, first,
                           "lower data.seq_len or data.global_batch_size, or spread it over more devices "
                           "(mesh.fsdp, mesh.context; on CPU runtime.cpu_devices=N)")
    result = evaluator(params, model_state, itertools.chain([first], data), batches, progress=True)
    return {"step": step, **result}
