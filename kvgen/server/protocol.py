"""The OpenAI-compatible wire format: request and response models, and request -> SamplingParams.

Requests are validated strictly (a string where a number belongs is an error, not coerced); a field
sent as `null` counts as not sent, and fields kvgen does not know are ignored (as vLLM does).
Defaults of the sampling fields are SamplingParams' own: only fields the client sent are passed on.
"""

from __future__ import annotations

import json
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvgen.engine.base import Prompt
from kvgen.errors import InvalidRequestError
from kvgen.sample.grammar import GrammarSpec
from kvgen.sampling_params import SamplingParams
from kvgen.server.limits import RequestLimits, check_64_bit_integers
from kvgen.server.tools import Tool, ToolCall, ToolCallDelta, ToolChoice, tool_grammar

# Request fields copied into SamplingParams under the same name, when the client sent them.
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "ignore_eos", "stop_token_ids", "kv_policy",
                    "speculative")


MAX_TEMPLATE_KWARGS_BYTES = 4096

# -- requests -----------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON under a schema."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object with a schema")
        return self


class SamplingRequest(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(strict=True, extra="ignore")
    # Fields that would change what the client gets back and that kvgen does not honour here: a 400,
    # not silence.
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("guided_grammar", "guided_decoding_backend", "structured_outputs",
                                              "tools", "tool_choice", "functions", "function_call")

    model: str | None = None
    max_tokens: int | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    kv_policy: str | None = None
    speculative: bool | None = None  # false: opt out of the server's speculative decoding
    logit_bias: dict[str, float] | None = None
    # structured outputs: OpenAI's response_format, or one of vLLM's guided_* fields
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        unsupported = [name for name in cls.UNSUPPORTED if data.get(name) is not None]
        if unsupported:
            raise ValueError(f"{unsupported[0]} is not supported by this server")
        return {k: v for k, v in data.items() if v is not None}

    def grammar(self) -> GrammarSpec | None:
        """What the output must match, from whichever structured-output field was sent (at most one)."""
        specs = self._extra_grammars()
        if self.response_format is not None and self.response_format.type == "json_object":
            specs.append(GrammarSpec.json_object())
        elif self.response_format is not None and self.response_format.type == "json_schema":
            schema = self.response_format.json_schema
            specs.append(GrammarSpec.json_schema(schema.schema_, strict=bool(schema.strict)))
        if self.guided_json is not None:
            specs.append(GrammarSpec.json_schema(self.guided_json))
        if self.guided_regex is not None:
            specs.append(GrammarSpec.regex(self.guided_regex))
        if self.guided_choice is not None:
            specs.append(GrammarSpec.choice(self.guided_choice))
        if len(specs) > 1:
            raise InvalidRequestError("send one of response_format, guided_json, guided_regex, guided_choice "
                                      "and a tool_choice that forces a call")
        return specs[0] if specs else None

    def _extra_grammars(self) -> list[GrammarSpec]:
        """Grammars an endpoint's own fields ask for."""
        return []

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        """Top alternatives per token to return (0: the chosen token's only), None: no logprobs."""
        return None

    def prompt_logprobs_count(self) -> int | None:
        """Top alternatives per prompt token the engine scores (None: the prompt is not scored)."""
        return None

    def engine_max_tokens(self) -> int | None:
        """The engine's max_tokens: what the client asked for, unless the endpoint needs otherwise."""
        return self.requested_max_tokens()

    def check_limits(self, limits: RequestLimits, num_prompts: int) -> None:
        """Raises LimitExceededError for a field over the server's bound (before any work is done)."""
        check_64_bit_integers(self.model_dump(exclude_unset=True))
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        limits.check_counts(n=self.n or 1, num_prompts=num_prompts, max_tokens=self.requested_max_tokens(),
                            logprobs=self.logprobs_count(), prompt_logprobs=self.prompt_logprobs_count(), stop=stop,
                            stop_token_ids=self.stop_token_ids or [], logit_bias=self.logit_bias, grammar=self.grammar())

    def sampling_params(self, max_tokens_left: int) -> SamplingParams:
        """The engine's parameters; without max_tokens a request may use the rest of the context.

        Raises InvalidRequestError for values out of range.
        """
        fields = {name: getattr(self, name) for name in _SAMPLING_FIELDS if name in self.model_fields_set}
        max_tokens = self.engine_max_tokens()
        return SamplingParams(**fields, max_tokens=max_tokens_left if max_tokens is None else max_tokens,
                              logprobs=self.logprobs_count(), prompt_logprobs=self.prompt_logprobs_count(),
                              logit_bias=_token_biases(self.logit_bias), grammar=self.grammar())


def _token_biases(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's {"token id": bias} (JSON keys are strings) -> {token id: bias}."""
    if not logit_bias:
        return {}
    if not all(key.isascii() and key.isdigit() and len(key) <= 18 for key in logit_bias):
        raise InvalidRequestError("logit_bias keys must be token ids (decimal strings such as \"50256\")")
    return {int(key): bias for key, bias in logit_bias.items()}


class CompletionRequest(SamplingRequest):
    """With `echo`, each choice starts with its prompt and, with `logprobs`, the prompt's tokens and
    their log-probabilities (the first token's is null); `max_tokens: 0` then scores the prompt only
    (as lm-evaluation-harness asks). vLLM's `prompt_logprobs` returns the prompt's scores apart."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty_list(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt list is empty")
        return prompt

    def prompts(self) -> list[Prompt]:
        """One prompt per engine request: a string or a list of token ids each."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def logprobs_count(self) -> int | None:
        return self.logprobs

    @property
    def scores_echo(self) -> bool:
        """The echoed prompt carries log-probabilities."""
        return self.echo and self.logprobs is not None

    @property
    def echo_only(self) -> bool:
        """`max_tokens: 0` with echo: the prompt alone comes back, nothing is generated."""
        return self.echo and self.max_tokens == 0

    def prompt_logprobs_count(self) -> int | None:
        wanted = [k for k in (self.logprobs if self.scores_echo else None, self.prompt_logprobs) if k is not None]
        return max(wanted, default=None)

    def engine_max_tokens(self) -> int | None:
        # The token sampled from the prompt's last row costs no forward pass; it is dropped.
        return 1 if self.echo_only else self.max_tokens


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None
    reasoning_content: str | None = None  # an assistant's earlier reasoning (templates that keep it read it)

    def template_fields(self) -> dict[str, Any]:
        """The message as chat templates read it (HF's layout: tool_calls with arguments as objects)."""
        fields: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            fields["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            fields["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            fields["name"] = self.name
        if self.reasoning_content is not None:
            fields["reasoning_content"] = self.reasoning_content
        return fields

    def text(self) -> str:
        """The content as one string; text parts are joined with newlines (as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class ChatCompletionRequest(SamplingRequest):
    UNSUPPORTED: ClassVar[tuple[str, ...]] = tuple(f for f in SamplingRequest.UNSUPPORTED
                                                   if f not in ("tools", "tool_choice"))

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # more variables for the chat template, as vLLM takes them: {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _small_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        if kwargs is not None and len(json.dumps(kwargs)) > MAX_TEMPLATE_KWARGS_BYTES:
            raise ValueError(f"chat_template_kwargs is over {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON")
        if kwargs and any(k in ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token") for k in kwargs):
            raise ValueError("chat_template_kwargs may not set messages, tools, add_generation_prompt or the tokens")
        return kwargs

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """OpenAI's default: auto with tools, none without."""
        return self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")

    def _extra_grammars(self) -> list[GrammarSpec]:
        spec = tool_grammar(self.tools or [], self.effective_tool_choice, self.parallel_tool_calls)
        return [spec] if spec is not None else []

    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported on chat completions; send the prompt to /v1/completions")
        return echo

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


# -- responses ----------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token (an echoed prompt's first
    token has null log-probabilities: nothing comes before it)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry for one token of `prompt_logprobs`; `rank` 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM: per prompt token, None for the first, else {token id: entry} for it and its alternatives
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvgen"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
