"""One conversation with the engine: its messages, the prompt they render to, one reply at a time.

The prompt is the model's chat template over the system message and the turns that fit (the same
rendering as the server's /v1/chat/completions, kvgen.server.chat). A model without a template
(stories260K) gets the server's plain fallback, "<|role|>" lines; its replies also stop at
PLAIN_STOP, where a model that knows no turns would start writing the user's next one.

When the prompt and the reply's `max_tokens` no longer fit the context (the engine's own check), the
oldest turns leave the prompt, for good: `dropped_turns` counts them. They stay in the transcript.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from kvgen.engine.admission import AdmittedRequest
from kvgen.engine.base import Engine
from kvgen.errors import InvalidRequestError, KVGenError
from kvgen.sampling_params import SamplingParams
from kvgen.scheduling.sequence import RequestOutput
from kvgen.server.chat import ChatTemplate
from kvgen.server.protocol import ChatMessage

PLAIN_STOP = "<|user|>"


@dataclass(frozen=True)
class ReplyStats:
    """What `/stats` shows of the last reply."""

    prompt_tokens: int
    reply_tokens: int
    ttft_s: float | None
    decode_tokens_per_s: float | None  # after the first token, as `generate --json` counts it
    kv_blocks_used: int  # the most in use at any step of the reply
    kv_blocks_total: int
    stopped: bool  # cut short by the user


class ChatSession:
    """A conversation on an engine. `reply(text)` adds the user's turn and streams the answer."""

    def __init__(self, engine: Engine, params: SamplingParams, system: str | None = None) -> None:
        self.engine = engine
        self.template = ChatTemplate(engine.tokenizer)
        if engine.tokenizer.chat_template is None:
            params = dataclasses.replace(params, stop=[*params.stop, PLAIN_STOP])
        self.params = params
        self.system = system or None
        self.messages: list[ChatMessage] = []  # user and assistant turns, the whole conversation
        self.first_kept = 0  # the oldest message still in the prompt
        self.dropped_turns = 0
        self.last_prompt = ""  # the last prompt as rendered
        self.last_stats: ReplyStats | None = None
        self._ids = itertools.count()

    def reset(self) -> None:
        """Forgets the turns (the system message stays)."""
        self.messages.clear()
        self.first_kept = self.dropped_turns = 0
        self.last_stats = None

    def set_system(self, text: str) -> None:
        """The system message from the next turn on; empty text removes it."""
        self.system = text or None

    def transcript(self) -> dict:
        """The conversation as /v1/chat/completions takes it: {"messages": [...]}, system first."""
        return {"messages": [m.template_fields() for m in self._with_system(self.messages)]}

    def reply(self, text: str) -> Iterator[str]:
        """Adds the user's turn and returns the reply's text as it is generated, a piece per engine
        step. The prompt is built here (raises InvalidRequestError, the turn taken back, if the turn
        alone does not fit); closing the stream early stops the reply, which keeps what it said."""
        self.messages.append(ChatMessage(role="user", content=text))
        try:
            admitted = self._fitting_prompt()
            request_id = f"chat-{next(self._ids)}"
            self.engine.add_admitted(request_id, admitted)
        except KVGenError:
            self.messages.pop()
            raise
        return self._stream(request_id, len(admitted.token_ids))

    def _stream(self, request_id: str, prompt_tokens: int) -> Iterator[str]:
        text, final, peak = "", None, 0
        try:
            while final is None or not final.finished:
                final = next((o for o in self.engine.step() if o.request_id == request_id), final)
                peak = max(peak, self.engine.stats().kv_blocks_used)
                if final is not None:
                    piece = final.outputs[0].new_text
                    text += piece
                    yield piece
            if final.error is not None:
                raise KVGenError(f"the reply failed: {final.error}")
        finally:
            stopped = final is None or not final.finished
            if stopped:
                self.engine.abort(request_id)
            self.messages.append(ChatMessage(role="assistant", content=text))
            self.last_stats = self._stats(final, prompt_tokens, peak, stopped)

    def _stats(self, out: RequestOutput | None, prompt_tokens: int, peak: int, stopped: bool) -> ReplyStats:
        metrics = out.metrics if out is not None else None
        per_token = metrics.mean_time_per_output_token if metrics else None
        return ReplyStats(prompt_tokens=prompt_tokens, reply_tokens=len(out.token_ids) if out else 0,
                          ttft_s=metrics.ttft if metrics else None,
                          decode_tokens_per_s=1 / per_token if per_token else None,
                          kv_blocks_used=peak, kv_blocks_total=self.engine.stats().kv_blocks_total, stopped=stopped)

    def _fitting_prompt(self) -> AdmittedRequest:
        """The prompt admitted (kvgen.engine.admission), the oldest turns dropped until the engine takes
        it with the reply's max_tokens; the newest turn alone that does not fit raises InvalidRequestError."""
        while True:
            self.last_prompt = self.template.render(self._with_system(self.messages[self.first_kept:]))
            prompt_ids = self.template.encode(self.last_prompt)
            try:
                return self.engine.admission.admit(prompt_ids, self.params)
            except InvalidRequestError as e:
                if self.first_kept == len(self.messages) - 1:
                    raise InvalidRequestError(f"the message does not fit the context: {e}") from None
                self._drop_oldest_turn()

    def _drop_oldest_turn(self) -> None:
        """Moves the prompt's start past one user message and what followed it, up to the next."""
        self.first_kept += 1
        while self.messages[self.first_kept].role != "user":
            self.first_kept += 1
        self.dropped_turns += 1

    def _with_system(self, messages: list[ChatMessage]) -> list[ChatMessage]:
        return [ChatMessage(role="system", content=self.system), *messages] if self.system else list(messages)
