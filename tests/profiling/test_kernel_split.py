"""kernel_split and step_breakdown against sums worked out by hand on small traces."""

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
    step_breakdown,
    waits,
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
    assert (
        kernel_kind("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgs)") == "communication"
    )


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
    assert split["idle_ms"] == pytest.approx(0.06)  # 450 .. 500 and 550 .. 560
    assert split["communication_exposed_ms"] == 0.0


def test_collectives_count_as_exposed_only_where_nothing_else_runs():
    events = [
        kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT", 0, 100),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 50, 100),  # 100 .. 150 alone
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 200, 30),  # alone, after a 50 us gap
        kernel("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 230, 20),
    ]
    split = kernel_split(events)
    assert split["communication_exposed_ms"] == pytest.approx(0.08)
    assert split["idle_ms"] == pytest.approx(0.05)
    assert split["by_kind_ms"]["communication"] == pytest.approx(0.13)
    assert waits(split, 2) == "2 steps: a step has 0.04 ms of collectives alone and 0.03 ms idle"


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


def test_breakdown_attributes_kernels_to_the_range_that_launched_them():
    def span(name, ts, dur, cat="user_annotation", **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}

    events = [
        span("step", 0, 100),
        span("data_wait", 0, 10),
        span("forward", 10, 30),
        span("backward", 40, 40),
        span("optimizer", 80, 15),
        span("cudaLaunchKernel", 20, 1, cat="cuda_runtime", correlation=1),
        span("cudaLaunchKernel", 50, 1, cat="cuda_runtime", correlation=2),
        span("gemm", 25, 20, cat="kernel", correlation=1),
        span("gemm_bwd", 45, 30, cat="kernel", correlation=2),  # overlaps the first
    ]
    ranges = ("data_wait", "to_device", "forward", "backward", "optimizer")
    out = step_breakdown(events, n_steps=1, ranges=ranges)
    assert out["step_s"] == pytest.approx(100e-6)
    assert out["host"]["forward"] == pytest.approx(30e-6)
    assert out["host"]["to_device"] == 0
    assert out["host"]["host_gap"] == pytest.approx(5e-6)
    assert out["device"]["forward"] == pytest.approx(20e-6)
    assert out["device"]["backward"] == pytest.approx(30e-6)
    assert out["device"]["optimizer"] == 0
    assert out["device"]["device_idle"] == pytest.approx(50e-6)  # busy 25..75


def test_breakdown_without_gpu_events_has_no_device_part():
    events = [
        {"ph": "X", "name": "step", "cat": "user_annotation", "ts": 0, "dur": 40},
        {"ph": "X", "name": "forward", "cat": "user_annotation", "ts": 0, "dur": 30},
        {"ph": "X", "name": "step", "cat": "user_annotation", "ts": 50, "dur": 60},
        {"ph": "X", "name": "forward", "cat": "user_annotation", "ts": 50, "dur": 50},
    ]
    out = step_breakdown(events, n_steps=2, ranges=("forward",))
    assert out["device"] is None
    assert out["step_s"] == pytest.approx(50e-6)
    assert out["host"] == pytest.approx({"forward": 40e-6, "host_gap": 10e-6})
