"""Chat completions read in the model's own format (kvgen.server.parsers): `reasoning_content` apart
from `content`, and tool calls as the model writes them (hermes tags, qwen3-xml, llama3 JSON, harmony)
turned into OpenAI tool_calls, streamed as they complete. Used when the server has a reasoning parser
or a tool-call format other than the generic JSON one (chat_completions.ChatFormat keeps that)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from kvgen.server.jobs import Choice, ChoiceDelta, Job
from kvgen.server.parsers import Call, Event, ReplyParser, Text
from kvgen.server.parsers.base import merge
from kvgen.server.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatResponseMessage,
    Usage,
)
from kvgen.server.replies import reply_parser
from kvgen.server.state import ServerState
from kvgen.server.tools import FunctionCall, ToolCall, ToolCallDelta


class ParsedChatFormat:
    """Spells chunks through `base` (chat_completions.ChatFormat: openings, logprobs, usage), reading
    the text with a ReplyParser per choice."""

    def __init__(self, base: Any, job: Job, state: ServerState, body: ChatCompletionRequest, prompt: str) -> None:
        self.base, self.job, self.model = base, job, state.model_name
        self._chunk, self._logprobs = base._chunk, base._logprobs
        self.new_parser = lambda: reply_parser(state, body, prompt)
        self.parsers: list[ReplyParser] = [self.new_parser() for _ in range(job.num_choices)]
        self.num_calls = [0] * job.num_choices

    def opening(self, index: int) -> BaseModel | None:
        return self.base.opening(index)

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self.base.usage_chunk(usage)

    def chunk(self, delta: ChoiceDelta) -> BaseModel | None:
        parser = self.parsers[delta.index]
        events = parser.feed(delta.text)
        if delta.finish_reason is not None:
            events = merge(events + parser.finish())
        finish = delta.finish_reason
        if finish == "stop" and (self.num_calls[delta.index] or any(isinstance(e, Call) for e in events)):
            finish = "tool_calls"
        content, reasoning, calls = self._split(events, self.num_calls[delta.index])
        self.num_calls[delta.index] += len(calls)
        if not (content or reasoning or calls or finish or (self.job.want_logprobs and delta.logprobs)):
            return None
        return self._chunk([ChatChunkChoice(
            index=delta.index, delta=ChatDelta(content=content, reasoning_content=reasoning, tool_calls=calls or None),
            logprobs=self._logprobs(delta.logprobs), finish_reason=finish)])

    def response(self, choices: Sequence[Choice], usage: Usage) -> BaseModel:
        out = []
        for c in choices:
            parser = self.new_parser()
            content, reasoning, calls = self._split(merge(parser.feed(c.text) + parser.finish()), 0)
            finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
            message = ChatResponseMessage(content=content if content or not calls else None, reasoning_content=reasoning,
                                          tool_calls=[ToolCall(id=d.id, function=d.function) for d in calls] or None)
            out.append(ChatChoice(index=c.index, message=message, logprobs=self._logprobs(c.logprobs),
                                  finish_reason=finish))
        return ChatCompletionResponse(id=self.job.request_id, created=self.job.created, model=self.model,
                                      usage=usage, choices=out)

    @staticmethod
    def _split(events: list[Event], first_call: int) -> tuple[str | None, str | None, list[ToolCallDelta]]:
        content = "".join(e.text for e in events if isinstance(e, Text) and e.kind == "content")
        reasoning = "".join(e.text for e in events if isinstance(e, Text) and e.kind == "reasoning")
        calls = [ToolCallDelta(index=first_call + i, id=e.id, function=FunctionCall(name=e.name, arguments=e.arguments))
                 for i, e in enumerate(e for e in events if isinstance(e, Call))]
        return content or None, reasoning or None, calls
