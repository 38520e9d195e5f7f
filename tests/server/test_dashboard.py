"""The dashboard's data over a real server: /dashboard/state's shape and consistency with /metrics,
the event stream's rate and encoding, the API key, and turning it off. (The page itself is driven by
a real browser in test_dashboard_browser.py.)"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from kvgen import LLM
from kvgen.cache.kv_manager import BLOCK_STATES, NO_OWNER, BlockStates
from kvgen.server.app import create_app
from kvgen.server.dashboard.source import MAX_INTERVAL_S, DashboardSource
from kvgen.server.dashboard.state import compact_pool
from tests.server.harness import API_KEY, Server, blocks_used, running

MODEL = "stories260K"
PREFIX = "Once upon a time there was a little girl named Lily. She loved to play in the park with her friends."
# A bounded cache policy runs past the context: the stream occupies the engine until dropped.
ENDLESS = {"prompt": PREFIX, "max_tokens": 60000, "ignore_eos": True, "kv_policy": "sinks:4,60", "stream": True}
SEQUENCE_KEYS = {"seq_id", "request_id", "status", "phase", "prompt_tokens", "output_tokens", "num_blocks",
                 "kv_policy", "preemptions"}
STEP_KEYS = {"prefill_tokens", "decode_tokens", "batch_size", "ms"}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    app = create_app(LLM(num_kv_blocks=256, block_size=4, max_num_seqs=16).engine, model_name=MODEL,
                     api_key=API_KEY)
    with running(app) as url:
        yield Server(url, app)


def state(server: Server, **query) -> dict:
    with server.client() as http:
        response = http.get("/dashboard/state", params=query)
    assert response.status_code == 200, response.text
    return response.json()


@contextmanager
def held_open(server: Server, **extra) -> Iterator[None]:
    """An endless stream, held open; its request is running once entered."""
    with server.client() as http, http.stream("POST", "/v1/completions", json=ENDLESS | extra) as response:
        lines = response.iter_lines()  # held: a dropped iterator closes the stream
        assert response.status_code == 200 and next(lines).startswith("data: ")
        yield


def check_shape(body: dict) -> None:
    assert {"pool", "sequences", "steps", "metrics", "snapshot", "step"} <= set(body)
    pool = body["pool"]
    n = pool["num_blocks"]
    assert pool["block_size"] == 4 and n == 256
    assert len(pool["state"]) == len(pool["owner"]) == len(pool["ref_count"]) == n
    assert set(pool["state"]) <= set(BLOCK_STATES)
    for s, owner, refs in zip(pool["state"], pool["owner"], pool["ref_count"]):
        assert (owner is None) == (refs == 0) == (s in ("free", "cached", "released"))
        assert (s == "shared") == (refs > 1)
    assert all(set(seq) >= SEQUENCE_KEYS for seq in body["sequences"])
    assert all(seq["status"] in ("running", "waiting") and seq["phase"] in ("prefill", "decode")
               for seq in body["sequences"])
    assert all(set(step) >= STEP_KEYS for step in body["steps"])
    assert body["tiers"] == []  # no KV tiers below this pool (test_kv_tiers_server.py has them)
    assert "kvgen_kv_cache_blocks_used" in body["metrics"] and "kvgen_time_to_first_token_seconds_p90" in body["metrics"]


def used(body: dict) -> int:
    return sum(s in ("used", "shared") for s in body["pool"]["state"])


def test_state_has_the_documented_shape_and_adds_up_while_requests_run(server):
    with held_open(server), held_open(server):
        body = state(server)
        check_shape(body)
        counts = {name: body["pool"]["state"].count(name) for name in BLOCK_STATES}
        assert counts == body["pool"]["counts"] and sum(counts.values()) == 256
        assert used(body) == body["metrics"]["kvgen_kv_cache_blocks_used"] > 0
        running_seqs = [s for s in body["sequences"] if s["status"] == "running"]
        assert len(running_seqs) == 2 and {s["kv_policy"] for s in running_seqs} == {"sinks:4,60"}
        assert sum(s["num_blocks"] for s in body["sequences"]) == sum(body["pool"]["ref_count"])
        assert {o for o in body["pool"]["owner"] if o is not None} == {s["seq_id"] for s in running_seqs}
        again = state(server, snapshot=body["snapshot"])  # the same snapshot, by its id
        assert again == body
    deadline = time.monotonic() + 10
    while blocks_used(server) > 0:  # the dropped streams' aborts reach the engine loop
        assert time.monotonic() < deadline
        time.sleep(0.02)
    idle = state(server)  # idle: nothing moves, so /metrics is read at the same moment
    assert used(idle) == blocks_used(server) == idle["metrics"]["kvgen_kv_cache_blocks_used"] == 0
    assert set(idle["pool"]["state"]) <= {"free", "cached", "released"}


def test_shared_blocks_of_an_n3_request(server):
    with held_open(server, n=3):  # its completions fork off the prompt's blocks: shared, copy-on-write
        body = state(server)
    check_shape(body)
    shared = [refs for s, refs in zip(body["pool"]["state"], body["pool"]["ref_count"]) if s == "shared"]
    assert shared and min(shared) >= 2


def decode_compact(state: dict) -> tuple[list[str], list[int | None], list[int]]:
    """The compact pool as the full one has it: owners are indices into the sequences, counts bytes."""
    pool, names = state["pool"], {name[0]: name for name in BLOCK_STATES}
    ids = [s["seq_id"] for s in state["sequences"]]
    none = 256 ** pool["owner_bytes"] - 1
    indices = np.frombuffer(base64.b64decode(pool["owner"]), f"<u{pool['owner_bytes']}").tolist()
    refs = np.frombuffer(base64.b64decode(pool["ref_count"]), np.uint8).tolist()
    return [names[c] for c in pool["codes"]], [None if i == none else ids[i] for i in indices], refs


def test_events_are_compact_snapshots_at_most_ten_a_second(server):
    with held_open(server), server.client() as http, http.stream("GET", "/dashboard/events") as events:
        assert events.status_code == 200 and events.headers["content-type"].startswith("text/event-stream")
        start, received = time.monotonic(), []
        for line in events.iter_lines():
            if line.startswith("data: "):
                received.append(json.loads(line.removeprefix("data: ")))
            if time.monotonic() - start > 2.0:
                break
        elapsed = time.monotonic() - start
    assert 3 <= len(received) <= 10 * elapsed + 1, (len(received), elapsed)
    steps = [e["step"] for e in received]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # each one new: nothing sent twice
    last = received[-1]
    full = state(server, snapshot=last["snapshot"])
    assert decode_compact(last) == (full["pool"]["state"], full["pool"]["owner"], full["pool"]["ref_count"])
    assert {k: v for k, v in last.items() if k != "pool"} == {k: v for k, v in full.items() if k != "pool"}
    assert state(server, snapshot=last["snapshot"], compact="true") == last


def test_thecompact_pool_widens_owner_indices_for_many_sequences_and_saturates_counts():
    """Owners index the sequences list in 2 bytes, or 4 from 65,535 sequences on; counts are bytes."""
    codes = np.array([BLOCK_STATES.index(s) for s in ("shared", "free", "used")], dtype=np.int8)
    blocks = BlockStates(codes=codes, owner=np.array([70_000, NO_OWNER, 5]), ref_count=np.array([300, 0, 1]))
    for count, width in ((70_001, 4), (6, 2)):
        sequences = [SimpleNamespace(seq_id=i) for i in range(count)][::-1]  # the list's order is the index
        state = {"pool": compact_pool(blocks, sequences), "sequences": [{"seq_id": s.seq_id} for s in sequences]}
        assert state["pool"]["owner_bytes"] == width
        owners = [70_000 if count > 70_000 else None, None, 5]
        assert decode_compact(state) == (["shared", "free", "used"], owners, [255, 0, 1])


def next_event(lines: Iterator[str]) -> dict:
    return json.loads(next(line for line in lines if line.startswith("data: ")).removeprefix("data: "))


def test_an_idle_server_sends_one_event_then_one_per_change(server):
    quick = httpx.Timeout(10, read=1.0)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=auth, timeout=quick) as http, \
            http.stream("GET", "/dashboard/events") as events:
        lines, received = events.iter_lines(), []
        with pytest.raises(httpx.ReadTimeout):  # idle: soon nothing for a second, ten snapshot intervals
            while True:  # (a stream an earlier test dropped may still be winding down)
                received.append(next_event(lines))
                assert len(received) <= 3, "an idle server keeps sending"
        assert received[0]["pool"]["num_blocks"] == 256
    with server.client() as http, http.stream("GET", "/dashboard/events") as events:
        lines = events.iter_lines()
        first = next_event(lines)
        http.post("/v1/completions", json={"prompt": "Tom", "max_tokens": 3})  # something changes
        assert next_event(lines)["step"] > first["step"]


def test_costly_snapshots_space_the_events_out_up_to_a_bound():
    """A snapshot costing 1 ms allows 10 a second (1%), 20 ms one a 2 s; however costly, one per 5 s."""
    source = DashboardSource(llm=None, metrics=None)
    for cost_s, interval in ((0.001, 0.1), (0.02, 2.0), (0.6, MAX_INTERVAL_S)):
        source._cost_s = cost_s
        assert source.interval == pytest.approx(interval)


def test_the_data_needs_the_key_and_the_page_does_not(server):
    with server.client(Authorization="") as anonymous:
        page = anonymous.get("/dashboard")
        assert page.status_code == 200 and "dashboard.js" in page.text
        assert anonymous.get("/dashboard/static/dashboard.js").status_code == 200
        assert anonymous.get("/dashboard/static/secrets.txt").status_code == 404
        for path in ("/dashboard/state", "/dashboard/events"):
            refused = anonymous.get(path)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert anonymous.get("/dashboard/state", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert state(server)["pool"]["num_blocks"] == 256


def test_a_snapshot_no_longer_kept_is_a_404(server):
    with server.client() as http:
        gone = http.get("/dashboard/state", params={"snapshot": 10**9})
    assert gone.status_code == 404 and "no longer kept" in gone.json()["error"]["message"]


@pytest.mark.parametrize(("engine_options", "dashboard"), [({"num_kv_blocks": 16}, False),
                                                           ({"kv_cache": "contiguous"}, True)])
def test_no_dashboard_without_the_flag_or_a_block_pool(engine_options, dashboard):
    """--no-dashboard turns it off; the one-at-a-time reference engine has no pool to show."""
    app = create_app(LLM(**engine_options).engine, model_name=MODEL, dashboard=dashboard)
    with running(app) as url, Server(url, app).client() as http:
        assert http.get("/dashboard").status_code == 404
        assert http.get("/dashboard/state").status_code == 404
        assert http.get("/health").status_code == 200
