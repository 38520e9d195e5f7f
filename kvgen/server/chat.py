"""Chat messages -> prompt token ids, with the model's own chat template or a plain fallback.

A model that ships a Jinja chat template (`tokenizer.chat_template`, from tokenizer_config.json or
GGUF metadata) gets it rendered as Hugging Face does: with `messages`, `bos_token`, `eos_token` and
`add_generation_prompt=True`, in a sandbox. A model without one (such as stories260K) gets
PLAIN_TEMPLATE: one "<|role|>" line before each message and "<|assistant|>" at the end (with tools, a
"<|tools|>" line listing their names comes first, and an assistant's earlier tool calls follow its
content as JSON):

    <|system|>
    You are terse.
    <|user|>
    Hello!
    <|assistant|>

"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvgen.errors import InvalidRequestError
from kvgen.server.protocol import ChatMessage
from kvgen.server.tools import Tool
from kvgen.tokenizer import Tokenizer

PLAIN_TEMPLATE = (
    "{% if tools %}<|tools|>\n{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}\n"
    "{% endif %}"
    "{% for message in messages %}<|{{ message.role }}|>\n"
    "{{ message.content ~ (message.tool_calls | tojson if message.tool_calls else '') }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """transformers' tojson: plain json.dumps, keys in their order, nothing HTML-escaped (Jinja's own
    sorts the keys and writes < as \\u003c, so a tool's schema would reach the model unlike in training)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template for one tokenizer (a broken template fails here, at start-up)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.source = tokenizer.chat_template or PLAIN_TEMPLATE
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        self._template = env.from_string(self.source)

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[Tool] = (),
               extra: Mapping[str, Any] | None = None) -> str:
        """The prompt text; a template that rejects the conversation raises InvalidRequestError. Tools
        go in as HF passes them (`tools`: a list of {"type": "function", "function": {...}}, None if none);
        `extra` are more variables for the template (chat_template_kwargs, such as enable_thinking)."""
        try:
            return self._template.render(
                **(extra or {}),
                messages=[m.template_fields() for m in messages],
                tools=[t.model_dump(exclude_none=True) for t in tools] or None,
                bos_token=self.tokenizer.bos_token or "", eos_token=self.tokenizer.eos_token or "",
                add_generation_prompt=True,
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"the chat template rejected the messages: {e}") from None

    def prompt_ids(self, messages: Sequence[ChatMessage], tools: Sequence[Tool] = ()) -> list[int]:
        """Token ids of the rendered prompt."""
        return self.encode(self.render(messages, tools))

    def encode(self, text: str) -> list[int]:
        """Token ids of a rendered prompt; BOS is added unless the template already wrote it."""
        bos = self.tokenizer.bos_token
        return self.tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos)))
