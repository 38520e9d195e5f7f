"""Llama 3.1 / 3.2 / 3.3 tool calls: the whole reply is JSON, `{"name": ..., "parameters": {...}}`,
after an optional <|python_tag|>; parallel calls are separated by ";". A reply that starts otherwise is
content and streams; one that starts like a call is held to its end and read whole (text, if it is not
calls of offered tools)."""

from __future__ import annotations

import json

from kvgen.server.parsers.base import Call, Event, Text, ToolSet

PYTHON_TAG = "<|python_tag|>"


class Llama3JSONParser:
    def __init__(self, tools: ToolSet) -> None:
        self.tools = tools
        self.buf = ""
        self.state = "start"  # start -> text | held

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        if self.state == "start":
            stripped = self.buf.lstrip()
            if not stripped or PYTHON_TAG.startswith(stripped):
                return []
            self.state = "held" if stripped.startswith((PYTHON_TAG, "{")) else "text"
        if self.state == "held":
            return []
        rest, self.buf = self.buf, ""
        return [Text("content", rest)]

    def finish(self) -> list[Event]:
        rest, self.buf = self.buf, ""
        if self.state == "start" and not rest.strip():
            return [Text("content", rest)]
        calls = _calls(rest, self.tools)
        return calls if calls else [Text("content", rest)]


def _calls(text: str, tools: ToolSet) -> list[Call] | None:
    text = text.strip().removeprefix(PYTHON_TAG)
    decoder, at, calls = json.JSONDecoder(), 0, []
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";" and calls):
            at += 1
        if at == len(text):
            return calls or None
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        call = tools.json_call(value)
        if call is None:
            return None
        calls.append(call)
