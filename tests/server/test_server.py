"""The OpenAI-compatible server, end to end: a real uvicorn server on a loopback port, the default model
(stories260K), the official `openai` client and raw httpx. Outputs are checked against offline greedy
runs of `kvgen.LLM` with the same engine options."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from kvgen import LLM, SamplingParams
from kvgen.server.app import create_app
from tests.server.harness import (
    API_KEY, ENGINE_OPTIONS, MODEL, Server, blocks_used, metric_samples, running, sse_events,
)

NON_ASCII_PROMPT = "Lily saw a café — 日本の猫 — and said"


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def greedy(offline: LLM, prompt, max_tokens: int):
    return offline.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0]


def chat_prompt(*turns: tuple[str, str]) -> str:
    """The documented plain chat template (the model has no template of its own)."""
    return "".join(f"<|{role}|>\n{content}\n" for role, content in turns) + "<|assistant|>\n"


# -- generation agrees with the offline engine --------------------------------------------------


@pytest.mark.parametrize("prompt", ["Once upon a time", NON_ASCII_PROMPT])
def test_completion_matches_offline_greedy(client, offline, prompt):
    expected = greedy(offline, prompt, 40)
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    choice = result.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert result.usage.completion_tokens == len(expected.token_ids)
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    assert result.object == "text_completion" and result.model == MODEL and result.id.startswith("cmpl-")

    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage == result.usage
    pieces = [c.choices[0].text for c in chunks[:-1]]
    assert "".join(pieces) == expected.text
    assert not any("\ufffd" in p for p in pieces)
    assert chunks[-2].choices[0].finish_reason == expected.finish_reason


def test_chat_matches_offline_greedy(client, offline):
    expected = greedy(offline, chat_prompt(("system", "Tell a story."), ("user", "A cat named Tom")), 30)
    messages = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "A cat named Tom"}]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.text
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.token_ids)

    parts = [{"role": "system", "content": [{"type": "text", "text": "Tell a story."}]},
             {"role": "user", "content": [{"type": "text", "text": "A cat named Tom"}]}]
    stream = client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=30, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_prompt_forms_and_n(client, offline, server):
    """A list of prompts (text or token ids) with n=2: choice index = prompt_index * n + i."""
    first, second = greedy(offline, "Once upon a time", 12), greedy(offline, "The dog", 12)
    result = client.completions.create(model=MODEL, prompt=["Once upon a time", "The dog"], n=2, max_tokens=12,
                                       temperature=0)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert [c.text for c in result.choices] == [first.text, first.text, second.text, second.text]
    assert result.usage.completion_tokens == 2 * (len(first.token_ids) + len(second.token_ids))
    assert result.usage.prompt_tokens == len(first.prompt_token_ids) + len(second.prompt_token_ids)

    by_ids = client.completions.create(model=MODEL, prompt=[first.prompt_token_ids], max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == first.text
    with server.client() as http:
        events = sse_events(http.post("/v1/completions", json={
            "prompt": second.prompt_token_ids, "n": 2, "max_tokens": 12, "temperature": 0, "stream": True}))
    texts = {0: "", 1: ""}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == {0: second.text, 1: second.text}


def test_sampling_options(client, offline):
    """Stop strings and token ids, echo, seeded sampling: each as the offline engine does it."""
    expected = offline.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop=["Lily"]))[0]
    result = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0,
                                       stop="Lily")
    assert result.choices[0].text == expected.text and result.choices[0].finish_reason == "stop"

    echoed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + greedy(offline, "Once upon a time", 5).text

    plain = greedy(offline, "The dog", 20)
    stop_id = plain.token_ids[5]
    expected = offline.generate("The dog", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]))[0]
    result = client.completions.create(model=MODEL, prompt="The dog", max_tokens=20, temperature=0,
                                       extra_body={"stop_token_ids": [stop_id], "kv_policy": "full"})
    assert result.choices[0].text == expected.text and result.usage.completion_tokens == len(expected.token_ids) <= 6

    params = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=20, repetition_penalty=1.1)
    seeded = offline.generate("The dog", params)[0]
    result = client.completions.create(model=MODEL, prompt="The dog", temperature=0.8, seed=7, max_tokens=20,
                                       extra_body={"top_k": 20, "repetition_penalty": 1.1})
    assert result.choices[0].text == seeded.text


def test_completion_logprobs(server, offline):
    with server.client() as http:
        body = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0,
                                                  "logprobs": 3}).json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) \
        == body["usage"]["completion_tokens"] == 10
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(10)]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert 1 <= len(top) <= 3 and logprob <= 0
        assert top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))  # greedy


def test_chat_logprobs(client):
    result = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                            temperature=0, logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    assert "".join(t.token for t in content) == result.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with httpx.Client(base_url=server.url) as http:  # no API key
        assert http.get("/health").status_code == 200


# -- errors ---------------------------------------------------------------------------------------

BAD_COMPLETIONS = {
    "max_tokens zero": {"prompt": "x", "max_tokens": 0},
    "negative temperature": {"prompt": "x", "temperature": -0.5},
    "top_p above 1": {"prompt": "x", "top_p": 1.5},
    "top_p zero": {"prompt": "x", "top_p": 0},
    "wrong type": {"prompt": "x", "max_tokens": "ten"},
    "string temperature": {"prompt": "x", "temperature": "0.5"},
    "empty prompt list": {"prompt": []},
    "missing prompt": {"max_tokens": 5},
    "token id out of range": {"prompt": [1, 99999]},
    "beyond the context": {"prompt": "Once upon a time", "max_tokens": 600},
    "logprobs over 20": {"prompt": "x", "logprobs": 21},
    "kv_policy not a string": {"prompt": "x", "kv_policy": 3},
}
BAD_CHATS = {
    "empty messages": {"messages": []},
    "unknown role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "top_logprobs without logprobs": {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
    "max_completion_tokens zero": {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
}


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code
    return error


@pytest.mark.parametrize("path,body", [("/v1/completions", b) for b in BAD_COMPLETIONS.values()]
                         + [("/v1/chat/completions", b) for b in BAD_CHATS.values()],
                         ids=list(BAD_COMPLETIONS) + list(BAD_CHATS))
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_invalid_request_is_400(server, path, body, stream):
    with server.client() as http:
        assert_error(http.post(path, json={**body, "stream": stream}), 400)


def test_wrong_type_names_the_field(server):
    with server.client() as http:
        error = assert_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": "ten"}), 400)
        assert error["param"] == "max_tokens"
        assert_error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                     400)


def test_auth_model_size_and_route_errors(server, client):
    with httpx.Client(base_url=server.url, timeout=60) as anonymous:
        assert_error(anonymous.post("/v1/completions", json={"prompt": "x"}), 401, "invalid_api_key")
        assert_error(anonymous.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with server.client() as http:
        assert_error(http.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [
            {"role": "user", "content": "x"}]}), 404, "model_not_found")
        big = {"prompt": "x" * (1 << 20)}
        assert_error(http.post("/v1/completions", json=big), 413, "request_too_large")
        chunked = iter([b'{"prompt": "', b"y" * (1 << 20), b'"}'])  # no Content-Length: counted as it arrives
        assert_error(http.post("/v1/completions", content=chunked), 413, "request_too_large")
        assert_error(http.get("/v1/nothing-here"), 404)
    # the server keeps serving
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0).usage.completion_tokens == 3


def test_beyond_kv_capacity_is_400():
    """8 blocks of 16 tokens: a request that fits the 512-token context but not the cache is refused."""
    app = create_app(LLM(num_kv_blocks=8).engine, model_name=MODEL)
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        for stream in (False, True):
            error = assert_error(http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 200,
                                                                     "stream": stream}), 400)
            assert "KV cache" in error["message"]
        assert http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 50}).status_code == 200


# -- lifecycle and load ---------------------------------------------------------------------------


def test_disconnect_mid_stream_frees_blocks(server):
    aborted_before = metric_samples(server).get(("kvgen_requests_total", (("finish_reason", "abort"),)), 0)
    with server.client() as http, http.stream("POST", "/v1/completions", json={
            "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        for _ in range(3):
            while not next(lines).startswith("data: "):
                pass
        assert blocks_used(server) > 0
    deadline = time.monotonic() + 1.0
    while blocks_used(server) and time.monotonic() < deadline:
        time.sleep(0.02)
    samples = metric_samples(server)
    assert samples[("kvgen_kv_cache_blocks_used", ())] == 0
    assert samples[("kvgen_num_requests_running", ())] == 0
    assert samples[("kvgen_requests_total", (("finish_reason", "abort"),))] == aborted_before + 1


def test_64_concurrent_streams_match_offline(server, offline):
    prompts = [f"Once upon a time, {name} number {i} went" for i, name in
               zip(range(64), ["Lily", "Tom", "Sue", "Ben"] * 16)]
    expected = [o.text for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=32))]

    async def stream_one(http: httpx.AsyncClient, prompt: str) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "temperature": 0, "stream": True}
        text = ""
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def all_streams() -> list[str]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            return await asyncio.gather(*(stream_one(http, p) for p in prompts))

    assert asyncio.run(all_streams()) == expected
    assert blocks_used(server) == 0


def test_metrics_move_with_requests(server, client):
    before = metric_samples(server)
    result = client.completions.create(model=MODEL, prompt="Once upon a time there", max_tokens=9, temperature=0,
                                       extra_body={"ignore_eos": True})
    after = metric_samples(server)

    def moved(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0)

    assert moved("kvgen_prompt_tokens_total") == result.usage.prompt_tokens
    assert moved("kvgen_generation_tokens_total") == 9
    assert moved("kvgen_requests_total", (("finish_reason", "length"),)) == 1
    assert moved("kvgen_time_to_first_token_seconds_count") == 1
    assert moved("kvgen_e2e_request_latency_seconds_count") == 1
    assert moved("kvgen_inter_token_latency_seconds_count") == 8
    assert moved("kvgen_prefix_cache_queries_total") > 0
    assert after[("kvgen_kv_cache_blocks_total", ())] == ENGINE_OPTIONS["num_kv_blocks"]
    assert after[("kvgen_kv_cache_usage_ratio", ())] == 0
    for name in ("kvgen_num_requests_waiting", "kvgen_prefix_cache_hit_rate", "kvgen_num_preemptions_total",
                 "kvgen_prefix_cache_hits_total"):
        assert (name, ()) in after
