"""Which slice of each weight a tensor-parallel rank holds (Megatron's layout).

    q/k/v, gate/up       column-parallel: a rank keeps its output rows (q/k/v by whole heads)
    o_proj, down_proj    row-parallel: a rank keeps its input columns; the partial outputs are summed
                         by one all-reduce (an o_proj bias is kept by rank 0 only, so it is added once)
    embedding, LM head   vocab-parallel: a rank keeps rows [v0, v1) of the vocabulary (a tied head
                         shares the embedding's shard)
    norms                replicated

KV heads are split in contiguous runs, one whole GQA group (a KV head and its query heads) at a
time, so a rank attends its own heads with the same kernels. Where the KV head count is not a
multiple of the rank count the runs differ by one head (SmolLM2's 3 KV heads at 2 ranks: 2 + 1);
where there are more ranks than KV heads, each KV head is replicated on ranks // kv_heads ranks that
split its query heads, as vLLM does. Each rank's model is an ordinary `DecoderModel` built from a
`ModelConfig` with its local head and MLP widths (`local_config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from kvgen.config import ModelConfig
from kvgen.errors import KVGenError
from kvgen.loaders.gguf_tensors import GGUFWeight

ROWS, COLUMNS = 0, 1


class ShardingError(KVGenError, ValueError):
    """A model whose shapes do not split across the requested ranks."""


@dataclass(frozen=True)
class Span:
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def scaled(self, factor: int) -> Span:
        return Span(self.start * factor, self.stop * factor)


@dataclass(frozen=True)
class Slice:
    """Rows or columns [start, stop) of a weight; `zero` keeps its shape and zeroes it (a bias of a
    row-parallel layer on ranks other than 0)."""

    dim: int
    span: Span
    zero: bool = False


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `world`: its query heads, KV heads, MLP columns and vocabulary rows."""

    config: ModelConfig
    rank: int
    world: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ShardingError(f"rank {self.rank} is outside a tensor-parallel group of {self.world}")
        cfg = self.config
        if cfg.arch.fused_checkpoint or cfg.arch.sandwich_norms or cfg.is_hybrid:
            raise ShardingError(f"tensor parallelism does not split {cfg.arch.name} models yet (fused q/k/v or "
                                "gate/up tensors, Gemma's norms and hybrid cache); run them on one rank")
        if cfg.is_moe:
            raise ShardingError(f"tensor parallelism does not split mixtures of experts ({cfg.arch.name}) yet; "
                                "run them on one rank")
        if cfg.intermediate_size % self.world:
            raise ShardingError(f"intermediate_size {cfg.intermediate_size} does not split across "
                                f"{self.world} tensor-parallel ranks")
        if self.world > cfg.num_kv_heads:
            copies = self.world // cfg.num_kv_heads
            group = cfg.num_heads // cfg.num_kv_heads
            if self.world % cfg.num_kv_heads or group % copies:
                raise ShardingError(
                    f"{cfg.num_kv_heads} KV heads x {group} query heads each cannot be replicated across "
                    f"{self.world} tensor-parallel ranks (the rank count must be a multiple of the KV heads, "
                    f"and the replicas must split each head's {group} query heads evenly)")
        if self.config.vocab_size < self.world:
            raise ShardingError(f"a vocabulary of {cfg.vocab_size} does not split across {self.world} ranks")

    @property
    def kv_heads(self) -> Span:
        kv = self.config.num_kv_heads
        if self.world > kv:
            head = self.rank // (self.world // kv)
            return Span(head, head + 1)
        return _even_span(kv, self.world, self.rank)

    @property
    def q_heads(self) -> Span:
        cfg = self.config
        group = cfg.num_heads // cfg.num_kv_heads
        if self.world > cfg.num_kv_heads:
            copies = self.world // cfg.num_kv_heads
            per_rank = group // copies
            start = self.kv_heads.start * group + (self.rank % copies) * per_rank
            return Span(start, start + per_rank)
        return self.kv_heads.scaled(group)

    @property
    def mlp(self) -> Span:
        return _even_span(self.config.intermediate_size, self.world, self.rank)

    @property
    def vocab(self) -> Span:
        return Span(*[min(i * self.vocab_rows, self.config.vocab_size) for i in (self.rank, self.rank + 1)])

    @property
    def vocab_rows(self) -> int:
        """Rows of every rank's vocabulary shard but the last, which may be shorter (gathers pad to it)."""
        return -(-self.config.vocab_size // self.world)

    def local_config(self) -> ModelConfig:
        """The config of this rank's model: its own head counts and MLP width."""
        return dataclasses.replace(self.config, num_heads=self.q_heads.size, num_kv_heads=self.kv_heads.size,
                                   intermediate_size=self.mlp.size)

    def slice_of(self, name: str) -> Slice | None:
        """The part of the weight `name` (HF naming) this rank keeps; None for a replicated one."""
        head_dim = self.config.head_dim
        role = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        is_bias = name.endswith(".bias")
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return Slice(ROWS, self.vocab)
        if role == "q_proj":
            return Slice(ROWS, self.q_heads.scaled(head_dim))
        if role in ("k_proj", "v_proj"):
            return Slice(ROWS, self.kv_heads.scaled(head_dim))
        if role == "o_proj":
            if is_bias:
                return Slice(ROWS, Span(0, self.config.hidden_size), zero=self.rank != 0)
            return Slice(COLUMNS, self.q_heads.scaled(head_dim))
        if role in ("gate_proj", "up_proj"):
            return Slice(ROWS, self.mlp)
        if role == "down_proj":
            return Slice(COLUMNS, self.mlp)
        return None

    def take(self, name: str, weight: torch.Tensor | GGUFWeight) -> torch.Tensor | GGUFWeight:
        """This rank's part of a loaded weight, as a fresh tensor (or raw GGUF blocks) of its own."""
        part = self.slice_of(name)
        if part is None:
            return weight
        if isinstance(weight, GGUFWeight):
            if len(weight.shape) > 1:
                return take_gguf(weight, part)
            weight = weight.dequantize()  # a bias: a few floats
        if part.zero:
            return torch.zeros_like(weight)
        return weight.narrow(part.dim, part.span.start, part.span.size).clone()

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world}: query heads [{self.q_heads.start}, {self.q_heads.stop}), "
                f"KV heads [{self.kv_heads.start}, {self.kv_heads.stop}), MLP [{self.mlp.start}, {self.mlp.stop}), "
                f"vocabulary [{self.vocab.start}, {self.vocab.stop})")


def take_gguf(weight: GGUFWeight, part: Slice) -> GGUFWeight:
    """Rows of a GGUF matrix are whole runs of blocks; columns split at block boundaries only
    (32 weights for Q4_0/Q8_0/..., 256 for the K-quants), in place, the blocks kept packed."""
    start, stop = part.span.start, part.span.stop
    shape = list(weight.shape)
    if part.dim == ROWS:
        shape[0] = stop - start
        return GGUFWeight(weight.name, weight.ggml_type, tuple(shape), np.ascontiguousarray(weight.raw[start:stop]))
    block, block_bytes = gguf.GGML_QUANT_SIZES[weight.ggml_type]
    if start % block or stop % block:
        raise ShardingError(f"{weight.name} ({weight.ggml_type.name}, blocks of {block}) cannot be split at "
                            f"column {start if start % block else stop}: a shard must start and end on a block")
    raw = weight.raw[:, start // block * block_bytes : stop // block * block_bytes]
    shape[-1] = stop - start
    return GGUFWeight(weight.name, weight.ggml_type, tuple(shape), np.ascontiguousarray(raw))


def first_rows(weight: torch.Tensor | GGUFWeight, rows: int) -> torch.Tensor | GGUFWeight:
    """Rows [0, rows) of a matrix (a draft's LM head over the first token ids), GGUF blocks kept packed."""
    if isinstance(weight, GGUFWeight):
        return take_gguf(weight, Slice(ROWS, Span(0, rows)))
    return weight[:rows]


def _even_span(total: int, parts: int, index: int) -> Span:
    """Part `index` of [0, total) cut into `parts` contiguous runs whose sizes differ by one at most."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return Span(start, start + base + (index < extra))
