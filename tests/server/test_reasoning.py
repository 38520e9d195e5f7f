"""Reasoning output on a random Qwen3-shaped checkpoint whose chat template thinks (the generation prompt
opens <think>, as Qwen3's thinking templates do, unless enable_thinking is false): reasoning_content,
thinking blocks and reasoning items carry exactly the text the model wrote before </think>, streamed
and not; `enable_thinking: false` turns it off per request."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from kvgen import LLM, SamplingParams
from kvgen.server.app import create_app
from kvgen.server.chat import ChatTemplate
from kvgen.server.protocol import ChatMessage
from tests.server.harness import API_KEY, running

THINK, END = 3, 4  # two of the tokenizer's added tokens, renamed <think> and </think> (not special: decoded)
TEMPLATE = """{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
# </think> made likely enough that the random model closes its thinking a few tokens in
SAMPLING = {"temperature": 1.0, "seed": 7, "max_tokens": 24}
BIAS = {str(END): 10.0}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> Path:
    from tests.loaders.arch_fixtures import arch_checkpoint

    source = arch_checkpoint("qwen3").hf_dir
    path = tmp_path_factory.mktemp("qwen3-thinking")
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"):
        shutil.copy(source / name, path / name)
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    renamed = {THINK: "<think>", END: "</think>"}
    for token in tokenizer["added_tokens"]:
        if token["id"] in renamed:
            old = token["content"]
            token["content"], token["special"] = renamed[token["id"]], False
            tokenizer["model"]["vocab"][renamed[token["id"]]] = tokenizer["model"]["vocab"].pop(old)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def llm(thinker) -> LLM:
    return LLM(thinker, num_kv_blocks=256, max_num_seqs=4)


@pytest.fixture(scope="module")
def url(llm) -> Iterator[str]:
    with running(create_app(llm.engine, model_name="thinker", api_key=API_KEY)) as url:
        yield url


def _raw(llm: LLM, **kwargs) -> str:
    """What the model writes for MESSAGES, as the offline engine samples it (the same seed)."""
    template = ChatTemplate(llm.engine.tokenizer)
    ids = template.encode(template.render([ChatMessage.model_validate(m) for m in MESSAGES], extra=kwargs))
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=24, logit_bias={END: 10.0})
    return llm.generate([ids], params)[0].text


def test_auto_picks_the_think_parser(url):
    from kvgen.server.parsers import resolve_reasoning_parser

    assert resolve_reasoning_parser("auto", TEMPLATE) == "think"


def test_reasoning_content_is_exactly_the_text_before_the_end_marker(url, llm):
    raw = _raw(llm)
    assert "</think>" in raw, raw  # the bias makes the random model close its thinking
    thought, _, answer = raw.partition("</think>")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    fields = dict(model="thinker", messages=MESSAGES, logit_bias=BIAS, **SAMPLING)
    message = client.chat.completions.create(**fields).choices[0].message
    assert message.reasoning_content == thought
    assert (message.content or "") == answer.lstrip()
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **fields):
        delta = chunk.choices[0].delta if chunk.choices else None
        reasoning += getattr(delta, "reasoning_content", None) or "" if delta else ""
        content += delta.content or "" if delta else ""
    assert (reasoning, content) == (thought, answer.lstrip())


def test_enable_thinking_false_per_request(url, llm):
    raw = _raw(llm, enable_thinking=False)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    message = client.chat.completions.create(model="thinker", messages=MESSAGES, logit_bias=BIAS,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                                             **SAMPLING).choices[0].message
    assert message.reasoning_content is None and message.content == raw


def test_thinking_blocks_and_reasoning_items(url, llm):
    thought, _, answer = _raw(llm).partition("</think>")
    claude = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0)
    fields = dict(model="thinker", max_tokens=24, messages=MESSAGES, thinking={"type": "enabled", "budget_tokens": 1024},
                  extra_body={"temperature": 1.0, "seed": 7, "logit_bias": BIAS})
    message = claude.messages.create(**fields)
    assert message.content[0].type == "thinking" and message.content[0].thinking == thought
    assert "".join(b.text for b in message.content[1:] if b.type == "text") == answer.lstrip()
    with claude.messages.stream(**fields) as stream:
        for _ in stream:
            pass
        blocks = [b.model_dump(exclude={"parsed_output"}) for b in stream.get_final_message().content]
        assert blocks == [b.model_dump() for b in message.content]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    response = client.responses.create(model="thinker", input="Why is the sky blue?", max_output_tokens=24,
                                       temperature=1.0, extra_body={"seed": 7, "logit_bias": BIAS})
    assert response.output[0].type == "reasoning" and response.output[0].content[0].text == thought
    assert response.output_text == answer.lstrip()


def test_logprobs_cover_every_token_when_replies_are_parsed(url):
    """Reasoning and content are split, the log-probabilities still cover each generated token."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    fields = dict(model="thinker", messages=MESSAGES, logit_bias=BIAS, logprobs=True, top_logprobs=2, **SAMPLING)
    whole = client.chat.completions.create(**fields)
    assert len(whole.choices[0].logprobs.content) == whole.usage.completion_tokens
    streamed = [entry for chunk in client.chat.completions.create(stream=True, **fields) if chunk.choices
                for entry in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else [])]
    assert [e.token for e in streamed] == [e.token for e in whole.choices[0].logprobs.content]
