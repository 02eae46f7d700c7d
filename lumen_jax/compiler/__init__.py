"""The compiler tools: the trainer's real step lowered and compiled, and what the program holds.

They build a trainer (`train.build`), so they sit above train/ and plan/; the analytic planner
(plan/) never imports them, and the trainer never does.

- `lower`: `python -m lumen_jax.lower`: the step lowered for CUDA on any machine (custom calls, fp8
  dots, collectives, the largest arrays), and `--against-xla`: the planner next to the step
  compiled on emulated CPU devices.
- `compiled`: `compile_step`, `abstract_step_args`, `against_xla`: XLA's bytes, FLOPs and collectives
  of the compiled step next to a plan's.
- `hlo`: a reader of HLO text: instructions, loops and their trip counts, collectives by mesh axes,
  matmul FLOPs on the critical path.
- `kernels`: the flash kernels' Triton IR compiled for a GPU with the `triton` package (shared
  memory, registers, spills).
- `aot`: the step compiled for an H100/H200 by XLA's GPU compiler without a GPU (needs the CUDA
  plugin), and `gemm_report`: its GEMMs, fp8 epilogues and the fusions around them.
"""
