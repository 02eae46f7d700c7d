"""Context parallelism (ring and all-gather attention) equals single-device attention.

Meshes put `context` = C in {2, 4, 8} and the rest of the 8 devices on `data` (B is split too), so
every case also checks that the sequence split composes with batch sharding.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from helpers.meshes import mesh_shape
from lumen_jax.ops import attention as attention_ops
from lumen_jax.ops import cudnn
from lumen_jax.ops.choice import Ops
from lumen_jax.ops.reference import mask as reference_mask
from lumen_jax.ops.reference import reference as reference_attention
from lumen_jax.parallel import context as context_lib
from lumen_jax.parallel.mesh import make_mesh
from lumen_jax.parallel.rules import Rules, activate

B, L, N, K, H = 4, 64, 4, 2, 16
TOL = dict(atol=2e-5, rtol=2e-5)  # float32: a few roundings of the online-softmax merge


def inputs(seed: int = 0, segments: bool = False):
    kq, kk, kv, ks, kc, kl = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(kq, (B, L, N, H), jnp.float32)
    k = jax.random.normal(kk, (B, L, K, H), jnp.float32)
    v = jax.random.normal(kv, (B, L, K, H), jnp.float32)
    seg = None
    if segments:  # documents of random lengths, crossing chunk borders
        starts = jax.random.bernoulli(ks, 0.08, (B, L)).at[:, 0].set(True)
        seg = jnp.cumsum(starts, axis=1).astype(jnp.int32)
    ct_o = jax.random.normal(kc, (B, L, N, H), jnp.float32)
    ct_lse = 0.1 * jax.random.normal(kl, (B, N, L), jnp.float32)
    return q, k, v, seg, ct_o, ct_lse


def reference(q, k, v, seg, ct_o, ct_lse, causal, window=0):
    def loss(q, k, v):
        o, lse = reference_attention(q, k, v, segment_ids_bt=seg, causal=causal, window=window)
        return jnp.sum(o * ct_o) + jnp.sum(lse * ct_lse), (o, lse)
    grads, (o, lse) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return o, lse, grads


@functools.lru_cache(maxsize=None)
def _compiled(c: int, strategy: str, causal: bool, has_seg: bool, balance: str, impl: str, window: int):
    mesh = make_mesh(mesh_shape(data=8 // c, context=c))
    rules = Rules(context_parallel=strategy, context_balance=balance)
    kernel = attention_ops.block_kernel(Ops(attention=impl, interpret=True), H, causal=causal)  # CPU: the interpreter

    def loss(q, k, v, seg, ct_o, ct_lse):
        with activate(mesh, rules):
            o, lse = context_lib.context_attention(q, k, v, segment_ids_bt=seg, causal=causal, kernel=kernel,
                                                   window=window)
        return jnp.sum(o * ct_o) + jnp.sum(lse * ct_lse), (o, lse)

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    return mesh, rules, fn


def context_parallel(q, k, v, seg, ct_o, ct_lse, *, c, strategy, causal, balance="zigzag", impl="xla", window=0):
    """Run on the mesh with tokens permuted into the layout; results back in the original order."""
    mesh, rules, fn = _compiled(c, strategy, causal, seg is not None, balance, impl, window)
    layout = context_lib.Layout(c, balance)
    perm = lambda x, axis=1: jnp.asarray(context_lib.permute_tokens(np.asarray(x), layout, axis))  # noqa: E731
    put = lambda x, names: jax.device_put(x, NamedSharding(mesh, rules.spec(names)))  # noqa: E731
    args = (put(perm(q), ("batch", "seq", "act_heads", None)), put(perm(k), ("batch", "seq", "act_kv_heads", None)),
            put(perm(v), ("batch", "seq", "act_kv_heads", None)),
            None if seg is None else put(perm(seg), ("batch", "seq")),
            put(perm(ct_o), ("batch", "seq", "act_heads", None)), put(perm(ct_lse, 2), ("batch", None, "seq")))
    grads, (o, lse) = fn(*args)
    back = lambda x, axis=1: context_lib.unpermute_tokens(x, layout, axis)  # noqa: E731
    return back(o), back(lse, 2), tuple(back(g) for g in grads)


def assert_matches(got, want):
    (o, lse, grads), (o_ref, lse_ref, grads_ref) = got, want
    np.testing.assert_allclose(o, o_ref, **TOL, err_msg="output")
    np.testing.assert_allclose(lse, lse_ref, **TOL, err_msg="log-sum-exp")
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, **TOL, err_msg=f"d{name}")


# Each case is its own compile. Every mask (causal or not, documents or not) at C = 4; C = 2 (one hop)
# and C = 8 (the ring's 8 unrolled hops) once per strategy, causal with documents: the code has no
# branch on C, the other masks at C = 2 and 8 run what C = 4 runs.
CASES = [(c, strategy, causal, segments)
         for c in (2, 4, 8) for strategy in ("ring", "allgather")
         for causal in (True, False) for segments in (False, True)
         if c == 4 or (causal and segments)]


@pytest.mark.parametrize("c,strategy,causal,segments", CASES)
def test_matches_single_device(c, strategy, causal, segments):
    data = inputs(seed=c, segments=segments)
    assert_matches(context_parallel(*data, c=c, strategy=strategy, causal=causal),
                   reference(*data, causal=causal))


def _emulated_mask(b, t, s, packed, mask_type):
    """[B, T, S] what cuDNN attends to, as its documentation reads: without `packed` the whole pair,
    causal from the top left under CAUSAL; packed, each (offset, length) of the queries with the
    same-numbered one of the keys, causal from both first tokens under PADDING_CAUSAL."""
    causal = mask_type in (cudnn._fused.MaskType.CAUSAL, cudnn._fused.MaskType.PADDING_CAUSAL)
    qi, ki = jnp.arange(t)[None, None, :, None], jnp.arange(s)[None, None, None, :]
    if packed is None:
        return jnp.broadcast_to(ki <= qi if causal else True, (b, 1, t, s)).any(1)
    q_len, kv_len, q_off, kv_off = (x[:, :, None, None] for x in (packed[0], packed[1], packed[2][:, :-1],
                                                                  packed[3][:, :-1]))
    inside = (q_len >= 0) & (qi >= q_off) & (qi < q_off + q_len) & (ki >= kv_off) & (ki < kv_off + kv_len)
    return (inside & ((ki - kv_off <= qi - q_off) if causal else True)).any(1)


def _packed_statistics(lse, packed, to_packed: bool):
    """The statistics' packed layout as its documentation reads: document after document across
    the batch (B x M slots, the unused ones -1), [sequence, head, position in the document]."""
    q_len, q_off = packed[0], packed[2]
    (b, m), (_, n, t) = q_len.shape, lse.shape
    padded = jnp.pad(lse, ((0, 0), (0, 0), (0, t)))
    out = jnp.zeros((b * m, n, t) if to_packed else (b, n, t), jnp.float32)
    seq = jnp.int32(0)
    for row in range(b):
        for d in range(m):
            used = q_len[row, d] >= 0
            if to_packed:  # sequence `seq` takes the row's tokens from its offset on
                out = jnp.where(used, out.at[seq].set(jax.lax.dynamic_slice_in_dim(padded[row], q_off[row, d], t, 1)), out)
            else:  # the row's tokens of this document read theirs back
                back = jax.lax.dynamic_slice_in_dim(jnp.pad(lse[seq], ((0, 0), (t, t))), t - q_off[row, d], t, 1)
                inside = (jnp.arange(t) >= q_off[row, d]) & (jnp.arange(t) < q_off[row, d] + q_len[row, d])
                out = out.at[row].set(jnp.where(used & inside, back, out[row]))
            seq = seq + used.astype(jnp.int32)
    return out


def _emulated_fwd(q, k, v, packed, mask_type, scale):
    """cuDNN's training forward on CPU: (o, statistics); rows outside every document NaN (unspecified)."""
    b, t, n, h = q.shape
    g = n // k.shape[2]
    visible = _emulated_mask(b, t, k.shape[1], packed, mask_type)[:, None]
    scores = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, g, 2)) * scale
    lse = jax.nn.logsumexp(jnp.where(visible, scores, -jnp.inf), axis=-1)
    o = jnp.einsum("bnts,bsnh->btnh", jnp.where(visible, jnp.exp(scores - lse[..., None]), 0.0), jnp.repeat(v, g, 2))
    seen = visible.any(-1)  # [B, 1, T]
    o, lse = jnp.where(seen[:, 0, :, None, None], o, jnp.nan), jnp.where(seen, lse, jnp.nan)
    return o, lse if packed is None else _packed_statistics(lse, packed, to_packed=True)


def _emulated_bwd(q, k, v, packed, stats, o, do, mask_type, scale):
    """cuDNN's backward on CPU from the given statistics and o (FlashAttention-2's); rows no
    document holds NaN."""
    b, t, n, h = q.shape
    g = n // k.shape[2]
    lse = stats if packed is None else _packed_statistics(stats, packed, to_packed=False)
    visible = _emulated_mask(b, t, k.shape[1], packed, mask_type)[:, None]
    kr, vr = jnp.repeat(k, g, 2), jnp.repeat(v, g, 2)
    p = jnp.where(visible, jnp.exp(jnp.einsum("btnh,bsnh->bnts", q, kr) * scale - lse[..., None]), 0.0)
    ds = p * (jnp.einsum("btnh,bsnh->bnts", do, vr) - jnp.einsum("btnh,btnh->bnt", do, o)[..., None])
    dq = jnp.einsum("bnts,bsnh->btnh", ds, kr) * scale
    fold = lambda x: x.reshape(b, x.shape[1], n // g, g, h).sum(3)  # noqa: E731 - GQA: the group's sum
    dk, dv = fold(jnp.einsum("bnts,btnh->bsnh", ds, q) * scale), fold(jnp.einsum("bnts,btnh->bsnh", p, do))
    q_seen, k_seen = visible.any(-1)[:, 0, :, None, None], visible.any(-2)[:, 0, :, None, None]
    return jnp.where(q_seen, dq, jnp.nan), jnp.where(k_seen, dk, jnp.nan), jnp.where(k_seen, dv, jnp.nan)


# The ring at C = 4 (2 rows a device: the packed statistics numbered across the batch) with documents
# crossing the chunks takes every pair kind; the all-gather at C = 2 without documents, cuDNN's plain masks.
@pytest.mark.parametrize("c,strategy,segments", [(4, "ring", True), (2, "allgather", False)])
def test_cudnn_chunk_pairs_match_one_device_with_cudnn_emulated(monkeypatch, c, strategy, segments):
    """`model.attention=cudnn` under context parallelism: each chunk pair through cuDNN's private
    forward and backward (the backward from the merged output and log-sum-exp), emulated here on
    the CPU as its documentation describes (rows outside every document NaN; the statistics of
    packed documents in its packed order): the glue (masks, the packed layout of a pair's
    documents and of their statistics, the document spanning two chunks, the merge) equals one
    device. The log-sum-exp is returned without a gradient (cuDNN's backward takes none)."""
    monkeypatch.setattr(cudnn, "_forward_primitive", _emulated_fwd)
    monkeypatch.setattr(cudnn, "_backward_primitive", _emulated_bwd)
    q, k, v, seg, ct_o, _ = inputs(seed=13, segments=segments)
    no_lse_grad = jnp.zeros((B, N, L), jnp.float32)
    assert_matches(context_parallel(q, k, v, seg, ct_o, 0.1 + no_lse_grad, c=c, strategy=strategy, causal=True,
                                    impl="cudnn"),
                   reference(q, k, v, seg, ct_o, no_lse_grad, causal=True))


# A sliding window of 20 over L = 64: with C = 4 zigzag (8 chunks of 8 tokens) the pairs one chunk
# apart are FULL, two and three apart on the window's edge, four and more SKIP (C = 2 zigzag, 4 chunks
# of 16, has only edge and SKIP pairs off the diagonal: a subset, and the ring has no branch on C); with
# C = 2 contiguous the window's edge crosses the one pair (32 tokens each).
WINDOW = 20


@pytest.mark.parametrize("c,strategy,balance", [(2, "allgather", "contiguous"), (4, "ring", "contiguous"),
                                                (4, "allgather", "zigzag"), (4, "ring", "zigzag")])
def test_a_sliding_window_matches_single_device(c, strategy, balance):
    """The window across chunk pairs by global position (packed documents crossing chunk borders
    too): output, log-sum-exp and gradients equal one device's."""
    data = inputs(seed=11, segments=True)
    assert_matches(context_parallel(*data, c=c, strategy=strategy, causal=True, balance=balance, window=WINDOW),
                   reference(*data, causal=True, window=WINDOW))


def test_a_sliding_window_with_the_flash_kernel_per_chunk():
    """The Pallas kernel (interpreted) on every chunk pair of C = 4 zigzag, all-gathered: skipped,
    unmasked, diagonal and window-edge pairs (its `q_offset`). The ring runs the same pair branches
    (`_attend`, `_masks`; its hops with a window: test_a_sliding_window_matches_single_device; with
    the kernel, in training, tests/model/test_gemma3.py's context2-ring-fsdp2-tensor2-sp: packed
    documents, a window of 8 over 32 tokens on the local layers and none on the global one)."""
    data = inputs(seed=13, segments=True)
    assert_matches(context_parallel(*data, c=4, strategy="allgather", causal=True, impl="flash", window=WINDOW),
                   reference(*data, causal=True, window=WINDOW))


@pytest.mark.parametrize("causal, window, chunk_len", [(True, 20, 8), (True, 5, 8), (False, 20, 8), (True, 0, 8),
                                                       (True, 16, 16)])
def test_pair_kinds_agree_with_the_mask(causal, window, chunk_len):
    """Each (query chunk, key chunk) pair's kind against the element mask of the global positions:
    SKIP exactly where no query sees a key, FULL exactly where every query sees every key,
    DIAGONAL on the same chunk, WINDOW elsewhere."""
    n = 8
    visible = np.asarray(reference_mask(n * chunk_len, n * chunk_len, causal, None, None, window))[0, 0, 0]
    blocks = visible.reshape(n, chunk_len, n, chunk_len)
    kinds = set()
    for qc in range(n):
        for kc in range(n):
            kind = int(context_lib.pair_kind(qc, kc, causal, window, chunk_len))
            tile = blocks[qc, :, kc, :]
            kinds.add(kind)
            assert (kind == context_lib.SKIP) == (not tile.any()), (qc, kc, kind)
            assert (kind == context_lib.FULL) == bool(tile.all()), (qc, kc, kind)
            if kind not in (context_lib.SKIP, context_lib.FULL):
                assert kind == (context_lib.DIAGONAL if qc == kc else context_lib.WINDOW), (qc, kc, kind)
    assert (context_lib.WINDOW in kinds) == bool(window), kinds


@pytest.mark.parametrize("c", [2, 4, 8])
def test_zigzag_balances_causal_work(c):
    balanced = context_lib.work_per_device(context_lib.Layout(c, "zigzag"))
    assert max(balanced) / min(balanced) <= 1.1, balanced
    contiguous = context_lib.work_per_device(context_lib.Layout(c, "contiguous"))
    assert max(contiguous) / min(contiguous) == 2 * c - 1, contiguous  # the imbalance zigzag removes
    # Every (query, key) chunk pair below or on the diagonal is computed exactly once overall.
    n = 2 * c
    assert sum(balanced) == n * (n - 1) / 2 + n * 0.5


def test_layout_order_is_a_permutation():
    layout = context_lib.Layout(4, "zigzag")
    order = layout.order(32)
    assert sorted(order.tolist()) == list(range(32))
    assert order[:8].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]  # device 0: chunks 0 and 7
    x = np.arange(2 * 32).reshape(2, 32)
    np.testing.assert_array_equal(context_lib.unpermute_tokens(context_lib.permute_tokens(x, layout), layout), x)


def _compiled_hlo(strategy: str, seq_len: int, c: int) -> str:
    """Per-device HLO of the forward + backward at a long sequence (compiled, never run)."""
    mesh = make_mesh(mesh_shape(data=8 // c, context=c))
    rules = Rules(context_parallel=strategy)

    def loss(q, k, v):
        with activate(mesh, rules):
            o, _ = context_lib.context_attention(q, k, v, segment_ids_bt=None, causal=True,
                                                 kernel=attention_ops.block_kernel(Ops(), 16))
        return jnp.sum(o)

    def arg(heads, names):
        return jax.ShapeDtypeStruct((1, seq_len, heads, 16), jnp.float32,
                                    sharding=NamedSharding(mesh, rules.spec(names)))

    q, kv = arg(2, ("batch", "seq", "act_heads", None)), arg(1, ("batch", "seq", "act_kv_heads", None))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().as_text()


def _full_kv_buffers(hlo: str, seq_len: int, head_dim: int = 16) -> list[str]:
    """Shapes of the program with a full sequence of K or V in them, however it is laid out: a
    trailing head dim and at least seq_len * head_dim elements (one KV head of the whole sequence,
    as one [.., L, ..] buffer or as C stacked [C, .., L/C, ..] chunks). Q, O and their gradients
    per device hold L/C * 2 heads; the score blocks do not end in the head dim."""
    found = []
    for dims in re.findall(r"[a-z0-9]+\[([0-9,]+)\]", hlo):
        shape = [int(d) for d in dims.split(",")]
        if shape[-1] == head_dim and int(np.prod(shape)) >= seq_len * head_dim:
            found.append(dims)
    return found


@pytest.mark.heavy
def test_ring_backward_never_holds_the_full_sequence():
    """L=8192 over C=8: the ring's compiled program has no buffer with the full sequence length
    (K/V live in chunks of L/C), in one piece or stacked; the all-gather variant, which does
    gather K/V, is the control."""
    ring = _compiled_hlo("ring", 8192, 8)
    assert "collective-permute" in ring
    assert not _full_kv_buffers(ring, 8192), sorted(set(_full_kv_buffers(ring, 8192)))[:5]
    assert _full_kv_buffers(_compiled_hlo("allgather", 8192, 8), 8192)


@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
def test_executed_blocks_per_device(balance):
    """Count the chunk pairs each device's forward really computes (a host callback in the kernel):
    they match `work_per_device`, and zigzag keeps max/min within 1.1."""
    c = 4
    mesh = make_mesh(mesh_shape(data=2, context=c))
    rules = Rules(context_parallel="ring", context_balance=balance)
    xla = attention_ops.block_kernel(Ops(), H)
    seen = []

    def fwd(q, k, v, q_seg, kv_seg, causal, window, offset):
        jax.debug.callback(lambda d, diag: seen.append((int(d), bool(diag))), jax.lax.axis_index("context"),
                           causal)
        return xla.fwd(q, k, v, q_seg, kv_seg, causal, window, offset)

    kernel = context_lib.BlockKernel(fwd, xla.bwd)
    q, k, v, *_ = inputs()
    sharded = lambda x, names: jax.device_put(x, NamedSharding(mesh, rules.spec(names)))  # noqa: E731
    def run(q, k, v):
        with activate(mesh, rules):
            return context_lib.context_attention(q, k, v, segment_ids_bt=None, causal=True, kernel=kernel)

    out = jax.jit(run)(
        sharded(q, ("batch", "seq", "act_heads", None)), sharded(k, ("batch", "seq", "act_kv_heads", None)),
        sharded(v, ("batch", "seq", "act_kv_heads", None)))
    jax.block_until_ready(out)
    work = [0.0] * c
    for device, diag in seen:
        work[device] += 0.5 if diag else 1.0
    work = [w / 2 for w in work]  # each context device appears once per data shard (data=2)
    assert work == context_lib.work_per_device(context_lib.Layout(c, balance)), work
    ratio = max(work) / min(work)
    assert ratio <= 1.1 if balance == "zigzag" else ratio == 2 * c - 1, work


@pytest.mark.parametrize("context", [1, 2])
def test_the_trainer_runs_context_attention_exactly_when_the_mesh_splits_sequences(context):
    """The choice is made once, when the step is built (`Ops.context`): with `mesh.context=2` the
    step's program holds the ring's hops (collective-permutes its attention states); without, none.
    (The reference attention on a sequence-sharded input gives the same numbers through XLA's own
    gathers, so only the program tells the two apart.)"""
    from lumen_jax.compiler.compiled import abstract_step_args
    from lumen_jax.config.checks import validate
    from lumen_jax.config.files import load_config
    from lumen_jax.train.build import build

    cfg = load_config("configs/tiny.yaml", ["mesh.fsdp=-1", f"mesh.context={context}", "model.num_layers=1"])
    trainer = build(cfg, make_mesh(validate(cfg, 8)))
    assert trainer.ops.context is (context > 1)
    text = trainer.step.trace(*abstract_step_args(trainer, cfg)).lower().as_text()
    assert ("stablehlo.collective_permute" in text) is (context > 1)
