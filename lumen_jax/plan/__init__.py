"""The analytic planner: bytes, FLOPs, collectives, step time and MFU of a run before launch
(`python -m lumen_jax.plan`), and its calibration on published runs.

```
python -m lumen_jax.plan --config configs/llama3_70b.yaml --devices 1024 --device h100 [key=value ...]
python -m lumen_jax.plan --config configs/llama3_405b.yaml --devices 16384 --device h100 --search
python -m lumen_jax.plan --calibration
```

Everything is arithmetic on the config, in small pure functions a test or a notebook can call one
by one; the only tracing is of the model's layer, abstractly, to read what it saves. Per-device
figures are for the worst device (the pipeline stage holding the embedding or the logits, plus its
share of the layers). The model behind each number and worked examples: docs/PLANNING.md. The
planner imports neither the trainer (train/) nor the compiler tools (lumen_jax/compiler/, which
compare a plan with the compiled step: `python -m lumen_jax.lower --against-xla`).

- `hardware`: `Hardware` (memory, peak, links), `DEVICES`, `Layout` (the config's resolved `mesh`
  section, plus pipeline stages and micro-batches).
- `memory`: `state_bytes` (exact, from the parameter shapes and the sharding rules), `activation_bytes`.
- `residuals`: `layer_residuals` (what a layer saves under a remat policy, read off a probe of the
  model), `recomputes` (which forward work the backward re-runs).
- `cost`: `flops_per_device`, `compiled_flops_per_device`, `bubble_fraction`. FLOP counts per token
  are `lumen_jax.metrics.flops`'s (one count for the trainer and the planner).
- `collectives`: the collectives of each mesh axis, per step.
- `moe`: the mixture-of-experts terms: the dispatch's buffers, an MoE layer's bytes, its all-to-alls,
  the FLOPs the compiler counts for it.
- `efficiency`: matmul efficiency by GEMM shape, attention, overlap per axis (the hardware terms).
- `predict`: `predict` -> `Plan` (bytes, FLOPs, step time, MFU, verdict), `search`.
- `goodput`: failures at Llama 3's rate, the Young-Daly checkpoint interval, expected goodput.
- `published`, `recipe_memory`, `calibration`: the published H100 runs, the memory of each recipe's
  own program, and the planner against them (`--calibration`).
- `startup`: `at_start`, the one call the trainer makes when a run starts.
- `cli`: the command line.
"""

from lumen_jax.plan.collectives import Collective, collectives, link_of
from lumen_jax.plan.cost import (ELEMENTWISE_OPS, bubble_fraction, compiled_flops_per_device, context_score_fraction,
                                 flops_per_device, planned_flops_per_token, planned_score_fraction)
from lumen_jax.plan.hardware import AXES, DEVICES, Hardware, Layout, compute_bytes, layout_from_config
from lumen_jax.plan.memory import (BACKWARD_ROWS, CONTEXT_BACKWARD_ROWS, STATE_BYTES, TEXTBOOK_BYTES_PER_PARAM,
                                   Activations, activation_bytes, fp8_bytes, saved_bytes_per_token, state_bytes,
                                   working_bytes_per_token)
from lumen_jax.plan.residuals import Residuals, layer_residuals, recomputes
from lumen_jax.plan.predict import SEARCH_REMATS, Plan, planned_attention, predict, search

__all__ = [
    "AXES", "BACKWARD_ROWS", "CONTEXT_BACKWARD_ROWS", "DEVICES", "ELEMENTWISE_OPS", "SEARCH_REMATS", "STATE_BYTES",
    "TEXTBOOK_BYTES_PER_PARAM", "Activations", "Collective", "Hardware", "Layout", "Plan", "Residuals",
    "activation_bytes", "bubble_fraction", "collectives", "compute_bytes", "compiled_flops_per_device",
    "context_score_fraction", "flops_per_device", "fp8_bytes", "layer_residuals",
    "layout_from_config", "link_of", "planned_attention", "planned_flops_per_token", "planned_score_fraction",
    "predict", "recomputes",
    "saved_bytes_per_token", "search", "state_bytes", "working_bytes_per_token",
]
