"""The optax chain: global-norm clipping, AdamW (decoupled decay on matrices, not on parameters
with the logical axis `norm`), warmup + decay."""

from __future__ import annotations

import jax
import optax

from lumen_jax.config import OptimConfig


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to `lr`, then cosine / linear decay to `lr * min_lr_ratio`, or constant."""
    decay_steps = max((cfg.decay_steps or total_steps) - cfg.warmup_steps, 1)
    end = cfg.lr * cfg.min_lr_ratio
    warmup = optax.linear_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1))
    decay = {
        "cosine": optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.min_lr_ratio),
        "linear": optax.linear_schedule(cfg.lr, end, decay_steps),
        "constant": optax.constant_schedule(cfg.lr),
    }[cfg.schedule]
    if cfg.warmup_steps == 0:
        return decay
    return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def decay_mask(param_names: dict) -> dict:
    """Which parameters get weight decay: the weight matrices, not the norms' scales.

    Args:
        param_names: {path: logical axis names} of the parameters (`model.param_shapes_and_names`);
            a parameter with the logical axis `norm` is a norm's scale.

    Returns:
        {path: bool}, the parameters' tree structure.
    """
    return jax.tree.map(lambda names: "norm" not in names, param_names,
                        is_leaf=lambda x: isinstance(x, tuple))


def make_optimizer(cfg: OptimConfig, total_steps: int, param_names: dict) -> optax.GradientTransformation:
    """AdamW with the schedule above, after global-norm clipping when `grad_clip > 0`.

    Args:
        cfg: the optimizer's settings.
        total_steps: the run's length (the default decay horizon).
        param_names: {path: logical axis names} of the parameters, for `decay_mask`.
    """
    adamw = optax.adamw(schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask(param_names))
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
    return adamw
