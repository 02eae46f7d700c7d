"""Llama building blocks in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP; Gemma 3's
variants of each where the config asks (norms times 1 + w, sandwich norms, GeGLU, local and global layers).

Single-device math only. Every parameter carries logical axis names (`out_sharding` metadata);
activations are pinned with `constrain(x, logical names)`. How each op runs (attention kernel,
projection form) is the `Ops` the layers are called with, chosen once by `ops.choice`; a layer's
projections may keep model state (`ops.projection.projection_state`). Shape letters: B batch, T sequence,
D d_model, N query heads, K kv heads, H head dim, F ffn dim, V vocab.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lumen_jax.config import REMAT_SAVES, ModelConfig
from lumen_jax.ops.attention import attention
from lumen_jax.ops.choice import Ops
from lumen_jax.ops.projection import Tape, project, project_columns, project_rows, projection_state
from lumen_jax.ops.swiglu import swiglu
from lumen_jax.parallel.rules import constrain


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], std: float) -> nnx.Param:
    value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
    return nnx.Param(value, out_sharding=names)


def _projector(module: nnx.Module, ops: Ops, layer_type: str, state: nnx.Dict | None, tape: Tape | None = None,
               together: tuple[str, ...] = ()):
    """`project` for the projections of one module: `(spec, x, attr, name) -> einsum(spec, x, w)`,
    w the module's weight `attr`, `name` its model state's key; through `tape` when the backward
    is split (`ops.projection.Taps`). A row-parallel projection (O, down) passes `rows=True`.
    `together`: the names of the projections that read one input (Q/K/V, gate/up): each is given
    their states too (`project`'s `peers`)."""
    def proj(spec: str, x: jax.Array, attr: str, name: str, rows: bool = False) -> jax.Array:
        w, st = getattr(module, attr)[...], None if state is None else state[name]
        peers = None if state is None or name not in together else tuple(state[n] for n in together)
        if tape is not None:
            return tape.project(attr, spec, x, w, ops, layer_type, st, peers)
        if rows:
            return project_rows(spec, x, w, ops, layer_type, st)
        return project(spec, x, w, ops, layer_type, st, peers=peers)
    return proj


def _columns(module: nnx.Module, ops: Ops, layer_type: str, state: nnx.Dict | None, tape: Tape | None = None):
    """The column-parallel projections of one input (Q/K/V, gate/up) of one module:
    `(specs, x, attrs, names) -> tuple of einsum(spec, x, w)` (`ops.projection.project_columns`),
    each through `tape` when the backward is split; fp8 projections share one scale of their input."""
    def cols(specs: tuple[str, ...], x: jax.Array, attrs: tuple[str, ...], names: tuple[str, ...]) -> tuple:
        if tape is not None:
            proj = _projector(module, ops, layer_type, state, tape, together=names)
            return tuple(proj(spec, x, attr, name) for spec, attr, name in zip(specs, attrs, names))
        ws = tuple(getattr(module, attr)[...] for attr in attrs)
        states = None if state is None else tuple(state[name] for name in names)
        return project_columns(specs, x, ws, ops, layer_type, states)
    return cols


def _named(on: bool, x: jax.Array, name: str) -> jax.Array:
    """`x` named `name` for the selective remat policies (`config.REMAT_SAVES`) when `on`; else `x`
    itself, so the other policies' programs are theirs by construction (as `Attention.name_out`;
    named always, the other policies' probed residuals and lowered steps measured the same)."""
    return checkpoint_name(x, name) if on else x


class RMSNorm(nnx.Module):
    """x / rms(x) times `scale` (from 1), or times 1 + `scale` (from 0) when `plus_one` (Gemma's
    parameterisation, `model.norm_scale=one_plus_weight`: the checkpoint's weight kept as it is)."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False):
        self.scale = nnx.Param((jnp.zeros if plus_one else jnp.ones)((dim,), jnp.float32), out_sharding=("norm",))
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        scale = self.scale[...]
        return rms_norm(x_btd, 1.0 + scale if self.plus_one else scale, self.eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x_btd: jax.Array, scale_d: jax.Array, eps: float) -> jax.Array:
    """`x / rms(x) * scale` in float32, returned in x's dtype. Its backward keeps x as it came (the
    compute dtype) and one float32 per row, 1 / rms: autodiff kept x and x / rms(x) in float32, four
    float32 rows of D per layer where this keeps two of the compute dtype (Korthikanti's count)."""
    return _rms_norm_fwd(x_btd, scale_d, eps)[0]


def _rms_norm_fwd(x_btd, scale_d, eps):
    x32 = x_btd.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv * scale_d).astype(x_btd.dtype), (x_btd, inv, scale_d)


def _rms_norm_bwd(eps, residuals, dy_btd):
    x_btd, inv, scale_d = residuals
    xhat = x_btd.astype(jnp.float32) * inv
    dy = dy_btd.astype(jnp.float32)
    dscale = jnp.sum(dy * xhat, axis=tuple(range(dy.ndim - 1)))
    dxhat = dy * scale_d
    dx = inv * (dxhat - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True))
    return dx.astype(x_btd.dtype), dscale


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    """The model's RMSNorm over `dim` (`model.norm_eps`, `model.norm_scale`)."""
    return RMSNorm(dim, cfg.norm_eps, cfg.norm_scale == "one_plus_weight")


def rope_frequencies(cfg: ModelConfig, local: bool = False) -> jax.Array:
    """Inverse frequencies [H/2], with Llama 3.1 frequency scaling when `rope_scaling == 'llama3'`, divided
    by the factor when `linear`. `local`: the local layers' (`model.rope_local_theta`, unscaled; the
    global layers' when it is 0)."""
    h = cfg.rope_dim
    if local and cfg.rope_local_theta:
        return 1.0 / (cfg.rope_local_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_scaling_factor
    if cfg.rope_scaling == "yarn":
        return yarn_frequencies(cfg, inv_freq)
    if cfg.rope_scaling == "llama3":
        low_wavelen = cfg.rope_original_max_len / cfg.rope_low_freq_factor
        high_wavelen = cfg.rope_original_max_len / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = ((cfg.rope_original_max_len / wavelen - cfg.rope_low_freq_factor)
                  / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
        mid = (1 - smooth) * inv_freq / cfg.rope_scaling_factor + smooth * inv_freq
        inv_freq = jnp.where(wavelen > low_wavelen, inv_freq / cfg.rope_scaling_factor,
                             jnp.where(wavelen < high_wavelen, inv_freq, mid))
    return inv_freq


def yarn_frequencies(cfg: ModelConfig, inv_freq: jax.Array) -> jax.Array:
    """YaRN's inverse frequencies [H/2] from the plain ones: interpolated (divided by the factor) below a
    ramp over the dims whose rotations within rope_original_max_len lie between beta_slow and beta_fast,
    extrapolated (kept) above it (transformers' _compute_yarn_parameters, truncated bounds)."""
    h, base, n = cfg.rope_dim, cfg.rope_theta, cfg.rope_original_max_len

    def dim_of(rotations: float) -> float:  # the dim whose wavelength makes `rotations` turns in n positions
        return h * math.log(n / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_of(cfg.rope_yarn_beta_fast)), 0)
    high = min(math.ceil(dim_of(cfg.rope_yarn_beta_slow)), h - 1)
    ramp = jnp.clip((jnp.arange(h // 2, dtype=jnp.float32) - low) / (high - low if high != low else 0.001), 0, 1)
    return inv_freq / cfg.rope_scaling_factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's m(s) = 0.1 s ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What YaRN multiplies the rotated dims by (1 without yarn): m(mscale) / m(mscale_all_dim), or m(1)."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    f = cfg.rope_scaling_factor
    if cfg.rope_yarn_mscale and cfg.rope_yarn_mscale_all_dim:
        return yarn_mscale(f, cfg.rope_yarn_mscale) / yarn_mscale(f, cfg.rope_yarn_mscale_all_dim)
    return yarn_mscale(f, 1.0)


def local_layers(cfg: ModelConfig, first: jax.Array | int, count: int) -> jax.Array | None:
    """[count] bool: which of the layers first, ..., first + count - 1 have the sliding window when
    local and global layers alternate (`model.global_every`: layer i is global when (i + 1) % n == 0);
    None when every layer is alike (`model.sliding_window` static for all). `first` may be traced (a
    pipeline stage's first layer); a padded slot past the model's layers is a zero layer, any kind."""
    if not cfg.global_every:
        return None
    return (first + jnp.arange(count) + 1) % cfg.global_every != 0


def layer_rope(cfg: ModelConfig, local: jax.Array | None) -> jax.Array:
    """The inverse frequencies [H/2] of a layer that is `local` (traced bool; None: every layer alike)."""
    if local is None:
        return rope_frequencies(cfg)
    return jnp.where(local, rope_frequencies(cfg, local=True), rope_frequencies(cfg))


def apply_rope(x_btnh: jax.Array, positions_bt: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding, half-split convention (as Llama's Hugging Face checkpoints)."""
    angles = positions_bt[:, :, None, None].astype(jnp.float32) * inv_freq  # [B, T, 1, H/2]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_btnh.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention; Q/K/V column-split and the output row-split over heads."""

    def __init__(self, cfg: ModelConfig, ops: Ops, *, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        self.wq = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), cfg.init_std)
        self.wk = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.wv = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        # Output projection scaled down by depth (GPT-2 / Megatron residual init).
        self.wo = _param(rngs, (n, h, d), ("heads", "head_dim", "embed"),
                         cfg.init_std / math.sqrt(2 * cfg.num_layers))
        self.name_out = cfg.remat == "save_attention_out"  # `out`: the one policy that reads the name
        self.name_projections = cfg.remat in REMAT_SAVES  # q, k, v, o: the selective policies' names
        if cfg.qkv_bias:  # Qwen2: learned biases of the q, k, v projections (zero at init)
            self.bq = nnx.Param(jnp.zeros((n, h), jnp.float32), out_sharding=("heads", "head_dim"))
            self.bk = nnx.Param(jnp.zeros((k, h), jnp.float32), out_sharding=("kv_heads", "head_dim"))
            self.bv = nnx.Param(jnp.zeros((k, h), jnp.float32), out_sharding=("kv_heads", "head_dim"))
        if cfg.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each query and key head's H dims, before the rotation
            self.q_norm = norm(cfg, h)
            self.k_norm = norm(cfg, h)
        self.projections = projection_state(ops, "attention", ("q", "k", "v", "o"))
        self.window = cfg.sliding_window  # static: the keys each query sees, 0 all (ops.attention)
        self.rope_factor = rope_attention_factor(cfg)  # YaRN's scaling of the rotated dims; 1: none
        self.scale = cfg.query_scale_dim ** -0.5 if cfg.query_scale_dim else None  # None: 1/sqrt(H)

    def __call__(self, x_btd: jax.Array, positions_bt: jax.Array, segment_ids_bt: jax.Array | None,
                 inv_freq: jax.Array, ops: Ops, tape: Tape | None = None, local: jax.Array | None = None) -> jax.Array:
        q, k, v = self.qkv(x_btd, positions_bt, inv_freq, ops, tape)
        return self.out(self.attend(q, k, v, segment_ids_bt, ops, local), ops, tape)

    def attend(self, q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, segment_ids_bt: jax.Array | None,
               ops: Ops, local: jax.Array | None = None) -> jax.Array:
        """Causal attention [B, T, N, H] of the rotated q, k, v: with the window when `local` (traced
        bool: a `lax.cond`, so each branch keeps its window static, as cuDNN needs), or as the model's
        every layer when None."""
        def run(window: int) -> jax.Array:
            return attention(q_btnh, k_btkh, v_btkh, segment_ids_bt=segment_ids_bt, causal=True, scale=self.scale,
                             ops=ops, window=window)
        if local is None:
            return run(self.window)
        return jax.lax.cond(local, lambda: run(self.window), lambda: run(0))

    def qkv(self, x_btd: jax.Array, positions_bt: jax.Array, inv_freq: jax.Array,
            ops: Ops, tape: Tape | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Rotated queries [B, T, N, H], rotated keys and values [B, T, K, H] (also the KV cache's entries)."""
        q, k, v = _columns(self, ops, "attention", self.projections, tape)(
            ("btd,dnh->btnh", "btd,dkh->btkh", "btd,dkh->btkh"), x_btd, ("wq", "wk", "wv"), ("q", "k", "v"))
        # the products, before bias, norm and RoPE: what dots_saveable keeps (q_norm's backward reads its input)
        named = self.name_projections
        q, k, v = _named(named, q, "query_proj"), _named(named, k, "key_proj"), _named(named, v, "value_proj")
        if hasattr(self, "bq"):
            q, k, v = (y + b[...].astype(y.dtype) for y, b in ((q, self.bq), (k, self.bk), (v, self.bv)))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions_bt, inv_freq), apply_rope(k, positions_bt, inv_freq)
        if self.rope_factor != 1.0:
            q, k = q * jnp.asarray(self.rope_factor, q.dtype), k * jnp.asarray(self.rope_factor, k.dtype)
        q = constrain(q, ("batch", "seq", "act_heads", None))
        k = constrain(k, ("batch", "seq", "act_kv_heads", None))
        return q, k, constrain(v, ("batch", "seq", "act_kv_heads", None))

    def out(self, o_btnh: jax.Array, ops: Ops, tape: Tape | None = None) -> jax.Array:
        """The output projection of the attention result [B, T, N, H] -> [B, T, D]."""
        # Named so that remat=save_attention_out keeps it and recomputes only the projections/MLP;
        # only then: a named copy is a second residual beside the attention's own saved output (the
        # flash kernel's), which the compiled program stores once but the planner's probe counts.
        o = constrain(o_btnh, ("batch", "seq", "act_heads", None))
        o = checkpoint_name(o, "attention_out") if self.name_out else o
        y = _projector(self, ops, "attention", self.projections, tape)("btnh,nhd->btd", o, "wo", "o", rows=True)
        return _named(self.name_projections, y, "out_proj")


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up)), or GeGLU with gelu_tanh (`model.mlp_activation`, Gemma);
    gate/up column-split, down row-split over `mlp`."""

    def __init__(self, cfg: ModelConfig, ops: Ops, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.ffn_dim
        self.w_gate = _param(rngs, (d, f), ("embed", "mlp"), cfg.init_std)
        self.w_up = _param(rngs, (d, f), ("embed", "mlp"), cfg.init_std)
        self.w_down = _param(rngs, (f, d), ("mlp", "embed"), cfg.init_std / math.sqrt(2 * cfg.num_layers))
        self.projections = projection_state(ops, "mlp", ("gate", "up", "down"))
        self.activation = cfg.mlp_activation
        self.name_projections = cfg.remat in REMAT_SAVES  # gate, up, down: the selective policies' names

    def __call__(self, x_btd: jax.Array, ops: Ops, tape: Tape | None = None) -> jax.Array:
        gate, up = _columns(self, ops, "mlp", self.projections, tape)(
            ("btd,df->btf", "btd,df->btf"), x_btd, ("w_gate", "w_up"), ("gate", "up"))
        gate, up = _named(self.name_projections, gate, "mlpwi_0"), _named(self.name_projections, up, "mlpwi_1")
        gated = swiglu(gate, up) if self.activation == "silu" else jax.nn.gelu(gate, approximate=True) * up
        h = constrain(gated, ("batch", "seq", "act_mlp"))
        y = _projector(self, ops, "mlp", self.projections, tape)("btf,fd->btd", h, "w_down", "down", rows=True)
        return _named(self.name_projections, y, "mlpwo")


class Block(nnx.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x)); with `model.block_norms=sandwich`
    (Gemma) x + norm(attn(norm(x))), then x + norm(mlp(norm(x))).

    `mlp` is the MLP's class: `MLP`, or `model.moe.MoE` (which returns auxiliary terms with its output);
    `attention` the attention's: `Attention`, or `model.mla.LatentAttention` (`model.kv_lora_rank` > 0).
    `__call__` returns (x_btd, aux): aux the MLP's auxiliary terms, {} for a dense one; `tape` taps
    the projections for a split backward (`ops.projection.Taps`), None: not split.
    """

    def __init__(self, cfg: ModelConfig, ops: Ops, *, rngs: nnx.Rngs, mlp: type = MLP, attention: type = Attention):
        self.attn_norm = norm(cfg, cfg.d_model)
        self.attn = attention(cfg, ops, rngs=rngs)
        self.mlp_norm = norm(cfg, cfg.d_model)
        self.mlp = mlp(cfg, ops, rngs=rngs)
        if cfg.block_norms == "sandwich":
            self.post_attn_norm = norm(cfg, cfg.d_model)
            self.post_mlp_norm = norm(cfg, cfg.d_model)

    def __call__(self, x_btd: jax.Array, positions_bt: jax.Array, segment_ids_bt: jax.Array | None,
                 inv_freq: jax.Array, ops: Ops, tape: Tape | None = None,
                 local: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`local`: this layer has the window (traced bool, `local_layers`); None: as every layer."""
        residual = ("batch", "act_seq", "act_embed")
        # Under sequence parallelism the normed input is gathered along the sequence over `tensor`
        # here, once, before the column-parallel projections (Megatron's g); left to itself the
        # partitioner gathered it per projection, and with context parallelism over `context` too.
        # `proj_seq`: the rules leave it split where the projections gather it themselves (in steps
        # under their matmuls, `ops.projection.project_columns`).
        gathered = ("batch", "proj_seq", "act_embed")
        h_btd = constrain(self.attn_norm(x_btd), gathered)
        scope = (lambda name: None) if tape is None else tape.scope  # noqa: E731
        a_btd = self.attn(h_btd, positions_bt, segment_ids_bt, inv_freq, ops, scope("attn"), local)
        x_btd = constrain(x_btd + self.after_attention(a_btd), residual)
        y_btd, aux = self.feed_forward(constrain(self.mlp_norm(x_btd), gathered), ops, scope("mlp"))
        return constrain(x_btd + y_btd, residual), aux

    def after_attention(self, a_btd: jax.Array) -> jax.Array:
        """What the attention's output adds to the residual stream (its post-norm under sandwich norms)."""
        return self.post_attn_norm(a_btd) if hasattr(self, "post_attn_norm") else a_btd

    def feed_forward(self, h_btd: jax.Array, ops: Ops, tape: Tape | None = None) -> tuple[jax.Array, dict]:
        """(what the MLP adds to the residual stream from its normed input, its aux terms: {} for a dense one)."""
        y_btd = self.mlp(h_btd, ops, tape)
        y_btd, aux = y_btd if isinstance(y_btd, tuple) else (y_btd, {})
        return (self.post_mlp_norm(y_btd) if hasattr(self, "post_mlp_norm") else y_btd), aux
