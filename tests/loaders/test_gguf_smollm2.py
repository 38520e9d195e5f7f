"""The real SmolLM2-135M-Instruct Q4_1 GGUF (gpt2 byte-level BPE, smollm pre-tokenizer, ChatML template)
against transformers reading the same file: tokenizer ids, and greedy tokens in float32."""

from __future__ import annotations

import torch

from kvgen import SamplingParams
from kvgen.tokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world",
    "  leading spaces, trailing   ",
    "tabs\tand\nnewlines\n\n\n  indented\r\nCRLF",
    "Digits 1234567890, 3.14159, 1,000,000 and 2024-12-01",
    "Unicode: café naïve 日本語 한국어 Ελληνικά русский 🙂🚀 and e\u0301 combining, 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|im_end|>more<repo_name>",
    "It's we're they'll I'd you've SHE'S",
    "a  b   c    d\n \n  \n",
    '{"json": [1, 2, {"k": null}]}',
    "",
]


def test_tokenizer_ids_equal_transformers(smollm_llm, smollm_transformers):
    _, reference = smollm_transformers
    ours = smollm_llm.tokenizer
    assert (ours.bos_token_id, ours.eos_token_id, ours.add_bos) == (1, 2, False)
    assert ours.chat_template == reference.chat_template
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference(text).input_ids, text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


def test_streaming_detokenization_of_split_characters(smollm_llm):
    """Emoji and CJK take several byte-level tokens each; the stream must never emit half a character."""
    tokenizer = smollm_llm.tokenizer
    text = "日本語 🙂🚀 café"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # some characters span tokens
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    pieces = [detokenizer.add([i]) for i in ids]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def chat_prompt(reference, question: str) -> str:
    return reference.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def test_greedy_tokens_equal_transformers(smollm_llm, smollm_transformers):
    model, reference = smollm_transformers
    texts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
             "1, 1, 2, 3, 5, 8, 13,",
             chat_prompt(reference, "What is the boiling point of water?"),
             chat_prompt(reference, "Write a haiku about autumn.")]
    prompts = [reference(t).input_ids for t in texts]
    assert prompts == [smollm_llm.tokenizer.encode(t) for t in texts]
    n = 32
    want = []
    eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None  # n steps, as ignore_eos
    try:
        with torch.no_grad():
            for ids in prompts:
                x = torch.tensor([ids])  # an explicit mask: else generate masks <|im_end|>, the pad token, out
                out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
                want.append(out[0, len(ids):].tolist())
    finally:  # the model is shared by the session
        model.generation_config.eos_token_id = eos
    got = smollm_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    for text, expected, result in zip(texts, want, got):
        assert result.token_ids == expected, text
