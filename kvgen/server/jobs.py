"""Running a request on the engine, the one path both generation endpoints share: the request is
validated and turned into a `Job` (prompt token ids + SamplingParams) before any response starts, so
a bad request always gets its 4xx status; `run_job` runs the job's prompts on the engine and yields
per-choice deltas (kvgen.server.responses turns them into the endpoint's chunks or response)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace

from fastapi import Request

from kvgen.async_llm import RequestStream
from kvgen.engine.admission import AdmittedRequest
from kvgen.engine.base import Prompt
from kvgen.sample.sampler import TokenLogprobs
from kvgen.sampling_params import SamplingParams
from kvgen.scheduling.sequence import CompletionOutput, RequestOutput
from kvgen.server.protocol import SamplingRequest, Usage
from kvgen.server.state import ServerState
from kvgen.tokenizer import Tokenizer

log = logging.getLogger("kvgen.server")


class RequestFailedError(Exception):
    """The engine failed a request (NaN logits, a fault in a step that ran it): a 500, or an error event
    in a stream that has started."""


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
    last_token_id: int | None = None  # the delta's last token (a stop token, or not: a stop string ended it)


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
    admitted: list[AdmittedRequest] = field(default_factory=list)  # one per prompt (kvgen.engine.admission)
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
    """Encodes the prompts (of a request within the server's limits), sizes max_tokens by the longest,
    and admits each prompt with the parameters, once (kvgen.engine.admission: a schema or regex that
    does not compile is a 400 too, before anything runs); raises InvalidRequestError."""
    admission, max_model_len = state.engine.admission, state.engine.max_model_len
    encoded = [admission.encode(p) for p in prompts]
    for prompt in encoded:
        state.limits.check_prompt_tokens(len(prompt.token_ids), max_model_len)
    longest = max(len(prompt.token_ids) for prompt in encoded)
    params = body.sampling_params(max_tokens_left=max(max_model_len - longest, 1))
    admitted = [admission.admit(prompt, params) for prompt in encoded]
    return Job(f"{id_prefix}-{uuid.uuid4().hex}", [a.token_ids for a in admitted], params, admitted)


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
                                          self._new_logprobs(c), c.finish_reason,
                                          last_token_id=c.new_token_ids[-1] if c.new_token_ids else None))
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


_END = object()


async def merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index of the stream, output) as outputs arrive from any stream. Closing the merge closes every
    stream, which aborts the requests still running, even one whose pump never got to iterate it."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
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
        close_streams(streams)


def open_streams(state: ServerState, job: Job) -> list[RequestStream]:
    """Adds every prompt of the job to the engine now, so the next request's admission counts them;
    if one cannot be added, those already added are aborted."""
    streams: list[RequestStream] = []
    try:
        for i, admitted in enumerate(job.admitted):
            streams.append(state.llm.submit(admitted, f"{job.request_id}-{i}"))
    except BaseException:
        close_streams(streams)
        raise
    return streams


def close_streams(streams: Sequence[RequestStream]) -> None:
    """Closes each stream; a request that has not finished is aborted (closing twice does nothing)."""
    for stream in streams:
        stream.close()


async def run_job(request: Request, state: ServerState, job: Job,
                  streams: Sequence[RequestStream]) -> AsyncIterator[ChoiceDelta]:
    """Runs the job's prompts (one opened stream each) and yields choice deltas as the engine produces
    them. Stops early (aborting what still runs) when the client has gone away; keeps the metrics and
    the request log."""
    trackers = [RequestTracker(job, i, state.engine.tokenizer) for i in range(len(job.prompts))]
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
