"""Published, measured BF16 training runs on H100s: the planner's calibration table (data only;
`plan.calibration` predicts each row). Throughput is per GPU; where a source gives FLOP/s, the row
names the FLOP convention that turns it back into tokens/s.

Each row: the model shape, the devices and their hardware (`HARDWARE`), the layout as published
(TP, PP, V, CP, DP, FSDP, micro-batch, global batch, sequence, recompute), the mesh of OUR program
that stands for it (`ours`: the axis sizes and options the planner plans), what the recipe overlaps
(`comm_overlap`: Megatron's TP and pipeline communication overlap, torchtitan's async TP), the measurement, its
source (repository + path, or paper + table) and notes on what had to be assumed.
"""

from __future__ import annotations

import dataclasses

LLAMA3_8B = dict(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=14336, vocab_size=128256)
LLAMA3_70B = dict(d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_dim=28672, vocab_size=128256)
LLAMA3_405B = dict(d_model=16384, num_layers=126, num_heads=128, num_kv_heads=8, ffn_dim=53248, vocab_size=128256)
LLAMA2_7B = dict(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32, ffn_dim=11008, vocab_size=32000)
# The shapes a table file (`plan.published_file`) may name instead of spelling one out.
MODELS = {"llama3_8b": LLAMA3_8B, "llama3_70b": LLAMA3_70B, "llama3_405b": LLAMA3_405B, "llama2_7b": LLAMA2_7B}

# Where a source measured: `Hardware` fields over the H100 80GB SXM defaults (plan.hardware.DEVICES).
HARDWARE = {
    "dgx-h100": {},  # DGX H100 / Meta's Grand Teton at 700 W: 989 TFLOP/s bf16, 80 GB HBM3, 400 Gb/s per GPU
    # Google Cloud A3 (a3-highgpu-8g): 4 x 200 Gb/s NICs per VM of 8 GPUs (GPUDirect-TCPX): 12.5 GB/s per GPU
    "gcp-a3": {"ib_bytes_per_s": 12.5e9},
    # torchtitan's Grand Teton hosts: H100 96 GB HBM2e (2.4 TB/s) at the default 500 W, whose peak the
    # source puts "between SXM and NVL" without a number: fitted to its six rows (585 TFLOP/s; a 500 W
    # cap lowers the clock under load, so below the NVL's 835)
    "gt-h100-500w": {"memory_bytes": 96e9, "hbm_bytes_per_s": 2.4e12, "peak_flops": 585e12},
}

# FLOP conventions: how a source counts the FLOPs behind its FLOP/s (to recover tokens/s).
CONVENTIONS = {
    "tokens": "tokens/s measured (step time and tokens per step)",
    "6N+causal": "6 x matmul parameters + causal attention (half the S x S square): ours, `flops.flops_per_token`",
    "6N+full": "6 x matmul parameters + full attention (the whole S x S square)",
}


@dataclasses.dataclass(frozen=True)
class Published:
    """One measured run."""

    name: str
    model: dict  # ModelConfig shape fields
    gpus: int
    hardware: str  # a key of HARDWARE
    layout: str  # as published
    seq_len: int
    global_batch: int  # sequences per step
    micro_batches: int  # per step (gradient accumulation / the pipeline's m)
    remat: str  # our policy that stands for the recipe's recompute
    ours: dict  # MeshConfig fields of our program for this layout (axis sizes resolved)
    measured: float  # per GPU, in `unit`
    unit: str  # "tokens/s" or "TFLOP/s" (then `convention` says which FLOPs)
    convention: str  # a key of CONVENTIONS
    source: str
    comm_overlap: bool = False  # the recipe overlaps its tensor-parallel collectives with the matmuls and its
    # pipeline sends with the next micro-batch (Megatron's tp_comm_overlap / overlap_p2p_comm, torchtitan's async TP)
    notes: str = ""
    program: str = ""  # the framework that ran it (`plan.recipe_memory.FAMILIES`); "": by the name's prefix

    @property
    def family(self) -> str:
        """The framework whose memory model stands for the run (`plan.recipe_memory.FAMILIES`)."""
        return self.program or next((f for prefix, f in FAMILY_OF_NAME.items() if self.name.startswith(prefix)), "")


# Llama 3 405B's 126 layers on 16 stages x V=2: one layer fewer on the first virtual stage (device 0)
# and on the last (device 15; virtual stage c*P + s runs on device s), so 7, 8, ..., 8, 7 layers by device.
LLAMA3_405B_SPLIT = (3,) + (4,) * 30 + (3,)

# Which program ran each row: its memory is that program's (`plan.recipe_memory`), not ours.
FAMILY_OF_NAME = {"NeMo": "megatron", "Llama 3": "llama3", "MaxText": "maxtext", "torchtitan": "torchtitan"}

_NEMO = "NVIDIA/dgxc-benchmarking llama3.1/README_{}.md, NeMo 24.09 BF16 table (step time -> tokens/s)"
_NEMO_NOTE = ("NeMo 24.09 perf recipe: sequence parallel and TP communication overlap on; no activation "
              "recompute assumed (the recipe lists none); Megatron's distributed optimizer planned as our ")
_TITAN_ASYNC = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, bfloat16 row"
_TITAN_2024 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
_MAXTEXT = "AI-Hypercomputer/maxtext MaxText/configs/a3/llama_2_7b/README.md (TFLOP/sec/chip); {}vm.sh"
_MAXTEXT_NOTE = ("per_device_batch_size 4, seq 4096, ici_fsdp 8 in a VM, dcn_data across VMs (fp32 gradient "
                 "all-reduce once per step), remat minimal_flash planned as dots_with_no_batch_dims_saveable, "
                 "cudnn flash; FLOP convention: MaxText's 2024 calculate_tflops_training_per_device counted the "
                 "whole S x S square (assumed)")
_LLAMA3 = "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4 (BF16 MFU, TFLOPs/GPU)"
_LLAMA3_NOTE = ("interleaved 1F1B, V=2 assumed (the paper gives no V); 126 layers balanced as the paper does, one "
                "layer fewer on the first and the last stage (embedding, output layer): mesh.pipeline_layers "
                "3, 4 x 30, 3 over the 32 virtual stages puts 7 layers on the first and last devices and 8 on the "
                "14 others (the paper's first and last chunks of the embedding or output alone would need chunks "
                "of one layer, V=8, and empty virtual stages, which our trainer refuses); FSDP with parameters kept after the "
                "forward planned as ZeRO-3 fsdp_regather=per_step; no activation recompute; TFLOP/s counted "
                "as 6N + causal attention (assumed: the paper does not say)")

TABLE: tuple[Published, ...] = (
    Published("NeMo llama3.1-8b 8 GPUs", LLAMA3_8B, 8, "dgx-h100", "TP1 PP1 CP2 DP4, MBS1 GA32", 8192, 128, 32,
              "none", dict(fsdp=4, context=2, zero_stage=3, zero_axes="fsdp+context"), 81222 / 8, "tokens/s",
              "tokens", _NEMO.format("8b"), True, _NEMO_NOTE + "ZeRO-3 over fsdp 4 (ZeRO-1 keeps 8 bytes/param "
              "replicated: 80 GB)"),
    Published("NeMo llama3.1-8b 128 GPUs", LLAMA3_8B, 128, "dgx-h100", "TP1 PP1 CP2 DP64, MBS1 GA32", 8192, 2048,
              32, "none", dict(data=16, fsdp=4, context=2, zero_stage=3, zero_axes="fsdp+context"), 1280704 / 128,
              "tokens/s", "tokens", _NEMO.format("8b"), True,
              _NEMO_NOTE + "ZeRO-3 over fsdp 4 in a node x data 16 across nodes"),
    Published("NeMo llama3.1-70b 64 GPUs", LLAMA3_70B, 64, "dgx-h100", "TP4 PP4 VP5 CP2 DP2, MBS1 GA64", 8192, 128,
              64, "none", dict(fsdp=2, pipeline=4, context=2, tensor=4, sequence_parallel=True, zero_stage=1, fsdp_grad_reduce="once",
                               pipeline_schedule="interleaved", pipeline_virtual_stages=5), 71235 / 64,
              "tokens/s", "tokens", _NEMO.format("70b"), True, _NEMO_NOTE + "ZeRO-1 over fsdp 2"),
    Published("NeMo llama3.1-70b 2048 GPUs", LLAMA3_70B, 2048, "dgx-h100", "TP4 PP4 VP5 CP2 DP64, MBS1 GA64", 8192,
              4096, 64, "none", dict(data=32, fsdp=2, pipeline=4, context=2, tensor=4, sequence_parallel=True,
                                     zero_stage=1, fsdp_grad_reduce="once", pipeline_schedule="interleaved", pipeline_virtual_stages=5),
              2248957 / 2048, "tokens/s", "tokens", _NEMO.format("70b"), True,
              _NEMO_NOTE + "ZeRO-1 over fsdp 2 x data 32"),
    Published("NeMo llama3.1-405b 576 GPUs", LLAMA3_405B, 576, "dgx-h100", "TP8 PP9 VP7 CP2 DP4, MBS1 GA63", 8192,
              252, 63, "none", dict(fsdp=4, pipeline=9, context=2, tensor=8, sequence_parallel=True, zero_stage=1, fsdp_grad_reduce="once",
                                    pipeline_schedule="interleaved", pipeline_virtual_stages=7), 120022 / 576,
              "tokens/s", "tokens", _NEMO.format("405b"), True, _NEMO_NOTE + "ZeRO-1 over fsdp 4"),
    Published("NeMo llama3.1-405b 2304 GPUs", LLAMA3_405B, 2304, "dgx-h100", "TP8 PP9 VP7 CP2 DP16, MBS1 GA63",
              8192, 1008, 63, "none", dict(data=4, fsdp=4, pipeline=9, context=2, tensor=8, sequence_parallel=True,
                                           zero_stage=1, fsdp_grad_reduce="once", pipeline_schedule="interleaved",
                                           pipeline_virtual_stages=7), 468646 / 2304, "tokens/s", "tokens",
              _NEMO.format("405b"), True, _NEMO_NOTE + "ZeRO-1 over fsdp 4 x data 4"),
    Published("Llama 3 405b 8,192 GPUs", LLAMA3_405B, 8192, "dgx-h100", "TP8 CP1 PP16 DP64, batch/DP 32", 8192,
              2048, 32, "none", dict(fsdp=64, pipeline=16, tensor=8, sequence_parallel=True, zero_stage=3,
                                     fsdp_regather="per_step", fsdp_grad_reduce="once",
                                     pipeline_schedule="interleaved", pipeline_virtual_stages=2,
                                     pipeline_layers=LLAMA3_405B_SPLIT), 430, "TFLOP/s",
              "6N+causal", _LLAMA3, True, _LLAMA3_NOTE),
    Published("Llama 3 405b 16,384 GPUs", LLAMA3_405B, 16384, "dgx-h100", "TP8 CP1 PP16 DP128, batch/DP 16", 8192,
              2048, 16, "none", dict(fsdp=128, pipeline=16, tensor=8, sequence_parallel=True, zero_stage=3,
                                     fsdp_regather="per_step", fsdp_grad_reduce="once",
                                     pipeline_schedule="interleaved", pipeline_virtual_stages=2,
                                     pipeline_layers=LLAMA3_405B_SPLIT), 400, "TFLOP/s",
              "6N+causal", _LLAMA3, True, _LLAMA3_NOTE),
    *(Published(f"MaxText llama2-7b {8 * n} GPUs", LLAMA2_7B, 8 * n, "gcp-a3", f"FSDP8 x DP{n}, per-device batch 4",
                4096, 32 * n, 1, "dots_with_no_batch_dims_saveable", dict(data=n, fsdp=8, zero_stage=3), tf,
                "TFLOP/s", "6N+full", _MAXTEXT.format(n), False, _MAXTEXT_NOTE)
      for n, tf in ((1, 492), (2, 422), (4, 407), (8, 409), (16, 375))),
    Published("torchtitan llama3.1-8b 8 GPUs", LLAMA3_8B, 8, "gt-h100-500w", "FSDP8, local batch 2", 8192, 16, 1,
              "dots_saveable", dict(fsdp=8, zero_stage=3), 6667, "tokens/s", "tokens",
              _TITAN_2024 + ", Table 1, FSDP + torch.compile", False,
              "selective (per-op) activation checkpointing planned as dots_saveable"),
    Published("torchtitan llama3.1-8b 128 GPUs", LLAMA3_8B, 128, "gt-h100-500w", "FSDP128, local batch 2", 8192,
              256, 1, "dots_saveable", dict(fsdp=128, zero_stage=3), 6514, "tokens/s", "tokens",
              _TITAN_2024 + ", Table 3, FSDP + torch.compile", False,
              "selective (per-op) activation checkpointing planned as dots_saveable"),
    Published("torchtitan llama3-8b 64 GPUs TP", LLAMA3_8B, 64, "gt-h100-500w", "FSDP8 TP8, local batch 12", 8192,
              96, 1, "dots_saveable", dict(fsdp=8, tensor=8, sequence_parallel=True, zero_stage=3), 4378,
              "tokens/s", "tokens", _TITAN_ASYNC + " (vanilla TP)", False, "torch.compile, per-op SAC"),
    Published("torchtitan llama3-8b 64 GPUs async TP", LLAMA3_8B, 64, "gt-h100-500w", "FSDP8 TP8, local batch 12",
              8192, 96, 1, "dots_saveable", dict(fsdp=8, tensor=8, sequence_parallel=True, zero_stage=3), 4809.4,
              "tokens/s", "tokens", _TITAN_ASYNC + " (async TP)", True, "torch.compile, per-op SAC"),
    Published("torchtitan llama3-70b 256 GPUs TP", LLAMA3_70B, 256, "gt-h100-500w", "FSDP32 TP8, local batch 16",
              8192, 512, 1, "full", dict(fsdp=32, tensor=8, sequence_parallel=True, zero_stage=3), 597.3,
              "tokens/s", "tokens", _TITAN_ASYNC + " (vanilla TP)", False, "torch.compile, full AC"),
    Published("torchtitan llama3-70b 256 GPUs async TP", LLAMA3_70B, 256, "gt-h100-500w",
              "FSDP32 TP8, local batch 16", 8192, 512, 1, "full",
              dict(fsdp=32, tensor=8, sequence_parallel=True, zero_stage=3), 652.4, "tokens/s", "tokens",
              _TITAN_ASYNC + " (async TP)", True, "torch.compile, full AC"),
)
