"""CUDA graphs around pure decode steps, and the hook that puts a CUDA runner on the Triton backend.

A decode step launches a few hundred small kernels; at batch 1 on a fast GPU Python's launch
overhead is most of its time. `GraphDecoder` captures the whole forward (embedding to fp32 logits)
of a step of `size` decode rows once per rung of the ladder (kvgen.gpu.graph_ladder), over static
buffers: token ids, positions, slot mapping, block table [size, max blocks a sequence holds], and
each row's key range [lo, hi). A step copies its inputs into the buffers (padding rows: the scratch
block, one scratch key) and replays the graph of its rung. Graphs are captured lazily, the first time
a rung is needed (the step's own inputs serve as the warm-up, which also compiles the kernels).

Steps that are not plain decodes over float pools (prompt chunks, verify chunks, heavy-hitter
scoring, re-rotated sinks, hybrid models' several pools, masks that are no single run of keys)
run eagerly on the Triton backend, as does everything under `--enforce-eager`.
"""

from __future__ import annotations

import torch

from kvgen.gpu.backend import TritonPagedAttention
from kvgen.gpu.graph_ladder import ladder, padded_size
from kvgen.gpu.triton_attention import key_ranges, paged_attention, store_kv
from kvgen.model.attention import Attention, PagedKVCache


class GraphAttention(Attention):
    """Decode attention over the graph's static buffers: store this step's K/V, then one decode row
    per sequence through the Triton kernel."""

    def __init__(self, cache: PagedKVCache, slots: torch.Tensor, table: torch.Tensor, lo: torch.Tensor,
                 hi: torch.Tensor) -> None:
        self.cache, self.slots, self.table, self.lo, self.hi = cache, slots, table, lo, hi

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        if sinks is not None:
            raise NotImplementedError("the Triton decode kernel takes no attention sinks")
        store_kv(self.cache.k[layer], self.slots, k)
        store_kv(self.cache.v[layer], self.slots, v)
        return paged_attention(q, self.cache.k[layer], self.cache.v[layer], self.table, self.lo, self.hi,
                               self.cache.block_size, 1, prefill=False)


class GraphDecoder:
    """Replays captured decode steps in place of `runner.run` where a step allows it."""

    def __init__(self, runner, max_batch: int, max_model_len: int, capture: bool = True) -> None:
        """`capture=False` replays by running the forward over the static buffers instead of a graph:
        the same bookkeeping (padding, ranges, buffers), testable on the CPU."""
        self.runner = runner
        self.eager = runner.run
        cache = runner.cache
        self.sizes = ladder(max_batch)
        device = runner.device
        largest = self.sizes[-1]
        self.width = min(cache.num_blocks, -(-max_model_len // cache.block_size)) + 1
        self.scratch_block = cache.num_blocks
        self.tokens = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slots = torch.zeros(largest, dtype=torch.long, device=device)
        self.table = torch.full((largest, self.width), self.scratch_block, dtype=torch.long, device=device)
        self.lo = torch.zeros(largest, dtype=torch.int32, device=device)
        self.hi = torch.ones(largest, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # steps served by a graph (the bench and tests read it)

    @torch.inference_mode()
    def run(self, inputs, head=None) -> torch.Tensor:
        """As ModelRunner.run; a step with a head of its own (a draft's vocabulary) runs eagerly."""
        rows = inputs.token_ids.shape[0]
        size = padded_size(rows, self.sizes)
        if head is not None or size is None or not self._plain_decode(inputs) or not self._fill(inputs, rows, size):
            return self.eager(inputs, head)
        if size not in self.graphs:
            self._capture(size)
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size][:rows][inputs.logit_rows]

    def _plain_decode(self, inputs) -> bool:
        cache = self.runner.cache
        return (len(self.runner.kinds) == 1 and not cache.quantized and not inputs.score_targets and not inputs.kept
                and all(g.mask.shape[2] == 1 and g.key_rotation is None and g.score_rows is None
                        and g.kv_blocks.shape[1] <= self.width for g in inputs.meta.groups))

    def _fill(self, inputs, rows: int, size: int) -> bool:
        """Copies the step into the static buffers; False (run eagerly) where a mask is no single run."""
        runs = []
        for g in inputs.meta.groups:
            batch, _, _, length = g.mask.shape
            lo, hi, one_run = key_ranges(g.mask.view(batch, length))
            runs.append(one_run)
            end = g.first_row + batch
            self.table[g.first_row:end, : g.kv_blocks.shape[1]].copy_(g.kv_blocks)
            self.lo[g.first_row:end].copy_(lo)
            self.hi[g.first_row:end].copy_(hi)
        if not bool(torch.stack(runs).all()):
            return False
        self.tokens[:rows].copy_(inputs.token_ids)
        self.positions[:rows].copy_(inputs.positions)
        self.slots[:rows].copy_(inputs.meta.slot_mapping)
        if size > rows:  # padding rows: write the scratch block's first slot, attend to that one key
            self.tokens[rows:size].zero_()
            self.positions[rows:size].zero_()
            self.slots[rows:size].fill_(self.scratch_block * self.runner.cache.block_size)
            self.table[rows:size, 0].fill_(self.scratch_block)
            self.lo[rows:size].zero_()
            self.hi[rows:size].fill_(1)
        return True

    def _forward(self, size: int) -> torch.Tensor:
        model = self.runner.model
        attention = GraphAttention(self.runner.cache, self.slots[:size], self.table[:size], self.lo[:size],
                                   self.hi[:size])
        return model.logits(model.forward(self.tokens[:size], self.positions[:size], attention))

    def _capture(self, size: int) -> None:
        if not self.capture:
            self.graphs[size] = _Replay(self, size)
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up on the step's own inputs: compiles the kernels, settles allocations
                self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[size] = self._forward(size)
        self.graphs[size] = graph


class _Replay:
    """What `capture=False` keeps per rung: a replay that runs the forward eagerly."""

    def __init__(self, decoder: GraphDecoder, size: int) -> None:
        self.decoder, self.size = decoder, size

    def replay(self) -> None:
        self.decoder.outputs[self.size] = self.decoder._forward(self.size)


def gpu_runner(runner, config):
    """Puts a runner whose model is on CUDA on the Triton backend, with decode graphs unless
    `config.enforce_eager`; returns it."""
    runner.attention_type = TritonPagedAttention
    if not getattr(config, "enforce_eager", False) and len(runner.kinds) == 1:
        max_len = config.max_model_len or runner.model.max_positions
        runner.graphs = GraphDecoder(runner, config.max_num_seqs, max_len)
        runner.run = runner.graphs.run
    return runner
