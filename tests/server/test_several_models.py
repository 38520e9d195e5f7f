"""Several models behind one port: the request's `model` picks one, each loads on first use, and with a
memory budget that fits one, alternating requests unload and reload without any failing."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import httpx
import pytest

from kvgen import LLM, SamplingParams
from kvgen.cli import build_parser
from kvgen.llm import DEFAULT_MODEL
from kvgen.server.app import make_state
from kvgen.server.model_router import ModelRouter, create_router_app, file_size
from tests.server.harness import API_KEY, running

PROMPT = "w5 w9 w12"  # words both tokenizers read (stories260K's spells them out, the random model's knows them)
OPTIONS = {"num_kv_blocks": 64, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def models(hf_model) -> dict[str, str]:
    return {"stories": str(DEFAULT_MODEL), "randllama": str(hf_model("llama-gqa")[0])}


@pytest.fixture(scope="module")
def expected(models) -> dict[str, str]:
    """Each model's greedy answer, offline."""
    return {name: LLM(path, **OPTIONS).generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0].text
            for name, path in models.items()}


def _server(models, budget) -> tuple[ModelRouter, object]:
    router = ModelRouter(list(models.items()), lambda path: LLM(path, **OPTIONS).engine,
                         lambda llm, name: make_state(llm, model_name=name, api_key=API_KEY), budget=budget)
    return router, create_router_app(router, api_key=API_KEY, max_request_bytes=1 << 20)


@pytest.fixture()
def one_fits(models) -> Iterator[tuple[ModelRouter, str]]:
    router, app = _server(models, budget=max(file_size(p) for p in models.values()) + 1)
    with running(app) as url:
        yield router, url


def _complete(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                      json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})


def test_each_request_gets_its_models_answer_and_models_lists_states(models, expected):
    router, app = _server(models, budget=None)
    with running(app) as url:
        listed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"]
        assert [(m["id"], m["status"]) for m in listed] == [("stories", "unloaded"), ("randllama", "unloaded")]
        for name in ("stories", "randllama", "stories"):
            body = _complete(url, name).json()
            assert body["model"] == name and body["choices"][0]["text"] == expected[name]
        listed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"]
        assert {m["status"] for m in listed} == {"loaded"} and router.unloads == 0
        missing = _complete(url, "nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert httpx.post(f"{url}/v1/completions", json={"model": "randllama", "prompt": "x"}).status_code == 401


def test_a_budget_for_one_unloads_and_reloads_and_none_fails(one_fits, expected):
    router, url = one_fits
    order = ["stories", "randllama"] * 3
    for name in order:
        response = _complete(url, name)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected[name]
        loaded = [e.name for e in router.entries.values() if e.state is not None]
        assert loaded == [name]
    assert router.loads == len(order) and router.unloads == len(order) - 1
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # at once: a request waits for the other model
        answers = list(pool.map(lambda n: _complete(url, n), order))
    assert [a.status_code for a in answers] == [200] * len(order)
    assert [a.json()["choices"][0]["text"] for a in answers] == [expected[n] for n in order]


def test_serve_takes_several_models():
    args = build_parser().parse_args(["serve", "--model", "a.gguf", "--model", "b=x/b.gguf", "--model-memory", "2GiB"])
    assert args.model == ["a.gguf", "b=x/b.gguf"] and args.model_memory == 2 << 30
    assert build_parser().parse_args(["serve"]).model is None
