"""accumulate_fp32_ against torch's mixed-dtype add_ and copy_, on the CPU path and through
Triton's interpreter."""

import pytest
import torch

from effdl.ops.fp32_accumulate import accumulate_fp32_
from tests.triton_interpreter import assert_kernels_ok_in_interpreter


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("overwrite", [False, True])
def test_cpu_path_equals_torch(dtype, overwrite):
    torch.manual_seed(0)
    dst = torch.randn(3, 50)
    src = torch.randn(3, 50).to(dtype)
    expected = src.float() if overwrite else dst + src.float()
    accumulate_fp32_(dst, src, overwrite=overwrite)
    assert torch.equal(dst, expected)


def test_refuses_a_low_precision_dst_or_another_shape():
    with pytest.raises(ValueError, match=r"float32 dst of src's shape; got dst torch\.bfloat16"):
        accumulate_fp32_(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4))
    with pytest.raises(ValueError, match=r"dst torch.float32 \(4,\), src \(5,\)"):
        accumulate_fp32_(torch.zeros(4), torch.zeros(5))


_INTERPRETED_KERNEL_CHECK = """
import torch
from effdl.ops import fp32_accumulate as fa
torch.manual_seed(0)
for n in (1, 1000, fa.BLOCK, fa.BLOCK + 3, 3 * fa.BLOCK - 1):  # partial and whole blocks
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        src = torch.randn(n).to(dtype)
        for overwrite in (False, True):
            dst = torch.randn(n)
            expected = src.float() if overwrite else dst + src.float()
            fa._triton_accumulate(dst, src, overwrite)
            assert torch.equal(dst, expected), (n, dtype, overwrite)
print("kernels ok")
"""


def test_triton_kernel_in_interpreter_equals_torch():
    assert_kernels_ok_in_interpreter(_INTERPRETED_KERNEL_CHECK)


@pytest.mark.gpu
def test_cuda_kernel_equals_torch():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on a machine with a GPU: pytest -m gpu)")
    torch.manual_seed(0)
    for n in (7, 1 << 20):
        src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dst = torch.randn(n, device="cuda")
        expected = dst + src.float()
        accumulate_fp32_(dst, src)
        assert torch.equal(dst, expected)
