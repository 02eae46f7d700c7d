"""Pipeline schedule tables (pure Python): valid for a grid of P, m and V, and their bubble is the
papers' formula; 1F1B and zero-bubble hold at most P micro-batches whatever m is."""

import dataclasses

import pytest

from lumen_jax.parallel.pipeline import schedule as pipeline_lib

GRID = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 4, 8, 12, 16, 32)]


def shapes(name: str):
    for p, m in GRID:
        for v in ((1, 2, 3) if name == "interleaved" else (1,)):
            if pipeline_lib.check_shape(name, p, m, v) is None:
                yield p, m, v


def forwards_before_first_backward(s: pipeline_lib.Schedule, stage: int) -> int:
    first = next(t for t, row in enumerate(s.table) if row[stage] is not None and row[stage].kind == "B")
    return sum(row[stage] is not None and row[stage].kind == "F" for row in s.table[:first])


def papers_warm_up(name: str, p: int, m: int, v: int, stage: int) -> int:
    """Forwards a stage runs before its first backward: GPipe all of them; 1F1B and ZB-H1 the P-s-1
    warm-up ones and the first of the steady state; Megatron's interleaved 2(P-s-1) + (V-1)P, + 1."""
    return {"gpipe": m, "1f1b": min(p - stage, m), "zero_bubble": min(p - stage, m),
            "interleaved": min(2 * (p - stage - 1) + (v - 1) * p + 1, v * m)}[name]


@pytest.mark.parametrize("name", pipeline_lib.SCHEDULES)
def test_tables_valid_and_bubble_is_the_formula(name):
    """Valid tables whose idle fraction is the papers' bubble and whose stages warm up as the papers
    say (the bubble alone does not see an extra warm-up forward: the table keeps its length)."""
    seen = 0
    for p, m, v in shapes(name):
        s = pipeline_lib.build(name, p, m, v)
        assert pipeline_lib.validate(s) == [], f"{name} P={p} m={m} V={v}:\n{pipeline_lib.render(s)}"
        assert s.bubble() == pytest.approx(pipeline_lib.bubble_formula(name, p, m, v), abs=1e-12), \
            f"{name} P={p} m={m} V={v}:\n{pipeline_lib.render(s)}"
        assert [forwards_before_first_backward(s, st) for st in range(p)] == \
            [papers_warm_up(name, p, m, v, st) for st in range(p)], f"{name} P={p} m={m} V={v}:\n{pipeline_lib.render(s)}"
        seen += 1
    assert seen >= 15


def test_issue_figures():
    assert pipeline_lib.build("1f1b", 8, 8).bubble() == pytest.approx(7 / 15)  # 47%
    assert pipeline_lib.build("gpipe", 8, 64).bubble() == pytest.approx(7 / 71)  # 10%
    one = pipeline_lib.build("1f1b", 4, 16).bubble()
    assert pipeline_lib.build("zero_bubble", 4, 16).bubble() < one / 2.5  # about a third
    assert pipeline_lib.build("interleaved", 4, 16, 2).bubble() < one


@pytest.mark.parametrize("name", ["1f1b", "zero_bubble"])
def test_memory_bound_does_not_grow_with_m(name):
    for p in (2, 4, 8):
        peaks = {m: max(pipeline_lib.build(name, p, m).in_flight()) for m in (p, 2 * p, 4 * p)}
        assert set(peaks.values()) == {p}, f"{name} P={p}: in flight {peaks}"
    assert pipeline_lib.build("1f1b", 4, 16).in_flight() == [4, 3, 2, 1]
    assert max(pipeline_lib.build("gpipe", 4, 16).in_flight()) == 16


def test_validate_catches_broken_tables():
    good = pipeline_lib.build("1f1b", 2, 2)
    rows = [list(r) for r in good.table]
    # swap stage 1's first forward and first backward: B before F, and before stage 0's F
    first_f = next(t for t, r in enumerate(rows) if r[1] is not None and r[1].kind == "F")
    first_b = next(t for t, r in enumerate(rows) if r[1] is not None and r[1].kind == "B")
    rows[first_f][1], rows[first_b][1] = rows[first_b][1], rows[first_f][1]
    bad = dataclasses.replace(good, table=tuple(map(tuple, rows)))
    assert any("not after F" in p for p in pipeline_lib.validate(bad))
    dropped = dataclasses.replace(good, table=good.table[:-1])
    assert any("lacks B" in p for p in pipeline_lib.validate(dropped))
    early = [list(r) for r in good.table]
    was = next(t for t, r in enumerate(early) if r[1] == pipeline_lib.Action("F", 1))
    early[0][1], early[was][1] = early[was][1], None  # stage 1 runs micro-batch 1 before stage 0 made it
    assert any("before its input" in p for p in pipeline_lib.validate(
        dataclasses.replace(good, table=tuple(map(tuple, early)))))


@pytest.mark.parametrize("name,p,m,v,words", [
    ("1f1b", 4, 2, 1, "at least as many micro-batches"),
    ("interleaved", 2, 3, 2, "divisible by stages"),
    ("gpipe", 2, 4, 2, "interleaved schedule only"),
    ("pipedream", 2, 4, 1, "unknown pipeline schedule"),
])
def test_check_shape(name, p, m, v, words):
    assert words in pipeline_lib.check_shape(name, p, m, v)
    with pytest.raises(ValueError, match=words):
        pipeline_lib.build(name, p, m, v)


@pytest.mark.parametrize("name", pipeline_lib.SCHEDULES)
def test_lockstep_programs_valid_and_their_bubble_is_the_formula(name):
    """The program the executor runs: every (micro-batch, virtual stage) once forward and once
    backward, each input and cotangent used in the tick after it was sent, slots never overwritten
    while held; the executed bubble is the schedule's formula. zero_bubble's split program: every
    stage's W of micro-batch i in the tick of stage 0's B, so 3m + 2(P-1) units per stage, a bubble
    of 2(P-1)/(3m + 2(P-1)) (1f1b's fused ticks: (P-1)/(m+P-1))."""
    seen = 0
    for p, m, v in shapes(name):
        prog = pipeline_lib.lockstep(name, p, m, v)
        assert pipeline_lib.validate_lockstep(prog) == [], f"{name} P={p} m={m} V={v}"
        if name == "zero_bubble":
            assert prog.split and prog.cost() == 3 * m + 2 * (p - 1), (p, m)
            assert prog.bubble() == pytest.approx(2 * (p - 1) / (3 * m + 2 * (p - 1)), abs=1e-12)
            assert prog.wslots <= p
        else:
            assert not prog.split
            assert prog.bubble() == pytest.approx(pipeline_lib.bubble_formula(name, p, m, v), abs=1e-12)
        assert prog.slots <= (m * v if name == "gpipe" else 2 * p * v - 1)
        seen += 1
    assert seen >= 15


def test_lockstep_validation_sees_a_broken_program():
    prog = pipeline_lib.lockstep("1f1b", 4, 8)
    late = list(map(list, prog.bwd))
    late[5][1], late[6][1] = late[6][1], late[5][1]  # stage 1's backwards of two ticks swapped
    assert pipeline_lib.validate_lockstep(dataclasses.replace(prog, bwd=tuple(map(tuple, late))))
    shared = [list(row) for row in prog.fwd]
    t = next(t for t in range(prog.ticks) if shared[t][0].valid and shared[t][0].slot == 1)
    shared[t][0] = shared[t][0]._replace(slot=0, wslot=0)  # a forward written into a slot still held
    assert any("still held" in e for e in pipeline_lib.validate_lockstep(dataclasses.replace(
        prog, fwd=tuple(map(tuple, shared)))))
    split = pipeline_lib.lockstep("zero_bubble", 4, 8)
    early = [list(row) for row in split.wgt]
    t = next(t for t in range(split.ticks) if early[t][3].valid)  # stage 3's first W ...
    b = next(t for t in range(split.ticks) if split.bwd[t][3].valid)
    early[b - 1][3], early[t][3] = early[t][3], early[b - 1][3]  # ... a tick before its B
    assert any("weight unit" in e for e in pipeline_lib.validate_lockstep(dataclasses.replace(
        split, wgt=tuple(map(tuple, early)))))
    elsewhere = [list(row) for row in split.wgt]
    elsewhere[t][3] = elsewhere[t][3]._replace(wslot=elsewhere[t][3].wslot + 1)  # reading another slot than its B wrote
    assert any("weight unit" in e for e in pipeline_lib.validate_lockstep(dataclasses.replace(
        split, wgt=tuple(map(tuple, elsewhere)))))
    reused = [list(row) for row in split.bwd]
    t = next(t for t in range(split.ticks) if reused[t][3].valid and reused[t][3].wslot == 1)
    reused[t][3] = reused[t][3]._replace(wslot=0)  # stage 3's B writes a W slot still held (its W reads it too)
    wgt = [list(row) for row in split.wgt]
    mb = reused[t][3].mb
    wt = next(t for t in range(split.ticks) if wgt[t][3].valid and wgt[t][3].mb == mb)
    wgt[wt][3] = wgt[wt][3]._replace(wslot=0)
    assert any("still held" in e for e in pipeline_lib.validate_lockstep(dataclasses.replace(
        split, bwd=tuple(map(tuple, reused)), wgt=tuple(map(tuple, wgt)))))
