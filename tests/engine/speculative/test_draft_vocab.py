"""A draft vocabulary (kvgen.engine.speculative.draft_vocab) on stories260K: the draft scores the first
ids and the text's own tokens as its whole head would, nothing else; speculation through it stays
exact, greedy and sampled. With 64 first ids (stories260K's specials and byte tokens) every word
the draft proposes comes from the text's own tokens."""

from types import SimpleNamespace

import pytest
import torch

from kvgen.config import EngineConfig
from kvgen.engine.speculative.draft import draft_tokens
from kvgen.engine.speculative.draft_vocab import Columns, DraftVocabulary, weight_rows
from kvgen.loaders import load_model
from kvgen.model.decoder import DecoderModel, head_weight
from kvgen.sampling_params import SamplingParams
from tests.engine.speculative.test_speculative import (ALPHA, STORY, _homogeneous, _second_and_third_tokens,
                                                       assert_clean, engine, ragged_requests, spec_options)
from tests.engine.test_continuous_batching import finished_outputs, prompts, run_all


@pytest.fixture(scope="module")
def loaded(stories_bin):
    return load_model(stories_bin)


def vocab_options(stories_bin, k: int, size: int) -> dict:
    return spec_options("draft", k, stories_bin) | {"draft_vocab_size": size}


@pytest.mark.parametrize("size", [64, 300])
def test_the_draft_scores_the_first_ids_and_the_texts_own_tokens_as_its_whole_head(loaded, size):
    """Its logits have a column per id it sees (the first ids, then the text's own), as many for every
    row as the longest text needs: a shorter one's last columns are -inf."""
    weights = {**loaded.weights, **loaded.quantized}
    whole = DecoderModel(loaded.config, weights)
    model = DecoderModel(loaded.config, weights, head_rows=size)
    vocabulary = DraftVocabulary(model, head_weight(loaded.config, weights), size)
    hidden = torch.randn(2, loaded.config.hidden_size, generator=torch.Generator().manual_seed(0))
    want = whole.logits(hidden)
    # Either side sums `hidden_size` fp32 products in its own order: each within n * eps of sum |h w|.
    head = weight_rows(head_weight(loaded.config, weights), list(range(loaded.config.vocab_size)))
    bound = 2 * loaded.config.hidden_size * torch.finfo(torch.float32).eps * (hidden.abs() @ head.abs().T)
    texts = [[5, 400, 17, 400, 311], [size - 1, 511]]
    seqs = [SimpleNamespace(seq_id=i, token_ids=list(t)) for i, t in enumerate(texts)]
    for grown in (False, True):
        if grown:  # a token of its output, read on the next call
            seqs[1].token_ids.append(290)
        got, columns = vocabulary.logits(hidden, seqs), vocabulary.columns(seqs)
        assert got.shape[1] == size + max(len(own) for own in columns.own)
        for row, seq in enumerate(seqs):
            seen = sorted(set(range(size)) | set(seq.token_ids))
            named = [columns.token(row, c) for c in range(len(seen))]  # the columns that score an id
            assert sorted(named) == seen and named[:size] == list(range(size))
            assert ((got[row, : len(seen)] - want[row, named]).abs() <= bound[row, named]).all()
            assert torch.isneginf(got[row, len(seen):]).all()  # the shorter text's padding
    assert vocabulary._own[1].ids == [511, 290][: 2 if size <= 290 else 1]


def test_draft_tokens_on_named_columns_are_ids_and_q_spans_the_whole_vocabulary():
    """A greedy row's token is the id its best column names, with that column's softmax probability; a
    sampled row's q is over all 10 ids, zero where no column names one (the padding names none)."""
    logits = torch.tensor([[0.0, 2.0, 1.0, float("-inf")], [1.0, 0.5, 3.0, 0.0]])
    columns = Columns(2, [[7], [9, 4]])  # ids 0 and 1, then each row's own
    greedy = SimpleNamespace(params=SamplingParams(temperature=0))
    sampled = SimpleNamespace(params=SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(3))
    tokens, q, sure = draft_tokens(logits, [greedy, sampled], columns, vocab_size=10)
    assert tokens[0] == 1 and sure[0] == pytest.approx(logits[0].softmax(-1)[1].item())
    assert q[0] is None and q[1].shape == (10,) and q[1].sum().item() == pytest.approx(1.0)
    want = torch.zeros(10)
    want[[0, 1, 9, 4]] = logits[1].softmax(-1)
    assert torch.allclose(q[1], want) and tokens[1] in (0, 1, 9, 4) and sure[1] == q[1][tokens[1]].item()
    assert draft_tokens(logits[1:], [greedy])[0] == [2]  # without columns named a column is its id


@pytest.mark.parametrize("size", [64, 300])
def test_greedy_through_a_draft_vocabulary_equals_plain(loaded, stories_bin, size):
    requests = [(p, SamplingParams(temperature=0, max_tokens=48)) for p in (STORY, "Once upon a time")]
    want = [run_all(engine(loaded), [r])[0] for r in requests]
    for request, tokens in zip(requests, want):
        eng = engine(loaded, **vocab_options(stories_bin, 3, size))
        assert run_all(eng, [request])[0] == tokens
        assert eng.speculator.counters.accepted > 0
        assert_clean(eng)
        assert not eng.speculator.proposer.vocabulary._own  # forgotten with the request


def test_a_ragged_batch_and_preemption_through_a_draft_vocabulary_equal_plain(loaded, stories_bin):
    requests = ragged_requests(16, seed=3)
    want = finished_outputs(engine(loaded, max_num_batched_tokens=64), requests)
    eng = engine(loaded, max_num_batched_tokens=64, **vocab_options(stories_bin, 3, 64))
    got = finished_outputs(eng, requests)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert_clean(eng)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tight_requests = [(t, params) for t in prompts(8, seed=4, longest=30)]
    tight = engine(loaded, num_kv_blocks=20, block_size=8, **vocab_options(stories_bin, 4, 64))
    assert run_all(tight, tight_requests) == run_all(engine(loaded), tight_requests)
    assert tight.scheduler.num_preemptions > 0
    assert_clean(tight)


def test_sampling_through_a_draft_vocabulary_keeps_the_target_distribution(loaded, stories_bin):
    """As test_speculative's test for the whole vocabulary: the draft's q is zero beyond its ids, and
    the target's tokens there still come out as often as plain sampling gives them."""
    params = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.1)
    options = dict(max_num_seqs=256, max_num_batched_tokens=1024)
    plain = _second_and_third_tokens(engine(loaded, **options), params, 1000)
    eng = engine(loaded, **options, **vocab_options(stories_bin, 2, 300))
    spec = _second_and_third_tokens(eng, params, 1000)
    assert 50 < eng.speculator.counters.accepted < eng.speculator.counters.proposed
    for want, got in zip(plain, spec):
        assert _homogeneous(want, got) > ALPHA


@pytest.mark.parametrize("size", [-1, True, 2.5])
def test_a_bad_draft_vocabulary_size_is_refused(size):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        EngineConfig(speculative_method="ngram", draft_vocab_size=size)


@pytest.mark.parametrize("options", [
    dict(dtype="bfloat16", kv_cache_dtype="bfloat16"),
    dict(kv_cache_dtype="int8", draft_quantization="none"),
    dict(quantization="int8", draft_quantization="int8"),
    dict(max_num_batched_tokens=4, enable_prefix_caching=True),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_a_draft_vocabulary_meets_the_engines_other_options(loaded, stories_bin, options):
    """With the model's dtype, KV dtypes, quantized weights and chunked prefill over prefix hits: the
    same tokens as that engine without speculation, n = 2 included."""
    requests = [(STORY, SamplingParams(temperature=0, max_tokens=32, n=2)),
                (STORY + " Lily", SamplingParams(temperature=0, max_tokens=32)),
                ("Once upon a time", SamplingParams(temperature=0, max_tokens=32))]
    plain = {k: v for k, v in options.items() if not k.startswith("draft")}
    want = finished_outputs(engine(loaded, **plain), requests)
    eng = engine(loaded, **vocab_options(stories_bin, 3, 64) | options)
    got = finished_outputs(eng, requests)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert eng.speculator.counters.accepted > 0
    assert_clean(eng)
