"""The real Gemma 3 270M Q4_K_M GGUF (architecture gemma3: QK-norm, GeGLU, sandwich norms, five
sliding-window layers of 512 to each global one, a 262,144-piece SentencePiece vocabulary) against
transformers reading the same file: tokenizer ids, greedy tokens in float32 past the window, the
chat template through the server, the packed weights' quality, and the hybrid cache's memory."""

from __future__ import annotations

import openai
import pytest
import torch

from kvgen import LLM, SamplingParams
from kvgen.eval.ppl import text_token_ids
from kvgen.server.app import create_app
from kvgen.server.chat import ChatTemplate
from kvgen.server.protocol import ChatMessage
from tests.model.teacher_forced import all_logits, packed_model, top1_agreement
from tests.server.test_server import running

TEXTS = [
    "Hello world",
    "  leading spaces, trailing   ",
    "tabs\tand\nnewlines\n\n\n  indented\r\nCRLF",
    "Digits 1234567890, 3.14159, 1,000,000 and 2024-12-01",
    "Unicode: café naïve 日本語 한국어 Ελληνικά русский 🙂🚀 and e\u0301 combining, 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    '{"json": [1, 2, {"k": null}]}',
    "",
]
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def long_text(tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of the GPL's text (the package's bundled long text), BOS first."""
    from importlib import resources

    text = resources.files("kvgen.eval").joinpath("data", "gpl-3.0.txt").read_text(encoding="utf-8")
    ids = text_token_ids(tokenizer, text)
    assert len(ids) >= num_tokens
    return ids[:num_tokens]


def test_tokenizer_ids_equal_transformers(gemma_llm, gemma_transformers):
    _, reference = gemma_transformers
    ours = gemma_llm.tokenizer
    assert (ours.bos_token_id, ours.eos_token_id) == (2, 1)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference(text).input_ids, text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


def hf_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None  # n steps
    try:
        with torch.no_grad():
            return [model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=n, do_sample=False)[0, len(ids):].tolist() for ids in prompts]
    finally:  # the model is shared by the session
        model.generation_config.eos_token_id = eos


def test_greedy_tokens_equal_transformers_past_the_window(gemma_llm, gemma_transformers):
    """A short prompt and one of 720 tokens, past the 512-token window of the sliding layers, 20 tokens
    each, through the paged engine and its hybrid cache."""
    model, reference = gemma_transformers
    prompts = [reference("The capital of France is").input_ids, long_text(gemma_llm.tokenizer, 720)]
    n = 20
    got = gemma_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    assert [g.token_ids for g in got] == hf_greedy(model, prompts, n)
    assert gemma_llm.engine.kv.num_used_blocks == 0


def test_chat_uses_gemmas_template_through_the_server(gemma_llm):
    """The file carries no chat template; kvgen applies Gemma's turn format (270M is a base model, so
    the answer is only checked to be the greedy continuation of that prompt)."""
    tokenizer = gemma_llm.tokenizer
    rendered = ChatTemplate(tokenizer).render([ChatMessage(**m) for m in MESSAGES])
    assert rendered == ("<bos><start_of_turn>user\nWhat is the capital of France? Answer in one sentence."
                        "<end_of_turn>\n<start_of_turn>model\n")
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    want = gemma_llm.generate([ids], SamplingParams(temperature=0, max_tokens=24))[0].text
    with running(create_app(gemma_llm.engine, model_name="gemma3")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        result = client.chat.completions.create(model="gemma3", messages=MESSAGES, max_tokens=24, temperature=0)
    assert result.usage.prompt_tokens == len(ids)
    assert result.choices[0].message.content == want


def test_packed_weights_keep_top1_against_dequantized(gemma_gguf, gemma_llm):
    """Teacher-forced over 640 tokens of real text: the packed Q4_K/Q5_0/Q6_K/Q8_0 kernels pick the
    dequantized fp32 model's top token at >= 98% of positions."""
    ids = long_text(gemma_llm.tokenizer, 640)
    with torch.no_grad():
        want, got = all_logits(gemma_llm.engine.model, ids), all_logits(packed_model(gemma_gguf), ids)
    agreement = top1_agreement(want, got)
    assert agreement >= 0.98, agreement


@pytest.mark.slow
def test_hybrid_cache_holds_a_quarter_of_the_full_kv_at_8k(gemma_gguf):
    """One sequence of 8,192 tokens: what its blocks take in the pools at the peak, against what every
    layer holding every token would take (measured from the pools' used blocks)."""
    llm = LLM(gemma_gguf, kv_cache_memory=1 << 30, max_num_seqs=1, enable_prefix_caching=False)
    engine = llm.engine
    prompt = long_text(llm.tokenizer, 4000)
    prompt = (prompt * 3)[:8190]
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    peak = 0
    block_bytes = [cache.nbytes() // (cache.num_blocks + 1) for cache in [kind.cache for kind in engine.runner.kinds]]
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, sum(k.num_used_blocks * b for k, b in zip(engine.kv.kinds, block_bytes)))
    full = 8192 * engine.bytes_per_token
    assert peak <= full / 4, (peak, full)
