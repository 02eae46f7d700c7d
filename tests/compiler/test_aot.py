"""`compiler.aot.gemm_report`, the reader of a step compiled for a GPU without one, on a hand-written
module in the form XLA's GPU compiler prints (no CUDA plugin needed): a loop of 4 trips that
quantizes an activation and a weight slice, runs an fp8 cuBLASLt GEMM to f32, converts its result
and saves it into a stacked buffer; a bf16 GEMM after the loop. The figures are counted by hand.
`benchmarks/gpu_aot.py` without the plugin: one line, exit 2."""

from __future__ import annotations

import importlib.util
import os

from lumen_jax.compiler import aot

TRIPS = 4
MODULE = """HloModule step, is_scheduled=true

%max (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}

%fused_amax (p0: bf16[64,32]) -> f32[] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %c = f32[64,32]{1,0} convert(%p0)
  %z = f32[] constant(0)
  ROOT %r = f32[] reduce(%c, %z), dimensions={0,1}, to_apply=%max
}

%fused_quant (p0.1: bf16[64,32], p1.1: f32[]) -> f8e4m3fn[64,32] {
  %p0.1 = bf16[64,32]{1,0} parameter(0)
  %p1.1 = f32[] parameter(1)
  %c.1 = f32[64,32]{1,0} convert(%p0.1)
  %b.1 = f32[64,32]{1,0} broadcast(%p1.1), dimensions={}
  %m.1 = f32[64,32]{1,0} multiply(%c.1, %b.1)
  ROOT %q.1 = f8e4m3fn[64,32]{1,0} convert(%m.1)
}

%fused_wq (p0.2: f32[4,32,16], p1.2: s32[]) -> f8e4m3fn[1,32,16] {
  %p0.2 = f32[4,32,16]{2,1,0} parameter(0)
  %p1.2 = s32[] parameter(1)
  %z.2 = s32[] constant(0)
  %ds.2 = f32[1,32,16]{2,1,0} dynamic-slice(%p0.2, %p1.2, %z.2, %z.2), dynamic_slice_sizes={1,32,16}
  ROOT %q.2 = f8e4m3fn[1,32,16]{2,1,0} convert(%ds.2)
}

%fused_cvt (p0.3: f32[64,16]) -> bf16[64,16] {
  %p0.3 = f32[64,16]{1,0} parameter(0)
  ROOT %c.3 = bf16[64,16]{1,0} convert(%p0.3)
}

%fused_save (p0.4: bf16[4,64,16], p1.4: bf16[64,16], p2.4: s32[]) -> bf16[4,64,16] {
  %p0.4 = bf16[4,64,16]{2,1,0} parameter(0)
  %p1.4 = bf16[64,16]{1,0} parameter(1)
  %bc.4 = bf16[1,64,16]{2,1,0} bitcast(%p1.4)
  %p2.4 = s32[] parameter(2)
  %z.4 = s32[] constant(0)
  ROOT %dus.4 = bf16[4,64,16]{2,1,0} dynamic-update-slice(%p0.4, %bc.4, %p2.4, %z.4, %z.4)
}

%body (p: (s32[], bf16[64,32], f32[4,32,16], bf16[4,64,16])) -> (s32[], bf16[64,32], f32[4,32,16], bf16[4,64,16]) {
  %p = (s32[], bf16[64,32]{1,0}, f32[4,32,16]{2,1,0}, bf16[4,64,16]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[64,32]{1,0} get-tuple-element(%p), index=1
  %w = f32[4,32,16]{2,1,0} get-tuple-element(%p), index=2
  %buf = bf16[4,64,16]{2,1,0} get-tuple-element(%p), index=3
  %amax_fusion = f32[] fusion(%x), kind=kInput, calls=%fused_amax
  %quant_fusion = f8e4m3fn[64,32]{1,0} fusion(%x, %amax_fusion), kind=kLoop, calls=%fused_quant
  %wq_fusion = f8e4m3fn[1,32,16]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%fused_wq
  %wq = f8e4m3fn[32,16]{1,0} bitcast(%wq_fusion)
  %one = f32[] constant(1)
  %gemm = (f32[64,16]{1,0}, s8[1024]{0}) custom-call(%quant_fusion, %wq, %amax_fusion, %one), custom_call_target="__cublas$lt$matmul$f8", backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"beta":0,"epilogue":"DEFAULT","damax_output":false},"force_earliest_schedule":false}
  %y = f32[64,16]{1,0} get-tuple-element(%gemm), index=0
  %cvt_fusion = bf16[64,16]{1,0} fusion(%y), kind=kLoop, calls=%fused_cvt
  %save_fusion = bf16[4,64,16]{2,1,0} fusion(%buf, %cvt_fusion, %i), kind=kLoop, calls=%fused_save
  %k = s32[] constant(1)
  %i1 = s32[] add(%i, %k)
  ROOT %t = (s32[], bf16[64,32]{1,0}, f32[4,32,16]{2,1,0}, bf16[4,64,16]{2,1,0}) tuple(%i1, %x, %w, %save_fusion)
}

%cond (p.c: (s32[], bf16[64,32], f32[4,32,16], bf16[4,64,16])) -> pred[] {
  %p.c = (s32[], bf16[64,32]{1,0}, f32[4,32,16]{2,1,0}, bf16[4,64,16]{2,1,0}) parameter(0)
  %i.c = s32[] get-tuple-element(%p.c), index=0
  %n.c = s32[] constant(4)
  ROOT %lt.c = pred[] compare(%i.c, %n.c), direction=LT
}

ENTRY %main (x.0: bf16[64,32], w.0: f32[4,32,16], buf.0: bf16[4,64,16], w2.0: bf16[32,16]) -> (bf16[4,64,16], bf16[64,16]) {
  %x.0 = bf16[64,32]{1,0} parameter(0)
  %w.0 = f32[4,32,16]{2,1,0} parameter(1)
  %buf.0 = bf16[4,64,16]{2,1,0} parameter(2)
  %w2.0 = bf16[32,16]{1,0} parameter(3)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,32]{1,0}, f32[4,32,16]{2,1,0}, bf16[4,64,16]{2,1,0}) tuple(%zero, %x.0, %w.0, %buf.0)
  %loop = (s32[], bf16[64,32]{1,0}, f32[4,32,16]{2,1,0}, bf16[4,64,16]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %saved = bf16[4,64,16]{2,1,0} get-tuple-element(%loop), index=3
  %gemm.2 = (bf16[64,16]{1,0}, s8[1024]{0}) custom-call(%x.0, %w2.0), custom_call_target="__cublas$lt$matmul", backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"beta":0,"epilogue":"DEFAULT","damax_output":false},"force_earliest_schedule":false}
  %out = bf16[64,16]{1,0} get-tuple-element(%gemm.2), index=0
  ROOT %r.0 = (bf16[4,64,16]{2,1,0}, bf16[64,16]{1,0}) tuple(%saved, %out)
}
"""


def test_gemm_report_counts_the_loop_by_hand():
    r = aot.gemm_report(MODULE, tokens=64)
    assert r.gemms == {"f8e4m3fn x f8e4m3fn -> f32": TRIPS, "bf16 x bf16 -> bf16": 1}
    assert r.fp8_epilogues == {"out=f32 scales=2 alpha=1 beta=0 epilogue=DEFAULT amax=False": TRIPS}
    assert (r.f32_outputs, r.f32_output_bytes) == (TRIPS, TRIPS * 64 * 16 * 4)
    assert (r.quantize_fusions, r.fp8_copies) == (2 * TRIPS, 0)
    # Quantized arrays: x (read by the amax and the quantize fusions) and the stacked weight (read
    # by its quantize fusion), each once per trip.
    assert (r.sources, r.source_reads) == (2 * TRIPS, (2 + 1) * TRIPS)
    per_trip = {
        "amax": 64 * 32 * 2 + 4,
        "quant": 64 * 32 * 2 + 4 + 64 * 32,
        "wq": 32 * 16 * 4 + 4 + 32 * 16,  # the dynamic slice of the stacked f32 weight, not all 4 slices
        "cvt": 64 * 16 * 4 + 64 * 16 * 2,
        "save": 64 * 16 * 2 + 4 + 64 * 16 * 2,  # the update in and out; the buffer updated in place
    }
    assert r.fusions == len(per_trip) * TRIPS
    assert r.fusion_bytes == sum(per_trip.values()) * TRIPS


def test_fusions_by_role_counted_by_hand():
    """`gemm_report`'s split of the non-GEMM fusions by role (`aot.fusion_role`), with a small-array
    bound below the module's arrays: per trip the amax, two quantize fusions (x, the weight slice)
    and two others (the f32 result converted, saved); then the roles of hand-made fusions."""
    r = aot.gemm_report(MODULE, tokens=64, small=64)
    amax, quant, wq, cvt, save = (64 * 32 * 2 + 4, 64 * 32 * 2 + 4 + 64 * 32, 32 * 16 * 4 + 4 + 32 * 16,
                                  64 * 16 * 4 + 64 * 16 * 2, 64 * 16 * 2 + 4 + 64 * 16 * 2)
    assert r.by_role == {"quantize": [2 * TRIPS, (quant + wq) * TRIPS], "fp8 move": [0, 0],
                         "amax": [TRIPS, amax * TRIPS], "small": [0, 0], "other": [2 * TRIPS, (cvt + save) * TRIPS]}
    assert aot.gemm_report(MODULE, tokens=64).by_role["small"] == [5 * TRIPS, r.fusion_bytes]  # all under 1 MiB

    from lumen_jax.compiler import hlo
    big = lambda t: hlo.Array(t, (4096, 4096))  # noqa: E731
    reduce_with = lambda comp: [hlo.Instr("r", "reduce", (hlo.Array("f32", ()),), f"r = f32[] reduce(p, z), to_apply={comp}", "f")]  # noqa: E731
    reducers = {"mx": "maximum", "sum": "add"}
    role = lambda ins, outs, body=(): aot.fusion_role(ins, outs, list(body), reducers)  # noqa: E731
    assert role([big("u8"), hlo.Array("s32", ())], [big("f8e4m3fn")]) == "fp8 move"  # a saved operand, transposed
    assert role([big("bf16"), hlo.Array("f32", ())], [big("f8e5m2"), big("f8e5m2")]) == "quantize"
    assert role([big("bf16")], [hlo.Array("bf16", (4096,))], reduce_with("mx")) == "amax"
    assert role([big("bf16")], [hlo.Array("f32", (4096,))], reduce_with("sum")) == "other"  # a sum: a norm's
    assert role([big("bf16")], [hlo.Array("bf16", (4096,)), big("bf16")], reduce_with("mx")) == "other"  # fused
    assert role([hlo.Array("f32", (14, 1024))], [hlo.Array("f32", (14, 1024))]) == "small"  # a history


def test_script_without_the_cuda_plugin_exits_2(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location(
        "gpu_aot", os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu_aot.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(aot, "plugin_installed", lambda: False)
    assert script.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "jax[cuda12]" in err
