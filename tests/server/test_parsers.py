"""The reply parsers on recorded outputs of each family: the events of a whole reply, and the same
events however the reply is cut into stream chunks (at every character, and one character at a time)."""

from __future__ import annotations

import json

import pytest

from kvgen.server.parsers import Call, ReplyParser, Text, resolve_reasoning_parser, resolve_tool_parser
from kvgen.server.parsers.base import merge

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = {"get_weather": WEATHER, "add": {"type": "object", "properties": {"a": {"type": "number"},
                                                                           "b": {"type": "number"}}}}

# (reasoning parser, tool parser, recorded reply, expected events as (kind, text) / ("call", name, args))
RECORDED = {
    "qwen2.5-hermes": (None, "hermes",
                       '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                       [("call", "get_weather", {"city": "Paris"})]),
    "hermes-text-then-two-calls": (None, "hermes",
                                   'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                   '{"city": "Oslo", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "add", '
                                   '"arguments": {"a": 1, "b": 2}}\n</tool_call>',
                                   [("content", "Let me check both.\n"), ("call", "get_weather", {"city": "Oslo", "days": 2}),
                                    ("call", "add", {"a": 1, "b": 2})]),
    "hermes-bare-json": (None, "hermes", '{"name": "get_weather", "arguments": {"city": "Paris"}}',
                         [("call", "get_weather", {"city": "Paris"})]),
    "qwen2.5-coder-1.5b-fenced-json": (None, "hermes",
                                       '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
                                       [("call", "get_weather", {"city": "Paris"})]),
    "hermes-fenced-code-stays-text": (None, "hermes", "```python\nprint(1)\n```", [("content", "```python\nprint(1)\n```")]),
    "hermes-unknown-tool-stays-text": (None, "hermes", 'A <tool_call>{"name": "rm", "arguments": {}}</tool_call> B',
                                       [("content", 'A <tool_call>{"name": "rm", "arguments": {}}</tool_call> B')]),
    "hermes-plain-text": (None, "hermes", "The weather <b>is</b> fine < tool_call",
                          [("content", "The weather <b>is</b> fine < tool_call")]),
    "qwen3-think-then-hermes": ("think", "hermes",
                                '<think>\nThe user wants Paris.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                                '"arguments": {"city": "Paris"}}\n</tool_call>',
                                [("reasoning", "\nThe user wants Paris.\n"), ("call", "get_weather", {"city": "Paris"})]),
    "qwen3-think-then-text": ("think", "hermes", "<think>\nEasy: 4.\n</think>\n\nIt is 4.",
                              [("reasoning", "\nEasy: 4.\n"), ("content", "It is 4.")]),
    "qwen3-no-think": ("think", "hermes", "It is 4.", [("content", "It is 4.")]),
    "non-ascii": ("think", "hermes", '<think>\nZürich → 東京?\n</think>\n\nSí.<tool_call>\n{"name": "get_weather", '
                  '"arguments": {"city": "Zürich 東京"}}\n</tool_call>',
                  [("reasoning", "\nZürich → 東京?\n"), ("content", "Sí."), ("call", "get_weather", {"city": "Zürich 東京"})]),
    "qwen3-think-cut": ("think", "hermes", "<think>\nStill going", [("reasoning", "\nStill going")]),
    "qwen3-xml": ("think", "qwen3-xml",
                  "<think>\nCall it.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
                  "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
                  [("reasoning", "\nCall it.\n"), ("call", "get_weather", {"city": "New York", "days": 3})]),
    "qwen3-xml-parallel-and-text": (None, "qwen3-xml",
                                    "Sure.\n<tool_call>\n<function=add>\n<parameter=a>\n1.5\n</parameter>\n"
                                    "<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                                    "<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>\n"
                                    "</tool_call>",
                                    [("content", "Sure.\n"), ("call", "add", {"a": 1.5, "b": 2}),
                                     ("call", "get_weather", {"city": "42"})]),
    "qwen3-xml-without-outer-tags": (None, "qwen3-xml",
                                     "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>",
                                     [("call", "get_weather", {"city": "Rome"})]),
    "llama3-json": (None, "llama3-json", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
                    [("call", "get_weather", {"city": "Paris"})]),
    "llama3-python-tag-parallel": (None, "llama3-json",
                                   '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                                   '{"name": "get_weather", "parameters": {"city": "Lima"}}',
                                   [("call", "add", {"a": 1, "b": 2}), ("call", "get_weather", {"city": "Lima"})]),
    "llama3-text": (None, "llama3-json", "Paris is sunny {mostly}.", [("content", "Paris is sunny {mostly}.")]),
    "llama3-json-not-a-call": (None, "llama3-json", '{"answer": 4}', [("content", '{"answer": 4}')]),
    "harmony-call": ("harmony", "harmony",
                     "<|channel|>analysis<|message|>Need weather for Paris.<|end|><|start|>assistant<|channel|>"
                     "commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>",
                     [("reasoning", "Need weather for Paris."), ("call", "get_weather", {"city": "Paris"})]),
    "harmony-final": ("harmony", "harmony",
                      "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>"
                      "It is sunny.<|return|>",
                      [("reasoning", "Simple."), ("content", "It is sunny.")]),
    "harmony-recipient-first": ("harmony", "harmony",
                                "<|start|>assistant to=functions.add<|channel|>commentary json<|message|>"
                                '{"a": 2, "b": 3}<|call|>',
                                [("call", "add", {"a": 2, "b": 3})]),
}


def _plain(events) -> list[tuple]:
    return [("call", e.name, json.loads(e.arguments)) if isinstance(e, Call) else (e.kind, e.text) for e in events]


def _parse(reasoning, tools, chunks) -> list:
    parser = ReplyParser(reasoning, tools, TOOLS)
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return _plain(merge(events + parser.finish()))


@pytest.mark.parametrize("name", RECORDED)
def test_recorded_reply_whole_and_split_at_every_character(name):
    reasoning, tools, text, expected = RECORDED[name]
    assert _parse(reasoning, tools, [text]) == expected
    for cut in range(1, len(text)):
        assert _parse(reasoning, tools, [text[:cut], text[cut:]]) == expected, f"cut at {cut}"
    assert _parse(reasoning, tools, list(text)) == expected


@pytest.mark.parametrize("name", RECORDED)
def test_recorded_reply_split_at_every_utf8_byte(name):
    """Cut at every byte, as byte-level tokens may cut a character: the decoder holds a partial
    character back, so each chunk is the text of the bytes so far that decode."""
    reasoning, tools, text, expected = RECORDED[name]
    data = text.encode()
    for cut in range(1, len(data)):
        head = data[:cut].decode(errors="ignore")
        assert _parse(reasoning, tools, [head, text[len(head):]]) == expected, f"cut at byte {cut}"


def test_without_tools_calls_stay_content_and_reasoning_is_still_split():
    parser = ReplyParser("think", "hermes", None)
    text = '<think>x</think><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert _plain(merge(parser.feed(text) + parser.finish())) == [
        ("reasoning", "x"), ("content", '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')]


def test_prompt_that_opens_thinking_starts_the_reply_as_reasoning():
    parser = ReplyParser("think", None, None, prompt="<|im_start|>assistant\n<think>\n")
    assert _plain(merge(parser.feed("Hmm.\n</think>\n\nHi") + parser.finish())) == [
        ("reasoning", "Hmm.\n"), ("content", "Hi")]


@pytest.mark.parametrize("forced, text, expected", [
    ("get_weather", '{"city": "Oslo"}', [("call", "get_weather", {"city": "Oslo"})]),
    ("", '[{"name": "add", "parameters": {"a": 1, "b": 1}}]', [("call", "add", {"a": 1, "b": 1})]),
])
def test_forced_call(forced, text, expected):
    parser = ReplyParser("think", "hermes", TOOLS, forced=forced)
    assert _plain(merge(parser.feed(text) + parser.finish())) == expected


@pytest.mark.parametrize("template, reasoning, tools", [
    ("{{ '<tool_call>' }}{% if enable_thinking %}<think>{% endif %}", "think", "hermes"),
    ("<tool_call><function=x><parameter=y>", None, "qwen3-xml"),
    ("<|start_header_id|>ipython<|end_header_id|> parameters", None, "llama3-json"),
    ("<|start|>{{ m }}<|channel|>analysis", "harmony", "harmony"),
    ("<|user|>", None, "json"),
])
def test_auto_picks_the_parsers_from_the_chat_template(template, reasoning, tools):
    assert resolve_reasoning_parser("auto", template) == reasoning
    assert resolve_tool_parser("auto", template) == tools
    assert resolve_reasoning_parser("none", template) is None
