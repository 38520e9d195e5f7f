"""POST /v1/completions: text choices, legacy logprobs (an echoed prompt's entries first), and vLLM's
prompt_logprobs."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel

from kvgen.server.jobs import Choice, ChoiceDelta, Job, TokenLogprob, prepare_job
from kvgen.server.protocol import (
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, PromptLogprob, Usage,
)
from kvgen.server.responses import respond
from kvgen.server.state import check_api_key, serving_state

router = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = serving_state(request, body.model)
    prompts = body.prompts()
    state.admit(body, len(prompts))
    job = prepare_job(state, "cmpl", prompts, body)
    if body.echo:
        job.echo = [p if isinstance(p, str) else state.engine.tokenizer.decode(p) for p in prompts]
    job.echo_only, job.prompt_logprobs = body.echo_only, body.prompt_logprobs
    return await respond(request, state, job, CompletionFormat(job, state.model_name), body)


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
