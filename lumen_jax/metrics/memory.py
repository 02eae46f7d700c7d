"""The compiled step's bytes per device next to the planner's prediction: one start-up line and
`<run_dir>/compile.json`.

XLA's `memory_analysis()` of the compiled step gives per device the bytes of its arguments (the
state and the batch), its outputs, its temporaries and the outputs that reuse a donated argument
(aliased); the step needs arguments + outputs + temporaries - aliased (on CPU the report's own peak
leaves the temporaries out: docs/PLATFORM.md). The prediction is `python -m lumen_jax.plan`'s for
the same config and mesh (train/cli.py computes it; this module imports no planner).
"""

from __future__ import annotations

from typing import Any, Mapping

def compiled_bytes(compiled: Any) -> dict[str, int] | None:
    """{arguments, outputs, temporaries, aliased, total} bytes per device of a `jax.stages.Compiled`
    (None where the backend gives no analysis)."""
    analysis = getattr(compiled, "memory_analysis", None)
    ma = analysis() if analysis is not None else None
    if ma is None:
        return None
    out = {"arguments": int(ma.argument_size_in_bytes), "outputs": int(ma.output_size_in_bytes),
           "temporaries": int(ma.temp_size_in_bytes), "aliased": int(ma.alias_size_in_bytes)}
    return {**out, "total": out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]}


def compiled_flops(compiled: Any) -> float | None:
    """Per-device FLOPs XLA counts for the step (a loop body once, elementwise work included); None
    where the backend gives no analysis."""
    analysis = getattr(compiled, "cost_analysis", None)
    cost = analysis() if analysis is not None else None
    if not cost:
        return None
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def size(x: float) -> str:
    """Bytes to three significant digits in B, kB, MB, GB or TB (powers of 10): `243 kB`, `8.05 MB`."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} B"


def memory_line(compiled: Mapping[str, int] | None, planned: Mapping[str, float] | None,
                planned_error: str = "") -> str:
    """`memory per device: compiled 8.05 MB (...), planned 7.99 MB (...)`."""
    c = compiled
    line = ("memory per device: compiled: unavailable (no memory analysis from this backend)" if c is None else
            f"memory per device: compiled {size(c['total'])} (arguments {size(c['arguments'])} + outputs "
            f"{size(c['outputs'])} + temporaries {size(c['temporaries'])} - aliased {size(c['aliased'])})")
    if planned is None:
        return line + f", planned: unavailable ({planned_error or 'no prediction'})"
    state = sum(v for k, v in planned.items() if k not in ("activations", "total"))
    return line + f", planned {size(planned['total'])} (state {size(state)} + activations {size(planned['activations'])})"


def report(compiled: Any, planned: Mapping[str, float] | None, planned_error: str, *, devices: int,
           platform: str, mesh: Mapping[str, int], compile_s: float) -> dict[str, Any]:
    """What compile.json holds."""
    return {"devices": devices, "platform": platform, "mesh": dict(mesh), "compile_s": compile_s,
            "compiled_bytes_per_device": compiled_bytes(compiled), "planned_bytes_per_device": planned,
            **({"planned_error": planned_error} if planned is None else {}),
            "compiled_flops_per_device": compiled_flops(compiled)}
