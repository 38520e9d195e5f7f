"""The dashboard's JSON: an engine snapshot and the /metrics values read with it, in the shape of
`GET /dashboard/state`

    {"snapshot": id, "step": n, "taken_at": unix time,
     "pool": {"num_blocks", "block_size", "state": [...], "owner": [...], "ref_count": [...], "counts": {...},
              "kinds": [{"label", "num_blocks"}, ...]},    (a hybrid cache's pools, in order; else [])
     "tiers": [{"tier": "host" | "disk", "blocks", "bytes", "capacity", "enabled", "hits", "stored",
                "bytes_in", "bytes_out", "seconds"}, ...],    (the KV tiers below the pool; else [])
     "sequences": [...], "steps": [...], "metrics": {...},
     "experts": [{"layer", "tokens": [per expert]}, ...]}   (a mixture's router statistics; else [])

or, for the event stream, a compact pool: "codes", one letter per block (f free, c cached, u used,
s shared, r released); "owner", base64 of little-endian unsigned ints of `owner_bytes` (2, or 4 for
a list of 65,535 sequences or more) each: the owner's index in "sequences", all ones for none; and
"ref_count", base64 of bytes (255 for 255 or more). A page decodes them into typed arrays in a
millisecond where 50,000-element JSON lists would cost tens; at 50,000 blocks the pool is 250 KB,
where int32 owner ids and counts would make it 580 KB (and formatting them 2 of a snapshot's 2.6 ms).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from kvgen.cache.kv_manager import BLOCK_STATES, NO_OWNER, BlockStates
from kvgen.engine.snapshot import EngineSnapshot, SequenceInfo

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
    pool = {"num_blocks": engine.num_blocks, "block_size": engine.block_size, "counts": engine.blocks.counts(),
            "kinds": [{"label": label, "num_blocks": n} for label, n in engine.pool_kinds]}
    pool.update(compact_pool(engine.blocks, engine.sequences) if compact else _full_pool(engine.blocks))
    return {"snapshot": snap.id, "step": engine.step, "taken_at": engine.taken_at, "pool": pool,
            "tiers": [{"tier": name, **reading} for name, reading in engine.stats.kv_tiers],
            "sequences": [s.as_dict() for s in engine.sequences], "steps": [r.as_dict for r in engine.steps],
            "metrics": snap.metrics,
            "experts": [{"layer": layer, "tokens": list(tokens)} for layer, tokens in engine.stats.expert_tokens]}


def _full_pool(blocks: BlockStates) -> dict:
    owner = blocks.owner.astype(object)
    owner[blocks.owner == NO_OWNER] = None
    return {"state": np.array(BLOCK_STATES)[blocks.codes].tolist(), "owner": owner.tolist(),
            "ref_count": blocks.ref_count.tolist()}


def compact_pool(blocks: BlockStates, sequences: list[SequenceInfo]) -> dict:
    dtype = "<u2" if len(sequences) < 0xFFFF else "<u4"
    return {"codes": STATE_LETTERS[blocks.codes].tobytes().decode("ascii"),
            "owner": _b64(owner_indices(blocks.owner, sequences).astype(dtype)), "owner_bytes": int(dtype[-1]),
            "ref_count": _b64(np.minimum(blocks.ref_count, 255).astype(np.uint8))}


def owner_indices(owner: np.ndarray, sequences: list[SequenceInfo]) -> np.ndarray:
    """owner [num_blocks] seq ids (NO_OWNER for none) -> each one's index in `sequences`, -1 for none
    (all ones once unsigned). Owners are live sequences, so in the list (one that is not shows none)."""
    ids = np.array([s.seq_id for s in sequences], dtype=np.int64)
    indices = np.full(owner.shape, -1, dtype=np.int64)
    if not len(ids):
        return indices
    order = np.argsort(ids)
    at = np.minimum(np.searchsorted(ids[order], owner), len(ids) - 1)
    found = ids[order][at] == owner
    indices[found] = order[at[found]]
    return indices


def _b64(values: np.ndarray) -> str:
    return base64.b64encode(values.tobytes()).decode("ascii")
