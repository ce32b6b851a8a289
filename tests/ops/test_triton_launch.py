"""KernelLauncher against the kernel's own ``kernel[grid](...)`` launch (GPU)."""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from effdl.ops.triton_launch import KernelLauncher  # noqa: E402


@triton.jit
def _scaled_copy_kernel(src_ptr, dst_ptr, n, scale, step, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs * step, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, (x * scale + SHIFT).to(dst_ptr.dtype.element_ty), mask=mask)


@pytest.mark.gpu
def test_cached_launches_match_triton_launches_across_specializations():
    """Alignment, integers equal to 1 or multiples of 16, dtypes and constexprs each change
    Triton's specialization: every combination, repeated, must match a plain launch."""
    launch = KernelLauncher(_scaled_copy_kernel)
    src = torch.randn(4099, device="cuda")
    for _ in range(2):
        for offset in (0, 1, 4):
            for n in (1, 16, 1000):
                for step in (1, 2):
                    for dtype in (torch.float32, torch.bfloat16):
                        for shift in (0, 3):
                            s = src[offset:]
                            got = torch.full((n,), -7.0, device="cuda", dtype=dtype)
                            want = got.clone()
                            grid = (triton.cdiv(n, 256),)
                            launch(grid, s, got, n, 0.5, step, num_warps=4, BLOCK=256, SHIFT=shift)
                            _scaled_copy_kernel[grid](
                                s, want, n, 0.5, step, SHIFT=shift, BLOCK=256, num_warps=4
                            )
                            torch.testing.assert_close(got, want, rtol=0, atol=0)
    # one entry per specialization, reused on the second pass
    assert 0 < len(launch._compiled) <= 3 * 3 * 2 * 2 * 2


@pytest.mark.gpu
def test_cached_launch_runs_on_the_current_stream():
    launch = KernelLauncher(_scaled_copy_kernel)
    src = torch.randn(1 << 20, device="cuda")
    dst = torch.empty_like(src)
    args = (src, dst, src.numel(), 2.0, 1)
    launch((src.numel() // 1024,), *args, num_warps=4, SHIFT=0, BLOCK=1024)  # compiles
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10_000_000)  # holds this stream: work queued after waits for it
        launch((src.numel() // 1024,), *args, num_warps=4, SHIFT=1, BLOCK=1024)  # compiles
        dst.zero_()
        launch((src.numel() // 1024,), *args, num_warps=4, SHIFT=1, BLOCK=1024)  # cached
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(dst, src * 2 + 1, rtol=0, atol=0)


@pytest.mark.gpu
def test_torch_compile_traces_the_launch_without_graph_breaks():
    import torch._dynamo

    launch = KernelLauncher(_scaled_copy_kernel)

    def copy_scaled(src: torch.Tensor) -> torch.Tensor:
        dst = torch.empty_like(src)
        launch((triton.cdiv(src.numel(), 256),), src, dst, src.numel(), 3.0, 1,
               num_warps=4, SHIFT=0, BLOCK=256)  # fmt: skip
        return dst

    src = torch.randn(1000, device="cuda")
    copy_scaled(src)  # a cached entry exists: tracing must still take the traceable path
    torch._dynamo.reset()
    explained = torch._dynamo.explain(copy_scaled)(src)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch.testing.assert_close(torch.compile(copy_scaled)(src), src * 3, rtol=0, atol=0)
