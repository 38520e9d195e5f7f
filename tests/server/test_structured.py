"""Structured outputs through the server with the official openai client: JSON schemas validated with
`jsonschema`, json_object, guided_regex and guided_choice, batched 16 at once among unconstrained
requests, streamed and not. stories260K writes gibberish, but gibberish that must match."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from kvgen import LLM, SamplingParams
from kvgen.server.app import create_app
from tests.server.harness import API_KEY, Server, running

MODEL = "stories260K"
MAX_TOKENS = 300
S = {"type": "string", "maxLength": 12}  # bounded, or a story model writes its whole story into one string


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


SCHEMAS = [
    obj({"name": S}),
    obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"count": {"type": "integer", "minimum": -5, "maximum": 5}}),
    obj({"tags": {"type": "array", "items": S, "maxItems": 3}}),
    obj({"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 4}}),
    obj({"point": obj({"x": {"type": "integer", "minimum": 0, "maximum": 9},
                       "y": {"type": "integer", "minimum": 0, "maximum": 9}})}),
    obj({"user": obj({"name": S, "address": obj({"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})}),
    obj({"name": S, "nickname": S}, required=["name"]),
    obj({"level": {"type": "string", "enum": ["low", "mid", "high"]}, "score": {"type": "integer", "minimum": 1,
                                                                               "maximum": 10}}),
    obj({"items": {"type": "array", "items": obj({"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                                  "label": S}), "maxItems": 2}}),
    obj({"flag": {"type": "boolean"}, "note": {"anyOf": [S, {"type": "null"}]}}),
    obj({"kind": {"const": "story"}, "title": S}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 3}, "maxItems": 2},
                    "maxItems": 2}}),
    obj({"answer": {"type": "string", "enum": ["yes", "no"]}, "why": S}),
    obj({"a": obj({"b": obj({"c": {"type": "boolean"}})})}),
    obj({"words": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 5}, "minItems": 2,
                   "maxItems": 3}}),
    obj({"id": {"type": "integer", "minimum": 1000, "maximum": 9999}, "active": {"type": "boolean"},
         "role": {"enum": ["admin", "user"]}}),
]
REGEX = r"[A-Z][a-z]{1,8} (is|was) [0-9]{1,3} years old\."
CHOICES = ["yes", "no", "once upon a time"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    app = create_app(LLM(num_kv_blocks=1024, max_num_seqs=64).engine, model_name=MODEL, api_key=API_KEY)
    with running(app) as url:
        yield Server(url, app)


@pytest.fixture(scope="module")
def aclient(server) -> str:
    """The base URL for the async clients (one per event loop: asyncio.run makes a new loop each time)."""
    return f"{server.url}/v1"


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


async def chat(client: openai.AsyncOpenAI, stream: bool, model: str = MODEL,
               messages: tuple[dict, ...] = ({"role": "user", "content": "Tell me about Lily."},),
               **fields) -> tuple[str, str]:
    """(text, finish reason) of one chat completion, streamed or not."""
    messages = list(messages)
    if not stream:
        out = await client.chat.completions.create(model=model, messages=messages, **fields)
        return out.choices[0].message.content, out.choices[0].finish_reason
    text, finish = "", None
    async for chunk in await client.chat.completions.create(model=model, messages=messages, stream=True, **fields):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


async def batch(base_url: str, stream: bool, constrained: list[dict]) -> list[tuple[str, str]]:
    """The constrained requests and as many unconstrained ones, all at once."""
    plain = [dict(max_tokens=20, temperature=0)] * len(constrained)
    async with openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=300) as client:
        return await asyncio.gather(*(chat(client, stream, **fields) for fields in constrained + plain))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_json_schemas_validate(aclient, stream):
    """20 schemas, in batches of 16 constrained + 16 unconstrained requests; half greedy, half sampled."""
    fields = [dict(max_tokens=MAX_TOKENS, temperature=0 if i % 2 else 1.0, seed=i, response_format=schema_format(s))
              for i, s in enumerate(SCHEMAS)]
    for start in (0, 16):
        group = fields[start:start + 16]
        results = asyncio.run(batch(aclient, stream, group))
        for schema, (text, finish) in zip(SCHEMAS[start:start + 16], results[:len(group)]):
            assert finish == "stop", text
            jsonschema.validate(json.loads(text), schema)
        assert all(finish == "length" for _, finish in results[len(group):])  # unconstrained: free text


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_regex_choice_and_guided_json(aclient, stream):
    constrained = ([dict(max_tokens=60, temperature=1.0, seed=i, extra_body={"guided_regex": REGEX}) for i in range(6)]
                   + [dict(max_tokens=10, temperature=1.0, seed=i, extra_body={"guided_choice": CHOICES})
                      for i in range(6)]
                   + [dict(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, extra_body={"guided_json": SCHEMAS[i]})
                      for i in range(4)])
    results = asyncio.run(batch(aclient, stream, constrained))
    for text, finish in results[:6]:
        assert re.fullmatch(REGEX, text) and finish == "stop"
    for text, finish in results[6:12]:
        assert text in CHOICES and finish == "stop"
    for schema, (text, finish) in zip(SCHEMAS, results[12:16]):
        jsonschema.validate(json.loads(text), schema)


def test_json_object(aclient):
    """Any JSON object: the output is one whenever the model ends it; a story model often does not end
    its strings within max_tokens, so a cut output must still be the start of one."""
    import xgrammar

    from kvgen.sample.grammar import GrammarSpec

    results = asyncio.run(batch(aclient, False, [dict(max_tokens=120, temperature=1.0, seed=i,
                                                      response_format={"type": "json_object"}) for i in range(16)]))
    grammar = LLM().engine.grammars.compile(GrammarSpec.json_object())
    for text, finish in results[:16]:
        assert text.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert xgrammar.GrammarMatcher(grammar.compiled).accept_string(text)


def test_unconstrained_rows_unchanged_by_constrained_neighbours(server, aclient):
    """Greedy requests without a grammar give the offline engine's text while constrained ones share the batch."""
    expected = LLM(num_kv_blocks=1024).generate(
        "<|user|>\nTell me about Lily.\n<|assistant|>\n", SamplingParams(temperature=0, max_tokens=20))[0].text
    results = asyncio.run(batch(aclient, False, [dict(max_tokens=40, temperature=0, response_format=schema_format(s))
                                                 for s in SCHEMAS[:8]]))
    assert all(text == expected for text, _ in results[8:])


BAD = {
    "invalid JSON schema": {"response_format": schema_format({"type": "object", "properties": 3})},
    "unknown schema type": {"extra_body": {"guided_json": {"type": "foo"}}},
    "regex that does not compile": {"extra_body": {"guided_regex": "([a-z]+"}},
    "empty choice": {"extra_body": {"guided_choice": []}},
    "two grammars": {"extra_body": {"guided_regex": "a+", "guided_choice": ["a"]}},
    "tool_choice naming an unknown function": {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "nowhere"}}},
    "a tool's invalid parameter schema": {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wrong"}}}],
        "tool_choice": "required"},
    "functions (unsupported)": {"extra_body": {"functions": [{"name": "f"}]}},
    "grammar over the size limit": {"extra_body": {"guided_regex": "a" * 40000}},
}


@pytest.mark.parametrize("fields", BAD.values(), ids=list(BAD))
def test_bad_structured_requests_are_400_and_the_server_goes_on(server, fields):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       **fields)
    assert set(raised.value.body) == {"message", "type", "param", "code"} and raised.value.body["message"]
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                  "guided_choice": ["ok"]}).json()["choices"][0]["text"] == "ok"
