"""Qwen3.5's chat from its GGUF: the Jinja chat template the file carries (Qwen3.5's ChatML turns and
its generation prompt, which opens <think> unless enable_thinking is false) renders the prompt,
`--reasoning-parser auto` picks the think parser for it, and /v1/chat/completions keeps the thinking
apart from the answer. The random fixture's GGUF gets the template and two of its vocabulary's
tokens renamed <think> and </think>."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvgen import LLM, SamplingParams
from kvgen.server.app import create_app
from kvgen.server.chat import ChatTemplate
from kvgen.server.parsers import resolve_reasoning_parser
from kvgen.server.protocol import ChatMessage
from tests.loaders.arch_fixtures import arch_checkpoint
from tests.loaders.gguf_builder import rewrite_gguf
from tests.server.harness import API_KEY, running

THINK, END = 3, 4
USER_DEFINED = 4  # llama.cpp's token type of a token that is text, not a control token
# Qwen3.5-4B's template (llama.cpp's models/templates/Qwen3.5-4B.jinja) without its tools and images.
TEMPLATE = """{%- for message in messages %}
    {%- if message.role == "system" or message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}"""
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
SAMPLING = {"temperature": 1.0, "seed": 7, "max_tokens": 24}
BIAS = {str(END): 6.0}  # </think> likely enough that the random model closes its thinking a few tokens in


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    import gguf

    source = arch_checkpoint("qwen35").gguf
    reader = gguf.GGUFReader(source)
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    tokens[THINK], tokens[END] = "<think>", "</think>"
    types[THINK] = types[END] = USER_DEFINED
    path = rewrite_gguf(source, tmp_path_factory.mktemp("qwen35-chat") / "chat.gguf", {
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.chat_template": TEMPLATE})
    return LLM(str(path), num_kv_blocks=256, max_num_seqs=4)


@pytest.fixture(scope="module")
def url(llm) -> Iterator[str]:
    with running(create_app(llm.engine, model_name="qwen35", api_key=API_KEY)) as url:
        yield url


def test_the_gguf_template_renders_and_auto_picks_the_think_parser(llm):
    template = ChatTemplate(llm.engine.tokenizer)
    text = template.render([ChatMessage.model_validate(m) for m in MESSAGES])
    assert text == "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert template.encode(text)[-2:] == [THINK, llm.engine.tokenizer.encode("\n")[-1]]
    assert resolve_reasoning_parser("auto", llm.engine.tokenizer.chat_template) == "think"


def test_the_thinking_stays_apart_from_the_answer(url, llm):
    template = ChatTemplate(llm.engine.tokenizer)
    ids = template.encode(template.render([ChatMessage.model_validate(m) for m in MESSAGES]))
    raw = llm.generate([ids], SamplingParams(temperature=1.0, seed=7, max_tokens=24, logit_bias={END: 6.0}))[0].text
    assert "</think>" in raw, raw
    thought, _, answer = raw.partition("</think>")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    message = client.chat.completions.create(model="qwen35", messages=MESSAGES, logit_bias=BIAS,
                                             **SAMPLING).choices[0].message
    assert message.reasoning_content == thought
    assert (message.content or "") == answer.lstrip()
