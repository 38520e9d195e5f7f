"""Tool calls through the official openai client: tool_choice required / named / none / auto, streamed
and not, a conversation with a `tool` message, and the reading of replies into tool_calls."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from kvgen import LLM
from kvgen.server.app import create_app
from kvgen.server.tools import NamedFunction, NamedToolChoice, Tool, parse_tool_calls
from tests.server.harness import API_KEY, running

MODEL = "stories260K"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    app = create_app(LLM(num_kv_blocks=512).engine, model_name=MODEL, api_key=API_KEY)
    with running(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def streamed(client: openai.OpenAI, **fields) -> tuple[list, str | None, str]:
    """(tool_calls, finish reason, content) gathered from a stream."""
    calls, finish, content = [], None, ""
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True, **fields):
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return calls, finish, content


def assert_valid_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", range(3))
def test_required(client, seed):
    """One call (a story model seldom closes an open-ended array of calls within its context)."""
    fields = dict(tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=seed)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, **fields)
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    assert_valid_calls(out.choices[0].message.tool_calls, {"weather", "add"})
    assert len(out.choices[0].message.tool_calls) == 1
    calls, finish, content = streamed(client, **fields)
    assert finish == "tool_calls" and content == ""
    assert [c.index for c in calls] == list(range(len(calls)))
    assert_valid_calls(calls, {"weather", "add"})
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]  # same seed


def test_named_function(client):
    choice = {"type": "function", "function": {"name": "add"}}
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                         max_tokens=40, temperature=0)
    assert out.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(out.choices[0].message.tool_calls, {"add"})
    calls, finish, _ = streamed(client, tool_choice=choice, max_tokens=40, temperature=0)
    assert finish == "tool_calls" and [c.function.arguments for c in calls] == \
        [c.function.arguments for c in out.choices[0].message.tool_calls]


def test_none_and_auto_give_text_when_the_reply_is_not_a_call(client):
    for tool_choice in ("none", "auto"):
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                             max_tokens=12, temperature=0)
        assert out.choices[0].message.tool_calls is None and out.choices[0].message.content
        _, finish, content = streamed(client, tool_choice=tool_choice, max_tokens=12, temperature=0)
        assert content == out.choices[0].message.content and finish == "length"


def test_conversation_with_a_tool_message(client):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 20 degrees."},
    ]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                         max_tokens=8, temperature=0)
    assert out.choices[0].message.content and out.usage.completion_tokens == 8


def test_tool_choice_naming_an_unknown_function_is_400(client):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "fly"}})
    with pytest.raises(openai.BadRequestError, match="send one of"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       response_format={"type": "json_object"})
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices[0].message.content


# -- reading replies back ---------------------------------------------------------------------------

PARSED_TOOLS = [Tool.model_validate(t) for t in TOOLS]


@pytest.mark.parametrize("text,expected", [
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', [("add", {"a": 1, "b": 2})]),
    ('<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>',
     [("weather", {"city": "Oslo", "days": 1})]),
    ('<tool_call>{"name": "add", "parameters": {"a": 1, "b": 1}}</tool_call><tool_call>{"name": "add", '
     '"arguments": {"a": 2, "b": 2}}</tool_call>', [("add", {"a": 1, "b": 1}), ("add", {"a": 2, "b": 2})]),
    ('{"name": "fly", "arguments": {}}', None),  # not a tool the request has
    ("It is sunny in Oslo.", None),
    ('{"name": "add"', None),
], ids=["bare JSON", "hermes tags", "two tagged calls", "unknown name", "prose", "cut JSON"])
def test_auto_reads_common_tool_call_formats(text, expected):
    calls = parse_tool_calls(text, PARSED_TOOLS, "auto")
    got = None if calls is None else [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    assert got == expected


def test_named_and_required_read_their_grammar_output():
    named = NamedToolChoice(type="function", function=NamedFunction(name="add"))
    [call] = parse_tool_calls('{"a": 1, "b": 2}', PARSED_TOOLS, named)
    assert call.function.name == "add" and call.function.arguments == '{"a": 1, "b": 2}'
    calls = parse_tool_calls('[{"name": "add", "parameters": {"a": 0, "b": 1}}]', PARSED_TOOLS, "required")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("add", {"a": 0, "b": 1})]
    assert parse_tool_calls("anything", PARSED_TOOLS, "none") is None


def test_plain_template_renders_tools_calls_and_tool_messages(stories_dir):
    from kvgen.loaders import load_tokenizer
    from kvgen.server.chat import ChatTemplate
    from kvgen.server.protocol import ChatMessage

    messages = [ChatMessage.model_validate(m) for m in MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]]
    text = ChatTemplate(load_tokenizer(stories_dir / "tok512.bin")).render(messages, PARSED_TOOLS)
    calls = '[{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]'  # as HF: keys in order
    assert text == ("<|tools|>\nweather, add\n<|user|>\nWeather in Oslo?\n<|assistant|>\n" + calls
                    + "\n<|tool|>\n3\n<|assistant|>\n")


def test_tools_on_completions_are_400(client):
    with pytest.raises(openai.BadRequestError, match="tools is not supported"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"tools": TOOLS})


@pytest.mark.parametrize("text,could", [("", True), ("  {", True), ("[{", True), ("<tool", True),
                                        ("<tool_call>{", True), ("Once", False), ("<b>", False)])
def test_auto_holds_a_streamed_reply_only_while_it_may_become_a_call(text, could):
    from kvgen.server.tools import may_become_tool_call

    assert may_become_tool_call(text, "auto") is could
    assert may_become_tool_call(text, "required") and not may_become_tool_call(text, "none")


def test_streamed_auto_text_reply_arrives_in_pieces(client):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                            max_tokens=12, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1
