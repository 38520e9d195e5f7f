"""Reading a model's reply in its own format: reasoning apart from content, and tool calls.

One parser per family, each a small streaming state machine (base.StreamParser: feed text deltas, get
`Text` and `Call` events):

    reasoning:  think (<think>...</think>: Qwen3, Qwen3.5, QwQ, DeepSeek-R1), harmony (gpt-oss)
    tool calls: hermes (<tool_call>{json}</tool_call>: Qwen2.5, Qwen3, Hermes), qwen3-xml (Qwen3-Coder,
                Qwen3.5), llama3-json (Llama 3.x), harmony (gpt-oss), json (a bare JSON call or
                hermes tags: kvgen's plain template and models with no format of their own)

`auto` picks each from the chat template (what its text shows the model); `ReplyParser` chains the
reasoning parser and the tool-call parser for one reply of one request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvgen.errors import KVGenError
from kvgen.server.parsers.base import Call, Event, StreamParser, Text, ToolSet, merge
from kvgen.server.parsers.forced import ForcedCallParser
from kvgen.server.parsers.harmony import HarmonyParser
from kvgen.server.parsers.hermes import HermesParser
from kvgen.server.parsers.llama3_json import Llama3JSONParser
from kvgen.server.parsers.qwen3_xml import Qwen3XMLParser
from kvgen.server.parsers.think import ThinkParser, prompt_opens_thinking

__all__ = ["Call", "Event", "ReplyParser", "Text", "ToolSet", "REASONING_PARSERS", "TOOL_PARSERS",
           "resolve_reasoning_parser", "resolve_tool_parser"]

REASONING_PARSERS = ("think", "harmony")
REASONING_ALIASES = {"qwen3": "think", "deepseek_r1": "think", "deepseek-r1": "think", "openai": "harmony",
                     "gpt-oss": "harmony"}
TOOL_PARSERS: dict[str, Callable[[ToolSet], StreamParser]] = {
    "hermes": HermesParser, "qwen3-xml": Qwen3XMLParser, "llama3-json": Llama3JSONParser,
    "harmony": lambda tools: HarmonyParser(tools), "json": HermesParser,
}
TOOL_ALIASES = {"qwen3_xml": "qwen3-xml", "qwen3_coder": "qwen3-xml", "qwen3-coder": "qwen3-xml",
                "llama3_json": "llama3-json", "openai": "harmony"}


def resolve_reasoning_parser(choice: str, template: str | None) -> str | None:
    """--reasoning-parser auto|none|NAME -> a parser name or None (auto: from the chat template)."""
    choice = REASONING_ALIASES.get(choice, choice)
    if choice == "none":
        return None
    if choice == "auto":
        text = template or ""
        if "<|channel|>" in text:
            return "harmony"
        return "think" if "<think>" in text or "</think>" in text else None
    if choice not in REASONING_PARSERS:
        raise KVGenError(f"unknown reasoning parser {choice!r}: auto, none, {', '.join(REASONING_PARSERS)}")
    return choice


def resolve_tool_parser(choice: str, template: str | None) -> str:
    """--tool-call-parser auto|NAME -> a parser name (auto: the format the chat template teaches)."""
    choice = TOOL_ALIASES.get(choice, choice)
    if choice == "auto":
        text = template or ""
        if "<|channel|>" in text:
            return "harmony"
        if "<function=" in text and "<parameter=" in text:
            return "qwen3-xml"
        if "<tool_call>" in text:
            return "hermes"
        if "<|python_tag|>" in text or "<|start_header_id|>" in text and "parameters" in text:
            return "llama3-json"
        return "json"
    if choice not in TOOL_PARSERS:
        raise KVGenError(f"unknown tool-call parser {choice!r}: auto, {', '.join(TOOL_PARSERS)}")
    return choice


class ReplyParser:
    """One reply's parser: reasoning first (if the model reasons), then tool calls in what is content.

    `tools` maps the offered tools' names to their parameter schemas; `forced` is None (auto: calls
    in the model's own format), "" (required: a JSON array of calls) or the forced function's name;
    without tools (or with tool_choice none) content is never read as calls. `prompt` is the rendered
    prompt: a template that opens <think> itself starts the reply inside the reasoning."""

    def __init__(self, reasoning: str | None, tool_parser: str | None, tools: dict[str, Any] | None,
                 forced: str | None = None, prompt: str = "") -> None:
        toolset = ToolSet(tools or {})
        self.reasoning: StreamParser | None = None
        self.tools: StreamParser | None = None
        if forced is not None:  # the grammar decides the whole reply: no reasoning, no model format
            self.tools = ForcedCallParser(toolset, forced or None)
            return
        if reasoning == "harmony" or tool_parser == "harmony":
            self.reasoning = HarmonyParser(toolset if tools and tool_parser == "harmony" else None,
                                           reasoning=reasoning == "harmony")
        elif reasoning == "think":
            self.reasoning = ThinkParser(opened=prompt_opens_thinking(prompt))
        if tools and tool_parser not in (None, "harmony"):
            self.tools = TOOL_PARSERS[tool_parser](toolset)

    def feed(self, text: str) -> list[Event]:
        return self._chain(self.reasoning.feed(text) if self.reasoning else [Text("content", text)], False)

    def finish(self) -> list[Event]:
        return self._chain(self.reasoning.finish() if self.reasoning else [], True)

    def _chain(self, events: list[Event], last: bool) -> list[Event]:
        if self.tools is None:
            return merge(events)
        out: list[Event] = []
        for event in events:
            out += self.tools.feed(event.text) if isinstance(event, Text) and event.kind == "content" else [event]
        if last:
            out += self.tools.finish()
        return merge(out)
