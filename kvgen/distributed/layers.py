"""The layers a sharded `DecoderModel` swaps in: each wraps the rank's ordinary layer around its shard
and adds the one collective Megatron's layout needs.

    RowParallel            o_proj, down_proj: partial outputs [T, hidden] summed by one all-reduce
    VocabParallelEmbedding a rank looks up the tokens in its vocabulary rows, zeros for the others;
                           an all-reduce (of exact zeros and one value per entry: no rounding) joins them
    VocabParallelHead      each rank's logits columns, gathered on rank 0 (a copy, no sums)

Column-parallel layers (q/k/v, gate/up) need no wrapper: their shard is a plain, narrower layer.
"""

from __future__ import annotations

import torch

from kvgen.distributed.group import TensorParallelGroup
from kvgen.loaders.shard import ShardPlan
from kvgen.model.linear import Linear, RowKernels
from kvgen.model.decoder import DecoderModel
from kvgen.model.linear_choice import Embedding


class RowParallel(Linear):
    """y = all_reduce(x_shard @ W_shard^T) (+ the bias, which rank 0's shard alone holds)."""

    def __init__(self, inner: Linear, group: TensorParallelGroup) -> None:
        self.inner, self.group = inner, group
        self.out_features, self.in_features, self.bias = inner.out_features, inner.in_features, inner.bias

    def __call__(self, x: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x, rows))


class VocabParallelEmbedding:
    def __init__(self, inner: Embedding, plan: ShardPlan, group: TensorParallelGroup) -> None:
        self.inner, self.group = inner, group
        self.start, self.stop = plan.vocab.start, plan.vocab.stop

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden], a fresh tensor."""
        mine = (token_ids >= self.start) & (token_ids < self.stop)
        local = torch.where(mine, token_ids - self.start, 0)
        rows = self.inner(local)
        rows[~mine] = 0
        return self.group.all_reduce(rows)


class VocabParallelHead(Linear):
    """[N, hidden] -> logits [N, vocab] on rank 0 (the columns of every rank side by side); other
    ranks return their own columns, which nobody reads."""

    def __init__(self, inner: Linear, plan: ShardPlan, group: TensorParallelGroup) -> None:
        self.inner, self.group = inner, group
        self.vocab_rows, self.vocab_size = plan.vocab_rows, plan.config.vocab_size
        self.out_features, self.in_features, self.bias = self.vocab_size, inner.in_features, None

    def __call__(self, x: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        local = self.inner(x, rows)  # [N, v_local]
        padded = local.new_zeros(local.shape[0], self.vocab_rows)
        padded[:, : local.shape[1]] = local
        parts = self.group.gather_to_first(padded)
        if parts is None:
            return local
        return torch.cat(parts, dim=1)[:, : self.vocab_size]


ROW_PARALLEL = {"o", "down"}  # projections whose input is split by rank: their partial sums are all-reduced


def parallelize(model: DecoderModel, plan: ShardPlan, group: TensorParallelGroup) -> DecoderModel:
    """Turns a model built from this rank's shards into its part of the whole (in place)."""
    model.embed = VocabParallelEmbedding(model.embed, plan, group)
    model.lm_head = VocabParallelHead(model.lm_head, plan, group)
    for block in (block for layer in model.layers for block in layer.blocks):
        for role in ROW_PARALLEL & block.projections().keys():  # the blocks' attributes of those names
            setattr(block, role, RowParallel(getattr(block, role), group))
    return model
