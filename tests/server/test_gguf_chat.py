"""Chat with the real SmolLM2 Q4_1 GGUF through the server and the official openai client: its own ChatML
template, and the same answer transformers gives on the same file (greedy, float32)."""

from __future__ import annotations

import openai
import torch

from kvgen.server.app import create_app
from tests.server.test_server import running

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_chat_answer_equals_transformers(smollm_llm, smollm_transformers):
    model, tokenizer = smollm_transformers
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    with torch.no_grad():  # stops at <|im_end|>, the file's EOS
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False)
    expected = tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)
    with running(create_app(smollm_llm.engine, model_name="smollm2")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        result = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=40, temperature=0)
        stream = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=40, temperature=0,
                                                stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream)
    assert "Paris" in expected
    assert result.choices[0].message.content == expected == streamed
    assert result.usage.prompt_tokens == prompt.shape[1]
