"""The roofline step-time model (`jaxspeed.cost.roofline`) on hand-written optimized HLO."""

import pytest

from jaxspeed.cost import roofline
from jaxspeed.cost.peaks import GPU_PEAKS, PEAK_FLOPS, gpu_peaks, peak_flops

H100 = GPU_PEAKS["H100"]
HBM = 3.35e12
N = 4096
GEMM_CONFIG = ('backend_config={"gemm_backend_config":{"dot_dimension_numbers":{'
               '"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],'
               '"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}')


def gemm_module(dtype: str, target: str = "__cublas$gemm") -> str:
    return f"""HloModule m

ENTRY %main (a: {dtype}[{N},{N}], b: {dtype}[{N},{N}]) -> bf16[{N},{N}] {{
  %a = {dtype}[{N},{N}]{{1,0}} parameter(0)
  %b = {dtype}[{N},{N}]{{1,0}} parameter(1)
  %gemm = (bf16[{N},{N}]{{1,0}}, s8[33554432]{{0}}) custom-call(%a, %b), custom_call_target="{target}", {GEMM_CONFIG}
  ROOT %out = bf16[{N},{N}]{{1,0}} get-tuple-element(%gemm), index=0
}}
"""


def only(ops, kind):
    (op,) = [o for o in ops if o.kind == kind]
    return op


def test_a_cublas_gemm_is_compute_bound_at_the_bf16_peak():
    (op,) = roofline.op_costs(gemm_module("bf16"), peaks=H100, hbm=HBM, efficiency=1.0)
    assert op.kind == "matmul" and op.bound == "compute"
    assert op.flops == 2 * N**3
    assert op.bytes == 3 * N * N * 2  # two operands and the result; not the workspace
    assert op.seconds == pytest.approx(2 * N**3 / H100.bf16)


def test_fp8_operands_run_at_the_fp8_peak_and_efficiency_scales_matmuls():
    bf16 = roofline.op_costs(gemm_module("bf16"), peaks=H100, hbm=HBM, efficiency=1.0)[0]
    fp8 = roofline.op_costs(gemm_module("f8e4m3fn", "__cublas$lt$matmul$f8"), peaks=H100, hbm=HBM,
                            efficiency=1.0)[0]
    assert fp8.seconds == pytest.approx(bf16.seconds / 2, rel=1e-3)
    half = roofline.op_costs(gemm_module("bf16"), peaks=H100, hbm=HBM, efficiency=0.5)[0]
    assert half.seconds == pytest.approx(2 * bf16.seconds)
    # A100 has no FP8 cores: the same call at its bf16 peak
    a100 = roofline.op_costs(gemm_module("f8e4m3fn"), peaks=GPU_PEAKS["A100"], hbm=HBM,
                             efficiency=1.0)[0]
    assert a100.seconds == pytest.approx(2 * N**3 / 312e12)


LOOP = """HloModule m

%fused_slice (p0: bf16[16,1024,1024], p1: s32[]) -> bf16[1024,1024] {
  %p0 = bf16[16,1024,1024]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = bf16[1,1024,1024]{2,1,0} dynamic-slice(%p0, %p1, %zero, %zero), dynamic_slice_sizes={1,1024,1024}
  ROOT %neg = bf16[1024,1024]{1,0} bitcast(%ds)
}

%fused_update (q0: bf16[16,1024,1024], q1: bf16[1024,1024], q2: s32[]) -> bf16[16,1024,1024] {
  %q0 = bf16[16,1024,1024]{2,1,0} parameter(0)
  %q1 = bf16[1024,1024]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %b = bf16[1,1024,1024]{2,1,0} bitcast(%q1)
  ROOT %dus = bf16[16,1024,1024]{2,1,0} dynamic-update-slice(%q0, %b, %q2, %z, %z)
}

%body (t: (s32[], bf16[16,1024,1024])) -> (s32[], bf16[16,1024,1024]) {
  %t = (s32[], bf16[16,1024,1024]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %stack = bf16[16,1024,1024]{2,1,0} get-tuple-element(%t), index=1
  %layer = bf16[1024,1024]{1,0} fusion(%stack, %i), kind=kLoop, calls=%fused_slice
  %new = bf16[16,1024,1024]{2,1,0} fusion(%stack, %layer, %i), kind=kLoop, calls=%fused_update
  %ar = bf16[1024,1024]{1,0} all-reduce(%layer), replica_groups={{0,1}}, to_apply=%add
  ROOT %r = (s32[], bf16[16,1024,1024]{2,1,0}) tuple(%i, %new)
}

%cond (c: (s32[], bf16[16,1024,1024])) -> pred[] {
  %c = (s32[], bf16[16,1024,1024]{2,1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: bf16[16,1024,1024]) -> bf16[16,1024,1024] {
  %x = bf16[16,1024,1024]{2,1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[16,1024,1024]{2,1,0}) tuple(%zero, %x)
  %w = (s32[], bf16[16,1024,1024]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"16"}}
  ROOT %y = bf16[16,1024,1024]{2,1,0} get-tuple-element(%w), index=1
}
"""
LAYER = 1024 * 1024 * 2  # bytes of one bf16 [1024, 1024] slice


def test_loop_bodies_count_per_trip_and_slices_read_only_their_slice():
    ops = roofline.op_costs(LOOP, peaks=H100, hbm=HBM, num_devices=2)
    by_name = {op.name: op for op in ops}
    layer, new = by_name["layer"], by_name["new"]
    assert layer.executions == new.executions == 16
    # the slice read and written, not the 16-layer stack; the update, written in place (and
    # each reads its s32 index)
    assert layer.bytes == new.bytes == 2 * LAYER + 4
    assert layer.seconds == pytest.approx((2 * LAYER + 4) / HBM)


def test_collectives_cross_nvlink_an_all_reduce_twice():
    ar = only(roofline.op_costs(LOOP, peaks=H100, hbm=HBM, num_devices=2), "collective")
    assert ar.executions == 16 and ar.bound == "link"
    assert ar.seconds == pytest.approx(2 * LAYER / H100.link)


def fmha_module(target: str, mask: str) -> str:
    dims = ('"bmm1_dot_dimension_numbers":{"lhs_contracting_dimensions":["3"],'
            '"rhs_contracting_dimensions":["3"],"lhs_batch_dimensions":["0","2"],'
            '"rhs_batch_dimensions":["0","2"]}')
    shape = "bf16[2,4096,16,128]{3,2,1,0}"
    return f"""HloModule m

ENTRY %main (q: bf16[2,4096,16,128], k: bf16[2,4096,16,128], v: bf16[2,4096,16,128]) -> bf16[2,4096,16,128] {{
  %q = {shape} parameter(0)
  %k = {shape} parameter(1)
  %v = {shape} parameter(2)
  %fmha = ({shape}, u8[0]{{0}}) custom-call(%q, %k, %v), custom_call_target="{target}", backend_config={{"cudnn_fmha_backend_config":{{{dims},"mask_type":"{mask}"}}}}
  ROOT %o = {shape} get-tuple-element(%fmha), index=0
}}
"""


@pytest.mark.parametrize("target, mask, matmuls", [
    ("__cudnn$fmhaSoftmax", "NO_MASK", 2), ("__cudnn$fmhaSoftmax", "CAUSAL", 1),
    ("__cudnn$fmhaSoftmaxBackward", "CAUSAL", 2.5),
])
def test_cudnn_attention_counts_its_matmuls(target, mask, matmuls):
    (op,) = roofline.op_costs(fmha_module(target, mask), peaks=H100, hbm=HBM, efficiency=1.0)
    qk = 2 * (2 * 4096 * 16 * 128) * 4096  # Q·Kᵀ: 2 x q's elements x the keys
    assert op.kind == "attention" and op.flops == matmuls * qk


def test_predict_gives_mfu_from_model_flops_and_hfu_from_the_program():
    got = roofline.predict(gemm_module("bf16"), peaks=H100, hbm=HBM, model_flops=N**3,
                           efficiency=1.0)
    seconds = 2 * N**3 / H100.bf16
    assert got["predicted_step_seconds"] == pytest.approx(seconds)
    assert got["predicted_mfu"] == pytest.approx(0.5)
    assert got["predicted_hfu"] == pytest.approx(1.0)
    assert got["top_ops"][0]["name"] == "gemm"


def test_one_table_of_gpu_peaks():
    assert PEAK_FLOPS["H100"] == GPU_PEAKS["H100"].bf16 == peak_flops("NVIDIA H100 80GB HBM3")
    h200 = gpu_peaks("NVIDIA H200")
    assert h200.fp8 == pytest.approx(2 * h200.bf16, rel=1e-3) and gpu_peaks("TPU v4") is None
    assert GPU_PEAKS["A100"].fp8 is None
