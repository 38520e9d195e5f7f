"""Chat templates: the plain fallback, and a model's own Jinja template (set on the real tok512 tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgen.errors import InvalidRequestError
from kvgen.loaders import load_tokenizer
from kvgen.server.chat import ChatTemplate
from kvgen.server.protocol import ChatMessage

# The shape of Llama 2's template: BOS written by the template, and roles checked.
LLAMA2_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% elif message['role'] == 'assistant' %} {{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('only user and assistant roles are supported') }}{% endif %}"
    "{% endfor %}"
)


@pytest.fixture
def tokenizer(stories_dir: Path):
    return load_tokenizer(stories_dir / "tok512.bin")


def messages(*turns: tuple[str, object]) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=content) for role, content in turns]


def test_plain_template(tokenizer):
    chat = ChatTemplate(tokenizer)
    conversation = messages(("system", "Be brief."), ("user", [{"type": "text", "text": "Hi"},
                                                               {"type": "text", "text": "there"}]))
    text = chat.render(conversation)
    assert text == "<|system|>\nBe brief.\n<|user|>\nHi\nthere\n<|assistant|>\n"
    assert chat.prompt_ids(conversation) == tokenizer.encode(text)
    assert chat.prompt_ids(conversation)[0] == tokenizer.bos_token_id


def test_model_template_writes_bos_once(tokenizer):
    tokenizer.chat_template = LLAMA2_STYLE
    chat = ChatTemplate(tokenizer)
    conversation = messages(("user", "Hi"), ("assistant", "Hello"), ("user", "Tell a story"))
    text = chat.render(conversation)
    assert text == "<s>[INST] Hi [/INST] Hello</s>[INST] Tell a story [/INST]"
    ids = chat.prompt_ids(conversation)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    with pytest.raises(InvalidRequestError, match="only user and assistant"):
        chat.render(messages(("system", "x")))
