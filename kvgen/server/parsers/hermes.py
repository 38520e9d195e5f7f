"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes 2/3, and kvgen's plain template), one JSON object
per call in tags, parallel calls one after another:

    Let me look.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from kvgen.server.parsers.base import Call, loads
from kvgen.server.parsers.tagged import TaggedCallParser


class HermesParser(TaggedCallParser):
    TAGS = (("<tool_call>", "</tool_call>"),)

    def parse_inner(self, opening: str, inner: str) -> list[Call] | None:
        call = self.tools.json_call(loads(inner.strip()))
        return [call] if call else None
