"""Tool calls wrapped in tags within free text, the shape hermes and qwen3-xml share: text outside the
tags is content and streams as it comes; a call is held from its opening tag to its closing one and
becomes a `Call` when its inside parses (else it stays text, as the model wrote it). A reply that is
nothing but a JSON call (a small model may drop the tags) is read as one too."""

from __future__ import annotations

import json

from kvgen.server.parsers.base import Call, Event, Text, ToolSet, held_suffix


class TaggedCallParser:
    TAGS: tuple[tuple[str, str], ...] = ()  # (opening, closing) pairs

    def __init__(self, tools: ToolSet) -> None:
        self.tools = tools
        self.buf = ""
        self.state = "start"  # start -> text | bare; text <-> call (self.tag); after (a call: blank lines dropped)
        self.tag: tuple[str, str] | None = None

    def parse_inner(self, opening: str, inner: str) -> list[Call] | None:
        raise NotImplementedError

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while True:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if not stripped:
                    return out
                if FENCE.startswith(stripped):
                    return out  # not yet telling a fenced call from a fenced answer
                self.state = "bare" if stripped[0] in "{[" or stripped.startswith(FENCE) else "text"
            if self.state == "bare":
                return out  # held to the end: read as a whole
            if self.state == "after":
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return out
                self.state = "text"
            if self.state == "text":
                found = [(self.buf.find(o), (o, c)) for o, c in self.TAGS if o in self.buf]
                if found:
                    at, self.tag = min(found)
                    out.append(Text("content", self.buf[:at]))
                    self.buf, self.state = self.buf[at + len(self.tag[0]):], "call"
                    continue
                keep = held_suffix(self.buf, *(o for o, _ in self.TAGS))
                out.append(Text("content", self.buf[:len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            opening, closing = self.tag
            end = self.buf.find(closing)
            if end < 0:
                return out
            inner, self.buf = self.buf[:end], self.buf[end + len(closing):]
            calls = self.parse_inner(opening, inner)
            if calls:
                out += calls
                self.state = "after"
            else:
                out.append(Text("content", opening + inner + closing))
                self.state = "text"

    def finish(self) -> list[Event]:
        rest, self.buf = self.buf, ""
        if self.state == "bare":
            calls = bare_json_calls(rest, self.tools)
            return calls if calls else [Text("content", rest)]
        if self.state == "call":  # cut before its closing tag (a stop string, max_tokens)
            opening, _ = self.tag
            calls = self.parse_inner(opening, rest)
            return calls if calls else [Text("content", opening + rest)]
        return [] if self.state == "after" else [Text("content", rest)]


FENCE = "```"


def bare_json_calls(text: str, tools: ToolSet) -> list[Call] | None:
    """A reply that is one JSON call object, or an array of them, naming offered tools; also inside a
    ```json fence (as Qwen2.5-Coder-1.5B writes its calls)."""
    text = text.strip()
    if text.startswith(FENCE) and text.endswith(FENCE) and len(text) > 2 * len(FENCE):
        text = text[len(FENCE):-len(FENCE)].removeprefix("json").strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = [tools.json_call(item) for item in (value if isinstance(value, list) else [value])]
    return calls if calls and all(calls) else None
