"""A decode step's forward as one list of C kernel calls, where every piece of it has a kernel.

At decode's few rows a layer's kernels do ~150 us of work on a small model, and the Python around
them (the calls, views, residual adds) costs ~50 us more: ~1.5 ms of a 7 ms SmolLM2 Q4_1 step.
Where every piece of the step has a C kernel, `DecodePrograms` writes the step once as a list of
kernel calls over buffers of its own (kvgen.model.kernels.step) and runs it each step with one
ctypes call. That holds on the CPU for fp32 models whose projections run kvgen's own kernels
(packed GGUF / int8 / int4 layers, or fp32 ones) and for bf16 models on its bf16 kernel, without
biases, with K/V pools of the model's dtype, when every
sequence of the step attends through the in-place attention kernel (a decode or a speculative
verify chunk; no heavy-hitter scores, no re-rotated keys) and there are fewer rows than the norm
kernel serves. Anything else runs
layer by layer (LlamaModel.forward).

Each call is the kernel, with the same arguments, that the layer-by-layer forward makes, and the
residual add is the same IEEE fp32 sum as torch's, so both give the same bits (tested).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from kvgen.model.attention import Attention, PagedAttention, PagedKVCache
from kvgen.model.kernels import KernelCall, PagedDecode
from kvgen.model.kernels.norm import rms_norm_kernel
from kvgen.model.kernels.rope import rope_kernel
from kvgen.model.kernels.step import CallList, step_kernels

if TYPE_CHECKING:
    from kvgen.model.llama import LlamaModel

MAX_PROGRAMS = 32  # step shapes kept (rows and their groups); the least recently used goes first
FUSED_BELOW_ROWS = 16  # steps of fewer rows run fused: decode batches and verify chunks of a few sequences


class DecodePrograms:
    """A model's fused decode steps, one per step shape, built on first use."""

    def __init__(self, model: LlamaModel, enabled: bool = True) -> None:
        self._model = model
        kernels = (step_kernels(), rms_norm_kernel(), rope_kernel())
        arch = model.config.arch
        self._usable = (enabled and model.device.type == "cpu" and model.dtype in (torch.float32, torch.bfloat16)
                        and all(k is not None for k in kernels) and not arch.qk_norm and not arch.sandwich_norms
                        and arch.activation == "silu" and not model.config.is_hybrid)
        self._programs: OrderedDict[tuple, DecodeProgram | None] = OrderedDict()
        self.fused_steps = 0  # steps that found a program (for tests and the curious)

    def find(self, rows: int, attention: Attention) -> DecodeProgram | None:
        """The program for this step, or None where it must run layer by layer."""
        if (not self._usable or rows >= FUSED_BELOW_ROWS or not isinstance(attention, PagedAttention)
                or not attention.decodes_in_place() or attention.cache.k[0].dtype != self._model.dtype):
            return None
        groups = tuple((g.first_row, g.mask.shape[0], g.mask.shape[2]) for g in attention.meta.groups)
        key = (rows, groups, id(attention.cache), torch.get_num_threads())
        program = self._programs.get(key)
        if key in self._programs and (program is None or program.serves(attention.cache)):
            self._programs.move_to_end(key)
        else:
            program = DecodeProgram.build(self._model, attention.cache, attention.decode_kernel, rows, groups)
            self._programs[key] = program
            if len(self._programs) > MAX_PROGRAMS:
                self._programs.popitem(last=False)
        self.fused_steps += program is not None
        return program


class DecodeProgram:
    """One step shape's forward as a call list over its own buffers [rows, ...]: the hidden state x,
    the normed h, the q/k/v, attention, projection, gate/up and activation rows, the RoPE rows and the
    K/V slots. A step copies its inputs in, runs the list, and returns the final norm's output."""

    def __init__(self, cache: PagedKVCache, buffers: dict[str, torch.Tensor], calls: CallList,
                 decodes: list, rope) -> None:
        # The calls point into the cache's pools without holding them: a program runs only while its
        # cache lives, and holds no KV memory once the engine lets the cache go.
        self._cache = weakref.ref(cache)
        self._buffers, self._calls, self._decodes, self._rope = buffers, calls, decodes, rope

    def serves(self, cache: PagedKVCache) -> bool:
        return self._cache() is cache

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, attention: PagedAttention) -> torch.Tensor:
        """x [T, hidden] (the embedded tokens), positions [T] -> hidden states [T, hidden] after the final norm."""
        b = self._buffers
        b["x"].copy_(x)
        cos_table, sin_table = self._rope.cos, self._rope.sin
        torch.index_select(cos_table, 0, positions, out=b["cos"].view(-1, cos_table.shape[1]))
        torch.index_select(sin_table, 0, positions, out=b["sin"].view(-1, sin_table.shape[1]))
        b["slots"].copy_(attention.meta.slot_mapping)
        for decode, group in zip(self._decodes, attention.meta.groups):
            batch, _, num_queries, length = group.mask.shape
            decode.set_blocks(group.kv_blocks, group.mask.view(batch * num_queries, length))
        self._calls()
        return b["h"].clone()

    @classmethod
    def build(cls, model: LlamaModel, cache: PagedKVCache, decode_kernel: PagedDecode, rows: int,
              groups: tuple[tuple[int, int, int], ...]) -> DecodeProgram | None:
        """The program, or None where a layer has no kernel call (a bias, a wrapped or torch layer)."""
        cfg, layers = model.config, model.layers
        heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = heads * dim, kv_heads * dim
        step, norm, rope = step_kernels(), rms_norm_kernel(), rope_kernel()
        b = _buffers(model, rows)
        qk = b["qkv"][:, : q_size + kv_size].view(rows, heads + kv_heads, dim)
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
        pools = list(zip(cache.k, cache.v))
        decodes = [decode_kernel.decode_calls(queries[first : first + batch * num_queries], pools, cache.block_size,
                                              attn[first : first + batch * num_queries], num_queries)
                   for first, batch, num_queries in groups]
        eps = cfg.rms_norm_eps
        calls: list[KernelCall | None] = [norm.call(b["x"], layers[0].input_norm, eps, b["h"])]
        for index, layer in enumerate(layers):
            next_norm = layers[index + 1].input_norm if index + 1 < len(layers) else model.final_norm
            calls += [layer.qkv.call(b["h"], b["qkv"]), rope.call(qk, b["cos"], b["sin"]),
                      decode_kernel.store_call(cache.k[index], cache.v[index], b["slots"], k, v)]
            calls += [*converts_before, *(decode.calls[index] for decode in decodes), *converts_after]
            calls += [layer.o.call(b["attn"], b["proj"]), step.add_call(b["x"], b["proj"]),
                      norm.call(b["x"], layer.post_norm, eps, b["h"]),
                      layer.gate_up.call(b["h"], b["gate_up"]), step.gate_mul_call("silu", b["gate_up"], b["act"]),
                      layer.down.call(b["act"], b["proj"]), step.add_call(b["x"], b["proj"]),
                      norm.call(b["x"], next_norm, eps, b["h"])]
        if any(call is None for call in calls):
            return None
        return cls(cache, b, step.call_list(calls), decodes, model.rope)


def _buffers(model: LlamaModel, rows: int) -> dict[str, torch.Tensor]:
    """A program's own buffers [rows, ...] in the model's dtype (the K/V slots as int64)."""
    cfg = model.config
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inner = model.layers[0].gate_up.out_features  # gate and up, side by side
    shapes = {"x": (cfg.hidden_size,), "h": (cfg.hidden_size,), "qkv": (q_size + 2 * kv_size,),
              "attn": (q_size,), "proj": (cfg.hidden_size,), "gate_up": (inner,), "act": (inner // 2,),
              "cos": (1, cfg.head_dim), "sin": (1, cfg.head_dim)}
    buffers = {name: torch.empty(rows, *shape, dtype=model.dtype) for name, shape in shapes.items()}
    buffers["slots"] = torch.empty(rows, dtype=torch.int64)
    return buffers
