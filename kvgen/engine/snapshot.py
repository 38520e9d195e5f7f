"""A read-only picture of the paged engine between two steps: its block pool, its sequences, its last
steps and its counters. Taking one changes nothing and costs O(blocks) (a few ms for 100,000).

It must be taken while no step runs (the async engine loop does it between steps; a local run
between its own calls to `step`). The dashboard (kvgen.server.dashboard) and the terminal view
(kvgen.kv_view) format it; nothing flows back into the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kvgen.cache.kv_manager import BlockStates
from kvgen.engine.base import EngineStats
from kvgen.engine.llm_engine import LLMEngine
from kvgen.engine.step_log import StepRecord
from kvgen.scheduling.sequence import Sequence, Status


@dataclass(frozen=True)
class SequenceInfo:
    """One live sequence, without its text (a dashboard shows token counts, never prompts)."""

    seq_id: int
    request_id: str
    status: str  # "running" | "waiting"
    phase: str  # "prefill" | "decode"
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int
    num_blocks: int
    kv_policy: str
    preemptions: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class EngineSnapshot:
    step: int  # steps the engine has run; the picture is of the moment after this one
    taken_at: float  # time.time()
    block_size: int
    blocks: BlockStates
    sequences: list[SequenceInfo]
    steps: list[StepRecord]  # the last steps, oldest first
    stats: EngineStats
    # A hybrid cache's pools side by side in `blocks`: (what layers, how many blocks) each, in order.
    pool_kinds: tuple[tuple[str, int], ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks.codes)


def take_snapshot(engine: LLMEngine, released_since: int | None = None) -> EngineSnapshot:
    """The engine now. Blocks a cache policy released in the steps after `released_since` (default: in
    the last step) and that are still free are shown as "released"."""
    log = engine.step_log
    since = log.num_steps - 1 if released_since is None else released_since
    released = [b for record in log.since(since) for b in record.released]
    scheduler = engine.scheduler
    sequences = [_info(engine, seq) for seq in [*scheduler.running, *scheduler.waiting]]
    blocks, kinds = engine.kv.block_states(released), ()
    if isinstance(blocks, list):  # a hybrid cache: one pool per kind of layer (kvgen.cache.hybrid)
        kinds = tuple((_kind_label(kind), len(states.codes)) for kind, states in zip(engine.layer_kinds, blocks))
        blocks = BlockStates(*(np.concatenate([getattr(b, f) for b in blocks]) for f in ("codes", "owner", "ref_count")))
    return EngineSnapshot(step=log.num_steps, taken_at=time.time(), block_size=engine.kv.block_size,
                          blocks=blocks, sequences=sequences, steps=list(log.records), stats=engine.stats(),
                          pool_kinds=kinds)


def _kind_label(kind) -> str:
    what = "global" if kind.window is None else f"window {kind.window}"
    return f"{len(kind.layers)} {what} layers"


def _info(engine: LLMEngine, seq: Sequence) -> SequenceInfo:
    decoding = bool(seq.output_token_ids) and seq.num_computed_tokens >= seq.num_tokens - 1
    return SequenceInfo(
        seq_id=seq.seq_id, request_id=seq.request.request_id,
        status="running" if seq.status is Status.RUNNING else "waiting",
        phase="decode" if decoding else "prefill", prompt_tokens=len(seq.prompt_token_ids),
        output_tokens=len(seq.output_token_ids), computed_tokens=seq.num_computed_tokens,
        num_blocks=engine.kv.num_live_blocks(seq.seq_id) if seq.seq_id in engine.kv else 0,
        kv_policy=seq.policy.spec, preemptions=seq.num_preemptions,
    )
