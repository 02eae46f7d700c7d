"""Count the bytes, FLOPs and collectives of a run before launch: `python -m lumen_jax.plan`.

```
python -m lumen_jax.plan --config configs/llama3_70b.yaml --devices 1024 --device h100 [key=value ...]
python -m lumen_jax.plan --config configs/llama3_405b.yaml --devices 16384 --device h100 --search
```

Everything is arithmetic on the config, in small pure functions a test or a notebook can call one
by one. Per-device figures are for the worst device (the pipeline stage holding the embedding or
the logits, plus its share of the layers). The model behind each number, its calibration against
XLA, and a worked 7B/70B example are in docs/PLANNING.md.

- `hardware`: `Hardware` (memory, peak, links), `DEVICES`, `Layout` (the config's resolved `mesh`
  section, plus pipeline stages and micro-batches).
- `memory`: `state_bytes` (exact, from the parameter shapes and the sharding rules), `activation_bytes`.
- `cost`: `flops_per_device`, `compiled_flops_per_device`, `bubble_fraction`, `collectives` per mesh
  axis. FLOP counts per token are `lumen_jax.metrics.flops`'s (one count for the trainer and the planner).
- `moe`: the mixture-of-experts terms: the dispatch's buffers, an MoE layer's bytes, its all-to-alls,
  the FLOPs the compiler counts for it.
- `predict`: `predict` -> `Plan` (bytes, FLOPs, step time, MFU, verdict), `search`.
- `compiled`: `compile_step`, `against_xla`: the real step compiled on emulated CPU devices, XLA's
  bytes and FLOPs next to the plan's (`--against-xla`; imported on use: it loads the trainer).
- `cli`: the command line.
"""

from lumen_jax.plan.collectives import Collective, collectives, link_of
from lumen_jax.plan.cost import (ELEMENTWISE_OPS, bubble_fraction, compiled_flops_per_device, context_score_fraction,
                                 flops_per_device, planned_flops_per_token)
from lumen_jax.plan.hardware import AXES, DEVICES, Hardware, Layout, compute_bytes, layout_from_config
from lumen_jax.plan.memory import (BACKWARD_ROWS, CONTEXT_BACKWARD_ROWS, STATE_BYTES, TEXTBOOK_BYTES_PER_PARAM,
                                   Activations, Residuals, activation_bytes, fp8_bytes,
                                   layer_residuals, recomputes, saved_bytes_per_token, state_bytes,
                                   working_bytes_per_token)
from lumen_jax.plan.predict import SEARCH_REMATS, Plan, planned_attention, predict, search

__all__ = [
    "AXES", "BACKWARD_ROWS", "CONTEXT_BACKWARD_ROWS", "DEVICES", "ELEMENTWISE_OPS", "SEARCH_REMATS", "STATE_BYTES",
    "TEXTBOOK_BYTES_PER_PARAM", "Activations", "Collective", "Hardware", "Layout", "Plan", "Residuals",
    "activation_bytes", "bubble_fraction", "collectives", "compute_bytes", "compiled_flops_per_device",
    "context_score_fraction", "flops_per_device", "fp8_bytes", "layer_residuals",
    "layout_from_config", "link_of", "planned_attention", "planned_flops_per_token", "predict", "recomputes",
    "saved_bytes_per_token", "search", "state_bytes", "working_bytes_per_token",
]
