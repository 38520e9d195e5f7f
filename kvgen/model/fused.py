"""A decode step's forward as one list of C kernel calls, where every piece of it has a kernel.

At decode's few rows a layer's kernels do ~150 us of work on a small model, and the Python around
them (the calls, views, residual adds) costs ~50 us more: ~1.5 ms of a 7 ms SmolLM2 Q4_1 step.
Where every piece of the step has a C kernel, `DecodePrograms` writes the step once as a list of
kernel calls over buffers of its own (kvgen.model.kernels.step) and runs it each step with one
ctypes call. That holds on the CPU for fp32 models whose projections run kvgen's own kernels
(packed GGUF / int8 / int4 layers, or fp32 ones) and for bf16 models on its bf16 kernel, without
biases, with float K/V pools (any the store writes: fp32, bf16, fp16), for every architecture
(QK-norm, GeGLU, Gemma's sandwich norms and a hybrid cache's per-kind pools, slots and RoPE bases
included), when every
sequence of the step attends through the in-place attention kernel (a decode or a speculative
verify chunk; no heavy-hitter scores, no re-rotated keys) and there are fewer rows than the norm
kernel serves. Anything else runs
layer by layer (DecoderModel.forward).

Each call is the kernel, with the same arguments, that the layer-by-layer forward makes, and the
residual add is the same IEEE fp32 sum as torch's, so both give the same bits (tested).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Protocol

import torch

from kvgen.config import ModelConfig
from kvgen.model.attention import Attention, PagedAttention, PagedKVCache
from kvgen.model.kernels import KernelCall, PagedDecode, stores
from kvgen.model.kernels.norm import rms_norm_kernel
from kvgen.model.kernels.rope import rope_kernel
from kvgen.model.kernels.step import CallList, step_kernels



class DecoderModel(Protocol):
    """What a program reads of the model (kvgen.model.llama.DecoderModel): its config, its layers'
    weights and kernels, its RoPE tables, its final norm, its device and dtype."""

    config: ModelConfig
    layers: list
    ropes: list
    final_norm: torch.Tensor
    device: torch.device
    dtype: torch.dtype

MAX_PROGRAMS = 32  # step shapes kept (rows and their groups); the least recently used goes first
FUSED_BELOW_ROWS = 16  # steps of fewer rows run fused: decode batches and verify chunks of a few sequences


class DecodePrograms:
    """A model's fused decode steps, one per step shape, built on first use."""

    def __init__(self, model: DecoderModel, enabled: bool = True) -> None:
        self._model = model
        kernels = (step_kernels(), rms_norm_kernel(), rope_kernel())
        self._usable = (enabled and model.device.type == "cpu" and model.dtype in (torch.float32, torch.bfloat16)
                        and all(k is not None for k in kernels))
        self._programs: OrderedDict[tuple, DecodeProgram | None] = OrderedDict()
        self.fused_steps = 0  # steps that found a program (for tests and the curious)

    def find(self, rows: int, attention: Attention) -> DecodeProgram | None:
        """The program for this step, or None where it must run layer by layer."""
        if (not self._usable or rows >= FUSED_BELOW_ROWS or not isinstance(attention, PagedAttention)
                or not attention.decodes_in_place()
                or any(not stores(self._model.dtype, cache.k[0].dtype) for cache, _ in attention.kinds)):
            return None
        groups = tuple(tuple((g.first_row, g.mask.shape[0], g.mask.shape[2]) for g in meta.groups)
                       for _, meta in attention.kinds)
        key = (rows, groups, id(attention.cache), torch.get_num_threads())
        program = self._programs.get(key)
        if key in self._programs and (program is None or program.serves(attention)):
            self._programs.move_to_end(key)
        else:
            program = DecodeProgram.build(self._model, attention, rows, groups)
            self._programs[key] = program
            if len(self._programs) > MAX_PROGRAMS:
                self._programs.popitem(last=False)
        self.fused_steps += program is not None
        return program


class DecodeProgram:
    """One step shape's forward as a call list over its own buffers [rows, ...]: the hidden state x,
    the normed h, the q/k/v (and the normed q/k of a QK-norm model), attention, projection, gate/up
    and activation rows, each RoPE base's rows and each kind of layer's K/V slots. A step copies its
    inputs in, runs the list, and returns the final norm's output."""

    def __init__(self, caches: list[PagedKVCache], buffers: dict[str, torch.Tensor], calls: CallList,
                 decodes: list[list], ropes: list) -> None:
        # The calls point into the caches' pools without holding them: a program runs only while its
        # caches live, and holds no KV memory once the engine lets them go.
        self._caches = [weakref.ref(cache) for cache in caches]
        self._buffers, self._calls, self._decodes, self._ropes = buffers, calls, decodes, ropes

    def serves(self, attention: PagedAttention) -> bool:
        return [ref() for ref in self._caches] == [cache for cache, _ in attention.kinds]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, attention: PagedAttention) -> torch.Tensor:
        """x [T, hidden] (the embedded tokens), positions [T] -> hidden states [T, hidden] after the final norm."""
        b = self._buffers
        b["x"].copy_(x)
        for i, rope in enumerate(self._ropes):
            torch.index_select(rope.cos, 0, positions, out=b[f"cos{i}"].view(-1, rope.cos.shape[1]))
            torch.index_select(rope.sin, 0, positions, out=b[f"sin{i}"].view(-1, rope.sin.shape[1]))
        for kind, (_, meta) in enumerate(attention.kinds):
            b[f"slots{kind}"].copy_(meta.slot_mapping)
            for decode, group in zip(self._decodes[kind], meta.groups):
                batch, _, num_queries, length = group.mask.shape
                decode.set_blocks(group.kv_blocks, group.mask.view(batch * num_queries, length))
        self._calls()
        return b["h"].clone()

    @classmethod
    def build(cls, model: DecoderModel, attention: PagedAttention, rows: int,
              groups: tuple[tuple[tuple[int, int, int], ...], ...]) -> DecodeProgram | None:
        """The program, or None where a layer has no kernel call (a bias, a wrapped or torch layer)."""
        cfg, layers = model.config, model.layers
        heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = heads * dim, kv_heads * dim
        step, norm, rope = step_kernels(), rms_norm_kernel(), rope_kernel()
        b = _buffers(model, rows, len(attention.kinds))
        qk_rows = b["qkv"][:, : q_size + kv_size]
        qk = b["qk"] if "qk" in b else qk_rows.view(rows, heads + kv_heads, dim)
        k = qk[:, heads:]
        v = b["qkv"][:, q_size + kv_size :].view(rows, kv_heads, dim)
        queries, attn = qk[:, :heads], b["attn"].view(rows, heads, dim)
        converts_before: list[KernelCall] = []
        converts_after: list[KernelCall] = []
        if model.dtype != torch.float32:  # the attention kernel reads and writes fp32 rows
            b["q32"], b["attn32"] = torch.empty(rows, heads, dim), torch.empty(rows, heads, dim)
            converts_before.append(step.convert_call(queries, b["q32"]))
            converts_after.append(step.convert_call(b["attn32"], attn))
            queries, attn = b["q32"], b["attn32"]
        decode_kernel = attention.decode_kernel
        decodes = [[decode_kernel.decode_calls(queries[first : first + batch * n], list(zip(cache.k, cache.v)),
                                               cache.block_size, attn[first : first + batch * n], n)
                    for first, batch, n in kind_groups]
                   for (cache, _), kind_groups in zip(attention.kinds, groups)]
        eps = cfg.rms_norm_eps
        calls: list[KernelCall | None] = [norm.call(b["x"], layers[0].input_norm, eps, b["h"])]
        for index, layer in enumerate(layers):
            kind, local = attention.kind_of(index)
            cache = attention.kinds[kind][0]
            next_norm = layers[index + 1].input_norm if index + 1 < len(layers) else model.final_norm
            calls.append(layer.qkv.call(b["h"], b["qkv"]))
            if layer.q_norm is not None:
                calls += _qk_norm_calls(norm, layer, qk_rows, qk, heads, dim, eps)
            calls += [rope.call(qk, b[f"cos{layer.rope}"], b[f"sin{layer.rope}"]),
                      decode_kernel.store_call(cache.k[local], cache.v[local], b[f"slots{kind}"], k, v)]
            calls += [*converts_before, *(decode.calls[local] for decode in decodes[kind]), *converts_after]
            calls += [layer.o.call(b["attn"], b["proj"]), *_residual_add(step, norm, b, layer.attn_out_norm, eps),
                      norm.call(b["x"], layer.post_norm, eps, b["h"]),
                      layer.gate_up.call(b["h"], b["gate_up"]),
                      step.gate_mul_call(cfg.arch.activation, b["gate_up"], b["act"]),
                      layer.down.call(b["act"], b["proj"]), *_residual_add(step, norm, b, layer.mlp_out_norm, eps),
                      norm.call(b["x"], next_norm, eps, b["h"])]
        if any(call is None for call in calls):
            return None
        return cls([cache for cache, _ in attention.kinds], b, step.call_list(calls), decodes, model.ropes)


def _qk_norm_calls(norm, layer, qk_rows: torch.Tensor, qk: torch.Tensor, heads: int, dim: int,
                   eps: float) -> list[KernelCall]:
    """Each row's q heads and k heads normed from the qkv row into the qk buffer (one call per row
    and part, each over that row's heads as the layer-by-layer forward's rows)."""
    calls = []
    for r in range(qk.shape[0]):
        calls += [norm.call(qk_rows[r, : heads * dim].view(heads, dim), layer.q_norm, eps, qk[r, :heads]),
                  norm.call(qk_rows[r, heads * dim :].view(-1, dim), layer.k_norm, eps, qk[r, heads:])]
    return calls


def _residual_add(step, norm, b: dict[str, torch.Tensor], out_norm: torch.Tensor | None,
                  eps: float) -> list[KernelCall]:
    """x += proj, normed first where the architecture norms its branch outputs (Gemma)."""
    if out_norm is None:
        return [step.add_call(b["x"], b["proj"])]
    return [norm.call(b["proj"], out_norm, eps, b["normed"]), step.add_call(b["x"], b["normed"])]


def _buffers(model: DecoderModel, rows: int, num_kinds: int) -> dict[str, torch.Tensor]:
    """A program's own buffers [rows, ...] in the model's dtype (the K/V slots as int64)."""
    cfg = model.config
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inner = model.layers[0].gate_up.out_features  # gate and up, side by side
    shapes = {"x": (cfg.hidden_size,), "h": (cfg.hidden_size,), "qkv": (q_size + 2 * kv_size,),
              "attn": (q_size,), "proj": (cfg.hidden_size,), "gate_up": (inner,), "act": (inner // 2,)}
    shapes |= {f"{table}{i}": (1, cfg.head_dim) for i in range(len(model.ropes)) for table in ("cos", "sin")}
    if model.layers[0].q_norm is not None:
        shapes["qk"] = (cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
    if model.layers[0].attn_out_norm is not None:
        shapes["normed"] = (cfg.hidden_size,)
    buffers = {name: torch.empty(rows, *shape, dtype=model.dtype) for name, shape in shapes.items()}
    buffers |= {f"slots{kind}": torch.empty(rows, dtype=torch.int64) for kind in range(num_kinds)}
    return buffers
