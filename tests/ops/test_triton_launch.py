"""CompiledLauncher against the JIT launch it stands in for.

On the CPU: the specialization key tells apart what Triton compiles apart. On CUDA (``-m gpu``):
repeated launches through the compiled handle give the JIT's results, with pointers aligned or
not and integers that are 1, multiples of 16 or neither, each in a kernel of its own.
"""

from __future__ import annotations

import pytest
import torch

from effdl.ops.triton_launch import CompiledLauncher, _arg_key

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


def test_key_separates_alignment_divisibility_and_width():
    buf = torch.zeros(64)
    assert _arg_key(buf) != _arg_key(buf[1:])  # 4-byte offset: not 16-byte aligned
    assert _arg_key(buf) == _arg_key(buf[4:])  # 16-byte offset: aligned
    assert _arg_key(buf) != _arg_key(buf.half())
    keys = {_arg_key(v) for v in (1, 16, 32, 17, 2**40)}
    assert len(keys) == 4  # 1, multiples of 16, others, too wide for int32
    assert _arg_key(True) != _arg_key(1)
    assert _arg_key(0.5) == _arg_key(1e-5)


@triton.jit
def _scaled_copy(src_ptr, dst_ptr, n, scale, stride, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs * stride, mask=mask, other=0.0)
    tl.store(dst_ptr + offs, x * scale, mask=mask)


@pytest.mark.gpu
def test_cuda_repeated_launches_match_torch():
    launch = CompiledLauncher(_scaled_copy)
    buf = torch.randn(4096 + 1, device="cuda")
    for n, stride, offset in [(1000, 1, 0), (1000, 1, 1), (1024, 1, 0), (1, 1, 0), (333, 3, 1)]:
        src = buf[offset:]
        for rep in range(3):  # the first compiles or finds the kernel, the others run direct
            dst = torch.full((n,), float("nan"), device="cuda")
            launch((triton.cdiv(n, 256),), src, dst, n, 0.5 + rep, stride, BLOCK=256, num_warps=4)
            expected = src[: n * stride : stride] * (0.5 + rep)
            torch.testing.assert_close(dst, expected, rtol=0, atol=0)
    assert len(launch._compiled) == 5


@pytest.mark.gpu
def test_cuda_constexprs_out_of_order_are_refused():
    launch = CompiledLauncher(_scaled_copy)
    x = torch.zeros(8, device="cuda")
    with pytest.raises(TypeError, match="constexprs by keyword"):
        launch((1,), x, x, 8, 1.0, BLOCK=16)  # stride passed as a constexpr by omission
