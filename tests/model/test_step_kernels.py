"""The step kernels (kvgen/model/kernels/step.c): the gated activations and the scale against torch's ops, in each
build (AVX-512, AVX2 with FMA, and the portable loop other CPUs run)."""

import ctypes
import functools

import pytest
import torch
import torch.nn.functional as F

from kvgen.model.kernels.build import FLAGS, build_library
from kvgen.model.kernels.step import SOURCE, StepKernels, step_kernels
from kvgen.model.layers import make_gate_mul, make_gate_pair_mul, silu_mul

CPU = torch.device("cpu")
# silu(g) * up is four roundings of ours (e^-g within 2 ulp from exp16's polynomial, then 1 + e,
# the quotient, the product: half an ulp each) against four of torch's (its vectorised exp within
# 1 ulp, then the same three): the two differ by at most ~6 ulp, 2^-21 relative at most.
F32_RTOL = 2.0**-20
BF16_RTOL = 2.0**-7  # one bf16 rounding step (8 bits) where the fp32 results straddle a rounding boundary
# gelu_tanh(g) * up = g/2 (1 + t) up with |t| <= 1: ours takes t = 1 - 2 / (1 + e^2u) (e within 2 ulp, three
# roundings: t within ~4 ulp of 1), torch's tanh is Sleef's (1 ulp); then 1 + t, the halved product and the
# product round once each. So both lie within a few ulp of |g up|, and apart by at most ~8: 2^-20 |g| |up|.
GELU_ATOL_PER_GU = 2.0**-20


@functools.cache
def built_without(*flags: str) -> StepKernels:
    return StepKernels(ctypes.CDLL(str(build_library(SOURCE, (*FLAGS, *flags)))))


KERNELS = {"native": step_kernels, "avx2": functools.partial(built_without, "-mno-avx512f"),
           "portable": functools.partial(built_without, "-mno-avx512f", "-mno-avx2", "-mno-fma")}


def gate_up(rows: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(rows * 1000 + n)
    x = torch.randn(rows, 2 * n) * 4
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 100.0, -100.0])  # tails and underflow
    return x.to(dtype)


@pytest.mark.parametrize("build", KERNELS)
@pytest.mark.parametrize("rows, n", [(1, 1536), (3, 100), (17, 37), (512, 64)])
def test_silu_mul_matches_torch_in_fp32(build, rows, n):
    x = gate_up(rows, n, torch.float32)
    got = KERNELS[build]().silu_mul(x)
    want = F.silu(x[:, :n]) * x[:, n:]
    torch.testing.assert_close(got, want, rtol=F32_RTOL, atol=1e-37)


@pytest.mark.parametrize("build", KERNELS)
@pytest.mark.parametrize("rows, n", [(1, 1536), (17, 37), (64, 1000)])
def test_gelu_mul_matches_torch_in_fp32(build, rows, n):
    x = gate_up(rows, n, torch.float32)
    got = KERNELS[build]().gate_mul("gelu_tanh", x)
    want = F.gelu(x[:, :n], approximate="tanh") * x[:, n:]
    assert ((got - want).abs() <= GELU_ATOL_PER_GU * x[:, :n].abs() * x[:, n:].abs() + 1e-37).all()


@pytest.mark.parametrize("build", KERNELS)
def test_silu_mul_matches_torch_in_bf16(build):
    x = gate_up(9, 300, torch.bfloat16)
    got = KERNELS[build]().silu_mul(x)
    want = F.silu(x[:, :300]).mul_(x[:, 300:])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=BF16_RTOL, atol=1e-37)
    assert (got == want).float().mean() > 0.99  # almost every value rounds the same way


def test_the_model_gets_the_kernel_on_the_cpu_and_torch_elsewhere():
    assert make_gate_mul("silu", CPU, torch.float32) == step_kernels().silu_mul
    assert make_gate_mul("silu", CPU, torch.float16) is silu_mul


def test_silu_mul_refuses_odd_widths_and_other_dtypes():
    with pytest.raises(ValueError, match="gate_up"):
        step_kernels().silu_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="gate_up"):
        step_kernels().silu_mul(torch.zeros(2, 8, dtype=torch.float16))


@pytest.mark.parametrize("build", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_pair_mul_gives_gate_mul_bits_from_two_matrices(build, dtype):
    """Gemma 4's per-layer input: gate and up apart, up a strided slice (a layer's of [T, L, P])."""
    x = gate_up(5, 40, dtype)
    up = torch.zeros(5, 3, 40, dtype=dtype)
    up[:, 1] = x[:, 40:]
    kernels = KERNELS[build]()
    got = kernels.gate_pair_mul("gelu_tanh", x[:, :40].clone(), up[:, 1])
    assert torch.equal(got, kernels.gate_mul("gelu_tanh", x))
    assert not torch.equal(got, kernels.gate_mul("gelu_tanh", torch.cat((x[:, :40], up[:, 0]), dim=1)))


def test_the_pair_mul_falls_back_to_torch_off_the_kernel():
    gate, up = torch.randn(3, 8, dtype=torch.float16), torch.randn(3, 8, dtype=torch.float16)
    got = make_gate_pair_mul("gelu_tanh", CPU, torch.float16)(gate, up)
    assert torch.equal(got, F.gelu(gate, approximate="tanh") * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_call_gives_torchs_mul_bits(dtype):
    """x *= the layer scalar, as the layered forward's x.mul_(scalar)."""
    torch.manual_seed(0)
    x, s = torch.randn(3, 1536).to(dtype), torch.tensor([0.7321]).to(dtype)
    want = x.clone().mul_(s)
    kernels = step_kernels()
    kernels.call_list([kernels.scale_call(x, s)])()
    assert torch.equal(x, want)
