"""Prompt scoring through /v1/completions: `echo` + `logprobs` (the legacy format lm-evaluation-harness
reads), `max_tokens: 0`, and vLLM's `prompt_logprobs`; checked against the offline engine's own prompt
scores, under batching and with the prefix cache warm."""

from __future__ import annotations

import asyncio

import openai
import pytest

from kvgen import LLM, SamplingParams
from tests.server.harness import API_KEY, MODEL, metric_samples, sse_events
from tests.support.tolerances import logprob_gap

# Over three 16-token blocks, so that a second request finds full blocks in the prefix cache.
LONG_PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park "
               "with her friends and her dog.")


def offline_scores(offline: LLM, prompt: str, top: int):
    """The engine's own prompt scores (a fresh request on a cache-cold prompt of the offline engine)."""
    out = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=top))[0]
    return out.prompt_token_ids, out.prompt_logprobs


def assert_scores_match(offline: LLM, prompt: str, token_logprobs: list, top_logprobs: list | None = None) -> None:
    """The server's per-token scores equal the offline engine's within fp32 reordering (another batch)."""
    ids, expected = offline_scores(offline, prompt, 3)
    assert len(token_logprobs) == len(ids) and token_logprobs[0] is None and expected[0] is None
    gap = logprob_gap(offline.engine.model_config, len(ids), max(abs(e.token_logprob) for e in expected[1:]))
    for got, want in zip(token_logprobs[1:], expected[1:]):
        assert got is not None and abs(got - want.token_logprob) <= gap
    if top_logprobs is not None:
        assert top_logprobs[0] is None
        for top, want in zip(top_logprobs[1:], expected[1:]):
            assert len(top) == len(want.top)
            assert max(top.values()) == pytest.approx(max(want.top.values()), abs=gap)


def test_echo_with_max_tokens_zero_scores_the_prompt(server, offline):
    with server.client() as http:
        body = http.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 0, "echo": True,
                                                  "logprobs": 3, "temperature": 0}).json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == LONG_PROMPT and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(lp["tokens"]) == len(lp["text_offset"])
    assert "".join(lp["tokens"]) == LONG_PROMPT  # BOS reads as ""; SentencePiece drops the first space
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert_scores_match(offline, LONG_PROMPT, lp["token_logprobs"], lp["top_logprobs"])


def test_echo_then_completion_in_the_legacy_format(server, offline):
    """lm-evaluation-harness's request: echo, logprobs 1, max_tokens 1; the prompt's entries come first,
    then the completion's, whose text is the offline greedy completion."""
    prompt = "Once upon a time"
    expected = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=1))[0]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=1)
    choice = result.choices[0]
    num_prompt = len(expected.prompt_token_ids)
    assert choice.text == prompt + expected.text
    assert len(choice.logprobs.tokens) == num_prompt + len(expected.token_ids) == num_prompt + 6
    assert "".join(choice.logprobs.tokens[num_prompt:]) == expected.text
    assert choice.logprobs.text_offset[num_prompt] == len(prompt)
    assert_scores_match(offline, prompt, choice.logprobs.token_logprobs[:num_prompt])
    for logprob, top in zip(choice.logprobs.token_logprobs[num_prompt:], choice.logprobs.top_logprobs[num_prompt:]):
        assert logprob == max(top.values())  # greedy: what lm-eval's is_greedy compares, exactly


def test_vllm_prompt_logprobs(server, offline):
    with server.client() as http:
        body = http.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 2, "temperature": 0,
                                                  "prompt_logprobs": 2}).json()
    choice = body["choices"][0]
    assert choice["logprobs"] is None and not choice["text"].startswith(LONG_PROMPT)
    ids, expected = offline_scores(offline, LONG_PROMPT, 2)
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token_id, entry, want in zip(ids[1:], entries[1:], expected[1:]):
        assert str(token_id) in entry and 2 <= len(entry) <= 3
        assert entry[str(token_id)]["rank"] == want.rank
        assert sorted(e["rank"] for e in entry.values()) == sorted({1, 2, want.rank})


def test_prefix_cache_does_not_skip_scoring(server, offline):
    """A prompt whose blocks are already in the prefix cache is still scored from its first token."""
    def hits() -> float:
        return metric_samples(server)[("kvgen_prefix_cache_hits_total", ())]

    with server.client() as http:
        for _ in range(2):  # warm the cache with plain requests: the second hits
            http.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 1})
        before = hits()
        body = http.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 0, "echo": True,
                                                  "logprobs": 0}).json()
        assert hits() == before  # the scoring request computed every token itself
    assert_scores_match(offline, LONG_PROMPT, body["choices"][0]["logprobs"]["token_logprobs"])


def test_scoring_shares_the_batch(server, offline):
    """Sixteen scoring requests and sixteen plain ones at once: each scored prompt is the offline one."""
    prompts = [f"{LONG_PROMPT[: 20 + 5 * i]}" for i in range(16)]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    async def run():
        scoring = [client.completions.create(model=MODEL, prompt=p, max_tokens=0, echo=True, logprobs=1)
                   for p in prompts]
        plain = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0) for p in prompts]
        return await asyncio.gather(*scoring, *plain)

    results = asyncio.run(run())
    for prompt, result in zip(prompts, results[:16]):
        assert result.choices[0].text == prompt
        assert_scores_match(offline, prompt, result.choices[0].logprobs.token_logprobs)
    for prompt, result in zip(prompts, results[16:]):
        assert result.choices[0].text == offline.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].text


def test_streamed_echo(server, offline):
    with server.client() as http, http.stream("POST", "/v1/completions", json={
            "prompt": "The dog", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 0,
            "stream": True}) as response:
        events = sse_events(response)
    choices = [e["choices"][0] for e in events]
    assert choices[0]["text"] == "The dog"
    assert "".join(c["text"] for c in choices) == "The dog" + offline.generate(
        "The dog", SamplingParams(temperature=0, max_tokens=4))[0].text
    prompt_entries = choices[0]["logprobs"]["token_logprobs"]
    assert_scores_match(offline, "The dog", prompt_entries)


@pytest.mark.parametrize("body", [
    {"prompt": "x", "max_tokens": 0},  # max_tokens 0 only with echo
    {"prompt": "x", "echo": True, "logprobs": 21},
    {"prompt": "x", "prompt_logprobs": 21},
    {"prompt": "x", "prompt_logprobs": -1},
], ids=["max_tokens 0 without echo", "echo logprobs over the limit", "prompt_logprobs over the limit",
        "negative prompt_logprobs"])
def test_bad_scoring_requests_are_400(server, body):
    with server.client() as http:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_echo_on_chat_is_400(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"echo": True})
    assert raised.value.body["param"] == "echo"
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_echo_for_several_prompts_and_choices(server, offline):
    """Two prompts x n=2: choice index = prompt index * n + i, each starting with its own prompt."""
    prompts = ["The dog", "Once upon a time"]
    with server.client() as http:
        body = http.post("/v1/completions", json={"prompt": prompts, "n": 2, "max_tokens": 0, "echo": True,
                                                  "logprobs": 0}).json()
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    for choice in choices:
        assert_scores_match(offline, choice["text"], choice["logprobs"]["token_logprobs"])
    assert body["usage"]["completion_tokens"] == 0
