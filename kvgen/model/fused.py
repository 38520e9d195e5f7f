"""A decode step's forward as one list of C kernel calls, where every piece of it has a kernel.

At decode's few rows a layer's kernels do ~150 us of work on a small model, and the Python around
them (the calls, views, residual adds) costs ~50 us more: ~1.5 ms of a 7 ms SmolLM2 Q4_1 step.
Where the pieces of the step have C kernels, `DecodePrograms` writes the step once as a list of
kernel calls over buffers of its own (kvgen.model.kernels.step) and runs it each step with one
ctypes call. The list is built from the model's own description: each layer's branches (norm,
block, residual add), each block giving its calls (kvgen.model.blocks.Block.fused_calls). That holds
on the CPU for fp32 models whose projections run kvgen's own kernels (packed GGUF / int8 / int4
layers, or fp32 ones) and for bf16 models on its bf16 kernel, with float K/V pools (any the store
writes: fp32, bf16, fp16), when every sequence of the step attends through the in-place attention
kernel (a decode or a speculative verify chunk; no heavy-hitter scores, no re-rotated keys) and
there are fewer rows than the norm kernel serves.

A recurrent block (Qwen3.5's Gated DeltaNet) reads and writes its state pool's slots in place from
the calls where every row of the step is a decode: the program copies each row's slot in per step.
A layer whose block has no fused form (a kind of block the program does not know, a recurrent block
in a step with a verify chunk), or whose projections have no kernel call (a torch layer),
runs layer by layer between two call lists of the same step (DecoderLayer.forward on the program's
residual buffer); a step where no layer has calls runs layer by layer throughout (DecoderModel.forward).

Each call is the kernel, with the same arguments, that the layer-by-layer forward makes, and the
residual add is the same IEEE fp32 sum as torch's, so both give the same bits (tested).
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from typing import Protocol

import torch

from kvgen.config import ModelConfig
from kvgen.model.attention import Attention, PagedAttention
from kvgen.model.kv_storage import PagedKVCache
from kvgen.model.blocks import StateBatch, StepContext
from kvgen.model.blocks.layer import DecoderLayer
from kvgen.model.blocks.per_layer_input import BUFFER as PER_LAYER_INPUTS
from kvgen.model.kernels.build import KernelCall
from kvgen.model.kernels.paged_decode import PagedDecode, stores
from kvgen.model.kernels.norm import rms_norm_kernel
from kvgen.model.kernels.rope import rope_kernel
from kvgen.model.kernels.step import CallList, step_kernels
from kvgen.model.linear import RowKernels

log = logging.getLogger(__name__)


class DecoderModel(Protocol):
    """What a program reads of the model (kvgen.model.decoder.DecoderModel): its config, its layers,
    its RoPE tables, its final norm, its device and dtype."""

    config: ModelConfig
    layers: list[DecoderLayer]
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
        unfused = [(i, sorted({b.kind for b in layer.blocks if not b.fuses()}))
                   for i, layer in enumerate(model.layers) if not layer.fuses()]
        if self._usable and unfused:
            log.info("fused decode: %d of %d layers have a block without a fused form (%s, first layer %d); "
                     "they run layer by layer inside the fused step", len(unfused), len(model.layers),
                     ", ".join(sorted({k for _, kinds in unfused for k in kinds})), unfused[0][0])

    def find(self, rows: int, attention: Attention, states: StateBatch | None = None) -> DecodeProgram | None:
        """The program for this step, or None where it must run layer by layer."""
        if (not self._usable or rows >= FUSED_BELOW_ROWS or not isinstance(attention, PagedAttention)
                or not attention.decodes_in_place()
                or any(not stores(self._model.dtype, cache.k[0].dtype) for cache, _ in attention.kinds)):
            return None
        groups = tuple(tuple((g.first_row, g.mask.shape[0], g.mask.shape[2]) for g in meta.groups)
                       for _, meta in attention.kinds)
        states = decoding_states(states, rows)
        pool = None if states is None else id(states.pool)
        key = (rows, groups, id(attention.cache), pool, torch.get_num_threads())
        program = self._programs.get(key)
        if key in self._programs and (program is None or program.serves(attention, states)):
            self._programs.move_to_end(key)
        else:
            program = DecodeProgram.build(self._model, attention, rows, groups, states)
            self._programs[key] = program
            if len(self._programs) > MAX_PROGRAMS:
                self._programs.popitem(last=False)
        self.fused_steps += program is not None
        return program


class DecodeProgram:
    """One step shape's forward over its own buffers [rows, ...]: segments that are call lists, and
    layers without a fused form run layer by layer on the residual buffer between them. A step
    copies its inputs in, runs the segments, and returns the final norm's output."""

    def __init__(self, caches: list[PagedKVCache], buffers: dict[str, torch.Tensor],
                 segments: list[CallList | DecoderLayer], decodes: dict, ropes: list,
                 state_pool: object | None = None) -> None:
        # The calls point into the caches' pools (and the state pool) without holding them: a program
        # runs only while they live, and holds no KV memory once the engine lets them go.
        self._caches = [weakref.ref(cache) for cache in caches]
        self._state_pool = None if state_pool is None else weakref.ref(state_pool)
        self._buffers, self._segments, self._decodes, self._ropes = buffers, segments, decodes, ropes
        self.layered = sum(isinstance(segment, DecoderLayer) for segment in segments)  # for tests and the curious

    def serves(self, attention: PagedAttention, states: StateBatch | None) -> bool:
        pool = None if self._state_pool is None else self._state_pool()
        return ([ref() for ref in self._caches] == [cache for cache, _ in attention.kinds]
                and pool is (None if states is None else states.pool))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, attention: PagedAttention,
                 rows: RowKernels | None = None, states: StateBatch | None = None,
                 per_layer_inputs: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] (the embedded tokens), positions [T] -> hidden states [T, hidden] after the final norm."""
        b = self._buffers
        b["x"].copy_(x)
        if PER_LAYER_INPUTS in b:
            b[PER_LAYER_INPUTS].copy_(per_layer_inputs)
        for i, rope in enumerate(self._ropes):
            torch.index_select(rope.cos, 0, positions, out=b[f"cos{i}"].view(-1, rope.cos.shape[1]))
            torch.index_select(rope.sin, 0, positions, out=b[f"sin{i}"].view(-1, rope.sin.shape[1]))
        if "state_slots" in b:
            b["state_slots"].copy_(states.slots)
        for kind, (_, meta) in enumerate(attention.kinds):
            b[f"slots{kind}"].copy_(meta.slot_mapping)
        for (_, kind), decodes in self._decodes.items():
            for decode, group in zip(decodes, attention.kinds[kind][1].groups):
                batch, _, num_queries, length = group.mask.shape
                decode.set_blocks(group.kv_blocks, group.mask.view(batch * num_queries, length))
        step = None
        for segment in self._segments:
            if isinstance(segment, CallList):
                segment()
            else:
                if step is None:
                    step = StepContext(positions, [rope.tables(positions) for rope in self._ropes], attention,
                                       rows, states, per_layer_inputs)
                segment.forward(b["x"], step)
        return b["h"].clone()

    @classmethod
    def build(cls, model: DecoderModel, attention: PagedAttention, rows: int,
              groups: tuple[tuple[tuple[int, int, int], ...], ...], states: StateBatch | None = None
              ) -> DecodeProgram | None:
        """The program, or None where no layer has kernel calls. `states`: a decoding step's
        (decoding_states), for the recurrent blocks' calls."""
        program = ProgramBuilder(model, attention, rows, groups, states)
        eps, segments, calls = model.config.rms_norm_eps, [], []
        for layer in model.layers:
            layer_calls = program.layer_calls(layer, eps)
            if layer_calls is None:
                segments += [program.step.call_list(calls), layer] if calls else [layer]
                calls = []
            else:
                calls += layer_calls
        if all(isinstance(segment, DecoderLayer) for segment in segments) and not calls:
            return None
        calls.append(program.norm.call(program.x, model.final_norm, eps, program.buffers["h"]))
        segments.append(program.step.call_list(calls))
        return cls([cache for cache, _ in attention.kinds], program.buffers, segments, program.decodes, model.ropes,
                   None if states is None else states.pool)


class ProgramBuilder:
    """The buffers and kernels a program's calls share, handed to each block's `fused_calls`
    (kvgen.model.blocks.base.FusedProgram): x the residual stream, h a branch's input (its normed x,
    or x itself where the branch has no norm), out (`proj`) a block's output, and whatever each block
    asks for by name."""

    def __init__(self, model: DecoderModel, attention: PagedAttention, rows: int,
                 groups: tuple[tuple[tuple[int, int, int], ...], ...], states: StateBatch | None = None) -> None:
        self.model, self.attention, self.rows, self.groups, self.states = model, attention, rows, groups, states
        self.step, self.norm, self.rope = step_kernels(), rms_norm_kernel(), rope_kernel()
        self.buffers: dict[str, torch.Tensor] = {}
        # By (the queries buffer, the kind of layer): the decode calls of that kind's groups of sequences.
        self.decodes: dict[tuple[int, int], list] = {}
        self._converts: dict[int, tuple[list[KernelCall], list[KernelCall], torch.Tensor, torch.Tensor]] = {}
        hidden = model.config.hidden_size
        self.x, self.h, self.out = (self.buffer(n, (hidden,)) for n in ("x", "h", "proj"))
        # Each block's buffers next, one after the other before anything else is allocated: where they
        # fall in memory changed a Gemma 3 step's time by ~5% (measured in CPU time, the same calls).
        # The first layer's first; layers of other shapes (Gemma 4's) add theirs after.
        for layer in model.layers:
            for block in layer.blocks:
                block.reserve_buffers(self)
        if any(branch.out_norm is not None for branch in model.layers[0].branches):
            self.buffer("normed", (hidden,))
        for i in range(len(model.ropes)):
            dim = model.ropes[i].cos.shape[1]  # the head size of the layers it rotates
            self.buffer(f"cos{i}", (1, dim)), self.buffer(f"sin{i}", (1, dim))
        for kind in range(len(attention.kinds)):
            self.buffers[f"slots{kind}"] = torch.empty(rows, dtype=torch.int64)
        self.state_slots = None
        if states is not None:
            self.state_slots = self.buffers["state_slots"] = torch.empty(rows, dtype=torch.int64)

    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.buffers:
            self.buffers[name] = torch.empty(self.rows, *shape, dtype=self.model.dtype)
        assert self.buffers[name].shape[1:] == shape, f"buffer {name} asked for with two shapes"
        return self.buffers[name]

    def rope_tables(self, rope: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.buffers[f"cos{rope}"], self.buffers[f"sin{rope}"]

    def layer_calls(self, layer: DecoderLayer, eps: float) -> list[KernelCall] | None:
        """The layer's branches as calls (x += out_norm(block(norm(x))), then x *= its scalar if it has
        one), or None where a block has none."""
        if not layer.fuses():
            return None
        calls = []
        for branch in layer.branches:
            self.h = self.x if branch.norm is None else self.buffers["h"]
            block_calls = branch.block.fused_calls(self)
            if block_calls is None or any(call is None for call in block_calls):
                return None
            if branch.norm is not None:
                calls.append(self.norm.call(self.x, branch.norm, eps, self.h))
            calls += block_calls
            if branch.out_norm is None:
                calls.append(self.step.add_call(self.x, self.out))
            else:
                normed = self.buffer("normed", (self.model.config.hidden_size,))
                calls += [self.norm.call(self.out, branch.out_norm, eps, normed), self.step.add_call(self.x, normed)]
        if layer.scalar is not None:
            calls.append(self.step.scale_call(self.x, layer.scalar))
        return calls

    def attend_calls(self, layer: int, queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor) -> list[KernelCall]:
        """Store k/v in the layer's pools, attend queries [rows, H, D] into out [rows, H, D]."""
        kind, local = self.attention.kind_of(layer)
        cache = self.attention.kinds[kind][0]
        decoder: PagedDecode = self.attention.decode_kernel
        return [decoder.store_call(cache.k[local], cache.v[local], self.buffers[f"slots{kind}"], k, v),
                *self.attend_cached_calls(layer, queries, out)]

    def attend_cached_calls(self, layer: int, queries: torch.Tensor, out: torch.Tensor) -> list[KernelCall]:
        """Attend queries [rows, H, D] over layer's pools as they are (this step's K/V already stored:
        a Gemma 4 layer reading its donor's) into out [rows, H, D]. The attention kernel reads and
        writes fp32 rows, so a bf16 model's go through fp32 copies."""
        kind, local = self.attention.kind_of(layer)
        ptr = queries.data_ptr()
        if ptr not in self._converts:
            before, after = [], []
            if self.model.dtype != torch.float32:
                q32, attn32 = torch.empty(queries.shape), torch.empty(out.shape)
                self.buffers[f"q32_{len(self._converts)}"], self.buffers[f"attn32_{len(self._converts)}"] = q32, attn32
                before, after = [self.step.convert_call(queries, q32)], [self.step.convert_call(attn32, out)]
                queries, out = q32, attn32
            self._converts[ptr] = (before, after, queries, out)
        before, after, queries, out = self._converts[ptr]
        if (ptr, kind) not in self.decodes:
            self.decodes[ptr, kind] = self._decode_calls(kind, queries, out)
        return [*before, *(decode.calls[local] for decode in self.decodes[ptr, kind]), *after]

    def _decode_calls(self, kind: int, queries: torch.Tensor, out: torch.Tensor) -> list:
        """Per group of sequences of a kind of layer: the decode kernel's calls for each of its layers' pools."""
        decoder, cache = self.attention.decode_kernel, self.attention.kinds[kind][0]
        return [decoder.decode_calls(queries[first : first + batch * n], list(zip(cache.k, cache.v)),
                                     cache.block_size, out[first : first + batch * n], n)
                for first, batch, n in self.groups[kind]]


def decoding_states(states: StateBatch | None, rows: int) -> StateBatch | None:
    """`states` where every one of the step's rows is a decode, whose recurrent blocks can run as calls
    (a verify chunk keeps its states in checkpoints, which the layer-by-layer forward writes), else None."""
    return states if states is not None and states.num_decodes == rows else None
