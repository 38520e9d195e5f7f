"""One admission (kvgen.engine.admission): every front end checks a request exactly once, with every
rule once, and a request's kv_policy is parsed once, when its SamplingParams are made. (The replicas'
front end: tests/replicas/test_admission.py; tensor parallelism: tests/distributed/test_executor.py.)"""

from __future__ import annotations

import asyncio

import pytest

from kvgen import LLM, SamplingParams
from kvgen.async_llm import AsyncLLM
from kvgen.errors import InvalidRequestError
from tests.conftest import ADMISSION_RULES

PROMPTS = ["Once upon a time", "Tom and Lily", [1, 400, 500]]


@pytest.fixture(scope="module")
def paged():
    return LLM(num_kv_blocks=256, max_num_seqs=8)


def assert_once_per_request(calls, requests: int) -> None:
    assert calls["admit"] == requests
    assert {rule: calls[rule] for rule in ADMISSION_RULES} == {rule: requests for rule in ADMISSION_RULES}


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_llm_generate_admits_each_request_once_and_parses_its_policy_once(paged, kv_cache, admissions):
    llm = paged if kv_cache == "paged" else LLM(kv_cache="contiguous")
    params = SamplingParams(temperature=0, max_tokens=4, n=2, kv_policy="window:64" if kv_cache == "paged" else "full")
    assert admissions["parse"] == 1
    outs = llm.generate(PROMPTS, params)
    assert all(len(out.outputs) == 2 and out.outputs[0].token_ids for out in outs)
    assert_once_per_request(admissions, len(PROMPTS))
    assert admissions["parse"] == 1  # not again for the request, its completions or its sequences


def test_async_llm_admits_at_once_and_the_engine_does_not_again(paged, admissions):
    params = SamplingParams(temperature=0, max_tokens=4, kv_policy="sinks:4,60")

    async def run() -> list[str]:
        llm = AsyncLLM(paged.engine)
        try:
            streams = [llm.generate(p, params) for p in PROMPTS]
            assert admissions["admit"] == len(PROMPTS)  # before the loop added any of them
            texts = []
            for stream in streams:
                async for out in stream:
                    pass
                texts.append(out.outputs[0].text)
            return texts
        finally:
            await llm.shutdown()

    assert all(asyncio.run(run()))
    assert_once_per_request(admissions, len(PROMPTS))
    assert admissions["parse"] == 1


def test_a_refused_request_raises_from_generate_and_reaches_no_engine(paged, admissions):
    async def run() -> None:
        llm = AsyncLLM(paged.engine)
        with pytest.raises(InvalidRequestError, match="context"):
            llm.generate("Tom", SamplingParams(max_tokens=10**6))
        assert not paged.engine.has_unfinished() and llm.num_waiting() == 0

    asyncio.run(run())
    assert admissions["admit"] == 1


def test_the_server_admits_each_prompt_once(paged, admissions):
    import httpx

    from kvgen.server.app import create_app
    from tests.server.harness import running

    with running(create_app(paged.engine, model_name="stories260K")) as url:
        body = {"prompt": ["Once upon a time", "Tom"], "max_tokens": 4, "n": 2, "kv_policy": "window:32"}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and len(response.json()["choices"]) == 4
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert chat.status_code == 200
    assert_once_per_request(admissions, 3)
    assert admissions["parse"] == 2  # one SamplingParams per HTTP request


def test_a_chat_session_admits_its_turn_once(paged, admissions):
    from kvgen.chat.session import ChatSession

    session = ChatSession(paged.engine, SamplingParams(temperature=0, max_tokens=4))
    assert "".join(session.reply("Hello"))
    assert_once_per_request(admissions, 1)
