"""Suffix decoding (kvgen/engine/speculative/suffix.py): the tree's counts under incremental inserts and
removals, its proposals, and greedy output equal to plain decoding on stories260K and the real
SmolLM2-135M (alone, a batch of several, n > 1, with the prefix cache, under preemption)."""

import random

import pytest

from kvgen.config import EngineConfig
from kvgen.engine.llm_engine import LLMEngine
from kvgen.engine.speculative.suffix import SuffixProposer, SuffixTree
from kvgen.loaders import load_model
from kvgen.sampling_params import SamplingParams
from tests.engine.test_continuous_batching import finished_outputs, prompts, run_all

STORY = "Lily and Tom went to the park. They saw a big ball. Lily and Tom played with the ball in the park."


def brute_counts(sequences: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for tokens in sequences:
        for i in range(len(tokens)):
            for n in range(1, depth + 1):
                if i + n <= len(tokens):
                    key = tuple(tokens[i : i + n])
                    counts[key] = counts.get(key, 0) + 1
    return counts


def tree_counts(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    counts, stack = {}, [(0, ())]
    while stack:
        node, path = stack.pop()
        for token, child in tree.children[node].items():
            counts[path + (token,)] = tree.counts[child]
            stack.append((child, path + (token,)))
    return counts


def test_incremental_inserts_and_removals_keep_exact_counts():
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randint(1, 40))] for _ in range(8)]
    tree = SuffixTree(depth=5)
    for s in seqs:
        tree.insert(s)
    assert tree_counts(tree) == brute_counts(seqs, 5)
    for s in seqs[:5]:
        tree.remove(s)
    assert tree_counts(tree) == brute_counts(seqs[5:], 5)
    tree.insert(seqs[0])  # freed nodes are reused
    assert tree_counts(tree) == brute_counts(seqs[5:] + seqs[:1], 5)
    for s in seqs[5:] + seqs[:1]:
        tree.remove(s)
    assert tree_counts(tree) == {} and tree.num_nodes == 1


class FakeSeq:
    def __init__(self, seq_id, prompt, output=()):
        self.seq_id, self.prompt_token_ids, self.output_token_ids = seq_id, list(prompt), list(output)

    @property
    def token_ids(self):
        return self.prompt_token_ids + self.output_token_ids


def test_proposes_the_continuation_of_the_longest_match_and_follows_new_tokens():
    proposer = SuffixProposer()
    passage = list(range(100, 140))
    seq = FakeSeq(1, [1, 2] + passage + [3], passage[:5])
    assert proposer.find(seq, 8) == (passage[5:10], 5)  # a 5-token match proposes at most 5 (FACTOR)
    seq.output_token_ids += passage[5:20]  # appended incrementally
    assert proposer.find(seq, 32).tokens == passage[20:]  # 20 (the match length): past the tree's depth
    assert proposer._tails[1].length == len(seq.token_ids)
    assert proposer.find(FakeSeq(2, [7, 8, 9], [10]), 8) == ([], 0)  # nothing to follow


def test_guesses_the_first_token_it_would_propose():
    proposer = SuffixProposer()
    passage = list(range(100, 140))
    seq = FakeSeq(1, [1, 2] + passage + [3], passage[:5])
    assert proposer.guess(seq) == passage[5] == proposer.find(seq, 8).tokens[0]
    assert proposer.guess(FakeSeq(2, [7, 8, 9], [10])) is None


def test_frequency_picks_the_most_common_continuation_and_stops_when_unlikely():
    proposer = SuffixProposer()
    # the longest match "0 5 6" is followed by 7 twice and 8 once: 7; "0 5 6 7" by 9 and 1 once each:
    # the latest (1) wins the tie
    prompt = [5, 6, 7, 9, 0, 5, 6, 7, 9, 0, 5, 6, 8, 0, 5, 6, 7, 1, 0]
    got = proposer.find(FakeSeq(1, prompt, [5, 6]), 8).tokens
    assert got[:2] == [7, 1]
    tree = SuffixTree()
    tree.insert([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 1, 2, 7])
    node, length = tree.match([9, 1, 2])
    assert length == 2
    assert tree.continuation(node, length, [9, 1, 2], 8, min_prob=0.3) == ([], 0.0)  # five ways on, each 1/5


def test_global_cache_serves_other_requests_and_is_bounded_lru():
    proposer = SuffixProposer(global_tokens=100)
    output = list(range(200, 260))
    seq = FakeSeq(1, [1, 2, 3], output)
    proposer.find(seq, 4)
    proposer.forget(1)  # finished: its output enters the global tree
    assert proposer.cached_tokens == 60
    other = FakeSeq(2, [9, 9, 9], output[:6])
    assert proposer.find(other, 10) == (output[6:12], 6)  # a 6-token match: 6 tokens
    proposer.cache_output(3, list(range(300, 360)))  # 120 tokens > 100: the oldest goes
    assert proposer.cached_tokens == 60 and proposer.global_tree.match(output[:6]) == (0, 0)
    proposer.cache_output(3, list(range(300, 310)))  # the same key replaces its earlier output
    assert proposer.cached_tokens == 10
    assert tree_counts(proposer.global_tree) == brute_counts([list(range(300, 310))], proposer.depth)


# -- in the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(stories_bin):
    return load_model(stories_bin)


def engine(loaded, **options) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(**options))


SUFFIX = dict(speculative_method="suffix", adaptive_speculation=False)


@pytest.mark.parametrize("k", [1, 4, 16])
def test_greedy_alone_equals_plain(loaded, k):
    requests = [(p, SamplingParams(temperature=0, max_tokens=64)) for p in (STORY, "Once upon a time", "")]
    eng = engine(loaded, num_speculative_tokens=k, **SUFFIX)
    for request in requests:
        assert run_all(eng, [request])[0] == run_all(engine(loaded), [request])[0]
    eng.kv.check_invariants()
    assert eng.kv.num_used_blocks == 0 and eng.speculator.counters.accepted > 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_batch_with_n_and_prefix_cache_equals_plain(loaded, prefix_caching):
    texts = [STORY, STORY + " Lily", *prompts(6, seed=3, longest=50)]
    requests = [(t, SamplingParams(temperature=0, max_tokens=48, n=1 + i % 3, ignore_eos=i % 2 == 0))
                for i, t in enumerate(texts)]
    options = dict(max_num_batched_tokens=64, enable_prefix_caching=prefix_caching)
    want = finished_outputs(engine(loaded, **options), requests)
    eng = engine(loaded, num_speculative_tokens=8, **options, **SUFFIX)
    for _ in range(2):  # the second round also draws on the first round's outputs (the global tree)
        got = finished_outputs(eng, requests)
        assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    eng.kv.check_invariants()
    assert eng.kv.num_used_blocks == 0 and eng.speculator.counters.accepted > 0
    assert eng.speculator.proposer.cached_tokens > 0 and not eng.speculator.proposer._tails


def test_greedy_under_preemption_and_adaptive_equals_plain(loaded):
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    requests = [(t, params) for t in prompts(12, seed=1, longest=40)]
    want = run_all(engine(loaded), requests)
    tight = engine(loaded, num_kv_blocks=24, block_size=8, speculative_method="suffix", num_speculative_tokens=6,
                   adaptive_speculation=False)
    assert run_all(tight, requests) == want
    assert tight.scheduler.num_preemptions > 0
    tight.kv.check_invariants()
    adaptive = engine(loaded, speculative_method="suffix", num_speculative_tokens=6)  # the switch on
    assert run_all(adaptive, requests) == want
    assert adaptive.speculator.switch.table()


def test_sampled_requests_keep_running_with_suffix(loaded):
    eng = engine(loaded, num_speculative_tokens=4, **SUFFIX)
    out = finished_outputs(eng, [(STORY, SamplingParams(temperature=0.8, seed=1, max_tokens=40, n=2))])
    assert all(len(c.token_ids) > 0 for c in out[0].outputs)
    eng.kv.check_invariants()


# -- the real SmolLM2-135M ----------------------------------------------------------------------

PASSAGE = ("The old lighthouse stood at the edge of the cliff, its white paint peeling in the salty wind. "
           "Every night for forty years, Martha climbed the hundred and twelve steps to light the lamp.")
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
SMOL_PROMPTS = [f"Repeat the following passage exactly.\n\n{PASSAGE}\n\n", "The capital of France is",
                f"Rewrite this code with type hints:\n\n{CODE}\n", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def smollm_packed(smollm_gguf):
    from kvgen.llm import load

    return load(smollm_gguf, EngineConfig())


def test_smollm_greedy_alone_and_batched_equals_plain(smollm_packed):
    """The real file as served by default (packed weights): suffix decoding keeps plain's tokens, alone
    and in a batch of several with n > 1 and the prefix cache."""
    options = dict(num_kv_blocks=256, max_num_seqs=8)
    alone = [(SMOL_PROMPTS[0], SamplingParams(temperature=0, max_tokens=48))]
    batch = [(p, SamplingParams(temperature=0, max_tokens=32, n=2 if i == 2 else 1)) for i, p in enumerate(SMOL_PROMPTS)]
    for requests in (alone, batch):
        want = finished_outputs(LLMEngine(smollm_packed, EngineConfig(**options)), requests)
        eng = LLMEngine(smollm_packed, EngineConfig(**options, num_speculative_tokens=8, **SUFFIX))
        got = finished_outputs(eng, requests)
        assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
        eng.kv.check_invariants()
        assert eng.kv.num_used_blocks == 0 and eng.speculator.counters.accepted > 0
