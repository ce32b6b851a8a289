"""kernel_split against sums worked out by hand on a small trace."""

import gzip
import json
from types import SimpleNamespace

import pytest

from effdl.profiling.kernel_split import (
    LAUNCH_STALL,
    kernel_kind,
    kernel_split,
    launched_kernel_us,
    read_trace_events,
)


def kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


EVENTS = [
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},  # host: ignored
    kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT", 0, 300),
    kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma", 300, 100),
    kernel("triton_poi_fused_mul_silu_2", 400, 50),
    kernel("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 500, 40),
    kernel("Memcpy HtoD (Pinned -> Device)", 540, 10, cat="gpu_memcpy"),
    kernel("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", 560, 40),
]


def test_kinds_from_names():
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert kernel_kind("triton_tem_fused_mm_0") == "gemm"
    assert kernel_kind("triton_red_fused__log_softmax_0") == "loss"
    assert kernel_kind("triton_per_fused_add_pow_sum_8") == "fused elementwise (triton)"
    assert kernel_kind("void at::native::elementwise_kernel<128, 4>") == "other elementwise"


def test_split_by_hand(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    split = kernel_split(read_trace_events(path), top=2)
    assert split["span_ms"] == pytest.approx(0.6)  # 0 .. 600 us
    assert split["kernel_ms"] == pytest.approx(0.54)
    assert split["busy_share"] == pytest.approx(0.9)
    assert split["by_kind_ms"] == pytest.approx(
        {
            "gemm": 0.3,
            "attention": 0.1,
            "fused elementwise (triton)": 0.05,
            "optimizer": 0.04,
            "other elementwise": 0.04,
            "copy/fill": 0.01,
        }
    )
    assert next(iter(split["by_kind_ms"])) == "gemm"
    assert [k["ms"] for k in split["top_kernels"]] == pytest.approx([0.3, 0.1])


def test_a_trace_without_kernels_is_refused():
    with pytest.raises(ValueError, match="no GPU kernels"):
        kernel_split(EVENTS[:1])


def test_range_kernel_time_counts_a_stalled_launch_once():
    """kineto lists a kernel whose launch waited on a full command queue under the launching op
    and again under a 'Command Buffer Full' event: the range's kernel time counts it once."""
    k = SimpleNamespace
    stall = SimpleNamespace(name=LAUNCH_STALL, kernels=[k(duration=700.0)], cpu_children=[])
    norm = SimpleNamespace(name="aten::native_layer_norm", kernels=[k(duration=700.0)],
                           cpu_children=[stall])  # fmt: skip
    mm = SimpleNamespace(name="aten::mm", kernels=[k(duration=300.0)], cpu_children=[])
    module = SimpleNamespace(name="module: block: Attention", kernels=[], cpu_children=[norm, mm])
    assert launched_kernel_us(module) == 1000.0
