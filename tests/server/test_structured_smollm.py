"""Structured outputs and tool calls with the real instruct model (the SmolLM2-135M-Instruct Q4_1 GGUF,
its byte-level BPE vocabulary and ChatML template), through the server and the official client:
the 20 schemas of test_structured in batches of 16 among unconstrained requests, streamed and not;
json_object, regex and choice; a required tool call and a conversation with a tool message."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from kvgen import LLM
from kvgen.server.app import create_app
from tests.server.harness import running
from tests.server.test_structured import CHOICES, REGEX, SCHEMAS, chat, schema_format
from tests.server.test_tools import SCHEMAS as TOOL_SCHEMAS
from tests.server.test_tools import TOOLS

MODEL = "smollm2"
ASK = ({"role": "user", "content": "Reply with a short JSON object: a person's name and age."},)


@pytest.fixture(scope="module")
def base_url(smollm_gguf) -> Iterator[str]:
    app = create_app(LLM(smollm_gguf, num_kv_blocks=2048, max_num_seqs=32).engine, model_name=MODEL)
    with running(app) as url:
        yield f"{url}/v1"


def run_batch(base_url: str, stream: bool, constrained: list[dict]) -> list[tuple[str, str]]:
    """The constrained requests, each beside an unconstrained one, all at once."""
    async def go():
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600) as client:
            plain = [dict(max_tokens=16, temperature=0)] * len(constrained)
            return await asyncio.gather(*(chat(client, stream, MODEL, ASK, **f) for f in constrained + plain))
    return asyncio.run(go())[:len(constrained)]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_twenty_schemas_validate_on_the_real_model(base_url, stream):
    fields = [dict(max_tokens=200, temperature=0 if i % 2 else 0.8, seed=i, response_format=schema_format(s))
              for i, s in enumerate(SCHEMAS)]
    for start in (0, 16):
        results = run_batch(base_url, stream, fields[start:start + 16])
        for schema, (text, finish) in zip(SCHEMAS[start:start + 16], results):
            assert finish == "stop", text
            jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_and_choice_on_the_real_model(base_url):
    # json_object runs greedy: sampled free-form JSON from a 135M model wanders into endless strings.
    constrained = ([dict(max_tokens=300, temperature=0, response_format={"type": "json_object"})
                    for i in range(4)]
                   + [dict(max_tokens=40, temperature=0.8, seed=i, extra_body={"guided_regex": REGEX}) for i in range(4)]
                   + [dict(max_tokens=10, temperature=0.8, seed=i, extra_body={"guided_choice": CHOICES})
                      for i in range(4)])
    results = run_batch(base_url, False, constrained)
    for text, finish in results[:4]:
        assert finish == "stop" and isinstance(json.loads(text), dict), text
    for text, finish in results[4:8]:
        assert finish == "stop" and re.fullmatch(REGEX, text), text
    for text, finish in results[8:]:
        assert finish == "stop" and text in CHOICES


def test_tool_calls_on_the_real_model(base_url):
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    messages = [{"role": "user", "content": "What is the weather in Oslo for the next 3 days?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])
    follow_up = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny", "high_c": 18})}]
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, tools=TOOLS, max_tokens=40,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
