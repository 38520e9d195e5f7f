"""A Mistral-style sliding-window model against Hugging Face transformers, well past the window.

transformers (masking_utils.sliding_window_overlay) lets query q read key k when q - W < k <= q: the
current token counts in the W. kvgen's convention is the same (the last W: t - W < j <= t). The paged
engine turns the model's `sliding_window` into the request policy window:W by itself; the
contiguous/none reference paths apply the same mask in `kvgen.phases`.
"""

import pytest
import torch

import kvgen
from kvgen import SamplingParams
from kvgen.loaders import load_model
from kvgen.model.decoder import DecoderModel
from kvgen.phases import decode, prefill
from tests.conftest import SMALL, _word_tokenizer

WINDOW = 32
NEW_TOKENS = 128
# initializer_range 0.1 (not 0.02) gives peaked logits: greedy ties are unlikely and an off-by-one
# window changes the last logits by ~0.3, far above the 1e-4 tolerance.
CONFIG = SMALL | {"sliding_window": WINDOW, "initializer_range": 0.1}


def _prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, SMALL["vocab_size"], (length - 1,), generator=g).tolist()


PROMPT = _prompt(20, 1)  # generation runs from 20 to 148 tokens: the window slides ~116 times
LONG_PROMPT = _prompt(77, 2)  # > WINDOW: prefill itself must mask


def _mistral(sliding_window: int | None):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(1234)  # the same weights whatever the window
    config = MistralConfig(**(CONFIG | {"sliding_window": sliding_window}), attn_implementation="eager")
    model = MistralForCausalLM(config).eval()
    assert model.config._attn_implementation == "eager"
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(directory, HF model with the window, HF model without it, same weights)."""
    model = _mistral(WINDOW)
    path = tmp_path_factory.mktemp("mistral") / "mistral-sw32"
    model.save_pretrained(path)
    _word_tokenizer(SMALL["vocab_size"], path)
    return path, model, _mistral(None)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_last_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1]


@pytest.fixture(scope="module")
def want(mistral):
    _, windowed, unwindowed = mistral
    tokens = hf_greedy(windowed, PROMPT, NEW_TOKENS)
    # The test can fail: without the window HF generates something else, and generate()'s cached path
    # agrees with one uncached forward over the whole text (so HF does apply the window when decoding).
    assert hf_greedy(unwindowed, PROMPT, NEW_TOKENS) != tokens
    with torch.no_grad():
        logits = windowed(torch.tensor([PROMPT + tokens])).logits[0]
    assert logits[len(PROMPT) - 1 : -1].argmax(-1).tolist() == tokens
    return tokens


def test_window_comes_from_the_config(mistral):
    loaded = load_model(mistral[0])
    assert loaded.config.sliding_window == WINDOW
    llm = kvgen.LLM(mistral[0])
    assert llm.engine.resolve_policy(SamplingParams()).spec == f"window:{WINDOW}"


@pytest.mark.parametrize("kv_cache, block_size", [("paged", 16), ("paged", 4), ("contiguous", 16), ("none", 16)])
def test_greedy_matches_transformers_past_the_window(mistral, want, kv_cache, block_size):
    llm = kvgen.LLM(mistral[0], kv_cache=kv_cache, block_size=block_size)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == want
    if kv_cache == "paged":
        assert llm.engine.kv.num_used_blocks == 0


def test_paged_engine_keeps_only_the_window(mistral, want):
    llm = kvgen.LLM(mistral[0], block_size=4)
    engine = llm.engine
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    most, tokens = 0, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        for seq in engine.scheduler.running:
            most = max(most, len(engine.kv.live_blocks(seq.seq_id)))
    assert tokens == want
    assert most <= WINDOW // 4 + 2


def test_prefill_logits_past_the_window_match_transformers(mistral):
    path, windowed, unwindowed = mistral
    want_logits = hf_last_logits(windowed, LONG_PROMPT)
    assert (hf_last_logits(unwindowed, LONG_PROMPT) - want_logits).abs().max() > 1e-2  # the window matters
    loaded = load_model(path)
    model = DecoderModel(loaded.config, loaded.weights)
    for kv_cache in ("contiguous", "none"):
        logits, _ = prefill(model, LONG_PROMPT, kv_cache)
        assert (logits - want_logits).abs().max().item() <= 1e-4, kv_cache
    # Prefill part of the prompt, then decode the rest token by token over the cache: same logits.
    logits, state = prefill(model, LONG_PROMPT[:10], "contiguous")
    for token in LONG_PROMPT[10:]:
        logits, state = decode(model, state, token)
    assert (logits - want_logits).abs().max().item() <= 1e-4
    # The paged engine: the prompt's last-token log-probabilities equal HF's log-softmax.
    for block_size, chunk in ((16, 512), (4, 24)):  # one chunk / chunked prefill across the window
        llm = kvgen.LLM(path, block_size=block_size, max_num_batched_tokens=chunk)
        out = llm.generate([LONG_PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
        got = out.outputs[0].logprobs[0].top
        ref = torch.log_softmax(want_logits, -1)
        assert set(got) == set(ref.topk(5).indices.tolist())
        assert max(abs(lp - ref[t].item()) for t, lp in got.items()) <= 1e-4
