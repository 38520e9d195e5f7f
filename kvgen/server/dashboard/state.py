"""The dashboard's JSON: an engine snapshot and the /metrics values read with it, in the shape of
`GET /dashboard/state`

    {"snapshot": id, "step": n, "taken_at": unix time,
     "pool": {"num_blocks", "block_size", "state": [...], "owner": [...], "ref_count": [...], "counts": {...}},
     "sequences": [...], "steps": [...], "metrics": {...}}

or, for the event stream, a compact pool: "codes", one letter per block (f free, c cached, u used,
s shared, r released), and "owner" / "ref_count" as base64 of little-endian int32 arrays (-1: no
owner), which a page decodes into typed arrays in a millisecond where 50,000-element JSON lists would
cost tens.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from kvgen.cache.kv_manager import BLOCK_STATES, NO_OWNER, BlockStates
from kvgen.engine.snapshot import EngineSnapshot

STATE_LETTERS = np.frombuffer(b"".join(name[0].encode() for name in BLOCK_STATES), np.uint8)


@dataclass(frozen=True)
class DashboardSnapshot:
    """An engine snapshot with its id (counted per server) and the /metrics values read at its moment."""

    id: int
    engine: EngineSnapshot
    metrics: dict[str, float]

    @property
    def fingerprint(self) -> tuple:
        """Equal for two snapshots an observer could not tell apart: nothing ran, nothing was added or
        aborted, and no block is shown as just released (which the next snapshot after a pause shows free)."""
        return self.engine.step, self.engine.stats, self.engine.blocks.counts()["released"]


def state_json(snap: DashboardSnapshot, compact: bool = False) -> dict:
    engine = snap.engine
    pool = {"num_blocks": engine.num_blocks, "block_size": engine.block_size, "counts": engine.blocks.counts()}
    pool.update(_compact_pool(engine.blocks) if compact else _full_pool(engine.blocks))
    return {"snapshot": snap.id, "step": engine.step, "taken_at": engine.taken_at, "pool": pool,
            "sequences": [s.as_dict() for s in engine.sequences], "steps": [r.as_dict for r in engine.steps],
            "metrics": snap.metrics}


def _full_pool(blocks: BlockStates) -> dict:
    owner = blocks.owner.astype(object)
    owner[blocks.owner == NO_OWNER] = None
    return {"state": np.array(BLOCK_STATES)[blocks.codes].tolist(), "owner": owner.tolist(),
            "ref_count": blocks.ref_count.tolist()}


def _compact_pool(blocks: BlockStates) -> dict:
    return {"codes": STATE_LETTERS[blocks.codes].tobytes().decode("ascii"),
            "owner": _b64_int32(blocks.owner), "ref_count": _b64_int32(blocks.ref_count)}


def _b64_int32(values: np.ndarray) -> str:
    return base64.b64encode(values.astype("<i4").tobytes()).decode("ascii")
