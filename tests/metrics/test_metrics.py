"""Parameter/FLOP counts against hand counts, MFU arithmetic, peak table, writers and progress."""

from __future__ import annotations

import glob
import math
import os
import struct
import types

import jax.numpy as jnp
import numpy as np
import pytest

from helpers.metrics import read_metrics
from lumen_jax.metrics import flops
from lumen_jax.metrics import mfu as metrics, writers
from lumen_jax.config import REMAT_POLICIES, ModelConfig

SMALL = ModelConfig()  # d_model=64, layers=2, heads=4, kv_heads=2, ffn_dim=172, vocab=512
LLAMA3_8B = ModelConfig(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=14336,
                        vocab_size=128256)
LLAMA3_70B = ModelConfig(d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_dim=28672,
                         vocab_size=128256)


def test_param_counts_small_by_hand():
    # head_dim 16. wq, wo: 64*4*16 = 4096 each; wk, wv: 64*2*16 = 2048 each; mlp 3*64*172 = 33024.
    layer_matmul = 4096 * 2 + 2048 * 2 + 33024  # 45312
    counts = flops.param_counts(SMALL)
    assert counts["layer_matmul"] == layer_matmul
    assert counts["embedding"] == 512 * 64
    assert counts["matmul"] == 2 * layer_matmul + 64 * 512  # 123392
    # embedding + 2 layers (+ 2 norms each) + final norm + lm_head
    assert counts["total"] == 32768 + 2 * (layer_matmul + 128) + 64 + 32768 == 156480


def test_param_counts_tied_drops_lm_head_but_keeps_logits_matmul():
    untied, tied = flops.param_counts(SMALL), flops.param_counts(
        ModelConfig(tie_embeddings=True))
    assert untied["total"] - tied["total"] == 64 * 512
    assert tied["matmul"] == untied["matmul"]


def test_param_counts_gqa_explicit_head_dim():
    cfg = ModelConfig(d_model=64, num_layers=1, num_heads=8, num_kv_heads=2, head_dim=32,
                      ffn_dim=100, vocab_size=10)
    # wq, wo: 64*8*32 = 16384 each; wk, wv: 64*2*32 = 4096 each; mlp 3*64*100 = 19200.
    assert flops.param_counts(cfg)["layer_matmul"] == 16384 * 2 + 4096 * 2 + 19200


def test_llama3_param_counts():
    assert flops.param_counts(LLAMA3_8B)["total"] == 8_030_261_248
    assert flops.param_counts(LLAMA3_70B)["total"] == pytest.approx(70.6e9, rel=2e-3)


def test_flops_per_token_by_hand():
    seq = 128
    attention_fwd_full = 2 * 2 * seq * 4 * 16 * 2  # 2*2*S*N*H per layer, 2 layers = 65536
    expected_causal = 6 * 123392 + 3 * attention_fwd_full / 2  # 838656
    assert flops.flops_per_token(SMALL, seq) == expected_causal == 838656
    assert flops.flops_per_token(SMALL, seq, causal=False) == 6 * 123392 + 3 * attention_fwd_full
    # Tied embeddings: the logits matmul still costs 6*D*V per token.
    assert flops.flops_per_token(ModelConfig(tie_embeddings=True), seq) == expected_causal


def test_flops_per_token_gqa_attention_uses_query_heads():
    cfg = ModelConfig(d_model=64, num_layers=1, num_heads=8, num_kv_heads=2, head_dim=32,
                      ffn_dim=100, vocab_size=10)
    matmul = 16384 * 2 + 4096 * 2 + 19200 + 64 * 10
    assert flops.flops_per_token(cfg, 256) == 6 * matmul + 3 * (2 * 2 * 256 * 8 * 32) / 2


def test_llama3_8b_flops_matches_6n_plus_attention():
    # 6 * (8.03e9 - embedding) + 6 * L * S * D (causal half of 12 * L * S * N * H, with N * H = D)
    matmul = 8_030_261_248 - 128256 * 4096 - 32 * 2 * 4096 - 4096
    expected = 6 * matmul + 6 * 32 * 8192 * 4096
    assert flops.flops_per_token(LLAMA3_8B, 8192) == expected


def test_hardware_flops_per_remat_policy():
    seq = 128
    model = flops.flops_per_token(SMALL, seq)
    projections = 2 * 2 * 45312  # 2 * L * layer_matmul
    attention = 2 * 2 * seq * 4 * 16 * 2 / 2  # forward attention, causal
    expected = {"none": model, "dots_saveable": model, "offload_dots": model,
                "dots_with_no_batch_dims_saveable": model + attention,
                "save_attention_out": model + projections, "full": model + projections + attention,
                # the selective policies: the projections they re-run, by hand (up, gate: D x F = 64 x 172;
                # o: N*H x D = 64 x 64), and QK^T, AV, which they do not name
                "save_dot_except_mlpwi_1": model + 2 * 2 * 64 * 172 + attention,
                "save_dot_except_mlpwi": model + 2 * 2 * 2 * 64 * 172 + attention,
                "save_qkv_proj": model + 2 * 2 * (64 * 64 + 2 * 64 * 172) + attention}
    assert set(expected) == set(REMAT_POLICIES)
    for policy, value in expected.items():
        assert flops.hardware_flops_per_token(SMALL, seq, policy) == value, policy
    assert flops.hardware_flops_per_token(ModelConfig(remat="full"), seq) == expected["full"]
    with pytest.raises(ValueError, match="model.remat='everything'"):
        flops.hardware_flops_per_token(SMALL, seq, "everything")


def test_hardware_flops_add_only_what_the_remat_policy_reruns():
    """HFU's extra over MFU is the policy's recompute alone: the pipelined step's backward runs from
    its forward's residuals (no stage forward again), so a pipeline adds nothing here."""
    seq = 128
    attention = 2 * 2 * seq * 4 * 16 * 2 / 2  # forward QK^T + AV over 2 layers, causal half
    recompute_full = 2 * 2 * 45312 + attention  # what remat=full re-runs: the layers' projections and attention
    plain = {r: flops.hardware_flops_per_token(SMALL, seq, r) for r in ("none", "full")}
    assert plain["full"] - plain["none"] == recompute_full
    assert flops.flops_per_token(SMALL, seq) == plain["none"]


def test_step_metrics_arithmetic():
    m = metrics.StepMetrics.compute(step_time_s=2.0, tokens_per_step=1_000_000, num_devices=8,
                                    flops_per_token=1e9, hw_flops_per_token=1.2e9,
                                    peak_flops_per_device=1e14)
    assert m.tokens_per_sec == 500_000
    assert m.tokens_per_sec_per_device == 62_500
    assert m.tflops_per_device == pytest.approx(62.5, rel=1e-12)
    assert m.mfu == pytest.approx(0.625, rel=1e-12)
    assert m.hfu == pytest.approx(0.75, rel=1e-12)
    assert m.as_dict()["step_time_s"] == 2.0


def test_step_metrics_without_peak_and_bad_input():
    m = metrics.StepMetrics.compute(1.0, 100, 1, 1e6, 1e6, None)
    assert m.mfu is None and m.hfu is None and "mfu" not in m.as_dict()
    with pytest.raises(ValueError, match="step_time_s=0"):
        metrics.StepMetrics.compute(0.0, 100, 1, 1e6, 1e6, None)


@pytest.mark.parametrize("kind,dtype,peak", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
    ("NVIDIA H100 80GB HBM3", "fp8", 1979e12),
    ("NVIDIA H100 80GB HBM3", "float32", 494.7e12),
    ("NVIDIA H200", "bfloat16", 989e12),
    ("NVIDIA H200", "float8_e4m3fn", 1979e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
    ("NVIDIA A100-SXM4-40GB", "float16", 312e12),
    ("NVIDIA A100-SXM4-80GB", "fp8", None),
    ("NVIDIA H200", "int4", None),
    ("cpu", "float32", None),
    ("TPU v4", "bfloat16", None),
])
def test_device_peak_flops(kind, dtype, peak):
    assert metrics.device_peak_flops(kind, dtype) == peak


def test_peak_flops_per_device_table_and_unknown():
    h200 = types.SimpleNamespace(device_kind="NVIDIA H200", platform="gpu")
    value, source = metrics.peak_flops_per_device([h200] * 8, "bfloat16")
    assert value == 989e12 and source.startswith("datasheet")
    unknown = types.SimpleNamespace(device_kind="Mystery GPU", platform="gpu")
    assert metrics.peak_flops_per_device([unknown], "bfloat16")[0] is None


def test_peak_flops_per_device_measures_on_cpu(monkeypatch):
    """The host's measured peak, shared by the process's 8 emulated CPU devices (fp8 measured as
    float32: XLA:CPU upcasts it); the measurement itself is the next test's."""
    import jax

    asked = []
    monkeypatch.setattr(metrics, "measure_cpu_matmul_peak", lambda dtype: asked.append(dtype) or 8e10)
    value, source = metrics.peak_flops_per_device(jax.devices("cpu"), "float32")
    assert (value, source) == (1e10, "measured: cpu float32 matmul 80.0 GFLOP/s per host, shared by 8 device(s)")
    assert metrics.peak_flops_per_device(jax.devices("cpu"), "fp8")[0] == 1e10
    assert asked == ["float32", "float32"]


def test_cpu_matmul_peak_is_the_best_timed_call(monkeypatch):
    """2 n^3 FLOPs over the fastest of the timed calls (a fake clock: each call lasts the next
    duration), stopping once 0.5 s were spent; and on the real clock a finite positive figure."""
    import jax

    def clock(durations):
        now, ticks = [0.0], iter(durations)

        def perf_counter():  # called at each start and end: an end advances by the call's duration
            perf_counter.calls += 1
            if perf_counter.calls % 2 == 0:
                now[0] += next(ticks)
            return now[0]
        perf_counter.calls = 0
        return types.SimpleNamespace(perf_counter=perf_counter)

    try:
        monkeypatch.setattr(metrics, "time", clock([0.004, 0.002, 0.003]))
        assert metrics.measure_cpu_matmul_peak("float32", n=64, repeats=3) == 2 * 64**3 / 0.002
        monkeypatch.setattr(metrics, "time", clock([0.3, 0.3, 0.001]))  # 0.6 s spent after two: stop
        assert metrics.measure_cpu_matmul_peak("float32", n=32, repeats=3) == 2 * 32**3 / 0.3
    finally:
        metrics.measure_cpu_matmul_peak.cache_clear()  # not these figures for later callers
    monkeypatch.undo()
    real = metrics.measure_cpu_matmul_peak("float32", n=64, repeats=2)
    assert math.isfinite(real) and real > 0


def _read_tb_scalars(path: str) -> dict[str, list[tuple[int, float]]]:
    """Parses a TFRecord event file (len, crc, data, crc) into {tag: [(step, value)]}."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
        pos += 12 + length + 4
        for v in event.summary.value:
            scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
    return scalars


def test_writer_jsonl_and_tensorboard(tmp_path):
    run_dir = str(tmp_path / "run")
    with writers.MetricsWriter(run_dir) as writer:
        writer.write(1, {"loss": jnp.float32(2.5), "lr": np.float64(3e-4), "tokens": np.int64(64)})
        writer.write(2, {"loss": jnp.array(1.25), "note": "hello", "mfu": 0.5})
    rows = read_metrics(run_dir)
    assert rows == [{"step": 1, "loss": 2.5, "lr": 3e-4, "tokens": 64},
                    {"step": 2, "loss": 1.25, "note": "hello", "mfu": 0.5}]
    events = glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))
    assert len(events) == 1
    scalars = _read_tb_scalars(events[0])
    assert scalars["loss"] == [(1, 2.5), (2, 1.25)]
    assert scalars["mfu"] == [(2, 0.5)] and "note" not in scalars


def test_writer_appends_on_resume_and_jsonl_only(tmp_path):
    run_dir = str(tmp_path)
    for step in (1, 2):
        with writers.MetricsWriter(run_dir, tensorboard=False) as writer:
            writer.write(step, {"loss": float(step)})
    assert [row["step"] for row in read_metrics(run_dir)] == [1, 2]
    assert not glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))


def test_disabled_writer_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    writer = writers.MetricsWriter(str(run_dir), enabled=False)
    writer.write(1, {"loss": 1.0})
    writer.close()
    writer.close()
    assert not run_dir.exists()


def test_progress_enabled_and_disabled(capsys):
    # tqdm redraws at most every 0.1 s; closing the bar draws its last state, so that is what is read.
    with writers.Progress(10, enabled=True) as bar:
        bar.update(3, {"loss": jnp.float32(1.5), "tokens_per_sec": 1234.0, "mfu": 0.42})
    shown = capsys.readouterr().err.split("\r")[-1]
    assert "3/10" in shown and "loss 1.5000" in shown and "1,234 tok/s" in shown and "MFU 42.0%" in shown, shown
    with writers.Progress(10, enabled=True) as bar:
        bar.update(5, {"loss": math.nan})
    assert "5/10" in capsys.readouterr().err
    with writers.Progress(10, enabled=False) as bar:
        bar.update(3, {"loss": 1.0})
    assert capsys.readouterr().err == ""
