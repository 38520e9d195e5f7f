"""A layer's experts, kept where a step streams them: each projection of every expert stacked in one
buffer (expert e's matrix at e times a fixed stride), packed as the dense layers of its GGUF file
would be (K-quants in kquant.c's panels, other block types in the packed format), else fp32. A step
hands the stacks to the C kernel (kvgen.model.kernels.moe), which reads only the experts its tokens
chose, each once: nothing is gathered into new tensors.

    gate_up  [experts, 2 * inner, hidden]   each expert's gate rows, then its up rows
    down     [experts, hidden, inner]

Packed stacks need each expert's rows to fill whole panels of 16 (the packed format's unit,
kvgen.model.formats.packed), which every released MoE has; other shapes and types stay fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvgen.loaders.gguf_tensors import GGUFWeight
from kvgen.loaders.progress import advance
from kvgen.model.formats.float_weights import GROUP
from kvgen.model.formats.gguf_blocks import convert
from kvgen.model.formats.kquant import KINDS, KPacked
from kvgen.model.formats.kquant import dequantize as dequantize_k
from kvgen.model.formats.packed import PANEL, PackedWeight
from kvgen.model.formats.packed import dequantize as dequantize_packed
from kvgen.model.kernels.block_pack import BLOCK_TYPES, block_packer
from kvgen.model.kernels.build import KernelCall
from kvgen.model.kernels.kquant import kquant_kernel
from kvgen.model.kernels.moe import ExpertOptions, ExpertStackArgs, moe_kernel
from kvgen.model.kernels.qmatmul import ACTIVATION_PARTS, qmatmul_kernel
from kvgen.model.linear_choice import FLOAT_QUANTIZERS, gguf_values, narrows
from kvgen.model.quant_linear import MANY_ROWS

Weight = torch.Tensor | GGUFWeight


@dataclass
class ExpertStack:
    """One projection of every expert: `args` for moe.c, over `weight` (fp32 [experts, N, K], or a
    PackedWeight / KPacked of experts * N rows)."""

    weight: torch.Tensor | PackedWeight | KPacked
    args: ExpertStackArgs
    experts: int

    @property
    def kernel(self) -> str:
        w = self.weight
        if isinstance(w, torch.Tensor):
            return "moe f32"
        return f"moe {w.kind}" if isinstance(w, KPacked) else f"moe packed {w.codebook or f'u{w.bits}'} g{w.group}"

    @property
    def nbytes(self) -> int:
        w = self.weight
        return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes

    def dequantize(self) -> torch.Tensor:
        """The values as fp32 [experts, N, K] (the torch reference's weights)."""
        w = self.weight
        if isinstance(w, torch.Tensor):
            return w
        values = dequantize_k(w) if isinstance(w, KPacked) else dequantize_packed(w)
        return values.view(self.experts, self.args.N, self.args.K)


def float_stack(values: torch.Tensor) -> ExpertStack:
    """fp32 [experts, N, K] as a stack for moe.c's fp32 matmul."""
    w = values.to(torch.float32).contiguous()
    experts, n, k = w.shape
    kernel = moe_kernel()
    matmul = kernel.f32_matmul if kernel is not None else None
    args = ExpertStackArgs(matmul, w.data_ptr(), None, None, n * k * 4, 0, 0, 0, 1, MANY_ROWS, n, k, 0)
    return ExpertStack(w, args, experts)


def expert_rows(parts: list[GGUFWeight]) -> list[np.ndarray]:
    """The parts' raw rows in stack order: expert 0's rows of each part, then expert 1's, ... (views)."""
    experts = parts[0].shape[0]
    return [p.raw[e * p.shape[1]:(e + 1) * p.shape[1]] for e in range(experts) for p in parts]


def kquant_stack(parts: list[GGUFWeight], activations: str) -> ExpertStack | None:
    """K-quant experts in kquant.c's panels, packed in one pass from the file's map, or None where
    that kernel does not run here."""
    kernel = kquant_kernel()
    if kernel is None:
        return None
    experts, n, k = parts[0].shape[0], sum(p.shape[1] for p in parts), parts[0].shape[2]
    packed = kernel.pack(parts[0].ggml_type, expert_rows(parts))
    stride = n // PANEL * packed.data.shape[1]
    args = ExpertStackArgs(kernel.address(packed), packed.data.data_ptr(), None, None, stride, 0, 0, 0,
                           ACTIVATION_PARTS[activations], MANY_ROWS, n, k, 1)
    return ExpertStack(packed, args, experts)


def packed_stack(parts: list[GGUFWeight], activations: str) -> ExpertStack | None:
    """Experts of a legacy block type (Q8_0, Q4_0, ...) or another type the packed format holds, in
    that format, or None where no format holds it or no packed kernel runs here."""
    if qmatmul_kernel() is None:
        return None
    ggml_type, experts, k = parts[0].ggml_type, parts[0].shape[0], parts[0].shape[2]
    n = sum(p.shape[1] for p in parts)
    if ggml_type in BLOCK_TYPES and block_packer() is not None:  # in one pass from the file's map
        packed = block_packer().pack(ggml_type, expert_rows(parts))
    else:
        packed = convert(ggml_type, np.concatenate(expert_rows(parts)), (experts * n, k))
    return None if packed is None else _packed_stack(packed, experts, activations)


def quantized_stack(values: torch.Tensor, quantization: str, activations: str) -> ExpertStack | None:
    """fp32 [experts, N, K] packed as `quantization` (int8 / int4) asks, as the dense layers of the
    model are, or None where no packed kernel runs here."""
    if qmatmul_kernel() is None:
        return None
    experts, n, k = values.shape
    return _packed_stack(FLOAT_QUANTIZERS[quantization](values.reshape(experts * n, k)), experts, activations)


def _packed_stack(packed: PackedWeight, experts: int, activations: str) -> ExpertStack:
    """A PackedWeight of `experts` experts' rows one after another as moe.c's stack."""
    qmatmul = qmatmul_kernel()
    n, k = packed.shape[0] // experts, packed.shape[1]
    panels = n // PANEL
    scale_stride = panels * packed.scale.shape[1] * packed.scale.element_size()
    minimum = None if packed.min is None else packed.min.data_ptr()
    args = ExpertStackArgs(qmatmul.address(packed), packed.codes.data_ptr(), packed.scale.data_ptr(), minimum,
                           panels * packed.codes.shape[1], scale_stride, scale_stride if minimum else 0,
                           packed.offset, ACTIVATION_PARTS[activations], MANY_ROWS, n, k, 0)
    return ExpertStack(packed, args, experts)


def expert_stack(parts: list[Weight], activations: str, quantization: str = "none") -> ExpertStack:
    """Parts [experts, N_i, K] (stacked along N per expert) as one stack, each expert's rows filling
    whole panels of 16: packed again as `quantization` asks (int8 / int4) where that makes them smaller
    (float weights, or GGUF blocks wider than it: the rule of the dense layers); else packed as they are
    where all are GGUF blocks of one type a packed kernel holds; else fp32."""
    advance(sum(p.raw.nbytes if isinstance(p, GGUFWeight) else p.nbytes for p in parts))  # the progress bar
    n, k = sum(p.shape[1] for p in parts), parts[0].shape[2]
    packable = n % PANEL == 0 and moe_kernel() is not None
    stack = None
    if packable and quantization in FLOAT_QUANTIZERS and k % GROUP == 0 and any(
            not isinstance(p, GGUFWeight) or not p.is_quantized or narrows(p, quantization) for p in parts):
        stack = quantized_stack(_values(parts), quantization, activations)
    elif packable and all(isinstance(p, GGUFWeight) and p.is_quantized for p in parts) \
            and len({p.ggml_type for p in parts}) == 1:
        stack = (kquant_stack if parts[0].ggml_type in KINDS else packed_stack)(parts, activations)
    if stack is None:
        return float_stack(_values(parts))
    for p in parts:
        if isinstance(p, GGUFWeight):
            p.release()
    return stack


def _values(parts: list[Weight]) -> torch.Tensor:
    """The parts' values, fp32 [experts, sum of N_i, K]."""
    values = [(gguf_values(p) if isinstance(p, GGUFWeight) else p).to(torch.float32) for p in parts]
    return torch.cat(values, dim=1) if len(values) > 1 else values[0]


class Experts:
    """A layer's routed experts: y = sum over the top-k experts e of w_e * down_e(silu(gate_e x) * up_e x),
    in one C call a step (with `options`' biases and activation where the model has them: gpt-oss).
    `counts` [experts] accumulates the tokens routed to each (router statistics)."""

    def __init__(self, gate: Weight, up: Weight, down: Weight, top_k: int, norm_topk: bool,
                 activations: str, options: ExpertOptions = ExpertOptions(), quantization: str = "none") -> None:
        self.gate_up = expert_stack([gate, up], activations, quantization)  # [experts, 2 * inner, hidden]
        self.down = expert_stack([down], activations, quantization)  # [experts, hidden, inner]
        self.top_k, self.norm_topk, self.options = top_k, norm_topk, options
        self.num_experts = self.down.experts
        self.counts = torch.zeros(self.num_experts, dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def __call__(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """x fp32 [T, hidden], the router's logits fp32 [T, experts] -> fp32 [T, hidden]."""
        kernel = moe_kernel()
        x, logits = x.contiguous(), logits.contiguous()
        if kernel is None:
            chosen, weights = route(logits, self.top_k, self.norm_topk)
            self.counts += torch.bincount(chosen.flatten(), minlength=self.num_experts)
            return moe_reference(x, chosen, weights, self.gate_up.dequantize(), self.down.dequantize(), self.options)
        return kernel(x, logits, self.gate_up.args, self.down.args, self.top_k, self.norm_topk, self.counts,
                      self.options)

    def call(self, x: torch.Tensor, logits: torch.Tensor, out: torch.Tensor) -> KernelCall | None:
        """out = self(x, logits) as a C call over those fp32 buffers (the fused decode step), or None
        where the kernel does not build."""
        kernel = moe_kernel()
        if kernel is None:
            return None
        return kernel.call(x, logits, self.gate_up.args, self.down.args, self.top_k, self.norm_topk, self.counts, out,
                           self.options)


def route(logits: torch.Tensor, top_k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [T, experts] -> each token's experts [T, top_k] and weights fp32 [T, top_k]: softmax,
    top-k, renormalised to sum 1 where `norm_topk` (as transformers' routers)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    return chosen, weights / weights.sum(dim=-1, keepdim=True) if norm_topk else weights


def moe_reference(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, options: ExpertOptions = ExpertOptions()) -> torch.Tensor:
    """The experts in torch, one expert at a time (the kernel's reference and its fallback): x fp32
    [T, hidden], chosen/weights [T, top_k], gate_up [experts, 2 * inner, hidden], down [experts,
    hidden, inner] -> [T, hidden]."""
    out = torch.zeros_like(x)
    inner = down.shape[2]
    for e in chosen.unique().tolist():
        tokens, k = torch.nonzero(chosen == e, as_tuple=True)
        gate_up_rows = x[tokens] @ gate_up[e].T  # [n, 2 * inner]
        if options.gate_up_bias is not None:
            gate_up_rows = gate_up_rows + options.gate_up_bias[e]
        y = expert_activation(*gate_up_rows.split(inner, dim=-1), options) @ down[e].T  # [n, hidden]
        if options.down_bias is not None:
            y = y + options.down_bias[e]
        out.index_add_(0, tokens, y * weights[tokens, k, None])
    return out


def expert_activation(gate: torch.Tensor, up: torch.Tensor, options: ExpertOptions) -> torch.Tensor:
    """silu(gate) * up, or gpt-oss's clamped SwiGLU in transformers' order of operations: [n, inner] each."""
    if options.activation == "silu":
        return torch.nn.functional.silu(gate) * up
    gate, up = gate.clamp(max=options.limit), up.clamp(-options.limit, options.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * options.alpha))
