"""The quantized layers: which kernel each weight gets, what it reports, and the torch twin."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize as gguf_dequantize

from kvgen.model.kernels.coded import pack_f32 as pack_coded_f32
from kvgen.model.linear import CodedF32Linear, F32Linear
from kvgen.model.linear_choice import make_linear
from kvgen.model.linear_choice import describe, make_quantized_linear, quantize_linear
from kvgen.model import linear_choice as quant_linear
from kvgen.model.formats.packed import dequantize
from kvgen.model.formats.gguf_blocks import convert
from kvgen.model.kernels.qmatmul import qmatmul_kernel
from tests.model.quant.bounds import bounds
from tests.model.quant.raw_blocks import Q, raw_matrix

FP32_LAYER = type(make_linear(torch.zeros(1, 1)))  # this CPU's float layer (F32Linear or BlasLinear)

needs_kernel = pytest.mark.skipif(qmatmul_kernel() is None, reason="CPU with neither AVX-512 VNNI nor AVX2")
U = 2.0 ** -24


@needs_kernel
@pytest.mark.parametrize("ggml_type, kernel", [(Q.Q4_1, "qmatmul_u4_g32_f16"), (Q.Q8_0, "qmatmul_u8_g32_f16"),
                                               (Q.Q4_K, "qmatmul_u4_g32_f32"), (Q.Q6_K, "qmatmul_u8_g16_f32")],
                         ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_gguf_matrix_gets_the_qmatmul_kernel_and_reports_it(ggml_type, kernel, activations):
    raw = raw_matrix(ggml_type, 8, 256)
    bias = torch.randn(8)
    layer = make_quantized_linear(ggml_type, raw, (8, 256), bias=bias, activations=activations)
    assert isinstance(layer, quant_linear.KernelQuantLinear)
    assert layer.kernel == f"{kernel} [{qmatmul_kernel().isa}] (x {activations})"
    packed = layer.packed
    parts = [packed.codes, packed.scale] + ([packed.min] if packed.min is not None else [])
    assert layer.weight_bytes == sum(t.numel() * t.element_size() for t in parts)
    assert (layer.out_features, layer.in_features) == (8, 256)
    x = torch.randn(3, 256)
    assert torch.equal(layer(x), qmatmul_kernel().bind(packed, activations)(x) + bias)
    assert describe(layer) == (layer.kernel, layer.weight_bytes)


def test_a_type_without_a_kernel_format_is_dequantized_to_a_float_layer():
    raw = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float16).view(np.uint8)  # F16
    layer = make_quantized_linear(Q.F16, raw, (4, 32))
    assert isinstance(layer, FP32_LAYER)
    # a one-hot x picks each weight exactly, whatever layout the layer keeps them in
    assert torch.equal(layer(torch.eye(32)).T, torch.from_numpy(gguf_dequantize(raw, Q.F16)))
    bf16 = make_quantized_linear(Q.F16, raw, (4, 32), dtype=torch.bfloat16)
    assert describe(bf16)[1] == 4 * 32 * 2


def test_a_cpu_without_the_kernel_gets_the_dequantized_weights_in_a_float_layer(monkeypatch):
    monkeypatch.setattr(quant_linear, "qmatmul_kernel", lambda: None)
    layer = make_quantized_linear(Q.Q5_1, raw_matrix(Q.Q5_1, 6, 64), (6, 64))
    assert isinstance(layer, FP32_LAYER)
    assert torch.equal(layer(torch.eye(64)).T, dequantize(convert(Q.Q5_1, raw_matrix(Q.Q5_1, 6, 64), (6, 64))))
    dense = dequantize(convert(Q.Q5_1, raw_matrix(Q.Q5_1, 6, 64), (6, 64)))
    # panels hold 32 rows, zeros past 6: 4 bytes a weight, or 28 bits and a table (CodedF32Linear)
    held = {F32Linear: 32 * 64 * 4, CodedF32Linear: pack_coded_f32(dense).nbytes}.get(FP32_LAYER, 6 * 64 * 4)
    assert describe(layer) == (FP32_LAYER.__name__, held)


def test_torch_twin_is_dequantize_then_f_linear():
    bias = torch.randn(6)
    packed = convert(Q.Q5_1, raw_matrix(Q.Q5_1, 6, 64), (6, 64))
    layer = quant_linear.TorchQuantLinear(packed, bias)
    assert describe(layer) == ("torch-dequantize", packed.nbytes)
    x = torch.randn(2, 64)
    assert torch.equal(layer(x), F.linear(x, dequantize(packed), bias))


@needs_kernel
def test_kernel_and_torch_twin_agree_within_the_kernels_bound():
    """The twin is fp32 F.linear on W^ (within K ulps of sum |x| |w^| of x W^T); the kernel within
    its bound (tests/model/quant/bounds.py) of x W^T."""
    weight = torch.randn(16, 128) * 0.05
    x = torch.randn(4, 128)
    fast = quantize_linear(weight, "int4")
    twin = quant_linear.TorchQuantLinear(fast.packed, None)
    _, _, kernel_bound = bounds(fast.packed, x)
    twin_bound = 128 * U * (x.double().abs() @ dequantize(twin.packed).double().abs().T)
    assert ((fast(x).double() - twin(x).double()).abs() <= kernel_bound + twin_bound).all()


@needs_kernel
def test_bfloat16_activations_come_back_in_bfloat16():
    layer = quantize_linear(torch.randn(8, 64), "int8")
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, layer(x.float()).to(torch.bfloat16))


def test_unknown_quantization_or_activations_are_refused():
    with pytest.raises(ValueError, match="quantization 'int3'"):
        quantize_linear(torch.randn(4, 32), "int3")
    with pytest.raises(ValueError, match="activations 'fp8'"):
        quantize_linear(torch.randn(4, 32), "int8", activations="fp8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_layer_equals_its_cpu_twin():
    weight = torch.randn(8, 64)
    cuda = quantize_linear(weight.cuda(), "int8")
    cpu = quant_linear.TorchQuantLinear(cuda.packed.to(torch.device("cpu")), None)
    assert isinstance(cuda, quant_linear.TorchQuantLinear) and cuda.packed.codes.is_cuda
    x = torch.randn(3, 64)
    w_hat = dequantize(cpu.packed).double()
    bound = 2 * 64 * U * (x.double().abs() @ w_hat.abs().T)  # two fp32 matmuls of 64 terms
    assert ((cuda(x.cuda()).cpu().double() - cpu(x).double()).abs() <= bound).all()
