"""The building blocks of a decoder layer: RMSNorm, rotary embeddings, the gated MLP's activation
(SwiGLU's silu, GeGLU's tanh GELU).

Numerics follow Hugging Face transformers op for op (fp32 norm statistics, the same RoPE tables),
so that fp32 greedy decoding matches it token for token.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvgen.config import ModelConfig
from kvgen.model.kernels.norm import DTYPES as NORM_DTYPES
from kvgen.model.kernels.norm import rms_norm_kernel
from kvgen.model.kernels.rope import DTYPES as ROPE_DTYPES
from kvgen.model.kernels.rope import rope_kernel
from kvgen.model.kernels.step import GATE_ACTIVATIONS, SILU_DTYPES, step_kernels


Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x [T, hidden], weight, eps) -> [T, hidden]
Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # apply_rope's signature
GateMul = Callable[[torch.Tensor], torch.Tensor]  # gate_up [T, 2n] -> act(gate) * up [T, n]
GatePairMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # gate, up [T, n] -> act(gate) * up [T, n]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, hidden] -> [T, hidden]; statistics in fp32 whatever the input dtype, and (as HF does) the
    weight applied after casting back. torch's fused kernel gives HF's fp32 result bit for bit."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def make_rms_norm(device: torch.device, dtype: torch.dtype) -> Norm:
    """The RMSNorm for a model's device and dtype: on the CPU in fp32 or bf16, kvgen's C kernel at
    every row count (the same operations as `rms_norm`, summed in another order: 8 us a call at 16
    rows against torch's 24, 74 against 1,086 at 512, one thread, buffers reused); elsewhere
    `rms_norm`."""
    if device.type != "cpu" or dtype not in NORM_DTYPES or (kernel := rms_norm_kernel()) is None:
        return rms_norm
    return kernel


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: gate_up [T, 2n] (the fused gate and up projections) -> silu(gate) * up [T, n]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU's activation (Gemma): gate_up [T, 2n] -> gelu_tanh(gate) * up [T, n]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


TORCH_GATE_MULS = {"silu": silu_mul, "gelu_tanh": gelu_tanh_mul}


def _check_activation(activation: str) -> None:
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {GATE_ACTIVATIONS}")


def make_gate_mul(activation: str, device: torch.device, dtype: torch.dtype) -> GateMul:
    """The gated MLP's activation for a model's device and dtype: on the CPU in fp32 or bf16, kvgen's
    C kernel at every row count (~4 us a decode call against torch's ~6; within 2 fp32 ulp of torch's
    silu and a few of its tanh GELU, and the fused decode step of kvgen.model.fused runs the same
    kernel); elsewhere torch's ops."""
    _check_activation(activation)
    if device.type != "cpu" or dtype not in SILU_DTYPES or (kernels := step_kernels()) is None:
        return TORCH_GATE_MULS[activation]
    return kernels.silu_mul if activation == "silu" else functools.partial(kernels.gate_mul, activation)


def make_gate_pair_mul(activation: str, device: torch.device, dtype: torch.dtype) -> GatePairMul:
    """act(gate) * up where gate and up are two matrices [T, n] (Gemma 4's per-layer input): the same C
    kernel as make_gate_mul's where it has one (the fused decode step runs it too), else torch's ops."""
    _check_activation(activation)
    if device.type != "cpu" or dtype not in SILU_DTYPES or (kernels := step_kernels()) is None:
        return lambda gate, up: TORCH_GATE_MULS[activation](torch.cat((gate, up), dim=-1))
    return functools.partial(kernels.gate_pair_mul, activation)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[rotary_dim / 2] inverse frequencies (rotary_dim: head_dim unless the model rotates part of
    each head), with linear, llama3, proportional or YaRN scaling applied."""
    dim = config.rotary_dim or config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    if scaling["rope_type"] == "proportional":
        return _proportional_inv_freq(inv_freq, scaling)
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(inv_freq, scaling, config.rope_theta)
    return _llama3_inv_freq(inv_freq, scaling)


def rope_attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor as transformers computes it (the
    scaling's own, else 0.1 m ln(factor) + 1 with m = 1, or that ratio for mscale / mscale_all_dim), 1
    for the other scalings."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


def _yarn_inv_freq(inv_freq: torch.Tensor, scaling: dict, base: float) -> torch.Tensor:
    """YaRN: pairs that turn more than beta_fast times over the original context keep their frequency,
    those turning fewer than beta_slow times are divided by `factor`, a linear ramp between (its ends
    rounded outwards where `truncate`, transformers' default; gpt-oss's config turns it off)."""
    factor, pairs = float(scaling["factor"]), inv_freq.shape[0]
    dim, context = 2 * pairs, float(scaling["original_max_position_embeddings"])
    periods = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)  # [pairs] 1 / inv_freq, as HF

    def pair_of(rotations: float) -> float:  # the (fractional) pair index turning `rotations` times
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_of(float(scaling.get("beta_fast") or 32)), pair_of(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(pairs, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    kept = 1 - ramp  # [pairs] the share of each pair's original frequency
    return 1.0 / (factor * periods) * (1 - kept) + inv_freq * kept


def _proportional_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Gemma 4's global layers: the first partial_rotary_factor of the pairs keep their frequency
    (exponents over the whole head size), the others get 0, so cos 1 and sin 0 leave them as they
    are; all divided by `factor` (1 unless given), as transformers computes them."""
    rotated = int(float(scaling["partial_rotary_factor"]) * inv_freq.shape[0] * 2 // 2)
    inv_freq = inv_freq.clone()
    inv_freq[rotated:] = 0.0
    return inv_freq / float(scaling.get("factor", 1.0))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short kept, a smooth blend between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables, indexed by position: the same values HF computes per call, except
    that the first half of sin is negated (rotate-half's minus sign, folded into the table)."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype):
        inv_freq = rope_inv_freq(config)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        scale = rope_attention_factor(config)
        self.cos = (emb.cos() * scale).to(device=device, dtype=dtype)
        sin = emb.sin() * scale
        sin[:, : sin.shape[1] // 2].neg_()
        self.sin = sin.to(device=device, dtype=dtype)

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, signed sin [..., 1, D], ready to broadcast over heads (see apply_rope)."""
        return self.cos[positions].unsqueeze(-2), self.sin[positions].unsqueeze(-2)


def make_rope(device: torch.device, dtype: torch.dtype) -> Rotate:
    """The rotary embedding for a model's device and dtype: on the CPU in fp32 or bf16, kvgen's C
    kernel, which rotates in place with apply_rope's bits (4.7 us a decode call against 12.6, and
    ~2.6x faster at 512 rows in fp32; level with torch there in bf16); elsewhere `apply_rope`."""
    if device.type != "cpu" or dtype not in ROPE_DTYPES or (kernel := rope_kernel()) is None:
        return apply_rope

    def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        kernel(x, cos, signed_sin)
        return x

    return rotate


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, D] rotated in rotate-half layout; cos/signed_sin [..., 1, D] from
    RotaryEmbedding.tables. HF's x * cos + cat(-x2, x1) * sin, with the same bits: the minus sign
    sits in the table, and the products are formed in place (fewer fresh buffers per layer)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(swapped.mul_(signed_sin))
