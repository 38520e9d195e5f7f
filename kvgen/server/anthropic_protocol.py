"""Anthropic's Messages API on the wire: the request (content blocks, tools, tool_choice, thinking),
its translation into the chat request the engine path runs, and the bounds on every new field.

Blocks kvgen reads: text, tool_use and thinking (assistant turns), tool_result (user turns);
redacted_thinking is dropped; image and document blocks are refused (a 400: kvgen runs text models).
Fields the API has that change nothing here (metadata, cache_control, service_tier) are ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvgen.errors import InvalidRequestError
from kvgen.server.protocol import ChatCompletionRequest

# Bounds on what only this API sends (the sampling fields keep the server's RequestLimits).
MAX_MESSAGES = 2048
MAX_BLOCKS = 1024  # content blocks in one message
MAX_TOOLS = 128
MAX_TOOL_SCHEMA_BYTES = 65536  # one tool's input_schema as JSON
MAX_TOOL_INPUT_BYTES = 262144  # one earlier tool_use's input as JSON
MAX_ID_LENGTH = 256


class _Strictish(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Strictish):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Strictish):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strictish):
    type: Literal["redacted_thinking"]
    data: str | None = None


class ToolUseBlock(_Strictish):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    name: str = Field(min_length=1, max_length=128)
    input: dict[str, Any]


class ToolResultBlock(_Strictish):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(b.text for b in self.content)
        return self.content or ""


Block = TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock
_BLOCKS = {"text": TextBlock, "thinking": ThinkingBlock, "redacted_thinking": RedactedThinkingBlock,
           "tool_use": ToolUseBlock, "tool_result": ToolResultBlock}


def _blocks(value: Any, where: str) -> Any:
    """Block dicts -> their models by `type`, with a message that names the block (a union's errors
    would list every member's)."""
    if not isinstance(value, list):
        return value
    if len(value) > MAX_BLOCKS:
        raise ValueError(f"{where} has {len(value)} content blocks, over this server's limit of {MAX_BLOCKS}")
    out = []
    for i, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in _BLOCKS:
            raise ValueError(f"{where}.{i}: content blocks of type {kind!r} are not supported "
                             f"(this server reads {', '.join(_BLOCKS)})")
        try:
            out.append(_BLOCKS[kind].model_validate(block))
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            raise ValueError(f"{where}.{i} ({kind} block){'.' + field if field else ''}: {first['msg']}") from None
    return out


class Message(_Strictish):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @model_validator(mode="before")
    @classmethod
    def _typed_blocks(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            data = {**data, "content": _blocks(data["content"], "content")}
        return data

    def blocks(self) -> list[Block]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class AnthropicTool(_Strictish):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(default=None, max_length=65536)
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None

    @model_validator(mode="after")
    def _small_schema(self) -> "AnthropicTool":
        if len(json.dumps(self.input_schema)) > MAX_TOOL_SCHEMA_BYTES:
            raise ValueError(f"tool {self.name!r}: input_schema is over {MAX_TOOL_SCHEMA_BYTES} bytes as JSON")
        return self


class ToolChoice(_Strictish):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strictish):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessagesRequest(_Strictish):
    model: str = Field(max_length=256)
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[AnthropicTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    # kvgen / vLLM extras, sent in the client's extra_body
    seed: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            tools = data.get("tools")
            if isinstance(tools, list):  # server tools (web_search_...) have a dated type and no input_schema
                for i, tool in enumerate(tools):
                    if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
                        raise ValueError(f"tools.{i}: tools of type {tool.get('type')!r} are not supported; "
                                         "this server runs custom tools (a name and an input_schema)")
            return {k: v for k, v in data.items() if v is not None}
        return data

    def chat_request(self) -> ChatCompletionRequest:
        """The same conversation as a chat completions request (OpenAI messages and tools), checked:
        tool_use names an offered tool, tool_result answers an earlier tool_use, and so on."""
        names = {t.name for t in self.tools or []}
        messages: list[dict[str, Any]] = []
        system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system or [])
        if self.system is not None:
            messages.append({"role": "system", "content": system})
        open_calls: set[str] = set()
        for i, message in enumerate(self.messages):
            where = f"messages.{i}"
            if message.role == "assistant":
                messages.append(_assistant(message.blocks(), names, open_calls, where))
            else:
                messages += _user(message.blocks(), open_calls, where)
        if self.messages[-1].role != "user":
            raise InvalidRequestError("the last message must be the user's (a prefilled assistant reply is not "
                                      "supported)")
        kwargs = dict(self.chat_template_kwargs or {})
        if self.thinking is not None:
            kwargs.setdefault("enable_thinking", self.thinking.type != "disabled")
        fields: dict[str, Any] = {
            "messages": messages, "max_tokens": self.max_tokens, "stream": self.stream,
            "stop": self.stop_sequences, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "seed": self.seed, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "logit_bias": self.logit_bias,
            "chat_template_kwargs": kwargs or None,
        }
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}} for t in self.tools]
            fields["tool_choice"], fields["parallel_tool_calls"] = self._tool_choice(names)
        elif self.tool_choice is not None and self.tool_choice.type in ("any", "tool"):
            raise InvalidRequestError(f"tool_choice {self.tool_choice.type!r} needs tools")
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0]
            field = {"max_tokens": "max_tokens", "stop": "stop_sequences"}.get(str(first["loc"][0]), ".".join(
                map(str, first["loc"])))
            raise InvalidRequestError(f"{field}: {first['msg']}") from None

    def _tool_choice(self, names: set[str]) -> tuple[Any, bool]:
        choice = self.tool_choice or ToolChoice(type="auto")
        parallel = not choice.disable_parallel_tool_use
        if choice.type == "tool":
            if choice.name not in names:
                raise InvalidRequestError(f"tool_choice names the tool {choice.name!r}, which is not in tools")
            return {"type": "function", "function": {"name": choice.name}}, parallel
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def _assistant(blocks: list[Block], names: set[str], open_calls: set[str], where: str) -> dict[str, Any]:
    text, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            if block.name not in names:
                raise InvalidRequestError(f"{where}.content.{j}: tool_use names the tool {block.name!r}, which is "
                                          "not in tools")
            arguments = json.dumps(block.input, ensure_ascii=False)
            if len(arguments) > MAX_TOOL_INPUT_BYTES:
                raise InvalidRequestError(f"{where}.content.{j}: tool_use input is over {MAX_TOOL_INPUT_BYTES} bytes")
            open_calls.add(block.id)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif isinstance(block, ToolResultBlock):
            raise InvalidRequestError(f"{where}.content.{j}: tool_result blocks belong in user messages")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return message


def _user(blocks: list[Block], open_calls: set[str], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages first (the order chat templates expect), then
    its text."""
    results, text = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in open_calls:
                raise InvalidRequestError(f"{where}.content.{j}: tool_result answers tool_use_id "
                                          f"{block.tool_use_id!r}, which no earlier tool_use has")
            content = block.text()
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {content}" if block.is_error else content})
        elif isinstance(block, TextBlock):
            text.append(block.text)
        else:
            raise InvalidRequestError(f"{where}.content.{j}: {block.type} blocks belong in assistant messages")
    return results + ([{"role": "user", "content": "\n".join(text)}] if text or not results else [])


class CountTokensRequest(MessagesRequest):
    """/v1/messages/count_tokens: a Messages request without max_tokens."""

    max_tokens: int = 1
