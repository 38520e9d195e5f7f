"""Qwen3-Coder / Qwen3.5 tool calls: XML-like tags, one per parameter, values as raw text:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value becomes the JSON type its parameter's schema says (a string stays text as written; a number,
boolean, object or array is read as JSON, falling back to the text). The model may drop the outer
<tool_call> tags; a bare <function=...>...</function> is a call too.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvgen.server.parsers.base import Call
from kvgen.server.parsers.tagged import TaggedCallParser

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


class Qwen3XMLParser(TaggedCallParser):
    TAGS = (("<tool_call>", "</tool_call>"), ("<function=", "</function>"))

    def parse_inner(self, opening: str, inner: str) -> list[Call] | None:
        text = inner if opening == "<tool_call>" else opening + inner + "</function>"
        calls = []
        for name, body in _FUNCTION.findall(text):
            name = name.strip()
            if name not in self.tools:
                return None
            properties = self.tools.schemas[name].get("properties", {})
            arguments = {key.strip(): _typed(_trim(value), properties.get(key.strip(), {}))
                         for key, value in _PARAMETER.findall(body)}
            calls.append(self.tools.call(name, arguments))
        return calls if calls and all(calls) else None


def _trim(value: str) -> str:
    """The value without the one newline the format puts on each side."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kind is None or "string" in kinds:
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value
