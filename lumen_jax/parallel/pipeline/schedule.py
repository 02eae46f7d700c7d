"""Pipeline schedules as static tables: tick x stage -> forward, backward, weight-gradient or idle.

The layer stack is cut into P stages (P devices along the `pipeline` mesh axis), or into P*V
chunks for the interleaved schedule: device s holds chunks c = 0..V-1, which are the *virtual*
stages v = c*P + s (non-contiguous layers, Narayanan et al. 2021). A micro-batch's forward visits
the virtual stages 0, 1, ..., P*V-1 and its backward the reverse. One tick is one action of one
(virtual) stage on one micro-batch:

- `F` forward of micro-batch `mb` through chunk `chunk`; its output goes to the next virtual stage
  (usable there from the next tick on).
- `B` backward: in `gpipe`, `1f1b` and `interleaved` the whole backward (input and weight
  gradients); in `zero_bubble` the input gradient only, which is on the critical path.
- `W` the weight gradient of a `B` done earlier (`zero_bubble` only; ZB-H1, Qi et al. 2023).

The tables are built by pure functions that walk each stage's program in order (a stage idles
while its next action waits for its inputs), and checked by `validate`. `bubble` is the idle
fraction of (tick, stage) slots, the figure the metrics report as `pipeline_bubble`:

=============  ==============================  ===========================================
schedule       bubble of the table             activations a stage keeps (micro-batches)
=============  ==============================  ===========================================
gpipe          (P-1) / (m+P-1)                 m
1f1b           (P-1) / (m+P-1)                 P - s (at most P, whatever m is)
interleaved    (P-1) / (V*m+P-1)               about P*V + P - 2s - 1 chunk inputs (m % P == 0)
zero_bubble    (P-1) / (3m+P-1)                at most P (ticks are a third of a stage's work)
=============  ==============================  ===========================================

A tick of `gpipe`/`1f1b` counts a forward and a whole backward as one tick each, a tick of
`zero_bubble` a forward, an input-gradient and a weight-gradient pass each: the formulas are those
of the papers with equal forward and backward times. These tables are the papers' per-stage
orders (checked against torch.distributed.pipelining's). The executor runs `lockstep(...)`, the
same schedules retimed so that every tick runs the same kinds of work on every stage (below).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
F, B, W = "F", "B", "W"


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # F | B | W
    mb: int  # micro-batch
    chunk: int = 0  # which of the device's V chunks (interleaved); virtual stage chunk * P + stage


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A static schedule: `table[tick][stage]` is an `Action` or None (idle)."""

    name: str
    stages: int  # P
    micro_batches: int  # m
    virtual: int  # V (1 unless interleaved)
    table: tuple[tuple[Action | None, ...], ...]

    @property
    def ticks(self) -> int:
        return len(self.table)

    @property
    def split_backward(self) -> bool:
        return any(a is not None and a.kind == W for row in self.table for a in row)

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return chunk * self.stages + stage

    def bubble(self) -> float:
        """Idle fraction of the table's (tick, stage) slots."""
        idle = sum(a is None for row in self.table for a in row)
        return idle / (self.ticks * self.stages)

    def in_flight(self) -> list[int]:
        """Per stage, the most (micro-batch, chunk) inputs held at once: from their forward until
        their last backward action (B, or W when the backward is split)."""
        last = W if self.split_backward else B
        peaks = []
        for s in range(self.stages):
            held = peak = 0
            for row in self.table:
                a = row[s]
                if a is not None and a.kind == F:
                    held += 1
                    peak = max(peak, held)
                elif a is not None and a.kind == last:
                    held -= 1
            peaks.append(peak)
        return peaks


def bubble_formula(name: str, stages: int, micro_batches: int, virtual: int = 1) -> float:
    """The bubble the papers give for `name` (equal forward/backward times); `Schedule.bubble` of the
    tables built here equals it."""
    p, m = stages, micro_batches
    work = {"gpipe": m, "1f1b": m, "interleaved": virtual * m, "zero_bubble": 3 * m}[name]
    return (p - 1) / (work + p - 1)


@functools.lru_cache(maxsize=256)
def lockstep_bubble(name: str, stages: int, micro_batches: int, virtual: int = 1) -> float:
    """`lockstep(...).bubble()`: the share of the executed work in the fill and the drain (cached)."""
    return lockstep(name, stages, micro_batches, virtual).bubble()


# --------------------------------------------------------------------------------------------------
# Building: each stage's program, walked in order
# --------------------------------------------------------------------------------------------------

def _ready(a: Action, s: int, p: int, v_total: int, done: dict, tick: int) -> bool:
    """Whether `a` of stage `s` may run at `tick`: its inputs were produced at an earlier tick."""
    v = a.chunk * p + s
    before = lambda key: done.get(key, tick) < tick  # noqa: E731
    if a.kind == F:
        return v == 0 or before((F, v - 1, a.mb))
    if a.kind == B:
        return before((F, v, a.mb)) and (v == v_total - 1 or before((B, v + 1, a.mb)))
    return before((B, v, a.mb))


def _walk(p: int, v_total: int, next_action: Callable[[int, dict, int], Action | None],
          total: int) -> tuple[tuple[Action | None, ...], ...]:
    done: dict = {}
    table = []
    while len(done) < total:
        if len(table) > 4 * total + 4:
            raise RuntimeError("pipeline schedule does not progress (a bug in its program)")
        tick = len(table)
        row = tuple(next_action(s, done, tick) for s in range(p))
        for s, a in enumerate(row):
            if a is not None:
                done[(a.kind, a.chunk * p + s, a.mb)] = tick
        table.append(row)
    return tuple(table)


def _in_order(p: int, v: int, programs: list[list[Action]]) -> tuple[tuple[Action | None, ...], ...]:
    """Each stage runs its program in order, idling while the next action is not ready."""
    pos = [0] * p

    def next_action(s: int, done: dict, tick: int) -> Action | None:
        if pos[s] < len(programs[s]) and _ready(programs[s][pos[s]], s, p, p * v, done, tick):
            pos[s] += 1
            return programs[s][pos[s] - 1]
        return None
    return _walk(p, v, next_action, sum(map(len, programs)))


def _one_f_one_b(forwards: list[tuple[int, int]], backwards: list[tuple[int, int]], warmup: int) -> list[Action]:
    """`warmup` forwards, then alternate one forward and one backward, then the remaining backwards."""
    n = len(forwards)
    warmup = min(warmup, n)
    prog = [Action(F, *forwards[i]) for i in range(warmup)]
    for i in range(n - warmup):
        prog += [Action(F, *forwards[warmup + i]), Action(B, *backwards[i])]
    return prog + [Action(B, *backwards[i]) for i in range(n - warmup, n)]


def _zero_bubble(p: int, m: int) -> tuple[tuple[Action | None, ...], ...]:
    """ZB-H1: forwards first (at most P - s waiting for their B, P waiting for their W), then input
    gradients, and a deferred weight gradient wherever the stage would otherwise idle."""
    next_f, next_b = [0] * p, [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]

    def next_action(s: int, done: dict, tick: int) -> Action | None:
        waiting_b = next_f[s] - next_b[s]
        held = waiting_b + len(pending_w[s])
        f = Action(F, next_f[s])
        if next_f[s] < m and waiting_b < p - s and held < p and _ready(f, s, p, p, done, tick):
            next_f[s] += 1
            return f
        b = Action(B, next_b[s])
        if next_b[s] < m and _ready(b, s, p, p, done, tick):
            next_b[s] += 1
            pending_w[s].append(b.mb)
            return b
        if pending_w[s]:
            return Action(W, pending_w[s].pop(0))
        return None
    return _walk(p, 1, next_action, 3 * p * m)


def check_shape(name: str, stages: int, micro_batches: int, virtual: int = 1) -> str | None:
    """Why (`name`, P, m, V) cannot be scheduled, in words; None when it can."""
    if name not in SCHEDULES:
        return f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}"
    if stages < 1 or micro_batches < 1 or virtual < 1:
        return f"stages={stages}, micro_batches={micro_batches}, virtual={virtual} must all be >= 1"
    if name != "interleaved" and virtual != 1:
        return f"virtual stages ({virtual}) are for the interleaved schedule only, not {name}"
    if name != "gpipe" and stages > 1 and micro_batches < stages:
        return f"{name} needs at least as many micro-batches as stages ({micro_batches} < {stages})"
    if name == "interleaved" and micro_batches % stages:
        return f"interleaved needs micro-batches ({micro_batches}) divisible by stages ({stages})"
    return None


def build(name: str, stages: int, micro_batches: int, virtual: int = 1) -> Schedule:
    """The table of schedule `name` for P = `stages`, m = `micro_batches`, V = `virtual`.

    Raises:
      ValueError: the combination cannot be scheduled (`check_shape`).
    """
    problem = check_shape(name, stages, micro_batches, virtual)
    if problem:
        raise ValueError(problem)
    p, m, v = stages, micro_batches, virtual
    order = [(i, 0) for i in range(m)]
    if name == "gpipe":
        programs = [[Action(F, i) for i in range(m)] + [Action(B, i) for i in range(m)] for _ in range(p)]
        table = _in_order(p, 1, programs)
    elif name == "1f1b":
        table = _in_order(p, 1, [_one_f_one_b(order, order, p - s - 1) for s in range(p)])
    elif name == "interleaved":
        # Megatron's order: micro-batches in groups of P, each group through chunk 0, 1, ... (forward)
        # and V-1, ..., 0 (backward); device s warms up with 2(P-s-1) + (V-1)P forwards.
        fwd = [(g * p + j, c) for g in range(m // p) for c in range(v) for j in range(p)]
        bwd = [(g * p + j, v - 1 - c) for g in range(m // p) for c in range(v) for j in range(p)]
        table = _in_order(p, v, [_one_f_one_b(fwd, bwd, 2 * (p - s - 1) + (v - 1) * p) for s in range(p)])
    else:
        table = _zero_bubble(p, m)
    return Schedule(name=name, stages=p, micro_batches=m, virtual=v, table=table)


def validate(schedule: Schedule) -> list[str]:
    """Every broken rule of `schedule`, in words ([] when valid): each (virtual stage, micro-batch)
    has one F and one B (and one W when split) in that order, on the device that holds the chunk;
    an F follows the previous virtual stage's F of the same micro-batch, a B the next one's B."""
    p, v_total = schedule.stages, schedule.stages * schedule.virtual
    at: dict = {}
    problems = []
    for tick, row in enumerate(schedule.table):
        if len(row) != p:
            problems.append(f"tick {tick} has {len(row)} entries for {p} stages")
        for s, a in enumerate(row):
            if a is None:
                continue
            key = (a.kind, a.chunk * p + s, a.mb)
            if not (0 <= a.mb < schedule.micro_batches and 0 <= a.chunk < schedule.virtual):
                problems.append(f"tick {tick} stage {s}: {a} is out of range")
            if key in at:
                problems.append(f"{a} on stage {s} runs twice (ticks {at[key]} and {tick})")
            at[key] = tick
    kinds = (F, B, W) if schedule.split_backward else (F, B)
    for v in range(v_total):
        for mb in range(schedule.micro_batches):
            ticks = {k: at.get((k, v, mb)) for k in kinds}
            missing = [k for k, t in ticks.items() if t is None]
            if missing:
                problems.append(f"virtual stage {v} micro-batch {mb} lacks {'/'.join(missing)}")
                continue
            if not ticks[F] < ticks[B]:
                problems.append(f"virtual stage {v} micro-batch {mb}: B at tick {ticks[B]} not after F at {ticks[F]}")
            if W in ticks and not ticks[B] < ticks[W]:
                problems.append(f"virtual stage {v} micro-batch {mb}: W at tick {ticks[W]} not after B at {ticks[B]}")
            if v > 0 and at.get((F, v - 1, mb), 1 << 30) >= ticks[F]:
                problems.append(f"virtual stage {v} micro-batch {mb}: F at tick {ticks[F]} before its input")
            if v < v_total - 1 and at.get((B, v + 1, mb), 1 << 30) >= ticks[B]:
                problems.append(f"virtual stage {v} micro-batch {mb}: B at tick {ticks[B]} before its cotangent")
    return problems


def render(schedule: Schedule) -> str:
    """The table as text, one line per tick (`F3` forward of micro-batch 3, `B3.1` chunk 1, `..` idle)."""
    def cell(a: Action | None) -> str:
        if a is None:
            return ".."
        return f"{a.kind}{a.mb}" + (f".{a.chunk}" if schedule.virtual > 1 else "")
    return "\n".join(" ".join(f"{cell(a):>5}" for a in row) for row in schedule.table)


# --------------------------------------------------------------------------------------------------
# What the executor runs: the schedule in lock step, every tick the same kinds of work on every stage
# --------------------------------------------------------------------------------------------------

class Cell(NamedTuple):
    """One stage's work of one kind in one tick: an entry of `Lockstep.fwd`, `.bwd` or `.wgt`.
    The executor scans each table as one `Cell` of [ticks, P] arrays."""

    valid: int  # 1: real work; 0: a stage in the fill or the drain, computing on zeros and keeping nothing
    mb: int  # its micro-batch
    chunk: int  # which of the device's V chunks (virtual stage chunk * P + stage)
    slot: int  # the stash slot of its forward's residuals (and of the loss's cotangent)
    wslot: int  # split backward: the slot of what its weight-gradient unit reads


class HeadCell(NamedTuple):
    """An entry of `Lockstep.head`: the last virtual stage's forward in that tick, whose loss it runs."""

    valid: int
    mb: int


@dataclasses.dataclass(frozen=True)
class Segment:
    """Consecutive ticks `[start, stop)` that run the same kinds of work on every stage."""

    start: int
    stop: int
    forward: bool  # every stage runs a forward (real or on zeros)
    head: bool  # the final norm, logits and loss of the last virtual stage's output, split over the stages
    backward: bool  # every stage runs a backward (from stashed residuals; input gradients only when split)
    weight: bool = False  # split backward: every stage runs a weight-gradient unit


@dataclasses.dataclass(frozen=True)
class Lockstep:
    """A schedule as the executor runs it: in every tick every stage runs the same kinds of work
    (a forward, the loss, a backward), so no stage computes a branch it then drops; a stage with
    nothing to do in the fill or the drain computes on zeros, which is the bubble.

    Micro-batch i enters virtual stage 0 at tick tau(i) (i; interleaved: groups of P every V*P
    ticks, so a device's forwards never collide) and reaches virtual stage v at tau(i) + v. Its
    backward leaves the last virtual stage in the same tick as its forward there (1f1b,
    interleaved, zero_bubble: the forward, the loss and the backward of one tick), or after all
    forwards (gpipe), and reaches v one tick after v + 1. So an activation and a cotangent are used
    in the tick after they are sent, and a stage keeps only the residuals of its forwards until
    their backward: `slots` of them (2PV - 1 for the fused schedules, m for gpipe), plus a scratch
    slot that a stage with nothing to do writes and reads (slot index `slots`).

    zero_bubble splits the backward (`split`): B computes the input gradient (and the gradients of
    what is not a plain projection), W the projections' weight gradients from B's per-projection
    inputs and output cotangents (`wslots` of them held, plus a scratch slot). Every stage runs its
    i-th W in the tick stage 0 runs its i-th B (w_tick(i) = i + 2(P-1)): W takes m ticks, not
    m + P - 1, and the drain's ticks run a B of one unit instead of two. Per stage the program
    costs 3m + 2(P-1) units against 1f1b's 3(m + P - 1) (each of F, B, W one unit).
    """

    name: str
    stages: int
    micro_batches: int
    virtual: int
    fwd: tuple  # [ticks][stages] of Cell
    bwd: tuple
    head: tuple  # [ticks] of HeadCell
    segments: tuple[Segment, ...]
    slots: int
    wgt: tuple = ()  # [ticks][stages] of Cell: the weight-gradient units (split only)
    wslots: int = 0

    @property
    def ticks(self) -> int:
        return len(self.fwd)

    @property
    def split(self) -> bool:
        return bool(self.wgt)

    def cost(self) -> float:
        """Per stage, the work of the program in forward units of a whole stage (a chunk forward 1/V,
        its backward 2/V, or its B and W 1/V each when split): what every stage executes, bubble included."""
        f = sum((s.stop - s.start) for s in self.segments if s.forward)
        b = sum((s.stop - s.start) for s in self.segments if s.backward)
        w = sum((s.stop - s.start) for s in self.segments if s.weight)
        return (f + (b + w if self.split else 2 * b)) / self.virtual

    def alone(self) -> tuple[bool, ...]:
        """Per segment, whether the executor runs its first tick on its own, before the scan of the
        others: a segment of backwards after a tick without one, whose first tick has no cotangent
        to receive and so sends none (`sends`), at the price of a second copy of that tick in the
        compiled program. Not a segment with the loss (the fill's successor in all but gpipe): XLA
        hoists the logits matrix's loop-invariant gather (ZeRO-3) out of each copy of such a tick,
        so a copy gathers the matrix once more (0.5 GB a step at Llama 3 405B's layout) to save one
        activation-sized send of zeros that runs beside that tick's forward (docs/PIPELINE.md)."""
        return tuple(g.backward and not g.head and not (i and self.segments[i - 1].backward)
                     for i, g in enumerate(self.segments))

    def bubble(self) -> float:
        """The share of the executed work that is the fill and drain's (computed on zeros)."""
        return 1.0 - 3 * self.micro_batches / self.cost()


class Send(NamedTuple):
    """One kind of send over `pipeline` in the ticks of one segment (`sends`)."""

    what: str  # "activation" (one stage on, read by the next tick's forward) | "cotangent" (one stage back)
    ticks: int  # how many of the segment's ticks send it (once each)
    beside: str  # the tick's work that neither feeds it nor reads it, letters of F H B W ("": none)

    @property
    def hidden(self) -> bool:
        """Whether a forward, backward or weight unit runs beside it (the loss alone, 1/P of the
        logits on each stage, is too thin to count on)."""
        return bool(set(self.beside) & set("FBW"))


def sends(prog: "Lockstep") -> tuple[tuple[Segment, tuple[Send, ...]], ...]:
    """What each segment of `prog` sends over `pipeline` as the executor runs it
    (`units.Device.tick`), and the work beside each send:

    - the activation, sent as soon as a tick's forward makes it: beside it the tick's backward and
      weight unit (and the loss, which reads the forward's output, not the send);
    - the cotangent a tick's backward returns, sent at the start of the next tick, which alone
      reads it, in its backward: beside it that tick's forward and loss (not its weight unit,
      which reads what the backward stashes: stage 0's W is the same tick's B's). The last
      backward's cotangent is never sent; the first tick of backwards after the fill sends the
      fill's zeros, beside its forward, unless it runs on its own (`Lockstep.alone`: gpipe's drain).

    So in the fill (forward only) the activation waits, since the next forward needs it, and in a
    drain of backwards alone the cotangent waits; in lock step every input arrives the tick before
    it is read, so nothing else could run beside them."""
    out = []
    for seg, alone in zip(prog.segments, prog.alone()):
        n = seg.stop - seg.start
        kinds = lambda *pairs: "".join(k for k, on in pairs if on)  # noqa: E731
        row = []
        if seg.forward:
            row.append(Send("activation", n, kinds(("H", seg.head), ("B", seg.backward), ("W", seg.weight))))
        if seg.backward and n - alone > 0:
            row.append(Send("cotangent", n - alone, kinds(("F", seg.forward), ("H", seg.head))))
        out.append((seg, tuple(row)))
    return tuple(out)


def _entry_tick(i: int, p: int, v: int) -> int:
    return i if v == 1 else (i // p) * v * p + i % p


@functools.lru_cache(maxsize=256)  # a pure table (frozen), rebuilt by every plan of a search otherwise
def lockstep(name: str, stages: int, micro_batches: int, virtual: int = 1) -> Lockstep:
    """The lock-step program of schedule `name` (zero_bubble: 1f1b's forwards and input gradients,
    and the deferred weight gradients, see `Lockstep`)."""
    problem = check_shape(name, stages, micro_batches, virtual)
    if problem:
        raise ValueError(problem)
    p, m, v = stages, micro_batches, virtual
    last = p * v - 1
    f_tick = {(i, w): _entry_tick(i, p, v) + w for i in range(m) for w in range(p * v)}
    if name == "gpipe":
        drain = m + p - 1  # the ticks of all forwards
        b_tick = {(i, w): drain + i + last - w for i in range(m) for w in range(p * v)}
    else:
        b_tick = {(i, w): f_tick[(i, last)] + last - w for i in range(m) for w in range(p * v)}
    split = name == "zero_bubble"
    w_tick = {(i, w): b_tick[(i, 0)] for i in range(m) for w in range(p * v)} if split else {}
    ticks = max(b_tick.values()) + 1
    empty = Cell(0, 0, 0, 0, 0)
    fwd, bwd, wgt = ([[empty] * p for _ in range(ticks)] for _ in range(3))
    head = [HeadCell(0, 0)] * ticks
    slots = wslots = 0
    for s in range(p):
        keys = [(i, c * p + s) for i in range(m) for c in range(v)]
        # residual slots: held from the forward's tick to the end of the backward's; split: the
        # weight unit's inputs from the backward's tick to the end of the weight unit's
        slot_of, used = _slots(keys, f_tick, b_tick)
        slots = max(slots, used)
        wslot_of, used = _slots(keys, b_tick, w_tick) if split else ({}, 0)
        wslots = max(wslots, used)
        for key in keys:
            i, w = key
            cell = Cell(valid=1, mb=i, chunk=w // p, slot=slot_of[key], wslot=wslot_of.get(key, 0))
            fwd[f_tick[key]][s], bwd[b_tick[key]][s] = cell, cell
            if split:
                wgt[w_tick[key]][s] = cell
            if w == last:
                head[f_tick[key]] = HeadCell(valid=1, mb=i)
    scratch = Cell(0, 0, 0, slots, wslots)  # a stage with nothing to do writes and reads the scratch slots
    fwd, bwd, wgt = ([[a if a.valid else scratch for a in row] for row in table] for table in (fwd, bwd, wgt))
    has_f = [any(a.valid for a in row) for row in fwd]
    has_b = [any(a.valid for a in row) for row in bwd]
    has_w = [any(a.valid for a in row) for row in wgt]
    heads = [t for t in range(ticks) if head[t].valid]
    has_h = [has_f[t] and heads[0] <= t <= heads[-1] for t in range(ticks)]  # V > 1: every tick between
    kinds = lambda t: (has_f[t], has_h[t], has_b[t], has_w[t])  # noqa: E731
    segments, start = [], 0
    for t in range(1, ticks + 1):
        if t == ticks or kinds(t) != kinds(start):
            segments.append(Segment(start, t, *kinds(start)))
            start = t
    return Lockstep(name=name, stages=p, micro_batches=m, virtual=v, fwd=tuple(map(tuple, fwd)),
                    bwd=tuple(map(tuple, bwd)), head=tuple(head), segments=tuple(segments), slots=slots,
                    wgt=tuple(map(tuple, wgt)) if split else (), wslots=wslots)


def _slots(keys: list, start: dict, stop: dict) -> tuple[dict, int]:
    """A slot per key, held from tick start[key] through stop[key] (reused from the tick after):
    ({key: slot}, slots used)."""
    free, used, release, slot_of = [], 0, [], {}
    for key in sorted(keys, key=lambda k: start[k]):
        t = start[key]
        for done_t, slot in list(release):
            if done_t < t:
                free.append(slot)
                release.remove((done_t, slot))
        if free:
            slot = min(free)
            free.remove(slot)
        else:
            slot, used = used, used + 1
        release.append((stop[key], slot))
        slot_of[key] = slot
    return slot_of, used


def validate_lockstep(prog: Lockstep) -> list[str]:
    """Every broken rule of `prog` ([] when valid): each (micro-batch, virtual stage) has one forward
    and one backward on the device holding its chunk; a forward's input was sent in the tick before
    (or it is virtual stage 0), a backward's cotangent likewise (or it is the last virtual stage,
    whose loss runs in its forward's tick); no slot is written while its residuals wait. Split: each
    also has one weight unit, in or after its backward's tick, reading the slot its backward wrote,
    which nothing writes in between."""
    p, v, m = prog.stages, prog.virtual, prog.micro_batches
    last = p * v - 1
    at_f, at_b, at_w, problems = {}, {}, {}, []
    for t in range(prog.ticks):
        for s in range(p):
            for table, at in ((prog.fwd, at_f), (prog.bwd, at_b), (prog.wgt, at_w)):
                if not table:
                    continue
                cell = table[t][s]
                if cell.valid:
                    key = (cell.mb, cell.chunk * p + s)
                    if key in at:
                        problems.append(f"micro-batch {cell.mb} virtual stage {key[1]} twice")
                    at[key] = (t, cell.wslot if table is prog.wgt else cell.slot, s)
    for i in range(m):
        for w in range(last + 1):
            if (i, w) not in at_f or (i, w) not in at_b:
                problems.append(f"micro-batch {i} virtual stage {w} lacks a forward or a backward")
                continue
            (tf, sf, _), (tb, sb, _) = at_f[(i, w)], at_b[(i, w)]
            if sf != sb or tb < tf:
                problems.append(f"micro-batch {i} virtual stage {w}: backward at {tb} (slot {sb}) before "
                                f"or apart from its forward at {tf} (slot {sf})")
            if w > 0 and at_f.get((i, w - 1), (None,))[0] != tf - 1:
                problems.append(f"micro-batch {i} virtual stage {w}: forward at {tf} not the tick after its input")
            if w < last and at_b.get((i, w + 1), (None,))[0] != tb - 1:
                problems.append(f"micro-batch {i} virtual stage {w}: backward at {tb} not the tick after its cotangent")
            if w == last and tb == tf and not prog.head[tf].valid:
                problems.append(f"micro-batch {i}: no loss in the tick of its last forward")
            if prog.split:
                tw, sw, dw = at_w.get((i, w), (None, None, None))
                if tw is None or tw < tb or dw != at_b[(i, w)][2] or sw != prog.bwd[tb][dw].wslot:
                    problems.append(f"micro-batch {i} virtual stage {w}: weight unit at {tw} (slot {sw}) "
                                    f"before or apart from its backward at {tb}")
    writes = [(prog.fwd, "slot", at_b)] + ([(prog.bwd, "wslot", at_w)] if prog.split else [])
    for table, field, until in writes:
        for s in range(p):
            held: dict[int, tuple[int, int]] = {}
            for t in range(prog.ticks):
                cell = table[t][s]
                slot = getattr(cell, field)
                if cell.valid:
                    if slot in held and held[slot][1] >= t:
                        problems.append(f"stage {s} tick {t}: slot {slot} still held for micro-batch {held[slot][0]}")
                    held[slot] = (cell.mb, until.get((cell.mb, cell.chunk * p + s), (t,))[0])
    return problems
