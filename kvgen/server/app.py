"""The OpenAI-compatible HTTP server over AsyncLLM: `create_app(engine, model_name=...)`.

    POST /v1/completions       POST /v1/chat/completions       GET /v1/models
    GET /health                GET /metrics (Prometheus)
    GET /dashboard             a live view of the KV cache (kvgen.server.dashboard), unless turned off

Both generation endpoints share one path: the request is validated and turned into a `Job` (prompt
token ids + SamplingParams) before any response starts, so a bad request always gets its 4xx status;
`run_job` runs the job's prompts on the engine and yields per-choice deltas; a `ResponseFormat` turns
deltas into the endpoint's streamed chunks or its aggregated response. All state lives on `app.state`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgen.async_llm import AsyncLLM
from kvgen.engine.base import Engine, Prompt
from kvgen.engine.llm_engine import LLMEngine
from kvgen.engine.sampling_params import SamplingParams
from kvgen.engine.sequence import CompletionOutput, RequestOutput
from kvgen.errors import InvalidRequestError
from kvgen.sampler import TokenLogprobs
from kvgen.server.chat import ChatTemplate
from kvgen.server.dashboard import routes as dashboard_routes
from kvgen.server.dashboard.source import DashboardSource
from kvgen.server.limits import DEFAULT_MAX_QUEUED_REQUESTS, LimitExceededError, RequestLimits
from kvgen.server.metrics import ServerMetrics
from kvgen.server.tools import Tool, ToolCallDelta, ToolChoice, may_become_tool_call, parse_tool_calls
from kvgen.server.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
    ChatLogprobs, ChatResponseMessage, ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionRequest,
    CompletionResponse, ErrorInfo, ErrorResponse, ModelCard, ModelList, PromptLogprob, SamplingRequest, TopLogprob,
    Usage,
)
from kvgen.tokenizer import Tokenizer

log = logging.getLogger("kvgen.server")

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
_SSE_DONE = "data: [DONE]\n\n"


# -- state and errors ---------------------------------------------------------------------------


@dataclass
class ServerState:
    llm: AsyncLLM
    model_name: str
    api_key: str | None
    metrics: ServerMetrics
    chat_template: ChatTemplate
    limits: RequestLimits
    max_queued_requests: int

    @property
    def engine(self) -> Engine:
        return self.llm.engine

    def admit(self, body: SamplingRequest, num_prompts: int) -> None:
        """Checks a request before any work is done on it: its fields against the server's limits
        (400), then backpressure: past `max_queued_requests` sequences waiting, a new request gets 429
        and Retry-After instead of growing the queue (as vLLM and TGI do)."""
        body.check_limits(self.limits, num_prompts)
        if self.llm.num_waiting() >= self.max_queued_requests:
            self.metrics.on_reject("queue_full")
            raise APIError(429, f"the server is busy: {self.max_queued_requests} requests are already queued; "
                           "retry later", type="server_busy", code="queue_full", headers={"Retry-After": "1"})


class APIError(Exception):
    """An error answered with an OpenAI-style error object and an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> Response:
        return _json(ErrorResponse(error=self.info), self.status, self.headers)


class RequestFailedError(Exception):
    """The engine failed a request (NaN logits, a fault in a step that ran it): a 500, or an error event
    in a stream that has started."""


def _json(model: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json", headers=headers)


def _state(request: Request) -> ServerState:
    return request.app.state.kvgen


def _serving_state(request: Request, model: str | None) -> ServerState:
    """The app's state, once the request names the served model (or none)."""
    state = _state(request)
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")
    return state


async def check_api_key(request: Request) -> None:
    key = _state(request).api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    async def invalid_request(request: Request, exc: InvalidRequestError) -> Response:
        if isinstance(exc, LimitExceededError):
            _state(request).metrics.on_reject("over_limit")
        return APIError(400, str(exc)).response()

    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        described = [_describe(e) for e in exc.errors()]
        message = "; ".join(f"{param}: {text}" if param else text for param, text in described)
        return APIError(400, message, param=described[0][0] if described else None).response()

    async def http_error(_: Request, exc: HTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail), type="invalid_request_error" if exc.status_code < 500
                        else "server_error").response()

    async def server_error(_: Request, exc: Exception) -> Response:
        return APIError(500, f"internal error: {exc}", type="server_error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(InvalidRequestError, invalid_request)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)


def _describe(error: dict) -> tuple[str | None, str]:
    """(the field, e.g. "messages.0.role", or None; what is wrong) of one pydantic validation error."""
    if error["type"] == "json_invalid":
        return None, f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}"
    param = ".".join(str(part) for part in error["loc"] if part != "body")
    return param or None, error["msg"]


class BodySizeLimit:
    """ASGI middleware: 413 for a body over `max_bytes`, by its Content-Length or by what arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body is over the server's limit of {self.max_bytes} bytes",
                         code="request_too_large")
        await error.response()(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out the already-read body once, then passes through (to see disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


# -- running a job on the engine ----------------------------------------------------------------


@dataclass
class TokenLogprob:
    """A token's text and log-probability, its most likely alternatives as (id, text, log-probability),
    and where the token's text starts in the choice. The first token of a scored prompt has no
    log-probability (nothing comes before it)."""

    token_id: int
    token: str
    logprob: float | None
    top: list[tuple[int, str, float]] | None
    text_offset: int
    rank: int | None = None

    def keep_top(self, k: int) -> "TokenLogprob":
        return self if self.top is None else replace(self, top=self.top[:k])


@dataclass
class ChoiceDelta:
    """What one step added to one choice; the first delta of a scored prompt carries its entries."""

    index: int
    text: str
    num_tokens: int
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class Choice:
    """One choice aggregated over its deltas."""

    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.num_tokens += delta.num_tokens
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


@dataclass
class Job:
    """A validated generation request: prompts (token ids) that each get `params.n` choices.

    `echo` holds the prompt texts the choices start with (None: no echo); `echo_only` drops what the
    engine generates (the one token it samples from the prompt's last row); `prompt_logprobs` is
    vLLM's count of alternatives per prompt token (None: not asked for)."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    echo: list[str] | None = None
    echo_only: bool = False
    prompt_logprobs: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts)

    @property
    def want_logprobs(self) -> bool:
        return self.params.logprobs is not None

    def usage(self, choices: Sequence[Choice]) -> Usage:
        completion = sum(c.num_tokens for c in choices)
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                     total_tokens=self.num_prompt_tokens + completion)


def prepare_job(state: ServerState, id_prefix: str, prompts: Sequence[Prompt], body: SamplingRequest) -> Job:
    """Encodes the prompts (of an admitted request) and checks they fit with the parameters; raises
    InvalidRequestError."""
    engine = state.engine
    token_ids = [engine.encode_prompt(p) for p in prompts]
    for ids in token_ids:
        state.limits.check_prompt_tokens(len(ids), engine.max_model_len)
    longest = max(len(ids) for ids in token_ids)
    params = body.sampling_params(max_tokens_left=max(engine.max_model_len - longest, 1))
    for ids in token_ids:
        engine.check_fits(len(ids), params)
    engine.compile_grammar(params)  # a schema or regex that does not compile is a 400 before anything runs
    return Job(f"{id_prefix}-{uuid.uuid4().hex}", token_ids, params)


class TokenTexts:
    """The text each token adds, decoded in the context of the tokens before it (so pieces keep their
    leading spaces). A token holding part of a multibyte character reads as U+FFFD."""

    WINDOW = 4

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int], offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.context = list(context_ids[-self.WINDOW:])
        self.offset = offset

    def entry(self, token_id: int, logprobs: TokenLogprobs | None) -> TokenLogprob:
        prefix = self.tokenizer.decode(self.context)
        token = self._text(prefix, token_id)
        if logprobs is None:
            entry = TokenLogprob(token_id, token, None, None, self.offset)
        else:
            top = [(alt, self._text(prefix, alt), value) for alt, value in logprobs.top.items()]
            entry = TokenLogprob(token_id, token, logprobs.token_logprob, top, self.offset, logprobs.rank)
        self.offset += len(token)
        self.context = (self.context + [token_id])[-self.WINDOW:]
        return entry

    def _text(self, prefix: str, token_id: int) -> str:
        return self.tokenizer.decode(self.context + [token_id])[len(prefix):]


class RequestTracker:
    """Turns the cumulative snapshots of one engine request (one prompt, n completions) into deltas;
    an echoed or scored prompt comes first, with the first snapshot (the prompt is scored by then)."""

    def __init__(self, job: Job, prompt_index: int, tokenizer: Tokenizer) -> None:
        n = job.params.n
        self.job, self.tokenizer = job, tokenizer
        self.first_index = prompt_index * n
        self.reported_finish = [False] * n
        self.prompt_ids = job.prompts[prompt_index]
        self.echo = job.echo[prompt_index] if job.echo is not None else None
        self.opened = self.echo is None and job.prompt_logprobs is None
        start = len(self.echo or "")
        self.token_texts = ([TokenTexts(tokenizer, self.prompt_ids, start) for _ in range(n)]
                            if job.want_logprobs else None)

    def deltas(self, out: RequestOutput) -> list[ChoiceDelta]:
        deltas = [] if self.opened else self._opening(out)
        self.opened = True
        for c in out.outputs:
            if self.reported_finish[c.index]:
                continue
            if self.job.echo_only:
                if c.finish_reason:
                    deltas.append(ChoiceDelta(self.first_index + c.index, "", 0, [], "length"))
            elif c.new_text or c.new_token_ids or c.finish_reason:
                deltas.append(ChoiceDelta(self.first_index + c.index, c.new_text, len(c.new_token_ids),
                                          self._new_logprobs(c), c.finish_reason))
            self.reported_finish[c.index] = c.finish_reason is not None
        return deltas

    def _opening(self, out: RequestOutput) -> list[ChoiceDelta]:
        """Each choice's echoed prompt (with its legacy logprobs) and vLLM prompt_logprobs."""
        scored = self._prompt_entries(out.prompt_logprobs) if out.prompt_logprobs is not None else []
        echoed = [e.keep_top(self.job.params.logprobs) for e in scored] if self.job.want_logprobs else []
        vllm = None if self.job.prompt_logprobs is None else [e.keep_top(self.job.prompt_logprobs) for e in scored]
        return [ChoiceDelta(self.first_index + i, self.echo or "", 0, echoed if self.echo is not None else [], None,
                            vllm) for i in range(self.job.params.n)]

    def _prompt_entries(self, logprobs: list[TokenLogprobs | None]) -> list[TokenLogprob]:
        texts = TokenTexts(self.tokenizer, [])
        return [texts.entry(t, lp) for t, lp in zip(self.prompt_ids, logprobs, strict=True)]

    def _new_logprobs(self, c: CompletionOutput) -> list[TokenLogprob]:
        if self.token_texts is None or not c.logprobs:
            return []
        start = len(c.logprobs) - len(c.new_token_ids)  # c.logprobs is a snapshot; c.token_ids is live
        texts = self.token_texts[c.index]
        return [texts.entry(t, lp) for t, lp in zip(c.new_token_ids, c.logprobs[start:])]


T = TypeVar("T")
_END = object()


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index of the stream, item) as items arrive from any stream. Closing the merge cancels the
    streams still running (an AsyncLLM stream aborts its request when cancelled)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
            queue.put_nowait((index, _END))
        except Exception as error:
            queue.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def run_job(request: Request, state: ServerState, job: Job) -> AsyncIterator[ChoiceDelta]:
    """Runs every prompt of the job and yields choice deltas as the engine produces them. Stops early
    (aborting what still runs) when the client has gone away; keeps the metrics and the request log."""
    trackers = [RequestTracker(job, i, state.engine.tokenizer) for i in range(len(job.prompts))]
    streams = [state.llm.generate(ids, job.params, f"{job.request_id}-{i}") for i, ids in enumerate(job.prompts)]
    unfinished = set(range(len(job.prompts)))
    state.metrics.on_start(job.num_prompt_tokens)
    try:
        async with aclosing(merge(streams)) as outputs:
            async for index, out in outputs:
                state.metrics.on_output(out)
                if out.finished:
                    unfinished.discard(index)
                    _log_finished(out)
                if out.error is not None:
                    raise RequestFailedError(out.error)
                for delta in trackers[index].deltas(out):
                    yield delta
                if await request.is_disconnected():
                    break
    finally:
        if unfinished:
            state.metrics.on_abort(len(unfinished) * job.params.n)
            log.info("%s: aborted (client went away)", job.request_id)


def _log_finished(out: RequestOutput) -> None:
    m = out.metrics
    ttft = f"{m.ttft:.3f} s" if m.ttft is not None else "-"
    log.info("%s: %d prompt tokens, %d output tokens, TTFT %s, total %.3f s", out.request_id,
             len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), ttft, m.e2e_latency or 0.0)


# -- response formats ---------------------------------------------------------------------------


class ResponseFormat(Protocol):
    """How one endpoint spells choices: streamed chunks, or one aggregated response."""

    def opening(self, index: int) -> BaseModel | None:
        """The chunk a streamed choice starts with, if any."""

    def chunk(self, delta: ChoiceDelta) -> BaseModel | None:
        """The streamed chunk of a delta; None where the format holds it back."""

    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    def response(self, choices: Sequence[Choice], usage: Usage) -> BaseModel: ...


class CompletionFormat:
    """/v1/completions: text choices, legacy logprobs (an echoed prompt's entries first), and vLLM's
    prompt_logprobs."""

    def __init__(self, job: Job, model: str) -> None:
        self.job, self.model = job, model

    def opening(self, index: int) -> BaseModel | None:
        return None

    def chunk(self, delta: ChoiceDelta) -> BaseModel:
        return self._message([self._choice(delta)])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._message([], usage)

    def response(self, choices: Sequence[Choice], usage: Usage) -> BaseModel:
        return self._message([self._choice(c) for c in choices], usage)

    def _message(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.job.request_id, created=self.job.created, model=self.model,
                                  choices=choices, usage=usage)

    def _choice(self, c: Choice | ChoiceDelta) -> CompletionChoice:
        return CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                logprobs=_legacy_logprobs(c.logprobs) if self.job.want_logprobs else None,
                                prompt_logprobs=_vllm_prompt_logprobs(c.prompt_logprobs))


def _legacy_logprobs(entries: list[TokenLogprob]) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=[e.token for e in entries], token_logprobs=[e.logprob for e in entries],
                              top_logprobs=[None if e.top is None else {t: v for _, t, v in e.top} for e in entries],
                              text_offset=[e.text_offset for e in entries])


def _vllm_prompt_logprobs(entries: list[TokenLogprob] | None) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's format: per prompt token, {token id: entry} for the alternatives and the token itself."""
    if entries is None:
        return None
    return [None if e.logprob is None else {
        **{str(i): PromptLogprob(logprob=v, rank=rank, decoded_token=t) for rank, (i, t, v) in enumerate(e.top, 1)},
        str(e.token_id): PromptLogprob(logprob=e.logprob, rank=e.rank, decoded_token=e.token),
    } for e in entries]


class ChatFormat:
    """/v1/chat/completions: assistant messages, chat logprobs. With tools (tool_choice other than
    none) a reply is read back as tool calls once it is complete, so a streamed reply that may become
    one is held until its end and sent as one delta: tool_calls and finish_reason "tool_calls", or
    its text if it is none. Under auto, a reply that can no longer be a call streams on as text."""

    def __init__(self, job: Job, model: str, tools: list[Tool], tool_choice: ToolChoice) -> None:
        self.job, self.model = job, model
        self.tools, self.tool_choice = tools, tool_choice
        self.holds_replies = bool(tools) and tool_choice != "none"
        self.held = [Choice(i) for i in range(job.num_choices)] if self.holds_replies else []
        self.released = [False] * job.num_choices  # held text sent as text: the rest streams through

    def opening(self, index: int) -> BaseModel | None:
        return self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])

    def chunk(self, delta: ChoiceDelta) -> BaseModel | None:
        if not self.holds_replies or self.released[delta.index]:
            return self._text_chunk(delta)
        held = self.held[delta.index]
        held.add(delta)
        if not may_become_tool_call(held.text, self.tool_choice):
            self.released[delta.index] = True
            return self._text_chunk(ChoiceDelta(held.index, held.text, held.num_tokens, held.logprobs,
                                                held.finish_reason))
        if delta.finish_reason is None:
            return None
        message, finish = self._message(held)
        calls = [ToolCallDelta(index=i, **c.model_dump()) for i, c in enumerate(message.tool_calls or [])]
        return self._chunk([ChatChunkChoice(index=held.index, delta=ChatDelta(content=message.content,
                                                                              tool_calls=calls or None),
                                            logprobs=self._logprobs(held.logprobs), finish_reason=finish)])

    def _text_chunk(self, delta: ChoiceDelta) -> BaseModel:
        return self._chunk([ChatChunkChoice(index=delta.index, delta=ChatDelta(content=delta.text),
                                            logprobs=self._logprobs(delta.logprobs),
                                            finish_reason=delta.finish_reason)])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def response(self, choices: Sequence[Choice], usage: Usage) -> BaseModel:
        replies = [(c, *self._message(c)) for c in choices]
        return ChatCompletionResponse(
            id=self.job.request_id, created=self.job.created, model=self.model, usage=usage,
            choices=[ChatChoice(index=c.index, message=message, logprobs=self._logprobs(c.logprobs),
                                finish_reason=finish) for c, message, finish in replies])

    def _message(self, c: Choice) -> tuple[ChatResponseMessage, str | None]:
        """A complete reply as the assistant's message, and its finish reason."""
        calls = (parse_tool_calls(c.text, self.tools, self.tool_choice)
                 if self.holds_replies and c.finish_reason == "stop" else None)
        if calls:
            return ChatResponseMessage(content=None, tool_calls=calls), "tool_calls"
        return ChatResponseMessage(content=c.text), c.finish_reason

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.job.request_id, created=self.job.created, model=self.model,
                                   choices=choices, usage=usage)

    def _logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs | None:
        if not self.job.want_logprobs:
            return None
        return ChatLogprobs(content=[
            ChatTokenLogprob(token=e.token, logprob=e.logprob, bytes=_utf8(e.token),
                             top_logprobs=[TopLogprob(token=t, logprob=v, bytes=_utf8(t)) for _, t, v in e.top])
            for e in entries])


def _utf8(text: str) -> list[int] | None:
    """The token's bytes; None where its text is only part of a character."""
    return None if "\ufffd" in text else list(text.encode("utf-8"))


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def respond(request: Request, state: ServerState, job: Job, fmt: ResponseFormat,
                  body: SamplingRequest) -> Response:
    deltas = run_job(request, state, job)
    if body.stream:
        return StreamingResponse(_event_stream(deltas, job, fmt, body.include_usage), media_type="text/event-stream")
    choices = [Choice(i) for i in range(job.num_choices)]
    async with aclosing(deltas):
        async for delta in deltas:
            choices[delta.index].add(delta)
    return _json(fmt.response(choices, job.usage(choices)))


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


# -- routes -------------------------------------------------------------------------------------

_open = APIRouter()
_api = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])


@_open.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@_open.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@_api.get("/models")
async def models(request: Request) -> Response:
    state = _state(request)
    return _json(ModelList(data=[ModelCard(id=state.model_name, max_model_len=state.engine.max_model_len)]))


@_api.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = _serving_state(request, body.model)
    prompts = body.prompts()
    state.admit(body, len(prompts))
    job = prepare_job(state, "cmpl", prompts, body)
    if body.echo:
        job.echo = [p if isinstance(p, str) else state.engine.tokenizer.decode(p) for p in prompts]
    job.echo_only, job.prompt_logprobs = body.echo_only, body.prompt_logprobs
    return await respond(request, state, job, CompletionFormat(job, state.model_name), body)


@_api.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = _serving_state(request, body.model)
    state.admit(body, 1)
    tools = body.tools or []
    job = prepare_job(state, "chatcmpl", [state.chat_template.prompt_ids(body.messages, tools)], body)
    return await respond(request, state, job, ChatFormat(job, state.model_name, tools, body.effective_tool_choice),
                         body)


# -- the app ------------------------------------------------------------------------------------


def create_app(engine: Engine | AsyncLLM, *, model_name: str, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, limits: RequestLimits | None = None,
               max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS, dashboard: bool = True) -> FastAPI:
    """The server's ASGI app over an engine (or an AsyncLLM already wrapping one). The dashboard needs
    the paged engine (the one-at-a-time reference has no block pool to show)."""
    llm = engine if isinstance(engine, AsyncLLM) else AsyncLLM(engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await llm.shutdown()

    app = FastAPI(title="kvgen", summary="OpenAI-compatible API over the kvgen engine", lifespan=lifespan)
    app.state.kvgen = ServerState(llm=llm, model_name=model_name, api_key=api_key,
                                  metrics=ServerMetrics(llm.engine), chat_template=ChatTemplate(llm.tokenizer),
                                  limits=limits or RequestLimits(), max_queued_requests=max_queued_requests)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    _add_error_handlers(app)
    app.include_router(_open)
    app.include_router(_api)
    if dashboard and isinstance(llm.engine, LLMEngine):
        app.state.dashboard = DashboardSource(llm, app.state.kvgen.metrics)
        app.include_router(dashboard_routes.page)
        app.include_router(dashboard_routes.data, dependencies=[Depends(check_api_key)])
    return app
