"""Every GGUF tensor type kvgen reads, on small random llama GGUFs written with gguf's writer:
weights equal gguf's dequantization, the raw blocks survive `keep_quantized`, and the model gives
the same greedy tokens as transformers reading the same file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvgen.loaders import load_model
from kvgen.loaders.gguf_tensors import BLOCK_TYPES
from kvgen.model.decoder import DecoderModel
from tests.loaders.gguf_builder import (ALL_TYPES, Dims, QType, as_float, gpt2_vocab, llama_vocab, random_model,
                                        write_gguf)
from tests.model.test_parity_hf import greedy, hf_greedy

PROMPT = [1, 17, 43, 99, 250, 7, 7, 300, 12, 5]


@pytest.fixture(scope="module")
def vocabs(stories_dir: Path) -> dict:
    return {"llama": llama_vocab(stories_dir), "gpt2": gpt2_vocab("smollm")}


@pytest.fixture(scope="module")
def files(tmp_path_factory, vocabs) -> dict:
    """(type, vocabulary) -> (file, HF name -> (type, stored array)); llama vocab for the float types,
    alternating vocabularies for the block types, so that each type and each vocabulary is covered."""
    root = tmp_path_factory.mktemp("gguf-types")
    built = {}
    for i, qtype in enumerate(ALL_TYPES):
        vocab = vocabs["gpt2" if i % 2 else "llama"]
        model = random_model(qtype, len(vocab.tokens), Dims(), seed=i)
        built[qtype] = (write_gguf(root / f"tiny-{qtype.name}.gguf", model, vocab), model)
    return built


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_weights_equal_gguf_dequantization(qtype, files):
    path, model = files[qtype]
    loaded = load_model(path)
    assert set(loaded.weights) == set(model) and not loaded.quantized
    for name, (stored_type, stored) in model.items():
        shape = tuple(loaded.weights[name].shape)
        assert torch.equal(loaded.weights[name], torch.from_numpy(as_float(stored, stored_type, shape))), name


@pytest.mark.parametrize("qtype", sorted(BLOCK_TYPES & set(ALL_TYPES), key=lambda q: q.value), ids=lambda q: q.name)
def test_keep_quantized_hands_over_the_blocks(qtype, files):
    """The raw blocks come back row for row in HF order (q/k rows permuted back as whole rows)."""
    path, model = files[qtype]
    loaded = load_model(path, keep_quantized=True)
    matrices = {name for name, (_, stored) in model.items() if stored.ndim == 2}
    assert set(loaded.quantized) == matrices and set(loaded.weights) == set(model) - matrices
    for name in matrices:
        weight = loaded.quantized[name]
        assert (weight.name, weight.ggml_type) == (name, qtype)
        assert np.array_equal(weight.raw, model[name][1]), name
        assert torch.equal(weight.dequantize(), torch.from_numpy(as_float(model[name][1], qtype, weight.shape)))
        rows = [weight.shape[0] - 1, 0, 2, 0]  # out of order, one twice
        assert torch.equal(weight.dequantize_rows(rows), weight.dequantize()[rows]), name


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_greedy_tokens_equal_transformers(qtype, files):
    pytest.importorskip("accelerate", reason="transformers needs accelerate for from_pretrained(gguf_file=...)")
    from transformers import AutoConfig, AutoModelForCausalLM

    path, _ = files[qtype]
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.pad_token_id = None
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                     dtype=torch.float32).eval()
    loaded = load_model(path)
    for name, expected in reference.state_dict().items():
        assert torch.equal(loaded.weights[name], expected), name
    want_tokens, want_logits = hf_greedy(reference, PROMPT, 24)
    tokens, logits = greedy(DecoderModel(loaded.config, loaded.weights), PROMPT, 24, "contiguous")
    assert (logits - want_logits).abs().max().item() <= 1e-4
    assert tokens == want_tokens


def test_a_q4_k_m_style_mix_loads(tmp_path, vocabs):
    """Q4_K_M files mix types per tensor (Q6_K for v and down in some layers and the output, Q5_0 or
    Q8_0 elsewhere in some converters); each tensor is read by its own type."""
    vocab = vocabs["gpt2"]
    types = (QType.Q4_K, QType.Q6_K, QType.Q5_0, QType.Q8_0)
    by_type = {q: random_model(q, len(vocab.tokens), Dims(), seed=7) for q in types}
    pick = {"v_proj": QType.Q6_K, "down_proj": QType.Q6_K, "lm_head": QType.Q6_K, "up_proj": QType.Q5_0,
            "embed_tokens": QType.Q8_0}
    model = {name: by_type[next((q for key, q in pick.items() if key in name), QType.Q4_K)][name]
             for name in by_type[QType.Q4_K]}
    loaded = load_model(write_gguf(tmp_path / "mix.gguf", model, vocab), keep_quantized=True)
    assert {w.ggml_type for w in loaded.quantized.values()} == {QType.Q4_K, QType.Q6_K, QType.Q5_0, QType.Q8_0}
    for name, (qtype, stored) in model.items():
        values = loaded.quantized[name].dequantize() if name in loaded.quantized else loaded.weights[name]
        assert torch.equal(values, torch.from_numpy(as_float(stored, qtype, tuple(values.shape)))), name
