"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens.

The request becomes the chat request it means (anthropic_protocol), runs on the shared reply path
(replies.py: the model's template, its reasoning and tool-call parsers), and is answered as content
blocks: thinking, text and tool_use, in the order the model wrote them. A stream follows Anthropic's
event sequence:

    message_start, ping,
    (content_block_start, content_block_delta..., content_block_stop) per block,
    message_delta (stop_reason, stop_sequence, usage.output_tokens), message_stop

Text and thinking stream as they come; a tool_use block's input arrives in one input_json_delta once
the call is complete. Errors have Anthropic's shape ({"type": "error", "error": {type, message}}),
mid-stream as an `error` event. Any `model` name is answered by the served model when the server has
one (agents such as Claude Code send their own names); with several, it picks one.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from kvgen.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from kvgen.server.parsers import Call, Event, Text
from kvgen.server.replies import Reply, ReplyStep, gather_reply, prepare_reply, run_reply, start_reply
from kvgen.server.responses import EventStreamResponse
from kvgen.server.state import APIError, ServerState, check_api_key, server_state
from kvgen.server.tools import template_tools

log = logging.getLogger("kvgen.server")
router = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_error(error: APIError) -> Response:
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": error.info.message}},
                        status_code=error.status, headers=error.headers)


def messages_state(request: Request, model: str) -> ServerState:
    return server_state(request)


@router.post("/messages")
async def messages(body: MessagesRequest, request: Request) -> Response:
    state = messages_state(request, body.model)
    reply = prepare_reply(state, "msg", body.chat_request())
    message_id = "msg_" + uuid.uuid4().hex[:24]
    stops = body.stop_sequences or []
    if body.stream:
        streams = start_reply(state, reply)
        return EventStreamResponse(_events(run_reply(request, state, reply, streams), message_id, body.model,
                                           reply.job.num_prompt_tokens, stops), streams)
    whole = await gather_reply(request, state, reply)
    blocks = [_block(e) for e in whole.events]
    return JSONResponse({"id": message_id, "type": "message", "role": "assistant", "model": body.model,
                         "content": blocks, **_stop(whole, stops),
                         "usage": {"input_tokens": reply.job.num_prompt_tokens, "output_tokens": whole.num_tokens}})


@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    state = messages_state(request, body.model)
    chat = body.chat_request()
    prompt = state.chat_template.render(chat.messages, template_tools(chat.tools, chat.effective_tool_choice), chat.chat_template_kwargs)
    return JSONResponse({"input_tokens": len(state.chat_template.encode(prompt))})


def _block(event: Event) -> dict[str, Any]:
    if isinstance(event, Call):
        return {"type": "tool_use", "id": _tool_use_id(event), "name": event.name, "input": json.loads(event.arguments)}
    if event.kind == "reasoning":
        return {"type": "thinking", "thinking": event.text, "signature": ""}
    return {"type": "text", "text": event.text}


def _tool_use_id(call: Call) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _stop(reply: Reply, stops: list[str]) -> dict[str, Any]:
    """stop_reason and stop_sequence (the engine does not say which stop string matched: named when
    only one was sent)."""
    if reply.calls and reply.finish_reason == "stop":
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if reply.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if reply.stopped_by_string:
        return {"stop_reason": "stop_sequence", "stop_sequence": stops[0] if len(stops) == 1 else None}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def _events(steps: AsyncIterator[ReplyStep], message_id: str, model: str, input_tokens: int,
                  stops: list[str]) -> AsyncIterator[str]:
    yield _sse("message_start", {"message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}})
    yield _sse("ping", {})
    whole = Reply()
    index, open_kind = -1, None  # the open block's index and kind (text / reasoning)
    try:
        async with aclosing(steps):
            async for step in steps:
                whole.add(step)
                for event in step.events:
                    if isinstance(event, Text) and event.kind == open_kind:
                        yield _sse("content_block_delta", {"index": index, "delta": _text_delta(event)})
                        continue
                    if open_kind is not None:
                        yield _sse("content_block_stop", {"index": index})
                    index += 1
                    if isinstance(event, Call):
                        block = _block(event)
                        yield _sse("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
                        yield _sse("content_block_delta", {"index": index, "delta": {
                            "type": "input_json_delta", "partial_json": event.arguments}})
                        yield _sse("content_block_stop", {"index": index})
                        open_kind = None
                    else:
                        yield _sse("content_block_start", {"index": index, "content_block": _block(Text(event.kind, ""))})
                        yield _sse("content_block_delta", {"index": index, "delta": _text_delta(event)})
                        open_kind = event.kind
    except Exception as error:  # the engine failed mid-stream: the status is sent, so say it in the stream
        log.exception("%s: failed", message_id)
        yield _sse("error", {"error": {"type": "api_error", "message": str(error)}})
        return
    if open_kind is not None:
        yield _sse("content_block_stop", {"index": index})
    yield _sse("message_delta", {"delta": _stop(whole, stops), "usage": {"output_tokens": whole.num_tokens}})
    yield _sse("message_stop", {})


def _text_delta(event: Text) -> dict[str, str]:
    if event.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": event.text}
    return {"type": "text_delta", "text": event.text}
