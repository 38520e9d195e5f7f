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

from collections.abc import Sequence

import jinja2
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


class ChatTemplate:
    """A compiled chat template for one tokenizer (a broken template fails here, at start-up)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.source = tokenizer.chat_template or PLAIN_TEMPLATE
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(self.source)

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[Tool] = ()) -> str:
        """The prompt text; a template that rejects the conversation raises InvalidRequestError. Tools
        go in as HF passes them (`tools`: a list of {"type": "function", "function": {...}}, None if none)."""
        try:
            return self._template.render(
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
