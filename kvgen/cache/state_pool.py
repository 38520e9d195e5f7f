"""The state pool: the recurrent layers' memory of every running sequence, beside the KV block pool.

A model with Gated DeltaNet layers (Qwen3.5) keeps, per sequence and per recurrent layer, a conv window
[conv_dim, K - 1] and a recurrent state [v_heads, k_dim, v_dim] (kvgen.cache.state_sizing): a fixed size
whatever the sequence's length, so a sequence owns one *slot* for its whole life instead of a growing
list of blocks. Three regions, all allocated once at start-up:

    slots        [layers, num_slots, ...]         one per running sequence (allocate / free / fork)
    snapshots    [layers, num_snapshots, ...]     states at block boundaries of cached prompts, keyed by
                                                  the prefix cache's block hash (kvgen.cache.block_pool),
                                                  LRU-evicted like free cached blocks
    checkpoints  [layers, verify_rows, positions, ...]  a verify step's state after each draft position

Layer-major, so that `states[layer]` is a contiguous [num_slots, v_heads, k_dim, v_dim] tensor a kernel
indexes by slot in place (kvgen.model.kernels.gated_delta_net).

Lifecycle, as the engine uses it:
- admission: `allocate()` a zeroed slot; preemption and finish: `free(slot)` (a preempted sequence
  recomputes its prompt on resume, as its blocks do). A slot always goes back: `num_used` counts them,
  `check()` verifies the books.
- n > 1: `fork(parent)` copies the parent's slot (a state cannot be shared copy-on-write: every step
  writes all of it).
- prefix caching: after prefilling up to a full block whose hash is h, `save_snapshot(slot, h, tokens)`;
  a later prompt whose blocks hit the prefix cache up to that block calls `restore_snapshot(h, slot)` and
  computes only the tokens after it. A hit costs one copy of the state (`bytes_per_sequence`), where a
  miss recomputes the prefix. `drop_snapshot(h)` when the KV block of h is evicted (a snapshot without
  its attention layers' KV is useless; without a snapshot the KV hit is one only up to the last boundary
  that has one).
- speculative verify: the verify step reads each sequence's slot, leaves it untouched, and writes the
  state after each of its positions into `checkpoints` (`begin_verify`); `accept(slot, row, n)` then
  copies the state after n accepted positions into the slot (n = 0 keeps it as it was), so rejected
  drafts leave no trace.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvgen.config import RecurrentShape


class StatePoolError(RuntimeError):
    """A state pool operation that cannot be done (no free slot, a slot freed twice, ...)."""


@dataclass
class _Snapshot:
    index: int  # its row in the snapshot region
    tokens: int  # how many tokens of the prompt the state has consumed
    block_tokens: tuple[int, ...] | None  # the last block's token ids: a hash collision guard, as BlockPool's


class StatePool:
    """Slots, snapshots and verify checkpoints for `num_layers` recurrent layers of one shape."""

    def __init__(self, shape: RecurrentShape, num_layers: int, num_slots: int, num_snapshots: int = 0,
                 verify_rows: int = 0, verify_positions: int = 0, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        if num_layers <= 0 or num_slots <= 0 or min(num_snapshots, verify_rows, verify_positions) < 0:
            raise ValueError(f"state pool: {num_layers} layers, {num_slots} slots, {num_snapshots} snapshots, "
                             f"{verify_rows} x {verify_positions} checkpoints")
        self.shape, self.num_layers, self.num_slots = shape, num_layers, num_slots
        self.num_snapshot_rows, self.verify_rows, self.verify_positions = num_snapshots, verify_rows, verify_positions
        self.dtype = dtype

        def region(*lead: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.zeros(num_layers, *lead, *shape.conv_window, dtype=dtype, device=device),
                    torch.zeros(num_layers, *lead, *shape.state, dtype=dtype, device=device))

        self.conv, self.states = region(num_slots)                                 # [L, slots, ...]
        self.snapshot_conv, self.snapshot_states = region(num_snapshots)          # [L, snapshots, ...]
        self.checkpoint_conv, self.checkpoint_states = region(verify_rows, verify_positions)  # [L, rows, P, ...]
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: the lowest slot is taken first
        self._used: set[int] = set()
        self._snapshots: OrderedDict[int, _Snapshot] = OrderedDict()  # hash -> snapshot, least recent first
        self._free_snapshot_rows = list(range(num_snapshots - 1, -1, -1))
        self._verifying: dict[int, int] = {}  # checkpoint row -> slot

    # -- sizing --------------------------------------------------------------------------------

    @property
    def bytes_per_sequence(self) -> int:
        """One slot's bytes in every layer (what a running sequence holds, and what a snapshot copies)."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        return self.num_layers * self.shape.bytes(element, element)

    @property
    def total_bytes(self) -> int:
        rows = self.num_slots + self.num_snapshot_rows + self.verify_rows * self.verify_positions
        return rows * self.bytes_per_sequence

    @classmethod
    def for_budget(cls, shape: RecurrentShape, num_layers: int, budget_bytes: int, max_num_seqs: int,
                   snapshot_fraction: float = 0.0, verify_positions: int = 0, verify_rows: int | None = None,
                   **kwargs) -> StatePool:
        """A pool within `budget_bytes`: a slot for each of up to `max_num_seqs` sequences (fewer if the
        budget holds fewer, at least one), then `verify_rows` (default: as many as slots) x
        `verify_positions` checkpoints, and `snapshot_fraction` of what is left as snapshots."""
        element = torch.empty(0, dtype=kwargs.get("dtype", torch.float32)).element_size()
        per = num_layers * shape.bytes(element, element)
        rows = budget_bytes // per
        slots = min(max_num_seqs, rows)
        if slots < 1:
            raise ValueError(f"state pool: {budget_bytes} bytes hold no sequence's state ({per} bytes each)")
        verify_rows = slots if verify_rows is None else verify_rows
        if verify_positions and slots + verify_rows * verify_positions > rows:  # shrink to fit the checkpoints
            slots = verify_rows = max(1, rows // (1 + verify_positions))
        left = rows - slots - verify_rows * verify_positions
        return cls(shape, num_layers, slots, int(max(left, 0) * snapshot_fraction), verify_rows if verify_positions
                   else 0, verify_positions, **kwargs)

    # -- slots ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int:
        """A free slot, zeroed (a sequence's start: no past, empty conv window)."""
        if not self._free:
            raise StatePoolError(f"state pool: all {self.num_slots} slots in use")
        slot = self._free.pop()
        self._used.add(slot)
        self.conv[:, slot].zero_()
        self.states[:, slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        """Gives a sequence's slot back (finish, abort, preemption)."""
        if slot not in self._used:
            raise StatePoolError(f"state pool: slot {slot} is not in use (freed twice?)")
        if slot in self._verifying.values():
            raise StatePoolError(f"state pool: slot {slot} is in a verify step; accept it first")
        self._used.remove(slot)
        self._free.append(slot)

    def fork(self, parent: int) -> int:
        """A new slot holding a copy of `parent`'s state (n > 1: the children continue from the prompt)."""
        if parent not in self._used:
            raise StatePoolError(f"state pool: cannot fork slot {parent}, which is not in use")
        child = self.allocate()
        self.conv[:, child].copy_(self.conv[:, parent])
        self.states[:, child].copy_(self.states[:, parent])
        return child

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Recurrent layer `index`'s (conv windows [num_slots, conv_dim, K - 1], states [num_slots, Hv,
        Dk, Dv]), contiguous, indexed by slot."""
        return self.conv[index], self.states[index]

    # -- prefix snapshots ----------------------------------------------------------------------

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def has_snapshot(self, block_hash: int, block_tokens=None) -> bool:
        """Whether a snapshot is kept under `block_hash` (and, if given, for a block of these token ids)."""
        snap = self._snapshots.get(block_hash)
        return snap is not None and (block_tokens is None or snap.block_tokens in (None, tuple(block_tokens)))

    def snapshot_tokens(self, block_hash: int) -> int | None:
        """How many tokens the snapshot under `block_hash` has consumed, or None."""
        snap = self._snapshots.get(block_hash)
        return None if snap is None else snap.tokens

    def save_snapshot(self, slot: int, block_hash: int, tokens: int, block_tokens=None) -> bool:
        """Copies `slot`'s state as the state after the block `block_hash` (`tokens` tokens of prompt; that
        block's token ids `block_tokens`, kept to guard against hash collisions), evicting the least
        recently used snapshot if none is free; False if the pool keeps none."""
        if slot not in self._used:
            raise StatePoolError(f"state pool: slot {slot} is not in use")
        if self.num_snapshot_rows == 0:
            return False
        snap = self._snapshots.get(block_hash)
        if snap is None:
            if not self._free_snapshot_rows:
                _, evicted = self._snapshots.popitem(last=False)
                self._free_snapshot_rows.append(evicted.index)
            snap = _Snapshot(self._free_snapshot_rows.pop(), tokens, None)
            self._snapshots[block_hash] = snap
        else:
            snap.tokens = tokens
            self._snapshots.move_to_end(block_hash)
        snap.block_tokens = None if block_tokens is None else tuple(block_tokens)
        self.snapshot_conv[:, snap.index].copy_(self.conv[:, slot])
        self.snapshot_states[:, snap.index].copy_(self.states[:, slot])
        return True

    def restore_snapshot(self, block_hash: int, slot: int, block_tokens=None) -> int:
        """Copies the snapshot under `block_hash` into `slot` (a prefix hit) and marks it recently used;
        returns how many tokens it covers. KeyError if there is none (or, given `block_tokens`, none for a
        block of these token ids)."""
        if slot not in self._used:
            raise StatePoolError(f"state pool: slot {slot} is not in use")
        if not self.has_snapshot(block_hash, block_tokens):
            raise KeyError(block_hash)
        snap = self._snapshots[block_hash]
        self._snapshots.move_to_end(block_hash)
        self.conv[:, slot].copy_(self.snapshot_conv[:, snap.index])
        self.states[:, slot].copy_(self.snapshot_states[:, snap.index])
        return snap.tokens

    def drop_snapshot(self, block_hash: int) -> bool:
        """Forgets the snapshot under `block_hash` (its KV block was evicted); whether there was one."""
        snap = self._snapshots.pop(block_hash, None)
        if snap is not None:
            self._free_snapshot_rows.append(snap.index)
        return snap is not None

    # -- speculative verify --------------------------------------------------------------------

    def begin_verify(self, slots: list[int]) -> list[int]:
        """Checkpoint rows for a verify step of these slots (one each); the step writes the state after
        its position p of row r into `checkpoint_conv[:, r, p]` / `checkpoint_states[:, r, p]`
        (`checkpoints(layer)`) and leaves the slots as they are."""
        free_rows = [r for r in range(self.verify_rows) if r not in self._verifying]
        if len(slots) > len(free_rows):
            raise StatePoolError(f"state pool: {len(slots)} sequences to verify, {len(free_rows)} checkpoint rows free")
        for slot in slots:
            if slot not in self._used or slot in self._verifying.values():
                raise StatePoolError(f"state pool: slot {slot} is not in use or already verifying")
        rows = free_rows[:len(slots)]
        self._verifying.update(zip(rows, slots))
        return rows

    def checkpoints(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Recurrent layer `index`'s checkpoints: (conv [verify_rows, positions, conv_dim, K - 1],
        states [verify_rows, positions, Hv, Dk, Dv])."""
        return self.checkpoint_conv[index], self.checkpoint_states[index]

    def accept(self, row: int, accepted: int) -> None:
        """Ends row's verify: its slot takes the state after `accepted` positions (0: unchanged)."""
        slot = self._verifying.pop(row, None)
        if slot is None:
            raise StatePoolError(f"state pool: checkpoint row {row} is not verifying")
        if not 0 <= accepted <= self.verify_positions:
            raise StatePoolError(f"state pool: {accepted} accepted of {self.verify_positions} positions")
        if accepted:
            self.conv[:, slot].copy_(self.checkpoint_conv[:, row, accepted - 1])
            self.states[:, slot].copy_(self.checkpoint_states[:, row, accepted - 1])

    # -- books ---------------------------------------------------------------------------------

    def check(self) -> None:
        """Raises StatePoolError unless every slot, snapshot row and checkpoint row is accounted for once."""
        if sorted(self._free + list(self._used)) != list(range(self.num_slots)):
            raise StatePoolError(f"state pool: slots lost or doubled ({self.num_free} free, {self.num_used} used)")
        rows = self._free_snapshot_rows + [s.index for s in self._snapshots.values()]
        if sorted(rows) != list(range(self.num_snapshot_rows)):
            raise StatePoolError("state pool: snapshot rows lost or doubled")
        if not set(self._verifying.values()) <= self._used:
            raise StatePoolError("state pool: a verifying row's slot was freed")

    def stats(self) -> dict:
        return {"slots": self.num_slots, "slots_used": self.num_used, "snapshots": self.num_snapshots,
                "snapshot_rows": self.num_snapshot_rows, "verifying": len(self._verifying),
                "bytes_per_sequence": self.bytes_per_sequence, "total_bytes": self.total_bytes}
