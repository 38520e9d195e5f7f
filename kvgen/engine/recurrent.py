"""The engine's rules for models with recurrent layers (Qwen3.5's Gated DeltaNet): what they run with
and what they refuse, how big their state pool is, and a speculative step's state checkpoints.

A recurrent layer keeps a fixed-size state per sequence in a slot of the state pool
(kvgen.cache.state_pool) instead of K/V blocks; the scheduler hands the slots out
(kvgen.scheduling.state_slots), the runner lays them out per step (kvgen.runner.state_batch).

Speculative decoding: a verify chunk (the last token and its draft) must not leave the rejected
tokens' updates in the state. Its sequence gets a checkpoint row before the step (`begin_step`); the
layer writes the state after each position there and leaves the slot alone; once the draft is
judged, `end_chunk` copies the state after the accepted positions into the slot.
"""

from __future__ import annotations

import torch

from kvgen.cache.sizing import format_bytes
from kvgen.cache.state_pool import StatePool
from kvgen.config import DEFAULT_KV_MEMORY, EngineConfig, ModelConfig
from kvgen.scheduling.output import ScheduledChunk
from kvgen.scheduling.state_slots import StateSlots

SNAPSHOTS_PER_SLOT = 4  # prefix snapshots kept, at most, per slot
SNAPSHOT_SHARE = 4  # ... within a quarter of the state budget


def recurrent_refusal(model: ModelConfig, config: EngineConfig) -> str | None:
    """Why the engine cannot run this recurrent model with these options (None: it can), in one line."""
    if not model.recurrent_layers:
        return None
    what = model.architecture
    if config.kv_cache != "paged":
        return f"{what}: its recurrent layers keep their state in the paged engine's state pool (--kv-cache paged)"
    if torch.device(config.device).type != "cpu":
        return f"{what}: its recurrent layers run on the CPU only (--device cpu)"
    if config.tensor_parallel_size > 1:
        return f"{what}: tensor parallelism does not split recurrent layers yet (--tensor-parallel-size 1)"
    if config.kv_tiers:
        return f"{what}: KV tiers would keep attention blocks without their recurrent state (no --kv-offload-memory " \
               "or --kv-cache-dir)"
    return None


def policy_refusal(model: ModelConfig, kind: str) -> str | None:
    """A cache policy that would drop attention K/V a recurrent model's state has no way to forget."""
    if model.recurrent_layers and kind != "full":
        return f"{model.architecture}: cache policy {kind!r} is not run on a model with recurrent layers (full is)"
    return None


def draft_refusal(draft: ModelConfig) -> str | None:
    if draft.recurrent_layers:
        return f"draft model {draft.architecture}: a draft model with recurrent layers is not supported"
    return None


def build_state_pool(model: ModelConfig, config: EngineConfig) -> StatePool:
    """Slots for up to `max_num_seqs` sequences within DEFAULT_KV_MEMORY (at least one), a checkpoint row
    of 1 + K positions each where the engine speculates, and prefix snapshots within a quarter of it."""
    positions = config.num_speculative_tokens + 1 if config.speculative_method else 0
    one = len(model.recurrent_layers) * model.recurrent.bytes()  # a sequence's state, fp32
    budget = max(DEFAULT_KV_MEMORY // one, 1 + positions + SNAPSHOT_SHARE)  # in sequences' states
    slots = max(1, min(config.max_num_seqs, budget * (SNAPSHOT_SHARE - 1) // SNAPSHOT_SHARE // (1 + positions)))
    snapshots = min(SNAPSHOTS_PER_SLOT * slots, budget // SNAPSHOT_SHARE) if config.enable_prefix_caching else 0
    return StatePool(model.recurrent, len(model.recurrent_layers), slots, snapshots,
                     slots if positions else 0, positions)


def describe(pool: StatePool) -> str:
    """The start-up log's line of the state pool, apart from the KV cache's."""
    return (f"state pool: {pool.num_slots} slots x {format_bytes(pool.bytes_per_sequence)} of recurrent state per "
            f"sequence ({pool.num_layers} layers, any length), {pool.num_snapshot_rows} prefix snapshots, "
            f"{pool.verify_rows} x {pool.verify_positions} verify checkpoints: {format_bytes(pool.total_bytes)}")


class RecurrentSteps:
    """A recurrent model's part of each engine step: verify checkpoints and prefix snapshots."""

    def __init__(self, pool: StatePool, slots: StateSlots) -> None:
        self.pool, self.slots = pool, slots

    def stats(self) -> dict[str, int]:
        """The state pool's part of EngineStats."""
        pool = self.pool
        return {"state_slots_used": pool.num_used, "state_slots_total": pool.num_slots,
                "state_bytes_used": pool.num_used * pool.bytes_per_sequence, "state_bytes_total": pool.total_bytes,
                "state_snapshots": pool.num_snapshots}

    def begin_step(self, chunks: list[ScheduledChunk]) -> None:
        """A checkpoint row for each verify chunk (its draft filled in already)."""
        for chunk in chunks:
            if chunk.draft:
                chunk.verify_row = self.pool.begin_verify([chunk.seq.state_slot])[0]

    def end_chunk(self, chunk: ScheduledChunk, num_accepted: int) -> None:
        """After a chunk's tokens are counted: a verify chunk's slot takes the state after its last token
        and `num_accepted` drafts; a chunk ending at a snapshot boundary leaves a snapshot."""
        if chunk.verify_row is not None:
            self.pool.accept(chunk.verify_row, 1 + num_accepted)
            chunk.verify_row = None
        self.slots.after_chunk(chunk.seq)

    def abandon(self, chunks: list[ScheduledChunk]) -> None:
        """A failed step's verify chunks keep their slots as they were."""
        for chunk in chunks:
            if chunk.verify_row is not None:
                self.pool.accept(chunk.verify_row, 0)
                chunk.verify_row = None
