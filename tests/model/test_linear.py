"""Linear kernels: each backend computes x @ W^T + b, and role-fixed rows do not depend on the batch."""

import pytest
import torch
import torch.nn.functional as F

from kvgen.model.kernels.bf16 import bf16_kernel
from kvgen.model.kernels.f32 import f32_kernel
from kvgen.model.linear import BlasLinear, Bf16Linear, F32Linear, OneDnnLinear, RowKernels, TorchLinear
from kvgen.model.linear_choice import make_linear

torch.manual_seed(0)
WEIGHT, BIAS = torch.randn(96, 64), torch.randn(96)


@pytest.mark.parametrize("kind", [BlasLinear, F32Linear])
def test_fp32_on_the_cpu_matches_f_linear(kind):
    if kind is F32Linear and f32_kernel() is None:
        pytest.skip("this CPU has no AVX-512")
    linear = BlasLinear(WEIGHT, BIAS) if kind is BlasLinear else F32Linear(WEIGHT, BIAS, f32_kernel())
    for rows in (1, 2, 7, 64):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x), F.linear(x, WEIGHT, BIAS), rtol=1e-5, atol=1e-5)


def test_fp32_on_the_cpu_takes_the_kernel_where_it_runs():
    assert isinstance(make_linear(WEIGHT, BIAS), F32Linear if f32_kernel() is not None else BlasLinear)


def test_bf16_on_the_cpu_uses_packed_weights_and_matches_f_linear():
    linear = make_linear(WEIGHT.bfloat16(), BIAS.bfloat16())
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert isinstance(linear, TorchLinear)
        pytest.skip("this CPU has no native bf16: F.linear is used")
    assert isinstance(linear, Bf16Linear if bf16_kernel() is not None else OneDnnLinear)
    for rows in (1, 3, 64):
        x = torch.randn(rows, 64).bfloat16()
        torch.testing.assert_close(linear(x).float(), F.linear(x, WEIGHT.bfloat16(), BIAS.bfloat16()).float(),
                                   rtol=1e-2, atol=1e-2)


def test_other_dtypes_use_f_linear():
    assert isinstance(make_linear(WEIGHT.half()), TorchLinear)


@pytest.mark.skipif(f32_kernel() is not None, reason="fp32 layers run on F32Linear here, not OpenBLAS")
def test_role_kernels_give_a_row_the_same_bits_whatever_runs_beside_it():
    """What `none` == `contiguous` rests on where BlasLinear is the fp32 layer (CPUs with neither
    AVX-512 nor AVX2): a prompt row (GEMM) and a generated row (GEMV) come out bit-identical in a
    batch of 2 or of 9 rows on OpenBLAS. (F32Linear's rows never depend on the batch:
    tests/model/test_f32_kernel.py. OpenBLAS's Haswell GEMM does not keep a row's bits across row
    counts, its SkylakeX GEMM does.)"""
    linear = BlasLinear(WEIGHT, None)
    x = torch.randn(9, 64)
    small = linear(torch.cat((x[:2], x[8:])), RowKernels.split(3, num_gemv_last=1))
    large = linear(x, RowKernels.split(9, num_gemv_last=1))
    assert torch.equal(small[:2], large[:2])  # GEMM rows: 2 vs 8 of them
    assert torch.equal(small[2], large[8])  # the generated row: one GEMV either way
    padded = linear(x[:1], RowKernels.split(1))  # a lone prompt row is padded to a 2-row GEMM
    assert torch.equal(padded[0], small[0])


def test_onednn_bf16_where_the_kernel_cannot_run_matches_f_linear():
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no native bf16")
    linear = OneDnnLinear(WEIGHT.bfloat16(), BIAS.bfloat16())
    x = torch.randn(3, 64).bfloat16()
    torch.testing.assert_close(linear(x).float(), F.linear(x, WEIGHT.bfloat16(), BIAS.bfloat16()).float(),
                               rtol=1e-2, atol=1e-2)
