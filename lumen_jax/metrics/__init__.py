"""What a run measures: FLOPs per token (flops.py, the one count, shared with the planner), peak
FLOP/s and MFU/HFU (mfu.py), JSONL/TensorBoard writers and the progress bar (writers.py), where the
step time goes (timing.py) and the compiled step's bytes per device (memory.py)."""
