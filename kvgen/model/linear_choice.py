"""Which layer each of the model's projections gets, from what the loader handed over.

    a float tensor            make_linear: kvgen's fp32 / bf16 kernels (coded where the weights
                              allow), OpenBLAS, oneDNN or F.linear, by device, dtype and CPU; or, with
                              quantization "int8" / "int4", a packed copy (packed_linear) where its
                              rows split into groups of 32 (others stay float, as llama.cpp keeps
                              such tensors)
    a GGUF matrix (raw blocks) kept packed: the K-quant layout where kquant.c runs, else the generic
                              packed format for its type (kvgen.model.formats); a type no format
                              holds is dequantized to the model's dtype

Fused projections (q/k/v, gate/up) become one packed matrix when their formats stack (parts of one
type packed in one pass by block_pack.c or kquant_pack.c, others stacked after), else one layer per
part side by side (a Q4_K_M file keeps some v or down projections in Q6_K). The token
embedding may stay packed too (sharing its table with a tied LM head): a step dequantizes only the
rows it looks up. `describe(layer)` gives (kernel, weight bytes) for the start-up log and
`generate --json`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kvgen.config import ACTIVATION_MODES
from kvgen.loaders.gguf_tensors import GGUFWeight
from kvgen.loaders.progress import advance
from kvgen.model.formats import packed as formats
from kvgen.model.formats.float_weights import GROUP, quantize_int4, quantize_int8
from kvgen.model.formats.gguf_blocks import convert
from kvgen.model.formats.kquant import KINDS, KPacked
from kvgen.model.formats.packed import PackedWeight, concat_rows, dequantize
from kvgen.model.kernels.bf16 import Bf16Tiles, bf16_kernel
from kvgen.model.kernels.coded import coded_bf16_kernel, coded_f32_kernel, fits
from kvgen.model.kernels.block_pack import BLOCK_TYPES, block_packer
from kvgen.model.kernels.f32 import f32_kernel
from kvgen.model.kernels.kquant import kquant_kernel
from kvgen.model.kernels.qmatmul import ACTIVATION_PARTS, qmatmul_kernel
from kvgen.model.linear import (BlasLinear, Bf16Linear, CodedBf16Linear, CodedF32Linear, F32Linear, Linear,
                                OneDnnLinear, TorchLinear, has_onednn_bf16)
from kvgen.model.quant_linear import (ConcatLinear, KernelQuantLinear, KQuantLinear, ManyRows, QuantLinear,
                                      TorchQuantLinear)

Weight = torch.Tensor | GGUFWeight
# How the packed kernels quantize activations by default (EngineConfig.activations): two int8 parts per
# 32 (~15 bits), which keeps top-1 agreement with the fp32 model at 100% on the real Q4_1 file where one
# part gives 97.8-98.2% (BENCHMARKS.md).
ACTIVATIONS = ACTIVATION_MODES[0]
CPU = torch.device("cpu")
FLOAT_QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}
PACKED_BITS = {"int8": 8 + 16 / GROUP, "int4": 4 + 32 / GROUP}  # a weight's bits: codes, fp16 scale (and min)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, scratch: Bf16Tiles | None = None) -> Linear:
    """The fastest kernel for the weight's device and dtype (see the module docstring); `scratch`, a
    buffer the model's layers share, lets bf16 layers take oneDNN at many rows."""
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        if (coded := coded_f32_kernel()) is not None:
            return CodedF32Linear(weight, bias, coded)
        if (f32 := f32_kernel()) is not None:
            return F32Linear(weight, bias, f32)
        return BlasLinear(weight, bias)
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
        kernel = bf16_kernel()
        if kernel is not None and fits(weight) and (coded := coded_bf16_kernel()) is not None:
            return CodedBf16Linear(weight, bias, coded, kernel, scratch)
        if kernel is not None:
            return Bf16Linear(weight, bias, kernel, scratch)
        if has_onednn_bf16():
            return OneDnnLinear(weight, bias)
    return TorchLinear(weight, bias)


def packed_linear(weight: PackedWeight, bias: torch.Tensor | None = None, device: torch.device = CPU,
                  dtype: torch.dtype = torch.float32, activations: str = "int8",
                  many_rows: ManyRows | None = None) -> Linear:
    """The layer for a packed weight on `device` (see the module docstring). `dtype` is the float
    layer's where a CPU lacks the kernel's features; `activations` how the kernel quantizes x;
    `many_rows` (None: never) how many rows of x run on the weight dequantized per call (ManyRows)."""
    if activations not in ACTIVATION_PARTS:
        raise ValueError(f"activations {activations!r}: expected one of {', '.join(ACTIVATION_PARTS)}")
    if device.type != "cpu":
        return TorchQuantLinear(weight.to(device), None if bias is None else bias.to(device))
    if qmatmul_kernel() is not None:
        return KernelQuantLinear(weight, bias, activations, many_rows)
    return make_linear(dequantize(weight).to(dtype), bias)


def describe_layer(layer: Linear) -> tuple[str, int]:
    """(kernel name, weight bytes) of one kvgen layer: a quantized layer's kernel, or the float
    layer's class, and the bytes its weight takes as held."""
    return (layer.kernel if isinstance(layer, QuantLinear) else type(layer).__name__), layer.weight_bytes


def make_quantized_linear(ggml_type: GGMLQuantizationType, raw: np.ndarray, shape: tuple[int, int],
                          bias: torch.Tensor | None = None, device: torch.device = CPU,
                          dtype: torch.dtype = torch.float32, activations: str = "int8") -> Linear:
    """One GGUF matrix (raw blocks uint8 [out, bytes per row], `shape` (out, in)) as a layer that keeps
    its values quantized, without a model around it (the tests' and tools' form of LayerBuilder.linear,
    which also stacks parts and releases the file's pages); a type no kernel format holds is
    dequantized with gguf to `dtype` and gets a float layer."""
    packed = convert(ggml_type, raw, shape)
    if packed is not None:
        return packed_linear(packed, bias, device, dtype, activations)
    weight = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, ggml_type).reshape(shape)))
    return make_linear(weight.to(device, dtype), bias)


def quantize_linear(weight: torch.Tensor, method: str, bias: torch.Tensor | None = None,
                    activations: str = "int8", many_rows: ManyRows | None = None) -> Linear:
    """A float weight [out, in] quantized by `method` ("int8" or "int4", see float_weights), on its
    device."""
    if method not in FLOAT_QUANTIZERS:
        raise ValueError(f"quantization {method!r}: expected one of {', '.join(FLOAT_QUANTIZERS)}")
    return packed_linear(FLOAT_QUANTIZERS[method](weight), bias, weight.device, weight.dtype, activations,
                         many_rows)


def narrows(weight: GGUFWeight, quantization: str) -> bool:
    """Whether packing `weight` again as `quantization` (int8 / int4) asks makes it smaller: a Q8_0, Q5_0
    or Q6_K matrix at int4 does, a Q4_0 or Q4_K one (4.5 bits a weight against int4's 5) does not, and
    stays as it is."""
    block, size = GGML_QUANT_SIZES[weight.ggml_type]
    return weight.shape[-1] % GROUP == 0 and 8 * size / block > PACKED_BITS[quantization]


def gguf_values(weight: GGUFWeight) -> torch.Tensor:
    """A GGUF matrix's fp32 values (gguf's, bit for bit): through its packed copy where the block
    packer takes the type (gguf's numpy dequantized Q8_0 at ~33 ns a value, 4.5 s of a 0.5B
    model's load), else gguf's."""
    rows = (weight.raw.shape[0], weight.shape[-1])  # an expert stack's [experts, N, K] as rows of K
    packed = convert(weight.ggml_type, weight.raw, rows) if weight.ggml_type in BLOCK_TYPES else None
    return dequantize(packed).view(weight.shape) if packed is not None else weight.dequantize()


class LayerBuilder:
    """Builds the model's linear layers on `device` in `dtype`; `quantization` as EngineConfig has it,
    `activations` how packed layers quantize x (a key of kvgen.model.kernels.qmatmul.ACTIVATION_PARTS).
    Each weight is converted once, so a tied embedding and LM head share one table, packed or float."""

    def __init__(self, device: torch.device, dtype: torch.dtype, quantization: str = "none",
                 activations: str = ACTIVATIONS) -> None:
        self.device, self.dtype, self.quantization, self.activations = device, dtype, quantization, activations
        self._conversions: dict[str, PackedWeight | KPacked | None] = {}
        self._many_rows = ManyRows(Bf16Tiles())  # one buffer for every layer's dequantized weights
        self._floats: dict[int, tuple[Weight, torch.Tensor]] = {}

    def packed(self, weight: GGUFWeight) -> PackedWeight | KPacked | None:
        """The matrix in a kernel format, or None where no format holds its type: K-quants in
        kquant.c's layout where that kernel runs, the rest in kvgen.model.formats.packed'."""
        if weight.name not in self._conversions:
            self._conversions[weight.name] = (kquant_kernel().pack(weight.ggml_type, [weight.raw])
                                              if self._keeps_k(weight.ggml_type) else
                                              convert(weight.ggml_type, weight.raw, weight.shape))
            if self._conversions[weight.name] is not None:
                weight.release()  # the packed copy is what the model reads from now on
            advance(weight.raw.nbytes)
        return self._conversions[weight.name]

    def _keeps_k(self, ggml_type: object) -> bool:
        return ggml_type in KINDS and self.device.type == "cpu" and kquant_kernel() is not None

    @staticmethod
    def _packs_blocks(ggml_type: object) -> bool:
        return ggml_type in BLOCK_TYPES and block_packer() is not None

    @staticmethod
    def _stacked(pack: Callable[[object, list[np.ndarray]], PackedWeight | KPacked],
                 run: list[GGUFWeight]) -> PackedWeight | KPacked:
        """`run`'s matrices (one type) stacked by rows as `pack` packs them: in one pass from the
        file's map, no stacked copy; the parts' pages are released after."""
        packed = pack(run[0].ggml_type, [p.raw for p in run])
        for part in run:
            part.release()
            advance(part.raw.nbytes)
        return packed

    def linear(self, parts: list[Weight], bias: torch.Tensor | None = None, logits: bool = False) -> Linear:
        """The projection whose weight is `parts` stacked by rows ([sum of out, in]). `logits`: its
        outputs are logits (the model's, which pick tokens and are reported as log-probabilities, or
        a router's, which pick experts), so packed layers keep fp32 sums at every row count (oneDNN's
        GEMM returns them rounded to bf16: teacher-forced top-1 on the real Qwen2.5-Coder-1.5B fell
        from 99.0% to 97.8% with them)."""
        return self._linear(parts, bias, replace(self._many_rows, onednn=False) if logits else self._many_rows)

    def unquantized(self, weight: Weight, bias: torch.Tensor | None = None) -> Linear:
        """A projection in the model's dtype whatever `quantization` asks: a router's, whose few logits
        pick the experts (llama.cpp's files keep routers F32, and vLLM leaves MoE gates unquantized)."""
        return make_linear(self.float(weight), bias, self._many_rows.tiles)

    def _linear(self, parts: list[Weight], bias: torch.Tensor | None, many_rows: ManyRows) -> Linear:
        if all(isinstance(p, GGUFWeight) for p in parts):
            if self.quantization in FLOAT_QUANTIZERS and any(narrows(p, self.quantization) for p in parts):
                return self._requantized(parts, bias, many_rows)
            if any(self._keeps_k(p.ggml_type) for p in parts):
                return self._k_linear(parts, bias, many_rows)
            if len(parts) > 1 and len({p.ggml_type for p in parts}) == 1 and self._packs_blocks(parts[0].ggml_type):
                return packed_linear(self._stacked(block_packer().pack, parts), bias, self.device, self.dtype,
                                     self.activations, many_rows)
            packed = [self.packed(p) for p in parts]
            if all(p is not None for p in packed):
                return self._packed(packed, bias, many_rows)
        weight = torch.cat([self.float(p) for p in parts]) if len(parts) > 1 else self.float(parts[0])
        if self.quantization in ("int8", "int4") and weight.shape[1] % GROUP == 0:
            return quantize_linear(weight, self.quantization, bias, self.activations, many_rows)
        return make_linear(weight, bias, self._many_rows.tiles)

    def _requantized(self, parts: list[GGUFWeight], bias: torch.Tensor | None, many_rows: ManyRows) -> Linear:
        """GGUF matrices packed again as `quantization` asks (int8 / int4: a draft made smaller than
        its file), from their values in the model's dtype, as a float checkpoint's would be; a
        projection stacked from several matrices is packed whole when any of them narrows."""
        values = [gguf_values(p).to(device=self.device, dtype=self.dtype) for p in parts]
        weight = torch.cat(values) if len(values) > 1 else values[0]
        for part in parts:
            part.release()
            advance(part.raw.nbytes)
        return quantize_linear(weight, self.quantization, bias, self.activations, many_rows)

    def float(self, weight: Weight) -> torch.Tensor:
        """The weight on the model's device and dtype; converted once, so that a tied embedding and
        LM head share one table."""
        key = id(weight)
        if key not in self._floats:
            dense = weight.dequantize() if isinstance(weight, GGUFWeight) else weight
            self._floats[key] = (weight, dense.to(device=self.device, dtype=self.dtype))  # keeps `weight` alive
            advance(weight.raw.nbytes if isinstance(weight, GGUFWeight) else weight.nbytes)
        return self._floats[key][1]

    def _k_linear(self, parts: list[GGUFWeight], bias: torch.Tensor | None, many_rows: ManyRows) -> Linear:
        """A projection with K-quant parts: consecutive parts of one type stack into one layer (their
        blocks stack as they are), side by side with the others' (a Q4_K_M file keeps some v
        projections in Q6_K beside Q4_K q and k)."""
        runs = [list(run) for _, run in itertools.groupby(parts, key=lambda p: p.ggml_type)]
        sizes = [sum(p.shape[0] for p in run) for run in runs]
        biases = [None] * len(runs) if bias is None else list(bias.split(sizes))
        layers = [self._k_run(run, b, many_rows) for run, b in zip(runs, biases)]
        return layers[0] if len(layers) == 1 else ConcatLinear(layers)

    def _k_run(self, run: list[GGUFWeight], bias: torch.Tensor | None, many_rows: ManyRows) -> Linear:
        if not self._keeps_k(run[0].ggml_type):
            return self._linear(run, bias, many_rows)
        packed = self.packed(run[0]) if len(run) == 1 else self._stacked(kquant_kernel().pack, run)
        return KQuantLinear(packed, bias, self.activations, many_rows.tiles if many_rows.onednn else None)

    def _packed(self, packed: list[PackedWeight], bias: torch.Tensor | None, many_rows: ManyRows) -> Linear:
        try:
            stacked = concat_rows(packed) if len(packed) > 1 else packed[0]
        except ValueError:  # formats that do not stack: one layer each, outputs side by side
            biases = [None] * len(packed) if bias is None else bias.split([p.shape[0] for p in packed])
            return ConcatLinear([packed_linear(p, b, self.device, self.dtype, self.activations, many_rows)
                                 for p, b in zip(packed, biases)])
        return packed_linear(stacked, bias, self.device, self.dtype, self.activations, many_rows)


def describe(layer: Linear) -> tuple[str, int]:
    """(kernel name, weight bytes) of a layer, side-by-side parts included; a wrapper that adds a
    collective to a layer (kvgen.distributed.layers) is described by the layer it wraps."""
    layer = getattr(layer, "inner", layer)
    if isinstance(layer, ConcatLinear):
        parts = [describe(p) for p in layer.parts]
        return " + ".join(sorted({k for k, _ in parts})), sum(size for _, size in parts)
    return describe_layer(layer)


class Embedding:
    """Token embedding rows [vocab, hidden]: a float table, or a packed one whose rows are dequantized
    as they are looked up (a step looks up a few hundred rows at most). A tied LM head on fp32
    panels (F32Linear) holds the table in its own layout: then the rows are looked up there, and no
    second copy is kept."""

    def __init__(self, weight: Weight, builder: LayerBuilder, tied_head: Linear | None = None) -> None:
        self.packed = builder.packed(weight) if isinstance(weight, GGUFWeight) else None
        self.head = tied_head if self.packed is None and isinstance(tied_head, F32Linear) else None
        self.table = None if self.packed is not None or self.head is not None else builder.float(weight)
        self.device, self.dtype = builder.device, builder.dtype

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden], a fresh tensor (the model adds to it in place)."""
        if self.table is not None:
            return self.table[token_ids]
        if self.head is not None:
            return self.head.weight_rows(token_ids)
        if isinstance(self.packed, KPacked):  # packed only where the K-quant kernel loads
            rows = kquant_kernel().rows(self.packed, token_ids.cpu())
        else:
            rows = formats.dequantize_rows(self.packed, token_ids.cpu())
        return rows.to(device=self.device, dtype=self.dtype)
