"""Reasoning between `<think>` and `</think>` (Qwen3, Qwen3.5, QwQ, DeepSeek-R1): the text between the
markers is reasoning, exactly; what follows `</think>` is content, its leading blank lines dropped.

A reply that does not open with `<think>` is all content, unless the prompt already opened it (templates
that end the generation prompt with `<think>\n`): then the reply starts inside the reasoning. A reply
cut before `</think>` (max_tokens) is all reasoning.
"""

from __future__ import annotations

from kvgen.server.parsers.base import Event, Text, held_suffix

START, END = "<think>", "</think>"


class ThinkParser:
    def __init__(self, opened: bool = False) -> None:
        self.state = "reasoning" if opened else "start"
        self.buf = ""

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while True:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(START):
                    self.buf, self.state = stripped[len(START):], "reasoning"
                    continue
                if START.startswith(stripped):  # nothing yet, or part of the marker
                    return out
                self.state = "content"
            elif self.state == "reasoning":
                end = self.buf.find(END)
                if end >= 0:
                    out.append(Text("reasoning", self.buf[:end]))
                    self.buf, self.state = self.buf[end + len(END):], "after"
                    continue
                keep = held_suffix(self.buf, END)
                out.append(Text("reasoning", self.buf[:len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            elif self.state == "after":
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return out
                self.state = "content"
            else:
                out.append(Text("content", self.buf))
                self.buf = ""
                return out

    def finish(self) -> list[Event]:
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return [Text("reasoning", rest)]
        return [] if self.state == "after" else [Text("content", rest)]


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open <think> (the reply then starts as reasoning)."""
    tail = prompt.rstrip()
    return tail.endswith(START)
