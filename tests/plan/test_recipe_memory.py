"""The memory of the program that ran each calibration row (plan/recipe_memory.py): every row that
ran fits, but the ones listed with the reason; one Megatron row by hand, term by term."""

from __future__ import annotations

import pytest

from lumen_jax.config import MeshConfig
from lumen_jax.plan import calibration, recipe_memory
from lumen_jax.plan.published import TABLE

# Rows that ran but that the recipe's memory, as modelled from its published settings, does not
# admit, and by how much (predicted / usable). Each is a known gap in what the sources state, not a
# tolerance: docs/PLANNING.md, section 5, "Memory of a recipe", says what each would need.
NOT_ADMITTED = {
    "NeMo llama3.1-8b 8 GPUs": 1.01,
    "NeMo llama3.1-405b 576 GPUs": 1.02,
    "Llama 3 405b 8,192 GPUs": 1.33,
}


@pytest.fixture(scope="module")
def found():
    return calibration.rows()


def test_every_calibration_row_that_ran_fits_its_recipe_memory(found):
    """Each row's recipe memory (its framework's terms) fits in what its allocator can hold; the
    rows listed in NOT_ADMITTED miss by no more than the factor stated there (and still miss: a
    fix that admits one must take it off the list)."""
    assert {r.published.family for r in found} == set(recipe_memory.FAMILIES)
    for r in found:
        over = r.memory.total / r.usable
        if r.published.name in NOT_ADMITTED:
            assert 1.0 < over <= NOT_ADMITTED[r.published.name] + 0.005, (r.published.name, over)
        else:
            assert r.fits, (r.published.name, r.memory.terms, r.usable)
    assert sum(r.fits for r in found) >= len(found) - len(NOT_ADMITTED)


def test_megatron_row_by_hand():
    """NeMo 70B on 64 GPUs (TP4 PP4 VP5 CP2 DP2, MBS 1, 64 micro-batches, SP, no recompute), the
    first pipeline stage, term by term from the formulas in recipe_memory.megatron."""
    row = next(r for r in TABLE if r.name == "NeMo llama3.1-70b 64 GPUs")
    got = calibration.recipe_memory_of(row, plan=None)
    h, hd, n, k, f, v, L = 8192, 128, 64, 8, 28672, 128256, 80
    t, p, vp, cp, dp = 4, 4, 5, 2, 2
    layer = 2 * h * n * hd + 2 * h * k * hd + 3 * h * f + 2 * h  # wq wo, wk wv, gate up down, 2 norms
    params = (L // p * layer + v * h) / t  # the first stage: 20 layers + the embedding
    tokens = 1 * 8192 / cp
    per_layer = 2 * tokens * (4 * h / t + (2 * n * hd + 2 * k * hd + 3 * f + n * 2) / t)
    chunks = 2 * (p - 1) + (vp - 1) * p + 1  # Megatron's interleaved warm-up on rank 0, + 1
    assert chunks == 23 and L // p / vp * chunks == pytest.approx(L * (1 + (p - 1) / (p * vp)))
    want = {"params": 2 * params, "grads": 4 * params, "optimizer": 12 * params / (dp * cp),
            "activations": chunks * (L // p / vp) * per_layer, "embedding": 2 * tokens * h / t, "logits": 0.0}
    assert got.stage == "first"
    assert got.terms == pytest.approx(want, rel=1e-12)
    assert got.total / 1e9 == pytest.approx(66.8, abs=0.05)


def test_in_flight_chunks_follow_megatrons_schedule():
    """1F1B: P - r micro-batches on rank r (Korthikanti: L layers' worth on the first stage);
    interleaved: L (1 + (P - 1) / (P V)) layers' worth on rank 0; never more than the step holds."""
    lay = lambda p, v, m: recipe_memory.RecipeLayout(1, p, v, 1, 1, m, 1, 8, False)  # noqa: E731
    assert [recipe_memory.in_flight_chunks(lay(4, 1, 8), r) for r in range(4)] == [4, 3, 2, 1]
    assert recipe_memory.in_flight_chunks(lay(4, 1, 2), 0) == 2
    assert recipe_memory.in_flight_chunks(lay(9, 7, 63), 0) == 9 * 7 + 9 - 1
    assert recipe_memory.in_flight_chunks(lay(16, 2, 8), 0) == 16
    assert recipe_memory.in_flight_chunks(lay(1, 1, 32), 0) == 1


def test_sequence_parallelism_divides_the_d_wide_activations():
    """Korthikanti's Table 2: with SP every saved tensor is split t ways (34 sbh / t), without it
    the d_model-wide ones are not (10 sbh + 24 sbh / t)."""
    row = next(r for r in TABLE if r.name == "NeMo llama3.1-70b 64 GPUs")
    mesh = MeshConfig(**{"fsdp": 1, **row.ours})
    model = calibration.model_of(row)
    sp = recipe_memory.RecipeLayout.of(mesh, row.global_batch, row.micro_batches, row.seq_len)
    no_sp = recipe_memory.RecipeLayout(**{**sp.__dict__, "sequence_parallel": False})
    a, b = (recipe_memory.megatron(model, x, "none").terms["activations"] for x in (sp, no_sp))
    per_token_layer = lambda x: x / (23 * 4 * 8192 / 2 * 2)  # noqa: E731  in elements
    assert per_token_layer(b) - per_token_layer(a) == pytest.approx(4 * 8192 * (1 - 1 / 4), rel=1e-12)


def test_calibration_prints_the_recipe_memory(found):
    text = calibration.format_calibration(found)
    line = next(x for x in text.splitlines() if x.startswith("NeMo llama3.1-70b 64 GPUs"))
    assert " 66.8 " in line and " yes " in line
    assert "every row fits: False" in text
    assert calibration.to_json(found)["rows"][2]["recipe_bytes_by_term"]["optimizer"] > 0
