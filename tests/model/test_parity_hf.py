"""The model against Hugging Face transformers on the same weights: logits and greedy tokens (fp32)."""

import pytest
import torch

from kvgen.loaders import load_model
from kvgen.model.decoder import DecoderModel
from kvgen.phases import decode, prefill
from tests.conftest import HF_MODELS

PROMPT = [1, 17, 43, 99, 250, 7, 7, 300, 12, 5, 61, 88]
NEW_TOKENS = 64


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    model.generation_config.eos_token_id = None  # run all n steps, as the loop below does
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        logits = model(torch.tensor([prompt])).logits[0, -1]
    return out[0, len(prompt):].tolist(), logits


def greedy(model: DecoderModel, prompt: list[int], n: int, kv_cache: str) -> tuple[list[int], torch.Tensor]:
    logits, state = prefill(model, prompt, kv_cache)
    first_logits, tokens = logits, []
    for _ in range(n):
        tokens.append(int(logits.argmax()))
        logits, state = decode(model, state, tokens[-1])
    return tokens, first_logits


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_matches_transformers(hf_model, name):
    path, reference = hf_model(name)
    loaded = load_model(path)
    model = DecoderModel(loaded.config, loaded.weights)
    want_tokens, want_logits = hf_greedy(reference, PROMPT, NEW_TOKENS)
    tokens, logits = greedy(model, PROMPT, NEW_TOKENS, "contiguous")
    assert (logits - want_logits).abs().max().item() <= 1e-4
    assert tokens == want_tokens


def test_stories260k_bin_and_gguf_match_transformers(stories_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(stories_dir, gguf_file="stories260K.gguf")
    config.pad_token_id = None
    reference = AutoModelForCausalLM.from_pretrained(stories_dir, gguf_file="stories260K.gguf", config=config).eval()
    prompt = load_model(stories_dir / "stories260K.bin").tokenizer.encode("Once upon a time, there was a")
    want_tokens, want_logits = hf_greedy(reference, prompt, NEW_TOKENS)
    for file in ("stories260K.bin", "stories260K.gguf"):
        loaded = load_model(stories_dir / file)
        tokens, logits = greedy(DecoderModel(loaded.config, loaded.weights), prompt, NEW_TOKENS, "contiguous")
        assert (logits - want_logits).abs().max().item() <= 1e-4, file
        assert tokens == want_tokens, file


def test_no_cache_and_contiguous_cache_agree_over_200_steps(stories_bin):
    loaded = load_model(stories_bin)
    model = DecoderModel(loaded.config, loaded.weights)
    prompt = loaded.tokenizer.encode("Lily saw a cat")
    cached, _ = greedy(model, prompt, 200, "contiguous")
    recomputed, _ = greedy(model, prompt, 200, "none")
    assert cached == recomputed


def test_decode_computes_only_the_new_token(stories_bin):
    """The cache holds every position once; decode appends exactly one."""
    loaded = load_model(stories_bin)
    model = DecoderModel(loaded.config, loaded.weights)
    _, state = prefill(model, [1, 2, 3, 4], "contiguous")
    assert state.cache.length == 4
    assert state.cache.k[0].shape == (1, loaded.config.num_kv_heads, model.max_positions, loaded.config.head_dim)
    decode(model, state, 5)
    assert state.cache.length == 5 and state.token_ids == [1, 2, 3, 4, 5]
