import itertools
import time

import pytest
import torch

from effdl.profiling.flops import (
    matmul_flops,
    measure_copy_bandwidth,
    measure_matmul_tflops,
    tflops,
)


def brute_force_matmul_flops(m: int, n: int, k: int) -> int:
    """Count the multiplies and adds of the schoolbook product, one term at a time."""
    ops = 0
    for _i, _j in itertools.product(range(m), range(n)):
        for _term in range(k):
            ops += 2  # acc += a[i, t] * b[t, j]
    return ops


@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 1), (3, 5, 7), (8, 2, 9), (4, 4, 0)])
def test_matmul_flops_counts_a_multiply_and_an_add_per_term(m, n, k):
    assert matmul_flops(m, n, k) == brute_force_matmul_flops(m, n, k)


def test_tflops_is_flops_per_second_over_a_trillion():
    assert tflops(3e12, 1.5) == pytest.approx(2.0)
    assert tflops(matmul_flops(1000, 1000, 1000), 1e-3) == pytest.approx(2.0)


@pytest.fixture
def millisecond_clock(monkeypatch):
    """``time.perf_counter`` advancing 1 ms per read: every timed call takes exactly 1 ms."""
    ticks = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 1e-3)


def test_measure_matmul_tflops_on_cpu_is_flops_over_the_median(millisecond_clock):
    tf, stats = measure_matmul_tflops(16, torch.float32, "cpu", warmup=1, iters=4)
    assert stats.n == 4
    assert stats.median == pytest.approx(1e-3)
    assert tf == pytest.approx(tflops(matmul_flops(16, 16, 16), stats.median))


def test_measure_copy_bandwidth_counts_bytes_read_and_written(millisecond_clock):
    nbytes = 4096
    gbs, stats = measure_copy_bandwidth(nbytes, torch.device("cpu"), warmup=1, iters=3)
    assert stats.n == 3
    assert gbs == pytest.approx(2 * nbytes / stats.median / 1e9)
    assert gbs == pytest.approx(2 * nbytes / 1e-3 / 1e9)


def test_measure_copy_bandwidth_real_clock_is_consistent():
    gbs, stats = measure_copy_bandwidth(1 << 16, "cpu", warmup=1, iters=5)
    assert stats.n == 5 and 0 < stats.min <= stats.median <= stats.max
    assert gbs == pytest.approx(2 * (1 << 16) / stats.median / 1e9)


def _swiglu_benchmark():
    """The SwiGLU benchmark script as a module (its GEMM table and stack builder)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "swiglu_checkpoint" / "benchmark.py"
    spec = importlib.util.spec_from_file_location("swiglu_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant", ["reference", "checkpoint", "level0", "level1", "level2"])
def test_swiglu_benchmark_gemm_table_equals_the_matmuls_that_run(variant):
    from effdl.profiling.flops import MatmulCounter

    bench = _swiglu_benchmark()
    layers = 3
    shape = bench.Shape(2, 8, 16, 48, layers)
    torch.manual_seed(0)
    model = bench.build_stack(variant, shape, torch.float64, torch.device("cpu"), residual=True)
    x = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)
    with MatmulCounter() as counter:
        model(x).backward(torch.randn_like(x))
    assert counter.total == bench.GEMMS[variant] * layers


def test_matmul_counter_counts_forward_and_backward_matmuls_by_op_name():
    from effdl.profiling.flops import MatmulCounter

    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    a, b = torch.randn(2, 3, 5, requires_grad=True), torch.randn(2, 5, 4)
    with MatmulCounter() as counter:
        out = linear(x)  # addmm
        assert counter.counts == {"addmm": 1} and counter.total == 1
        out = out.sum() + torch.bmm(a, b).sum() + torch.baddbmm(torch.zeros(2, 3, 4), a, b).sum()
        out.backward()  # Linear: mm for dx and dW; bmm and baddbmm: one bmm each for da
        torch.zeros(3, 3).addmm_(torch.randn(3, 3), torch.randn(3, 3))
        torch.relu(x).exp().sum()
    assert counter.counts == {"addmm": 1, "mm": 2, "bmm": 3, "baddbmm": 1, "addmm_": 1}
    assert counter.total == 8
    with counter:  # entering again starts from zero
        torch.mm(torch.randn(2, 2), torch.randn(2, 2))
    assert counter.counts == {"mm": 1}
