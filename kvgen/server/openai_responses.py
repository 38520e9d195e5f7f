"""POST /v1/responses (OpenAI's Responses API) and GET /v1/responses/{id}.

Input items (messages, function_call, function_call_output, reasoning) and `instructions` become the
chat request they mean and run on the shared reply path (replies.py); the reply comes back as output
items in the order the model wrote them: reasoning (its text as reasoning_text content), message
(output_text), function_call. With `store` (the API's default) the response is kept in a bounded
in-memory store (the least recently used go first), so a later request can continue it with
`previous_response_id`: its input and output come before the new input (its instructions do not, as
OpenAI has it). A stream sends the API's events:

    response.created, response.in_progress,
    per item: response.output_item.added, then for a message response.content_part.added,
      response.output_text.delta..., response.output_text.done, response.content_part.done;
      for reasoning response.reasoning_text.delta... / .done; for a call
      response.function_call_arguments.delta / .done; then response.output_item.done
    response.completed (or response.incomplete, cut by max_output_tokens)
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvgen.errors import InvalidRequestError
from kvgen.server.parsers import Call, Event, Text
from kvgen.server.protocol import ChatCompletionRequest
from kvgen.server.replies import PreparedReply, Reply, ReplyStep, gather_reply, prepare_reply, run_reply, start_reply
from kvgen.server.responses import EventStreamResponse
from kvgen.server.state import APIError, check_api_key, serving_state, server_state

log = logging.getLogger("kvgen.server")
router = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

MAX_INPUT_ITEMS = 2048
MAX_TOOLS = 128
MAX_TOOL_SCHEMA_BYTES = 65536
MAX_ID_LENGTH = 256


# -- the store ----------------------------------------------------------------------------------


@dataclass
class Stored:
    response: dict[str, Any]  # the response object, as GET returns it
    history: list[dict[str, Any]]  # the conversation as chat messages, its output included
    size: int


class ResponseStore:
    """Responses kept for previous_response_id: at most `max_entries` of them and `max_bytes` of their
    conversations (as JSON), the least recently used dropped first."""

    def __init__(self, max_entries: int = 1024, max_bytes: int = 64 << 20) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.size = 0
        self.lock = threading.Lock()

    def get(self, response_id: str) -> Stored | None:
        with self.lock:
            entry = self.entries.get(response_id)
            if entry is not None:
                self.entries.move_to_end(response_id)
            return entry

    def put(self, response_id: str, response: dict[str, Any], history: list[dict[str, Any]]) -> None:
        size = len(json.dumps(history)) + len(json.dumps(response))
        if size > self.max_bytes:
            return
        with self.lock:
            self.entries[response_id] = Stored(response, history, size)
            self.size += size
            while len(self.entries) > self.max_entries or self.size > self.max_bytes:
                _, dropped = self.entries.popitem(last=False)
                self.size -= dropped.size


# -- the request --------------------------------------------------------------------------------


class _Lenient(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(default=None, max_length=65536)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _small_schema(self) -> "FunctionTool":
        if len(json.dumps(self.parameters)) > MAX_TOOL_SCHEMA_BYTES:
            raise ValueError(f"tool {self.name!r}: parameters are over {MAX_TOOL_SCHEMA_BYTES} bytes as JSON")
        return self


class NamedFunctionChoice(_Lenient):
    type: Literal["function"]
    name: str


class Reasoning(_Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class ResponsesRequest(_Lenient):
    model: str | None = Field(default=None, max_length=256)
    input: str | list[dict[str, Any]] = Field(max_length=MAX_INPUT_ITEMS)
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None  # a vLLM extra, in the client's extra_body
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(default=None, max_length=MAX_ID_LENGTH)
    reasoning: Reasoning | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            tools = data.get("tools")
            if isinstance(tools, list):
                for i, tool in enumerate(tools):
                    if isinstance(tool, dict) and tool.get("type") != "function":
                        raise ValueError(f"tools.{i}: tools of type {tool.get('type')!r} are not supported; this "
                                         "server runs function tools")
            return {k: v for k, v in data.items() if v is not None}
        return data

    def chat_request(self, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
        """(the chat request, the conversation without instructions: what a stored response keeps)."""
        names = {t.name for t in self.tools or []}
        conversation = list(history) + _messages(self.input, names, _call_ids(history))
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else []) \
            + conversation
        kwargs = {}
        if self.reasoning is not None and self.reasoning.effort is not None:
            kwargs["enable_thinking"] = self.reasoning.effort != "none"
        fields: dict[str, Any] = {
            "messages": messages, "max_tokens": self.max_output_tokens, "stream": self.stream,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
            "logit_bias": self.logit_bias,
            "chat_template_kwargs": kwargs or None, "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description,
                "parameters": t.parameters or {"type": "object", "properties": {}}}} for t in self.tools]
            choice = self.tool_choice or "auto"
            if isinstance(choice, NamedFunctionChoice):
                choice = {"type": "function", "function": {"name": choice.name}}
            fields["tool_choice"] = choice
        elif self.tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice forces a call, but no tools were given")
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None}), conversation
        except ValidationError as e:
            first = e.errors()[0]
            raise InvalidRequestError(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def _call_ids(history: list[dict[str, Any]]) -> set[str]:
    return {c["id"] for m in history for c in m.get("tool_calls") or []}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}.content.{j}: parts of type {kind!r} are not supported (this server "
                                      "reads input_text and output_text)")
        parts.append(part["text"])
    return "".join(parts)


def _string(item: dict[str, Any], key: str, where: str, limit: int | None = None) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value and key != "output" or limit and len(value) > limit:
        raise InvalidRequestError(f"{where}.{key} must be a non-empty string" + (f" of at most {limit} characters"
                                                                                 if limit else ""))
    return value


def _messages(items: str | list[dict[str, Any]], names: set[str], known_calls: set[str]) -> list[dict[str, Any]]:
    """Input items -> chat messages. A function_call joins the assistant message before it; a
    function_call_output must answer a call made earlier; a reasoning item goes with the next
    assistant message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(f"{where}.role must be user, assistant, system or developer")
            message = {"role": "system" if role == "developer" else role, "content": _text(item.get("content"), where)}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = "".join(reasoning), []
            messages.append(message)
        elif kind == "function_call":
            name = _string(item, "name", where, 64)
            if name not in names:
                raise InvalidRequestError(f"{where}: function_call names the function {name!r}, which is not in tools")
            call_id = _string(item, "call_id", where, MAX_ID_LENGTH)
            arguments = _string(item, "arguments", where)
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            if reasoning:
                messages[-1]["reasoning_content"], reasoning = "".join(reasoning), []
            messages[-1].setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
            known_calls.add(call_id)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where, MAX_ID_LENGTH)
            if call_id not in known_calls:
                raise InvalidRequestError(f"{where}: function_call_output answers call_id {call_id!r}, which no "
                                          "earlier function_call has")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": output if isinstance(output, str) else _text(output, where)})
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list):
                raise InvalidRequestError(f"{where}.content must be a list of reasoning_text parts")
            reasoning += [p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        else:
            raise InvalidRequestError(f"{where}: input items of type {kind!r} are not supported (this server reads "
                                      "message, function_call, function_call_output and reasoning)")
    if not messages:
        raise InvalidRequestError("input has no message")
    return messages


# -- the route ----------------------------------------------------------------------------------


@router.post("/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    state = serving_state(request, body.model)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = state.responses.get(body.previous_response_id)
        if previous is None:
            raise APIError(404, f"no stored response has the id {body.previous_response_id!r} (responses are kept "
                           "in memory, a bounded number of them)", param="previous_response_id",
                           code="previous_response_not_found")
        history = previous.history
    chat, conversation = body.chat_request(history)
    reply = prepare_reply(state, "resp", chat)
    answer = Answer(body, state.model_name, reply, conversation)
    if body.stream:
        streams = start_reply(state, reply)
        return EventStreamResponse(answer.events(run_reply(request, state, reply, streams), state), streams)
    whole = await gather_reply(request, state, reply)
    response = answer.response(whole, answer.items(whole.events))
    answer.store(state, whole, response)
    return JSONResponse(response)


@router.get("/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    stored = server_state(request).responses.get(response_id)
    if stored is None:
        raise APIError(404, f"no stored response has the id {response_id!r}", code="not_found")
    return JSONResponse(stored.response)


class Answer:
    """One response's objects: its items, the response, its events and what the store keeps."""

    def __init__(self, body: ResponsesRequest, model: str, reply: PreparedReply,
                 conversation: list[dict[str, Any]]) -> None:
        self.body, self.model, self.reply, self.conversation = body, model, reply, conversation
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())

    def items(self, events: list[Event]) -> list[dict[str, Any]]:
        return [self._item(e) for e in events]

    def _item(self, event: Event, done: bool = True) -> dict[str, Any]:
        status = "completed" if done else "in_progress"
        if isinstance(event, Call):
            return {"type": "function_call", "id": "fc_" + event.id.removeprefix("call_"), "call_id": event.id,
                    "name": event.name, "arguments": event.arguments if done else "", "status": status}
        item_id = ("rs_" if event.kind == "reasoning" else "msg_") + uuid.uuid4().hex[:24]
        if event.kind == "reasoning":
            return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": event.text}] if done else []}
        return {"type": "message", "id": item_id, "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": event.text, "annotations": []}] if done else []}

    def response(self, whole: Reply | None, output: list[dict[str, Any]]) -> dict[str, Any]:
        cut = whole is not None and whole.finish_reason == "length"
        status = "in_progress" if whole is None else "incomplete" if cut else "completed"
        body = self.body
        tool_choice = body.tool_choice or "auto"
        usage = None
        if whole is not None:
            prompt = self.reply.job.num_prompt_tokens
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": whole.num_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": prompt + whole.num_tokens}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "store": body.store, "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "text": {"format": {"type": "text"}}, "metadata": body.metadata or {}, "usage": usage,
        }

    def store(self, state: Any, whole: Reply, response: dict[str, Any]) -> None:
        if not self.body.store:
            return
        message: dict[str, Any] = {"role": "assistant", "content": whole.text("content")}
        if whole.text("reasoning"):
            message["reasoning_content"] = whole.text("reasoning")
        if whole.calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in whole.calls]
        state.responses.put(self.id, response, self.conversation + [message])

    async def events(self, steps: AsyncIterator[ReplyStep], state: Any) -> AsyncIterator[str]:
        seq = 0

        def sse(kind: str, **data: Any) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

        yield sse("response.created", response=self.response(None, []))
        yield sse("response.in_progress", response=self.response(None, []))
        whole, done = Reply(), []  # done: the finished items
        item, text = None, ""  # the open text item, and its text so far
        try:
            async with aclosing(steps):
                async for step in steps:
                    whole.add(step)
                    for event in step.events:
                        if item is not None and isinstance(event, Text) and event.kind == _kind(item):
                            text += event.text
                            yield self._text_delta(sse, item, len(done), event.text)
                            continue
                        if item is not None:
                            for chunk in self._close(sse, item, len(done), text):
                                yield chunk
                            done.append(_finished(item, text))
                            item = None
                        if isinstance(event, Call):
                            for chunk in self._call(sse, event, len(done)):
                                yield chunk
                            done.append(self._item(event))
                        else:
                            item, text = self._item(event, done=False), event.text
                            yield sse("response.output_item.added", output_index=len(done), item=item)
                            if event.kind == "content":
                                yield sse("response.content_part.added", item_id=item["id"], output_index=len(done),
                                          content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                            yield self._text_delta(sse, item, len(done), event.text)
        except Exception as error:
            log.exception("%s: failed", self.id)
            failed = self.response(None, done) | {"status": "failed", "error": {"code": "server_error",
                                                                                "message": str(error)}}
            yield sse("response.failed", response=failed)
            return
        if item is not None:
            for chunk in self._close(sse, item, len(done), text):
                yield chunk
            done.append(_finished(item, text))
        response = self.response(whole, done)
        self.store(state, whole, response)
        yield sse("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                  response=response)

    @staticmethod
    def _text_delta(sse, item: dict[str, Any], index: int, delta: str) -> str:
        kind = "response.reasoning_text.delta" if item["type"] == "reasoning" else "response.output_text.delta"
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        return sse(kind, item_id=item["id"], output_index=index, content_index=0, delta=delta, **extra)

    @staticmethod
    def _close(sse, item: dict[str, Any], index: int, text: str) -> list[str]:
        finished = _finished(item, text)
        if item["type"] == "reasoning":
            out = [sse("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                       text=text)]
        else:
            part = {"type": "output_text", "text": text, "annotations": []}
            out = [sse("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                       text=text, logprobs=[]),
                   sse("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                       part=part)]
        return out + [sse("response.output_item.done", output_index=index, item=finished)]

    def _call(self, sse, call: Call, index: int) -> list[str]:
        added = self._item(call, done=False)
        return [sse("response.output_item.added", output_index=index, item=added),
                sse("response.function_call_arguments.delta", item_id=added["id"], output_index=index,
                    delta=call.arguments),
                sse("response.function_call_arguments.done", item_id=added["id"], output_index=index,
                    name=call.name, arguments=call.arguments),
                sse("response.output_item.done", output_index=index, item=self._item(call))]


def _kind(item: dict[str, Any]) -> str:
    return "reasoning" if item["type"] == "reasoning" else "content"


def _finished(item: dict[str, Any], text: str) -> dict[str, Any]:
    if item["type"] == "reasoning":
        return item | {"status": "completed", "content": [{"type": "reasoning_text", "text": text}]}
    return item | {"status": "completed", "content": [{"type": "output_text", "text": text, "annotations": []}]}
