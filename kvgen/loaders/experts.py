"""Expert tensors of HF checkpoints, stacked per layer as kvgen keeps them (and GGUF stores them):
`mlp.experts.{gate,up,down}_proj.weight` [experts, out, in] (kvgen.architectures.spec.MoESpec).

transformers saves a mixture's experts one by one (`mlp.experts.{e}.gate_proj.weight`) or, in its own
fused layout, as `mlp.experts.gate_up_proj` [experts, 2 * inner, hidden] and `mlp.experts.down_proj`
[experts, hidden, inner]; both become the stacked names. gpt-oss's fused layout (MoESpec's
`hf_interleaved`) is [experts, in, out], gate and up columns interleaved, with biases beside
(`gate_up_proj_bias` [experts, 2 * inner], `down_proj_bias`); its releases hold the expert matrices
in MXFP4 (`*_proj_blocks` / `*_proj_scales`, [experts, out, ...]), read as the fp32 values they hold
(exactly: e2m1 times a power of two), 4 bytes a weight where the GGUF's packed experts keep about one.
A layer missing an expert, or whose experts differ in shape, is refused in one line.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import torch

from kvgen.architectures.spec import MoESpec
from kvgen.config import ModelConfig
from kvgen.errors import ModelLoadError

_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.\w+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
_FUSED = re.compile(r"(model\.layers\.\d+\.\w+\.experts)\.(gate_up|down)_proj(_bias)?")
_MXFP4 = re.compile(r"(model\.layers\.\d+\.\w+\.experts)\.(gate_up|down)_proj_(blocks|scales)")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by 4-bit code


def stack_experts(weights: dict[str, torch.Tensor], config: ModelConfig, source: Any) -> dict[str, torch.Tensor]:
    """`weights` with every layer's expert tensors stacked under kvgen's names (other tensors as they are)."""
    if not config.is_moe:
        return weights
    out: dict[str, torch.Tensor] = {}
    interleaved = any(isinstance(b, MoESpec) and b.hf_interleaved for b in config.arch.blocks())
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = defaultdict(dict)
    mxfp4: dict[tuple[str, str], dict[str, torch.Tensor]] = defaultdict(dict)
    for name, tensor in weights.items():
        if m := _PER_EXPERT.fullmatch(name):
            per_expert[(m.group(1), m.group(3))][int(m.group(2))] = tensor
        elif m := _FUSED.fullmatch(name):
            bias = bool(m.group(3))
            out |= _split_fused(m.group(1), m.group(2), tensor, bias, interleaved, interleaved and not bias, source)
        elif m := _MXFP4.fullmatch(name):
            mxfp4[(m.group(1), m.group(2))][m.group(3)] = tensor
        else:
            out[name] = tensor
    for (prefix, projection), experts in per_expert.items():
        out[f"{prefix}.{projection}_proj.weight"] = _stacked(prefix, projection, experts, config, source)
    for (prefix, projection), parts in mxfp4.items():
        if set(parts) != {"blocks", "scales"}:
            raise ModelLoadError(source, f"{prefix}.{projection}_proj has MXFP4 {sorted(parts)} without its "
                                         f"{'scales' if 'blocks' in parts else 'blocks'}")
        values = dequantize_mxfp4(parts["blocks"], parts["scales"])
        out |= _split_fused(prefix, projection, values, False, interleaved, False, source)
    return out


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's MXFP4 tensors: blocks uint8 [..., G, 16] (two e2m1 codes a byte, the first value in the low
    nibble), scales uint8 [..., G] (e8m0 exponents, bias 127) -> fp32 [..., 32 G], the values they hold."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., G, 32]
    values = torch.tensor(E2M1)[codes] * torch.exp2(scales.float() - 127)[..., None]
    return values.flatten(-2)


def _stacked(prefix: str, projection: str, experts: dict[int, torch.Tensor], config: ModelConfig,
             source: Any) -> torch.Tensor:
    missing = sorted(set(range(config.num_experts)) - set(experts))
    if missing:
        raise ModelLoadError(source, f"{prefix}: {projection}_proj is missing for experts {missing}")
    extra = sorted(set(experts) - set(range(config.num_experts)))
    if extra:
        raise ModelLoadError(source, f"{prefix}: {projection}_proj of experts {extra}, past the config's "
                                     f"{config.num_experts}")
    shapes = {tuple(t.shape) for t in experts.values()}
    if len(shapes) > 1:
        raise ModelLoadError(source, f"{prefix}: the experts' {projection}_proj differ in shape: {sorted(shapes)}")
    return torch.stack([experts[e] for e in range(config.num_experts)])


def _split_fused(prefix: str, projection: str, tensor: torch.Tensor, bias: bool, interleaved: bool, in_out: bool,
                 source: Any) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors ([experts, out, in], or [experts, in, out] where `in_out`; a
    bias: [experts, out]) -> the stacked gate / up / down."""
    suffix = "bias" if bias else "weight"
    if tensor.dim() != (2 if bias else 3):
        raise ModelLoadError(source, f"{prefix}.{projection}_proj{'_bias' if bias else ''} has shape "
                                     f"{tuple(tensor.shape)}, not {'[experts, out]' if bias else '[experts, out, in]'}")
    if in_out:
        tensor = tensor.transpose(1, 2)  # [experts, in, out] -> [experts, out, in]
    if projection == "down":
        return {f"{prefix}.down_proj.{suffix}": tensor}
    gate, up = (tensor[:, ::2], tensor[:, 1::2]) if interleaved else tensor.chunk(2, dim=1)  # out is dim 1
    return {f"{prefix}.gate_proj.{suffix}": gate, f"{prefix}.up_proj.{suffix}": up}
