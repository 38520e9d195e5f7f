"""What every reply parser shares: the events it yields and the hold-back of a marker cut by a chunk.

A parser reads a reply as the engine streams it, text delta by text delta, and turns it into events:
`Text` (content or reasoning, in order) and `Call` (one complete tool call). `feed(text)` returns the
events that text settles; `finish()` the rest once the reply ends. Text that may be the start of a
marker (`<tool_call>` cut after `<tool_`) is held until the next delta settles it, so the events of a
reply are the same however its text is split into deltas.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol


@dataclass
class Text:
    kind: Literal["content", "reasoning"]
    text: str


@dataclass
class Call:
    """A complete tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


Event = Text | Call


class StreamParser(Protocol):
    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def held_suffix(text: str, *markers: str) -> int:
    """The length of the longest end of `text` that begins one of `markers` (and so must wait)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest


def merge(events: list[Event]) -> list[Event]:
    """Adjacent text events of one kind joined, empty ones dropped."""
    merged: list[Event] = []
    for event in events:
        if isinstance(event, Text):
            if not event.text:
                continue
            if merged and isinstance(merged[-1], Text) and merged[-1].kind == event.kind:
                merged[-1] = Text(event.kind, merged[-1].text + event.text)
                continue
        merged.append(event)
    return merged


def parse_all(parser: StreamParser, chunks: list[str]) -> list[Event]:
    """Every event of a reply fed in `chunks` (merged): what a test compares across splittings."""
    events: list[Event] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return merge(events + parser.finish())


class ToolSet:
    """The tools a request offers, by name: a call to a tool not offered stays text."""

    def __init__(self, tools: dict[str, dict[str, Any]]) -> None:
        self.schemas = tools  # name -> the parameters' JSON schema

    def __contains__(self, name: object) -> bool:
        return name in self.schemas

    def call(self, name: Any, arguments: Any) -> Call | None:
        """A Call for a known tool with an object (or its JSON text) as arguments; None otherwise."""
        if not isinstance(name, str) or name not in self.schemas:
            return None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return None
        return Call(name, json.dumps(arguments, ensure_ascii=False))

    def json_call(self, value: Any) -> Call | None:
        """{"name": ..., "arguments" | "parameters": {...}} as a Call (the JSON formats' object)."""
        if not isinstance(value, dict):
            return None
        return self.call(value.get("name"), value.get("arguments", value.get("parameters", {})))


def loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
