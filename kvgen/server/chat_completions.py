"""POST /v1/chat/completions: the messages through the model's chat template (kvgen.server.chat),
assistant messages back, with chat logprobs and tool calls."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel

from kvgen.server.chat_parsed import ParsedChatFormat
from kvgen.server.jobs import Choice, ChoiceDelta, Job, TokenLogprob, prepare_job
from kvgen.server.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
    ChatLogprobs, ChatResponseMessage, ChatTokenLogprob, TopLogprob, Usage,
)
from kvgen.server.responses import respond
from kvgen.server.state import check_api_key, serving_state
from kvgen.server.tools import (Tool, ToolCallDelta, ToolChoice, may_become_tool_call, parse_tool_calls,
                                template_tools)

router = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = serving_state(request, body.model)
    state.admit(body, 1)
    tools = body.tools or []
    prompt = state.chat_template.render(body.messages, template_tools(tools, body.effective_tool_choice), body.chat_template_kwargs)
    job = prepare_job(state, "chatcmpl", [state.chat_template.encode(prompt)], body)
    fmt = ChatFormat(job, state.model_name, tools, body.effective_tool_choice)
    if state.reasoning_parser is not None or state.tool_parser != "json":  # the model's own format
        fmt = ParsedChatFormat(fmt, job, state, body, prompt)
    return await respond(request, state, job, fmt, body)


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
