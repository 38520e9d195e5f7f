"""The hybrid KV cache: one block pool per kind of layer, for models that interleave sliding-window
layers with global ones (Gemma 3: five layers of window 512, then one global).

A global layer reads every earlier token, so its blocks stay as long as the sequence. A windowed
layer reads only the last W tokens, so its blocks go back to their pool as the sequence moves on.
Keeping both kinds in one table would hold the windowed layers' K/V for the whole text; giving each
kind its own pool and tables (vLLM's hybrid allocator, on kvgen's block pool) lets the windowed kind
hold about W tokens per sequence whatever the length:

    global pool   (3 of Gemma 3 270M's 18 layers)   seq A: [ 4 | 9 | 2 | 7 | 5 ]   every block
    windowed pool (the other 15, W = 32 here)       seq A: [ - | - | - | 3 | 8 ]   the last W tokens

`HybridKVManager` keeps one `KVCacheManager` per kind (the same block size and token positions) and
answers the scheduler and the engine as one manager would: an allocation succeeds in every kind or in
none, prefix hits are the blocks every kind still has cached, copies and truncations go to each.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from kvgen.cache.kv_manager import BlockStates, KVCacheManager


@dataclass(frozen=True)
class LayerKind:
    """Layers that share a window (None: global), and so one pool and one table per sequence."""

    window: int | None
    layers: tuple[int, ...]

    def tokens_held(self, num_tokens: int, chunk: int, block_size: int) -> int:
        """Most tokens one sequence of `num_tokens` holds in this kind's pool at once: all of them, or
        a window plus one step's chunk and a block of slack on each side."""
        return num_tokens if self.window is None else min(num_tokens, self.window + chunk + 2 * block_size)


def layer_kinds(windows: Sequence[int | None], layers: Sequence[int] | None = None) -> list[LayerKind]:
    """The model's layers grouped by their window (`windows[i]` of layer i), the global ones first;
    `layers`: only those (the layers that hold K/V, where others share theirs: Gemma 4)."""
    layers = range(len(windows)) if layers is None else layers
    order = sorted({windows[i] for i in layers}, key=lambda w: -1 if w is None else w)
    return [LayerKind(w, tuple(i for i in layers if windows[i] == w)) for w in order]


def sequence_bytes(kinds: list[LayerKind], bytes_per_layer_token: int | Sequence[int], max_len: int, chunk: int,
                   block_size: int) -> list[int]:
    """Per kind, the bytes one sequence of `max_len` tokens holds in its pool at most;
    `bytes_per_layer_token` one layer's, or per kind where their shapes differ (Gemma 4)."""
    per_kind = [bytes_per_layer_token] * len(kinds) if isinstance(bytes_per_layer_token, int) else bytes_per_layer_token
    return [len(k.layers) * b * k.tokens_held(max_len, chunk, block_size) for k, b in zip(kinds, per_kind)]


def window_start(num_blocks: int, window: int, block_size: int) -> int:
    """The first block a window's query at token `num_blocks * block_size` reads (as `slide` frees)."""
    return max(0, num_blocks * block_size - window + 1) // block_size


def split_budget(budget: int, needs: list[int]) -> list[int]:
    """The KV budget in bytes per kind, in proportion to `needs` (`sequence_bytes`: so the kinds run
    out together for sequences of that length)."""
    return [budget * need // sum(needs) for need in needs]


class HybridKVManager:
    """Block tables per kind of layer: `kinds[0]` the global layers' (the one shown as "the" table),
    the others each slide `windows[i]` tokens (release what no later query reads)."""

    def __init__(self, kinds: list[KVCacheManager], layer_kinds: list[LayerKind], chunk: int) -> None:
        """`chunk`: the most tokens a sequence computes in one step (the engine's token budget)."""
        if len({k.block_size for k in kinds}) != 1 or layer_kinds[0].window is not None:
            raise ValueError("hybrid KV cache: one block size, and the first kind global")
        self.kinds, self.layer_kinds, self.chunk = kinds, layer_kinds, chunk
        self.windows = [k.window for k in layer_kinds]
        self.block_size = kinds[0].block_size

    # -- what the scheduler and the engine read: the global kind's figures, or every kind's sum --

    @property
    def enable_prefix_caching(self) -> bool:
        return self.kinds[0].enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        return sum(k.num_blocks for k in self.kinds)

    @property
    def num_used_blocks(self) -> int:
        return sum(k.num_used_blocks for k in self.kinds)

    @property
    def num_free_blocks(self) -> int:
        return sum(k.num_free_blocks for k in self.kinds)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(k.num_cached_free_blocks for k in self.kinds)

    @property
    def usage(self) -> float:
        return max(k.usage for k in self.kinds)

    @property
    def prefix_queries(self) -> int:
        return self.kinds[0].prefix_queries

    @property
    def prefix_hits(self) -> int:
        return self.kinds[0].prefix_hits

    @property
    def prefix_hit_rate(self) -> float:
        return self.kinds[0].prefix_hit_rate

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.kinds[0]

    def live_blocks(self, seq_id: int) -> list[tuple[int, int]]:
        return self.kinds[0].live_blocks(seq_id)

    def block_id(self, seq_id: int, index: int) -> int:
        return self.kinds[0].block_id(seq_id, index)

    def block_table(self, seq_id: int) -> list[int]:
        return self.kinds[0].block_table(seq_id)

    def num_slots(self, seq_id: int) -> int:
        return self.kinds[0].num_slots(seq_id)

    def num_live_blocks(self, seq_id: int) -> int:
        return sum(k.num_live_blocks(seq_id) for k in self.kinds)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return self.kinds[0].num_blocks_needed(num_tokens)

    def fits(self, num_tokens: int) -> bool:
        """Whether one sequence holding `num_tokens` tokens at once fits the pools (its windowed kinds
        hold about a window of them)."""
        return all(manager.fits(kind.tokens_held(num_tokens, self.chunk, self.block_size))
                   for manager, kind in zip(self.kinds, self.layer_kinds))

    def block_states(self, released: Iterable[int] = ()) -> list[BlockStates]:
        """Every kind's pool, global first (policy releases are shown in the global pool)."""
        return [k.block_states(released if i == 0 else ()) for i, k in enumerate(self.kinds)]

    def find_cached_prefix(self, token_ids: Sequence[int], extra_key: Hashable = None) -> list[tuple]:
        """Per block of the longest prefix every kind can serve, the block of each kind: the global kind's
        cached chain; of a windowed kind, only the blocks the first computed token's window reads (None
        before them: evicted or not, no query reads them)."""
        chain = self.kinds[0].find_cached_prefix(token_ids, extra_key)
        hit = len(chain)
        while True:  # a shorter hit reads earlier blocks: ask again until every kind serves the same length
            parts = [self._window_part(kind, window, token_ids, extra_key, hit)
                     for kind, window in zip(self.kinds[1:], self.windows[1:])]
            shortest = min((len(p) for p in parts), default=hit)
            if shortest == hit:
                return list(zip(chain[:hit], *parts))
            hit = shortest

    def _window_part(self, kind: KVCacheManager, window: int, token_ids: Sequence[int], extra_key: Hashable,
                     limit: int) -> list:
        """A windowed kind's blocks of the longest hit up to `limit` blocks whose window it holds."""
        blocks = kind.cached_blocks(token_ids, extra_key, limit, window_start(limit, window, self.block_size))
        hit = limit
        while hit and None in blocks[window_start(hit, window, self.block_size):hit]:
            hit -= 1
        start = window_start(hit, window, self.block_size)
        return [None] * start + blocks[start:hit]

    # -- mutations: each kind in turn ------------------------------------------------------------

    def allocate(self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int,
                 cached_prefix: list[tuple] | None = None, num_lookahead: int = 0) -> bool:
        """As KVCacheManager.allocate, in every kind or (returning False) in none."""
        prefixes = list(zip(*cached_prefix)) if cached_prefix else [[] for _ in self.kinds]
        if not all(k.can_extend(seq_id, num_new_tokens, list(p)) for k, p in zip(self.kinds, prefixes)):
            return False
        for kind, prefix in zip(self.kinds, prefixes):
            done = kind.allocate(seq_id, token_ids, num_new_tokens, list(prefix), num_lookahead)
            assert done, "a kind refused blocks it said it had"
        return True

    def slide(self, seq_id: int, num_computed_tokens: int) -> None:
        """Gives back the windowed kinds' blocks that no query from `num_computed_tokens` on reads."""
        for kind, window in zip(self.kinds, self.windows):
            if window is not None:
                kind.free_blocks_before(seq_id, max(0, num_computed_tokens - window + 1))

    def take_pending_copies(self) -> list[list[tuple[int, int]]]:
        """Copy-on-write copies due, per kind."""
        return [k.take_pending_copies() for k in self.kinds]

    def fork(self, parent_id: int, child_id: int) -> None:
        for kind in self.kinds:
            kind.fork(parent_id, child_id)

    def cache_full_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int,
                          extra_key: Hashable = None) -> None:
        for kind in self.kinds:
            kind.cache_full_blocks(seq_id, token_ids, num_computed_tokens, extra_key)

    def free(self, seq_id: int) -> None:
        for kind in self.kinds:
            kind.free(seq_id)

    def truncate(self, seq_id: int, num_slots: int) -> int:
        return sum(kind.truncate(seq_id, num_slots) for kind in self.kinds)

    def release_blocks(self, seq_id: int, block_indices: Iterable[int]) -> int:
        indices = list(block_indices)
        return sum(kind.release_blocks(seq_id, indices) for kind in self.kinds)

    def check_invariants(self) -> None:
        for kind in self.kinds:
            kind.check_invariants()
