"""Tool calls in chat: which grammar a `tool_choice` puts the reply under, and reading the reply back
as OpenAI `tool_calls`.

    tool_choice "none"        free text; the chat template is not shown the tools (as vLLM does)
    tool_choice "auto"        free text; a reply that is a tool call in the common formats (a JSON
                              {"name", "arguments"|"parameters"} object, or one inside
                              <tool_call>...</tool_call> as Hermes-style templates ask) becomes tool_calls
    tool_choice "required"    a JSON array of {"name", "parameters"} objects, each under its
                              function's parameter schema
    {"type": "function", "function": {"name": f}}
                              the arguments of f, under f's parameter schema
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvgen.errors import InvalidRequestError
from kvgen.sample.grammar import GrammarSpec


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCall):
    index: int


def named(tools: list[Tool], choice: ToolChoice) -> Tool | None:
    """The tool a named tool_choice forces (InvalidRequestError if no tool has that name)."""
    if not isinstance(choice, NamedToolChoice):
        return None
    for tool in tools:
        if tool.function.name == choice.function.name:
            return tool
    raise InvalidRequestError(f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                              f"({', '.join(t.function.name for t in tools) or 'none given'})")


def tool_grammar(tools: list[Tool], choice: ToolChoice, parallel: bool = True) -> GrammarSpec | None:
    """The grammar the reply is generated under: the forced function's arguments, an array of calls
    (required; one call only unless `parallel`), or none (auto, none)."""
    if choice == "required" and not tools:
        raise InvalidRequestError("tool_choice required needs at least one tool")
    forced = named(tools, choice)
    if forced is not None:
        return GrammarSpec.json_schema(forced.function.parameters, strict=True)
    if choice != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": t.function.parameters},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | ({} if parallel else {"maxItems": 1})
    return GrammarSpec.json_schema(array, strict=True)


def parse_tool_calls(text: str, tools: list[Tool], choice: ToolChoice) -> list[ToolCall] | None:
    """The reply as tool calls, or None where it is not one (then it stays content)."""
    forced = named(tools, choice)
    if forced is not None:
        return [ToolCall(function=FunctionCall(name=forced.function.name, arguments=text))]
    if choice == "required":
        return _calls(_json(text), tools)
    if choice == "auto" and tools:
        tagged = re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.DOTALL)
        return _calls([_json(t) for t in tagged] if tagged else _json(text), tools)
    return None


def template_tools(tools: list[Tool] | None, choice: ToolChoice) -> list[Tool]:
    """The tools the chat template shows the model: none under tool_choice "none" (as vLLM does), so a
    model told not to call answers in text instead of imitating the template's call format."""
    return [] if choice == "none" else list(tools or [])


def may_become_tool_call(text: str, choice: ToolChoice) -> bool:
    """Whether a reply that begins with `text` could still be read as tool calls (auto: it opens a
    JSON value or a <tool_call> tag; a forced call always is one)."""
    if choice != "auto":
        return choice != "none"
    start = text.lstrip()
    return start[:1] in ("", "{", "[") or start.startswith(_TAG) or _TAG.startswith(start)


_TAG = "<tool_call>"


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _calls(value: Any, tools: list[Tool]) -> list[ToolCall] | None:
    """[{"name", "parameters" | "arguments"}, ...] (or one such object) naming known tools -> ToolCalls."""
    items = value if isinstance(value, list) else [value]
    names = {t.function.name for t in tools}
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        arguments = item.get("parameters", item.get("arguments", {}))
        calls.append(ToolCall(function=FunctionCall(
            name=item["name"], arguments=arguments if isinstance(arguments, str) else json.dumps(arguments))))
    return calls or None
