"""One assistant reply read in the model's own format: the path /v1/messages and /v1/responses share
(and chat completions, when the model reasons or has a tool-call format of its own).

`prepare_reply` renders a chat request through the model's template and validates it into a Job (any
4xx comes before an answer starts); `run_reply` runs it and yields `ReplyStep`s: the parser's events for
each engine delta, the last one with the finish reason. A non-streamed answer is the same steps
gathered (`gather_reply`), so streamed and non-streamed answers agree by construction.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request

from kvgen.async_llm import RequestStream
from kvgen.server.jobs import Job, close_streams, open_streams, prepare_job, run_job
from kvgen.server.parsers import Call, Event, ReplyParser, Text
from kvgen.server.parsers.base import merge
from kvgen.server.protocol import ChatCompletionRequest
from kvgen.server.state import ServerState
from kvgen.server.tools import NamedToolChoice, template_tools


@dataclass
class PreparedReply:
    job: Job
    prompt: str  # the rendered prompt text
    body: ChatCompletionRequest

    def parser(self, state: ServerState) -> ReplyParser:
        return reply_parser(state, self.body, self.prompt)


def prepare_reply(state: ServerState, id_prefix: str, body: ChatCompletionRequest,
                  clamp_max_tokens: bool = True) -> PreparedReply:
    """Admits, renders and validates the request. With `clamp_max_tokens` a max_tokens past the
    context is cut to what the prompt leaves (agents send 32000 whatever the model's context; the
    reply then ends with max_tokens / incomplete, as Anthropic's and OpenAI's own servers do)."""
    state.admit(body, 1)
    prompt = state.chat_template.render(body.messages, template_tools(body.tools, body.effective_tool_choice), body.chat_template_kwargs)
    ids = state.chat_template.encode(prompt)
    if clamp_max_tokens and body.max_tokens is not None:
        body.max_tokens = max(1, min(body.max_tokens, state.engine.max_model_len - len(ids)))
    return PreparedReply(prepare_job(state, id_prefix, [ids], body), prompt, body)


def reply_parser(state: ServerState, body: ChatCompletionRequest, prompt: str) -> ReplyParser:
    choice = body.effective_tool_choice
    tools = {t.function.name: t.function.parameters for t in body.tools or []} if choice != "none" else None
    forced = (choice.function.name if isinstance(choice, NamedToolChoice) else
              "" if choice == "required" else None)
    return ReplyParser(state.reasoning_parser, state.tool_parser, tools, forced=forced, prompt=prompt)


@dataclass
class ReplyStep:
    events: list[Event]
    num_tokens: int
    finish_reason: str | None = None  # the engine's: stop, length, ... (set on the last step)
    stopped_by_string: bool = False  # the last step ended on a stop string, not a stop token


@dataclass
class Reply:
    """A whole reply: its events in order (text merged by kind), its finish and token count."""

    events: list[Event] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stopped_by_string: bool = False

    def add(self, step: ReplyStep) -> None:
        self.events = merge(self.events + step.events)
        self.num_tokens += step.num_tokens
        if step.finish_reason is not None:
            self.finish_reason, self.stopped_by_string = step.finish_reason, step.stopped_by_string

    def text(self, kind: str) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Text) and e.kind == kind)

    @property
    def calls(self) -> list[Call]:
        return [e for e in self.events if isinstance(e, Call)]


def start_reply(state: ServerState, reply: PreparedReply) -> list[RequestStream]:
    """The reply's engine request, added now (so the next request's admission counts it)."""
    return open_streams(state, reply.job)


async def run_reply(request: Request, state: ServerState, reply: PreparedReply,
                    streams: list[RequestStream]) -> AsyncIterator[ReplyStep]:
    parser = reply.parser(state)
    stop_ids = set(reply.job.params.stop_token_ids or []) | set(state.engine.tokenizer.stop_token_ids)
    async with aclosing(run_job(request, state, reply.job, streams)) as deltas:
        async for delta in deltas:
            events = parser.feed(delta.text)
            if delta.finish_reason is None:
                yield ReplyStep(events, delta.num_tokens)
                continue
            by_string = (delta.finish_reason == "stop" and bool(reply.job.params.stop)
                         and delta.last_token_id not in stop_ids)
            yield ReplyStep(merge(events + parser.finish()), delta.num_tokens, delta.finish_reason, by_string)


async def gather_reply(request: Request, state: ServerState, reply: PreparedReply) -> Reply:
    """The whole reply at once (the streams are closed however it ends)."""
    streams = start_reply(state, reply)
    whole = Reply()
    try:
        async with aclosing(run_reply(request, state, reply, streams)) as steps:
            async for step in steps:
                whole.add(step)
    finally:
        close_streams(streams)
    return whole
