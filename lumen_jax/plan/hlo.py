"""The collectives of a compiled program, read from its HLO text: kind, dtype, bytes, the mesh axes
each one crosses, and how many times it runs per step (the trip counts of the loops around it).

XLA's `cost_analysis` counts a loop body once, so a gradient all-reduce inside the micro-batch scan
looks like one all-reduce however many micro-batches there are. Here every instruction is weighted
by the `known_trip_count` of each `while` that (transitively) calls its computation, which is what
`python -m lumen_jax.plan --against-xla` and the communication tests compare with the plan.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import Iterable

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1,
                "f8e4m3fnuz": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
                "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INST = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_CALLS = re.compile(r"(?:body|to_apply|calls|condition|true_computation|false_computation|"
                    r"branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))? \{([^}]*)\}")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[0-9,{} ]*\})\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{([0-9,{} ]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the program and how often it runs per step."""

    kind: str  # one of KINDS
    dtype: str  # HLO element type: f32, bf16, ...
    bytes: int  # the full array of one call: all-reduce's, the gathered one, the one reduce-scattered
    axes: tuple[str, ...]  # the mesh axes its groups span (sorted by the mesh's order)
    count: int  # runs per step (product of the enclosing loops' trip counts)

    @property
    def total(self) -> int:
        return self.bytes * self.count


def _array_bytes(shape_text: str, async_start: bool) -> tuple[str, int]:
    """(dtype, bytes) of an HLO result shape: a tuple (combined collectives) sums its arrays; the
    tuple of an async start other than all-reduce's holds (operands, results): the results count."""
    arrays = _ARRAY.findall(shape_text)
    if async_start and len(arrays) > 1:
        arrays = arrays[len(arrays) // 2:]
    total = 0
    for dtype, dims in arrays:
        total += int(np.prod([int(d) for d in dims.split(",") if d])) * _DTYPE_BYTES.get(dtype, 4)
    return (arrays[0][0] if arrays else ""), total


def _groups(line: str, num_devices: int) -> list[list[int]]:
    """The device groups of a collective, from any of HLO's spellings of them."""
    m = _GROUPS_MESH.search(line)
    if m:  # mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}
        named = [(a.strip().strip("'").split("'=")[0], int(a.split("=")[1])) for a in m.group(1).split(",")]
        shape = [n for _, n in named]
        ids = np.arange(num_devices)
        if m.group(2):
            ids = ids.reshape([int(x) for x in m.group(2).split(",")])
            if m.group(3):
                ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        ids = ids.reshape(shape)
        over = [i for i, (a, _) in enumerate(named) if f"'{a}'" in m.group(4)]
        rest = [i for i in range(len(shape)) if i not in over]
        size = int(np.prod([shape[i] for i in over])) if over else 1
        return ids.transpose(rest + over).reshape(-1, size).tolist()
    m = _GROUPS_IOTA.search(line)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    m = _GROUPS_LIST.search(line)
    if m:
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([0-9, ]*)\}", m.group(1))]
    m = _PAIRS.search(line)
    if m:
        return [[int(x) for x in p.split(",")] for p in re.findall(r"\{([0-9, ]*)\}", m.group(1))]
    return [list(range(num_devices))]


def _axes(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the members of the groups differ (device i = flat mesh index i)."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    varying: set[str] = set()
    for g in groups:
        if len(g) < 2:
            continue
        coords = np.array(np.unravel_index(np.asarray(g), sizes)).T
        varying |= {names[k] for k in range(len(names)) if len(set(coords[:, k])) > 1}
    return tuple(a for a in names if a in varying)


def parse(hlo_text: str, mesh_shape: dict[str, int]) -> list[Collective]:
    """Every collective of `hlo_text` (a compiled module's `as_text()`), weighted by loop trip counts.

    Args:
      hlo_text: the optimized HLO of an SPMD-partitioned program.
      mesh_shape: {axis: size} in the mesh's order (device i of a group is flat mesh index i).
    """
    num_devices = int(np.prod(list(mesh_shape.values())))
    body: dict[str, list[str]] = defaultdict(list)
    callers: dict[str, list[tuple[str, int]]] = defaultdict(list)  # callee -> [(caller, times)]
    current = None
    for line in hlo_text.splitlines():
        if current is None or line.startswith(("ENTRY", "%")) and line.rstrip().endswith("{"):
            m = _COMP.match(line)
            if m:
                current = m.group(1)
                continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        body[current].append(line)
        trip = _TRIP.search(line)
        for m in _CALLS.finditer(line):
            for callee in m.group(1).strip("{}").replace("%", "").split(","):
                callee = callee.strip()
                if callee:
                    is_body = f"body={callee}" in line.replace("%", "")
                    callers[callee].append((current, int(trip.group(1)) if trip and is_body else 1))

    memo: dict[str, int] = {}

    def times(comp: str, seen: frozenset = frozenset()) -> int:
        if comp in memo:
            return memo[comp]
        if comp not in callers or comp in seen:
            return 1
        n = sum(t * times(c, seen | {comp}) for c, t in callers[comp])
        memo[comp] = n
        return n

    out = []
    for comp, lines in body.items():
        for line in lines:
            m = _INST.match(line)
            if not m:
                continue
            op = m.group(2)
            kind = op[:-len("-start")] if op.endswith("-start") else op
            if kind not in KINDS:
                continue
            dtype, nbytes = _array_bytes(m.group(1), op.endswith("-start") and kind != "all-reduce")
            groups = _groups(line, num_devices)
            if kind == "reduce-scatter":  # the full array that is reduced, like the other kinds
                nbytes *= max(len(groups[0]), 1)
            out.append(Collective(kind=kind, dtype=dtype, bytes=nbytes, axes=_axes(groups, mesh_shape),
                                  count=times(comp)))
    return out


def summarize(collectives: Iterable[Collective]) -> dict[tuple[str, str, str], int]:
    """Bytes per step by (axes joined with '+', kind, dtype)."""
    total: dict[tuple[str, str, str], int] = defaultdict(int)
    for c in collectives:
        total[("+".join(c.axes) or "none", c.kind, c.dtype)] += c.total
    return dict(total)
