"""gpt-oss's harmony format: the reply is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

or, answering, `<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>`. The analysis
channel is reasoning; a body addressed `to=functions.NAME` (in the header, before or after the channel)
is a call's JSON arguments; the final channel, and commentary to no one, are content. One parser does
both reasoning and tool calls, as the format mixes them.

It reads the text the engine decodes (special tokens kept); openai-harmony's token-level parser needs
its o200k vocabulary, which it downloads at first use, so the server does not depend on it.
"""

from __future__ import annotations

import re

from kvgen.server.parsers.base import Event, Text, ToolSet, held_suffix

MESSAGE, START = "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.-]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyParser:
    def __init__(self, tools: ToolSet | None = None, reasoning: bool = True) -> None:
        self.tools = tools
        self.reasoning = reasoning  # False: the analysis channel is dropped, as --reasoning-parser none asks
        self.buf = ""
        self.state = "header"  # header -> body -> header ...
        self.kind: str | None = None  # the body's event kind; None: a call's arguments (held)
        self.recipient: str | None = None

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while True:
            if self.state == "header":
                at = self.buf.find(MESSAGE)
                if at < 0:
                    return out
                self._open(self.buf[:at])
                self.buf, self.state = self.buf[at + len(MESSAGE):], "body"
                continue
            found = [(self.buf.find(end), end) for end in ENDS if end in self.buf]
            if found:
                at, end = min(found)
                out += self._body(self.buf[:at], final=True)
                self.buf, self.state = self.buf[at + len(end):], "header"
                continue
            if self.kind is None:
                return out  # a call's arguments wait for their end
            keep = held_suffix(self.buf, *ENDS)
            out += self._body(self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return out

    def finish(self) -> list[Event]:
        rest, self.buf = self.buf, ""
        if self.state == "header":  # no message opened: text without a header is content
            return [Text("content", rest)] if rest.strip() and MESSAGE not in rest and "<|" not in rest else []
        return self._body(rest, final=True)

    def _open(self, header: str) -> None:
        header = header.replace(START, "")
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        self.recipient = recipient.group(1) if recipient else None
        if self.recipient is not None:
            self.kind = None
        elif channel and channel.group(1) == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"

    def _body(self, text: str, final: bool = False) -> list[Event]:
        if self.kind is not None:
            if self.kind == "reasoning" and not self.reasoning:
                return []
            return [Text(self.kind, text)]
        if not final:
            return []
        call = self.tools.call(self.recipient, text.strip()) if self.tools is not None else None
        return [call] if call else [Text("content", text)]
