"""The host tier: evicted blocks' payloads in a bounded region of RAM, least recently used out first."""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostTier:
    """digest -> (token ids, payload); at most `capacity` bytes of payloads."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.nbytes = 0
        self._blocks: OrderedDict[bytes, tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, digest: bytes, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        entry = self._blocks.get(digest)
        if entry is None or entry[0] != token_ids:
            return None
        self._blocks.move_to_end(digest)
        return entry[1]

    def put(self, digest: bytes, token_ids: tuple[int, ...], payload: torch.Tensor,
            pinned: set[bytes] = frozenset()) -> list[tuple[bytes, tuple[int, ...], torch.Tensor]]:
        """Stores a block (most recently used); returns the blocks pushed out to make room (oldest first;
        pinned ones are kept while others can go)."""
        if digest in self._blocks:
            self._blocks.move_to_end(digest)
            return []
        size = payload.numel()
        if size > self.capacity:
            return [(digest, token_ids, payload)]
        out = []
        victims = iter([d for d in self._blocks if d not in pinned])
        while self.nbytes + size > self.capacity:
            victim = next(victims, None)
            if victim is None:
                return [(digest, token_ids, payload)]
            tokens, data = self._blocks.pop(victim)
            self.nbytes -= data.numel()
            out.append((victim, tokens, data))
        self._blocks[digest] = (token_ids, payload)
        self.nbytes += size
        return out

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0
