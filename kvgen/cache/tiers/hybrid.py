"""The hybrid cache (kvgen.cache.hybrid: a pool per kind of layer) over the KV tiers.

Each kind's manager is a `TieredKVManager` over its own pool, and all of them share one `Tiers`: one
host budget, one disk directory, one set of counters. A kind's blocks are keyed by chain digests from
its own root, so a global block and a window block of the same tokens never meet in a tier:

    global kind   root b"root"    every block of a prefix, as a model without kinds
    window kind   root b"kind1"   stored as they are evicted; on a hit only the blocks the first
                                  computed token's window reads come back (kvgen.cache.hybrid)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvgen.cache.hybrid import HybridKVManager, LayerKind
from kvgen.cache.tiers.manager import TieredKVManager, Tiers


def kind_root(index: int) -> bytes:
    """Where kind `index`'s chain digests start: the global kind as a model without kinds."""
    return b"root" if index == 0 else f"kind{index}".encode()


class TieredHybridKVManager(HybridKVManager):
    """`HybridKVManager` whose kinds are `TieredKVManager`s sharing one `Tiers`."""

    def __init__(self, kinds: list[TieredKVManager], layer_kinds: list[LayerKind], chunk: int) -> None:
        super().__init__(kinds, layer_kinds, chunk)
        self.tiers: Tiers = kinds[0].tiers

    @property
    def tier_hit_blocks(self) -> int:
        return sum(kind.tier_hit_blocks for kind in self.kinds)

    def pin(self, token_ids: Sequence[int], extra_key: Hashable = None, pin: bool = True) -> dict[str, int]:
        """Pins (or unpins) the prompt's blocks of every kind; counts of the global kind's blocks."""
        done = [kind.pin(token_ids, extra_key, pin) for kind in self.kinds]
        return done[0]
