"""A reply under a grammar that forces a tool call (tool_choice required or a named function): the
whole reply is the call, so it is held to its end and read there.

    named function f      the reply is f's arguments (a JSON object under f's schema)
    required              a JSON array of {"name", "parameters"} objects (kvgen.server.tools.tool_grammar)
"""

from __future__ import annotations

from kvgen.server.parsers.base import Event, Text, ToolSet
from kvgen.server.parsers.tagged import bare_json_calls


class ForcedCallParser:
    def __init__(self, tools: ToolSet, name: str | None) -> None:
        self.tools, self.name = tools, name  # name: the forced function (None: any, as required asks)
        self.buf = ""

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        return []

    def finish(self) -> list[Event]:
        rest, self.buf = self.buf, ""
        calls = [self.tools.call(self.name, rest)] if self.name else bare_json_calls(rest, self.tools)
        return calls if calls and all(calls) else [Text("content", rest)]
