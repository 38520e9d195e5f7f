"""Choice deltas -> an endpoint's answer: server-sent events as they come, or one aggregated response.
How each endpoint spells its chunks is its `ResponseFormat` (completions.py, chat_completions.py)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from kvgen.async_llm import RequestStream
from kvgen.server.jobs import Choice, ChoiceDelta, Job, close_streams, open_streams, run_job
from kvgen.server.protocol import ErrorInfo, ErrorResponse, SamplingRequest, Usage
from kvgen.server.state import ServerState, json_response

log = logging.getLogger("kvgen.server")

_SSE_DONE = "data: [DONE]\n\n"


class ResponseFormat(Protocol):
    """How one endpoint spells choices: streamed chunks, or one aggregated response."""

    def opening(self, index: int) -> BaseModel | None:
        """The chunk a streamed choice starts with, if any."""

    def chunk(self, delta: ChoiceDelta) -> BaseModel | None:
        """The streamed chunk of a delta; None where the format holds it back."""

    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    def response(self, choices: Sequence[Choice], usage: Usage) -> BaseModel: ...


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def respond(request: Request, state: ServerState, job: Job, fmt: ResponseFormat,
                  body: SamplingRequest) -> Response:
    """Adds the job's prompts to the engine at once (so the next request's admission counts them), then
    answers: the streams are closed however the answer ends, even a stream that never started."""
    streams = open_streams(state, job)
    deltas = run_job(request, state, job, streams)
    if body.stream:
        return EventStreamResponse(_event_stream(deltas, job, fmt, body.include_usage), streams)
    choices = [Choice(i) for i in range(job.num_choices)]
    try:
        async with aclosing(deltas):
            async for delta in deltas:
                choices[delta.index].add(delta)
    finally:
        close_streams(streams)
    return json_response(fmt.response(choices, job.usage(choices)))


class EventStreamResponse(StreamingResponse):
    """Server-sent events that close the job's streams when the response ends, also when the client
    left before the first event (Starlette then never starts the body iterator)."""

    def __init__(self, events: AsyncIterator[str], streams: Sequence[RequestStream]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close_streams(self.streams)


async def _event_stream(deltas: AsyncIterator[ChoiceDelta], job: Job, fmt: ResponseFormat,
                        include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: the openings, a chunk per delta, the usage chunk if asked for, [DONE]."""
    choices = [Choice(i) for i in range(job.num_choices)]
    for choice in choices:
        if (opening := fmt.opening(choice.index)) is not None:
            yield _sse(opening)
    try:
        async with aclosing(deltas):
            async for delta in deltas:
                choices[delta.index].add(delta)
                if (chunk := fmt.chunk(delta)) is not None:
                    yield _sse(chunk)
    except Exception as error:  # the engine failed mid-stream: the status is sent, so say it in the stream
        log.exception("%s: failed", job.request_id)
        yield _sse(ErrorResponse(error=ErrorInfo(message=str(error), type="server_error")))
    else:
        if include_usage:
            yield _sse(fmt.usage_chunk(job.usage(choices)))
    yield _SSE_DONE
