"""The KV tiers through the server: /metrics counts hits and bytes per tier, POST /v1/cache/pin keeps
a prompt's blocks in the tiers until unpinned, and a server restarted on the same directory serves a
prefix from disk."""

from __future__ import annotations

import pytest

from kvgen import LLM
from kvgen.server.app import create_app
from tests.server.harness import API_KEY, MODEL, Server, metric_samples, running

DOC = "Once upon a time there was a little girl named Lily. She loved to play in the park with her ball. " * 6
OPTIONS = {"num_kv_blocks": 14, "block_size": 16, "max_num_seqs": 1}


def ask(server: Server, prompt: str) -> list[int]:
    with server.client() as http:
        reply = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                   "temperature": 0, "ignore_eos": True, "logprobs": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.fixture()
def tiered(tmp_path):
    app = create_app(LLM(**OPTIONS, kv_offload_memory=2 * 20480, kv_cache_dir=str(tmp_path)).engine,
                     model_name=MODEL, api_key=API_KEY)
    with running(app) as url:
        yield Server(url, app)


def test_metrics_count_hits_and_bytes_per_tier(tiered):
    plain = LLM(**OPTIONS)
    expected = [o.text for o in plain.generate([DOC + " Q1", "Tom had a big red dog " * 16, DOC + " Q2"],
                                               __import__("kvgen").SamplingParams(temperature=0, max_tokens=8,
                                                                                  ignore_eos=True))]
    texts = [ask(tiered, p) for p in (DOC + " Q1", "Tom had a big red dog " * 16, DOC + " Q2")]
    assert texts == expected
    m = metric_samples(tiered)
    hits = m[("kvgen_kv_tier_hits_total", (("tier", "host"),))] + m[("kvgen_kv_tier_hits_total", (("tier", "disk"),))]
    assert hits > 0  # the blocks of the document the second prompt pushed out of the pool
    assert m[("kvgen_kv_tier_bytes_total", (("direction", "out"), ("tier", "host")))] > 0
    assert m[("kvgen_kv_tier_blocks", (("tier", "disk"),))] > 0
    assert ("kvgen_kv_tier_seconds_total", (("tier", "disk"),)) in m
    with tiered.client() as http:  # the dashboard's tiers below the pool, as /metrics counts them
        tiers = {t["tier"]: t for t in http.get("/dashboard/state").json()["tiers"]}
    assert list(tiers) == ["host", "disk"] and tiers["host"]["capacity"] == 2 * 20480
    for name, t in tiers.items():
        assert t["hits"] == m[("kvgen_kv_tier_hits_total", (("tier", name),))]
        assert t["blocks"] == m[("kvgen_kv_tier_blocks", (("tier", name),))] and t["enabled"]


def test_pinned_blocks_stay_in_the_tiers_until_unpinned(tmp_path):
    llm = LLM(**OPTIONS, kv_offload_memory=4 * 20480)
    app = create_app(llm.engine, model_name=MODEL, api_key=API_KEY)
    with running(app) as url:
        server = Server(url, app)
        with server.client() as http:
            pinned = http.post("/v1/cache/pin", json={"prompt": "Tom had a big red dog " * 4}).json()
        assert pinned["pinned"] and pinned["blocks"] == pinned["stored"] > 0
        host = llm.engine.kv.tiers.host
        digests = llm.engine.kv.digests(llm.engine.admission.admit("Tom had a big red dog " * 4,
                                                                   __import__("kvgen").SamplingParams()).token_ids)
        for prompt in (DOC + " Q1", "The sun was hot and the sky " * 16, DOC + " Q2"):  # pressure on RAM
            ask(server, prompt)
        assert all(d in host for d in digests[:pinned["blocks"]])
        with server.client() as http:
            assert http.post("/v1/cache/pin", json={"prompt": "Tom had a big red dog " * 4,
                                                    "unpin": True}).json()["pinned"] is False
        for prompt in (DOC + " Q3", "The sun was hot and the sky " * 15):
            ask(server, prompt)
        assert not any(d in host for d in digests[:pinned["blocks"]])


def test_pin_without_tiers_is_refused(server):
    with server.client() as http:
        reply = http.post("/v1/cache/pin", json={"prompt": "Once upon a time"})
    assert reply.status_code == 400 and "--kv-offload-memory" in reply.text


def test_a_restarted_server_serves_the_prefix_from_disk(tmp_path):
    texts, computed = [], []
    for _ in range(2):
        llm = LLM(**{**OPTIONS, "num_kv_blocks": 40}, kv_cache_dir=str(tmp_path))
        app = create_app(llm.engine, model_name=MODEL, api_key=API_KEY)
        with running(app) as url:
            texts.append(ask(Server(url, app), DOC + " Q1"))
            stats = llm.engine.stats()
            computed.append(stats.prefix_cache_queries - stats.prefix_cache_hits)
    assert texts[0] == texts[1]
    assert computed[1] == computed[0] - 11 * 16
