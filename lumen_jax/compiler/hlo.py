"""Read an HLO module's text: its instructions, how often each runs per step, and the things a
reviewer looks for before a GPU run (kernels, fp8 dots, collectives, the largest arrays).

Works on both kinds of text JAX gives: a lowered module (`lowered.as_text(dialect="hlo")`, before
the SPMD partitioner: shapes are global outside per-device (manual) regions and per shard inside them) and a compiled
one (`compiled.as_text()`, per device). `python -m lumen_jax.lower` prints what `summarize` finds;
tests/plan/test_lower.py asserts on it.

Executions per step: an instruction in the entry computation runs once; one inside a `while` body
runs the loop's trip count times (nested loops multiply). The trip count is XLA's
`known_trip_count` when the text has it (compiled modules), else the single integer constant the
loop condition compares against (how `lax.scan` lowers: `i < L`); a loop whose count cannot be read
counts once and is flagged (`Module.unknown_trip_counts`).

`on_mesh` gives each collective of a compiled program the mesh axes its device groups span, which
is what the planner's collective bytes are compared with (`lower --against-xla`, the communication
tests).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Iterable

import numpy as np

# Bytes per element of HLO element types (pred and the fp8 types take one byte).
ELEMENT_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                 "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?(%?[\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_CALLED = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=(%?[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONST_INT = re.compile(r"\bs(?:32|64)\[\] constant\((\d+)\)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_KERNEL_NAME = re.compile(r'\bname = "([^"]+)"')


def target_of(line: str) -> str:
    """A custom call's target ("" for other instructions)."""
    m = _TARGET.search(line)
    return m.group(1) if m else ""


def kernel_of(line: str) -> str:
    """A Pallas/Triton custom call's kernel name (its backend_config `name`; "" for others)."""
    m = _KERNEL_NAME.search(line)
    return m.group(1) if m else ""


def dtypes_in(text: str) -> set[str]:
    """The element types of the arrays `text` spells out (e.g. an instruction's typed operands)."""
    return {t for t, _ in _ARRAY.findall(text)}


def element_bytes(dtype: str) -> int:
    return ELEMENT_BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return element_bytes(self.dtype) * math.prod(self.dims)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    op: str  # HLO opcode: dot, custom-call, all-gather, while, ...
    arrays: tuple[Array, ...]  # the result: one array, or a tuple's arrays
    line: str  # the whole instruction text
    computation: str

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def _result_text(rest: str) -> tuple[str, str]:
    """Split "SHAPE opcode(...)..." into (SHAPE, the remainder), SHAPE possibly a (tuple, ...)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    shape, _, tail = rest.partition(" ")
    return shape, tail


def _parse_instr(line: str, computation: str) -> Instr | None:
    s = line.strip()
    if s.startswith("ROOT "):
        s = s[5:]
    name, sep, rest = s.partition(" = ")
    if not sep or " " in name:
        return None
    shape, tail = _result_text(rest)
    op = tail.split("(", 1)[0].strip()
    if not op or " " in op:
        return None
    arrays = tuple(Array(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape))
    return Instr(name=name.lstrip("%"), op=op, arrays=arrays, line=s, computation=computation)


@dataclasses.dataclass
class Module:
    """An HLO module's instructions with the number of times each computation runs per step."""

    instrs: list[Instr]
    runs: dict[str, int]  # computation -> executions per step (0: not reached from the entry)
    loops: list[tuple[str, int | None]]  # (while body, trip count or None when unreadable)
    # computation -> what it calls: (the computations of which one runs (a conditional's branches;
    # else one), times per execution (a while body: its trip count))
    calls: dict[str, list[tuple[tuple[str, ...], int]]] = dataclasses.field(default_factory=dict)
    entry: str | None = None

    def critical(self, own: dict[str, float]) -> float:
        """The sum over the step of `own` (computation -> its cost per execution, without what it
        calls), each conditional at its dearest branch: what a device on the critical path runs
        when devices in lock step take different branches (context parallelism's hop switch)."""
        memo: dict[str, float] = {}

        def cost(comp: str, depth: int = 0) -> float:
            if comp not in memo:
                memo[comp] = own.get(comp, 0.0) + (0.0 if depth > 64 else sum(
                    times * max(cost(c, depth + 1) for c in alternatives)
                    for alternatives, times in self.calls.get(comp, ())))
            return memo[comp]
        return cost(self.entry) if self.entry is not None else 0.0

    @property
    def unknown_trip_counts(self) -> int:
        return sum(n is None for _, n in self.loops)

    def executions(self, instr: Instr) -> int:
        return self.runs.get(instr.computation, 0)

    def where(self, op: str) -> list[Instr]:
        return [i for i in self.instrs if i.op == op]


def parse(text: str, prefer: str | None = None) -> Module:
    """Parse HLO text (lowered or compiled) into a `Module`. Every branch of a conditional is
    counted once per execution, except that with `prefer`, a conditional some of whose branches
    hold `prefer` in their own instructions' text (e.g. a named scope in the op names) counts
    those branches only: the branch a program takes in its steady state."""
    comps: dict[str, list[str]] = collections.defaultdict(list)
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line.strip())
            if m and " = " not in line:
                current = m.group(1).lstrip("%")
                if line.lstrip().startswith("ENTRY"):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        comps[current].append(line)
    instrs = [i for c, lines in comps.items() for i in (_parse_instr(ln, c) for ln in lines) if i]
    by_comp: dict[str, list[Instr]] = collections.defaultdict(list)
    for i in instrs:
        by_comp[i.computation].append(i)

    loops: list[tuple[str, int | None]] = []
    runs: dict[str, int] = collections.defaultdict(int)
    calls: dict[str, list[tuple[tuple[str, ...], int]]] = collections.defaultdict(list)
    for comp, comp_instrs in by_comp.items():
        for i in comp_instrs:
            called = dict(_CALLED.findall(i.line))
            if i.op == "while":
                body, cond = called.get("body", "").lstrip("%"), called.get("condition", "").lstrip("%")
                trip = _trip_count(i.line, by_comp.get(cond, [])) or 1
                calls[comp] += [((body,), trip), ((cond,), trip + 1)]
                continue
            branches = [b.strip().lstrip("%") for b in (_BRANCHES.findall(i.line) or [""])[0].split(",") if b.strip()]
            branches += [v.lstrip("%") for k, v in called.items() if k in ("true_computation", "false_computation")]
            if prefer is not None and len(branches) > 1:
                marked = [b for b in branches if any(prefer in ln for ln in comps.get(b, ()))]
                branches = marked or branches
            if branches:
                calls[comp].append((tuple(branches), 1))
            calls[comp] += [((v.lstrip("%"),), 1) for k, v in called.items()
                            if k not in ("true_computation", "false_computation") and (k != "to_apply" or i.op == "call")]

    def visit(comp: str, times: int, depth: int = 0) -> None:
        if depth > 64:
            return
        runs[comp] += times
        for i in by_comp.get(comp, ()):
            if i.op == "while":
                cond = dict(_CALLED.findall(i.line)).get("condition", "").lstrip("%")
                loops.append((dict(_CALLED.findall(i.line)).get("body", "").lstrip("%"),
                              _trip_count(i.line, by_comp.get(cond, []))))
        for alternatives, n in calls.get(comp, ()):
            for t in alternatives:  # fusions, calls, loops, conditionals (every branch counted once)
                visit(t, times * n, depth + 1)

    if entry is not None:
        visit(entry, 1)
    return Module(instrs=instrs, runs=dict(runs), loops=loops, calls=dict(calls), entry=entry)


def _trip_count(while_line: str, condition: list[Instr]) -> int | None:
    m = _TRIP.search(while_line)
    if m:
        return int(m.group(1))
    consts = {int(c) for i in condition for c in _CONST_INT.findall(i.line)}
    return consts.pop() if len(consts) == 1 else None


# --------------------------------------------------------------------------------------------------
# What a reader looks for
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Call:
    """Custom calls of one target (and kernel name, for Pallas/Triton kernels)."""

    target: str
    kernel: str  # the kernel's name (Triton: backend_config name), "" for other custom calls
    instructions: int  # in the module text
    per_step: int  # executions per step (loops counted)


def custom_calls(module: Module, skip: Iterable[str] = ("Sharding", "SPMDFullToShardShape",
                                                         "SPMDShardToFullShape")) -> list[Call]:
    """Custom calls by (target, kernel name), without the partitioner's annotations (`skip`, and
    Shardy's `xla.sdy.*`)."""
    seen: dict[tuple[str, str], list[int]] = {}
    for i in module.where("custom-call"):
        target = target_of(i.line) or "?"
        if target in skip or target.startswith("xla.sdy."):
            continue
        key = (target, kernel_of(i.line))
        n = seen.setdefault(key, [0, 0])
        n[0] += 1
        n[1] += module.executions(i)
    return [Call(t, k, n[0], n[1]) for (t, k), n in sorted(seen.items())]


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    instructions: int
    per_step: int
    bytes_per_step: int  # result bytes x executions (per device in a compiled program or a manual region)


_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))? "
                          r"\{([^}]*)\}")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[0-9,{} ]*\})\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{([0-9,{} ]*)\}")


def _iota(dims: str, perm: str | None) -> np.ndarray:
    ids = np.arange(math.prod(int(x) for x in dims.split(","))).reshape([int(x) for x in dims.split(",")])
    return ids.transpose([int(x) for x in perm.split(",")]) if perm else ids


def device_groups(line: str) -> list[list[int]] | None:
    """The device groups of a collective (flat device indices), from any of HLO's spellings:
    `mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}`, `[2,4]<=[8]`, `{{0,1},{2,3}}`,
    or a collective-permute's source-target pairs. None when the text gives none."""
    m = _GROUPS_MESH.search(line)
    if m:
        named = [(a.split("=")[0].strip().strip("'"), int(a.split("=")[1])) for a in m.group(1).split(",")]
        shape = [n for _, n in named]
        ids = (_iota(m.group(2), m.group(3)) if m.group(2) else np.arange(math.prod(shape))).reshape(shape)
        over = [k for k, (a, _) in enumerate(named) if f"'{a}'" in m.group(4)]
        rest = [k for k in range(len(shape)) if k not in over]
        return ids.transpose(rest + over).reshape(-1, math.prod(shape[k] for k in over)).tolist()
    m = _GROUPS_IOTA.search(line)
    if m:
        return _iota(m.group(2), m.group(3)).reshape([int(x) for x in m.group(1).split(",")]).tolist()
    m = _GROUPS_LIST.search(line) or _PAIRS.search(line)
    if m:
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([0-9, ]*)\}", m.group(1))]
    return None


def group_size(i: Instr) -> int | None:
    """Devices per replica group of a collective (None when the text gives no groups)."""
    groups = device_groups(i.line)
    return len(groups[0]) if groups and i.op != "collective-permute" else None


def collectives(module: Module) -> list[Collective]:
    """Collectives by kind (`-start`/`-done` pairs of async collectives counted once, at the start).

    Collectives over groups of one device move nothing (a manual region's transpose sums cotangents
    over mesh axes of size 1; XLA drops them): they are left out.
    """
    out = []
    for kind in COLLECTIVES:
        found = [i for i in module.instrs if i.op in (kind, f"{kind}-start") and group_size(i) != 1]
        if found:
            out.append(Collective(kind, len(found), sum(module.executions(i) for i in found),
                                  sum(_payload(i) * module.executions(i) for i in found)))
    return out


def _payload(i: Instr) -> int:
    # An async start's tuple holds the operand and the result: count the result (the last array).
    return i.arrays[-1].nbytes if i.op.endswith("-start") and i.arrays else i.nbytes


def largest_arrays(module: Module, top: int = 8) -> list[tuple[Instr, int]]:
    """The `top` largest distinct result shapes of instructions that compute, each as (the first
    instruction with it, how many have it). Parameters, constants, tuples and loop/call wrappers,
    which only pass their operands on, are left out, and so are tuples (a kernel's or a manual region's
    several results: their arrays appear where they are used)."""
    passive = {"parameter", "constant", "tuple", "get-tuple-element", "while", "call", "conditional",
               "bitcast", "copy-start", "copy-done", "opt-barrier"}
    shapes: dict[tuple[Array, ...], list[Instr]] = {}
    for i in module.instrs:
        if i.op not in passive and len(i.arrays) == 1 and module.runs.get(i.computation, 0):
            shapes.setdefault(i.arrays, []).append(i)
    ranked = sorted(shapes.values(), key=lambda same: -same[0].nbytes)[:top]
    return [(same[0], len(same)) for same in ranked]


def square_arrays(module: Module, length: int) -> list[tuple[Instr, Array]]:
    """(instruction, array) for every result array whose last two dimensions are both `length`
    ([.., T, T]: attention scores when `length` is the sequence length)."""
    return [(i, a) for i in module.instrs for a in i.arrays
            if len(a.dims) >= 2 and a.dims[-1] == a.dims[-2] == length]


# --------------------------------------------------------------------------------------------------
# Collectives on a mesh: what the planner compares (`lower --against-xla`,
# tests/parallel/test_communication.py)
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MeshCollective:
    """One collective instruction of a partitioned program and how often it runs per step."""

    kind: str  # one of COLLECTIVES
    dtype: str  # HLO element type: f32, bf16, ...
    bytes: int  # the full array of one call: all-reduce's, the gathered one, the one reduce-scattered
    axes: tuple[str, ...]  # the mesh axes its groups span, in the mesh's order
    count: int  # executions per step (the enclosing loops' trip counts)

    @property
    def total(self) -> int:
        return self.bytes * self.count


def _axes(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which members of a group differ (device i = flat mesh index i)."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    varying: set[str] = set()
    for g in groups:
        if len(g) > 1:
            coords = np.array(np.unravel_index(np.asarray(g), sizes)).T
            varying |= {names[k] for k in range(len(names)) if len(set(coords[:, k])) > 1}
    return tuple(a for a in names if a in varying)


def on_mesh(module: Module, mesh_shape: dict[str, int]) -> list[MeshCollective]:
    """Every collective of a compiled SPMD `module` with the mesh axes it crosses (`mesh_shape`:
    {axis: size} in the mesh's order), weighted by loop trip counts. Groups of one device are left out."""
    out = []
    for i in module.instrs:
        kind = i.op[:-len("-start")] if i.op.endswith("-start") else i.op
        groups = device_groups(i.line) if kind in COLLECTIVES else None
        if groups is None or not module.executions(i):
            continue
        axes = _axes(groups, mesh_shape)
        if not axes:
            continue
        full = _payload(i) * (len(groups[0]) if kind == "reduce-scatter" else 1)
        out.append(MeshCollective(kind=kind, dtype=i.arrays[-1].dtype if i.arrays else "", bytes=full, axes=axes,
                                  count=module.executions(i)))
    return out


def bytes_by_axes(collectives: Iterable[MeshCollective]) -> dict[tuple[str, str, str], int]:
    """Bytes per step by (axes joined with '+', kind, dtype)."""
    total: dict[tuple[str, str, str], int] = collections.defaultdict(int)
    for c in collectives:
        total[("+".join(c.axes), c.kind, c.dtype)] += c.total
    return dict(total)


_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_FIRST_OPERAND = re.compile(r" dot\(\s*(?:([a-z][a-z0-9]*)\[([0-9,]*)\]\S*\s+)?%?([\w.\-]+)")


def matmul_flops(module: Module) -> int:
    """Matmul FLOPs of one device per step on the critical path: 2 x output elements x contracted
    size of every `dot`, times the executions of its computation (loop bodies times their trip
    counts), a conditional at its dearest branch (`Module.critical`: devices in lock step that take
    different branches, as context parallelism's hop switch does, wait for the dearest)."""
    own: dict[str, float] = collections.defaultdict(float)
    for (comp, _), flops in _dot_flops(module).items():
        own[comp] += flops
    return int(module.critical(own))


def _dot_flops(module: Module) -> dict[tuple[str, str], int]:
    """{(computation, dot): 2 x output elements x contracted size} of every `dot`."""
    shapes = {(i.computation, i.name): i.arrays[0] for i in module.instrs if len(i.arrays) == 1}
    out: dict[tuple[str, str], int] = {}
    for i in module.where("dot"):
        m, c = _FIRST_OPERAND.search(i.line), _CONTRACTING.search(i.line)
        if m is None or c is None or not i.arrays:
            continue
        lhs = (tuple(int(d) for d in m.group(2).split(",") if d) if m.group(1)
               else getattr(shapes.get((i.computation, m.group(3))), "dims", None))
        if lhs is not None:
            out[(i.computation, i.name)] = 2 * math.prod(i.arrays[0].dims) * math.prod(
                lhs[int(k)] for k in c.group(1).split(",") if k)
    return out


@dataclasses.dataclass(frozen=True)
class Beside:
    """An instruction and the matmul work of its computation that could run while it does."""

    instr: Instr
    flops: float  # matmul FLOPs (per execution of its computation) of the instructions that neither
    # feed it nor read its result, loops and fusions included (`matmul_flops`' count)
    computation_flops: float  # all the matmul FLOPs of its computation, per execution


def beside(module: Module, ops: Iterable[str] = ("collective-permute", "collective-permute-start")) -> list[Beside]:
    """For every instruction of `ops`: the matmuls of its computation that are independent of it,
    neither among what it is computed from nor among what reads its result, which a scheduler may
    run while it is in flight (an async collective under compute). A `while`, `call`, `fusion` or
    `conditional` counts with the matmuls it runs (a loop: times its trip count; a conditional: its
    dearest branch)."""
    ops = tuple(ops)
    dots = _dot_flops(module)
    by_comp: dict[str, list[Instr]] = collections.defaultdict(list)
    for i in module.instrs:
        by_comp[i.computation].append(i)
    memo: dict[str, float] = {}

    def comp_flops(comp: str, depth: int = 0) -> float:
        if comp not in memo:
            memo[comp] = 0.0  # a cycle guard; HLO has none
            memo[comp] = sum(instr_flops(i, depth + 1) for i in by_comp.get(comp, ()))
        return memo[comp]

    def instr_flops(i: Instr, depth: int = 0) -> float:
        if i.op == "dot":
            return dots.get((i.computation, i.name), 0.0)
        if depth > 64:
            return 0.0
        called = dict(_CALLED.findall(i.line))
        if i.op == "while":
            cond = called.get("condition", "").lstrip("%")
            trip = _trip_count(i.line, by_comp.get(cond, [])) or 1
            return trip * comp_flops(called.get("body", "").lstrip("%"), depth)
        branches = [b.strip().lstrip("%") for b in (_BRANCHES.findall(i.line) or [""])[0].split(",") if b.strip()]
        branches += [v.lstrip("%") for k, v in called.items() if k in ("true_computation", "false_computation")]
        if branches:
            return max(comp_flops(b, depth) for b in branches)
        return sum(comp_flops(v.lstrip("%"), depth) for k, v in called.items() if k in ("calls", "to_apply"))

    out = []
    for comp in sorted({i.computation for i in module.instrs if i.op in ops}):
        instrs = by_comp[comp]
        own = {i.name for i in instrs}
        operands = {i.name: {o for o in re.findall(r"%([\w.\-]+)", i.line.split(" = ", 1)[1]) if o in own}
                    for i in instrs}
        users: dict[str, set[str]] = collections.defaultdict(set)
        for n, used in operands.items():
            for o in used:
                users[o].add(n)
        flops = {i.name: instr_flops(i) for i in instrs}

        for i in instrs:
            if i.op in ops:
                tied = reachable(i.name, operands) | reachable(i.name, users) | {i.name}
                out.append(Beside(i, sum(f for n, f in flops.items() if n not in tied), sum(flops.values())))
    return out


def reachable(start: str, edges: dict) -> set[str]:
    """The instructions reachable from `start` along `edges` (name -> names: operands or users), `start`
    itself left out unless a cycle returns to it."""
    seen, todo = set(), [start]
    while todo:
        for n in edges.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen
