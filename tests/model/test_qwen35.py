"""Qwen3.5 through the paged engine against transformers (fp32, greedy) on the tiny `qwen35` fixture
(tests/loaders/arch_fixtures.py), from the HF directory and from the GGUF llama.cpp's converter wrote:
prompts past one 64-token delta-rule chunk and past the fixture's 512 positions, chunked prefill on and
off, one sequence and a ragged batch; and the state cache's behaviour: a prefix hit, preemption, n > 1,
speculation, and every block and state slot given back.

The fixture's config says 512 positions; the 700-token prompts run on copies that say 1024 (the
weights are the same files, transformers' RoPE has no table to outgrow)."""

import functools
import json
import shutil

import pytest

from kvgen import LLM, SamplingParams
from tests.loaders.arch_fixtures import arch_checkpoint, hf_greedy

N = 32
POSITIONS = 1024


@functools.cache
def checkpoint():
    return arch_checkpoint("qwen35")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{"hf": a copy of the HF directory, "gguf": of the F32 GGUF}, both saying POSITIONS positions."""
    from gguf import GGUFReader

    ckpt, root = checkpoint(), tmp_path_factory.mktemp("qwen35")
    hf = shutil.copytree(ckpt.hf_dir, root / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(config | {"max_position_embeddings": POSITIONS}))
    gguf = shutil.copy(ckpt.gguf, root / "qwen35.gguf")
    field = GGUFReader(gguf, "r+").fields["qwen35.context_length"]
    field.parts[field.data[0]][0] = POSITIONS
    return {"hf": hf, "gguf": gguf}


def prompt(length: int, seed: int = 0) -> list[int]:
    return [3 + (i * 37 + 11 * seed + 5) % 700 for i in range(length)]


@functools.cache
def reference(ids: tuple[int, ...], n: int = N) -> list[int]:
    return hf_greedy(checkpoint().hf_dir, list(ids), n)


def greedy(tokens: int = N, **options) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, **options)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams | None = None) -> list[list[int]]:
    """Every completion's tokens, after which no block or state slot may be held."""
    outputs = llm.generate(prompts, params or greedy())
    assert_pools_empty(llm)
    return [c.token_ids for out in outputs for c in out.outputs]


def assert_pools_empty(llm: LLM) -> None:
    engine = llm.engine
    assert engine.kv.num_used_blocks == 0
    assert engine.recurrent.pool.num_used == 0
    engine.recurrent.pool.check()


def engine(path, **options) -> LLM:
    return LLM(str(path), quantization="none", **options)


def cases():
    """Every source, length and chunking; the whole-prompt runs of the GGUF are slow-marked (the default
    suite keeps the chunked ones and every HF one)."""
    return [pytest.param(source, length, chunk, marks=[pytest.mark.slow] if (source, chunk) == ("gguf", 1024) else [])
            for source in ("hf", "gguf") for length in (10, 200, 700) for chunk in (48, 1024)]


@pytest.mark.parametrize("source,length,chunk", cases())
def test_one_sequence_gives_transformers_tokens(sources, source, length, chunk):
    """48-token steps split the prompt across steps and across the delta rule's 64-token chunks."""
    ids = prompt(length)
    llm = engine(sources[source], max_num_batched_tokens=chunk, enable_prefix_caching=False)
    assert run(llm, [ids]) == [reference(tuple(ids))]


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_a_ragged_batch_gives_transformers_tokens(sources, source):
    """Six prompts at once: prompt chunks of several sequences and decodes in the same steps."""
    prompts = [prompt(n, seed) for seed, n in enumerate((10, 200, 700, 37, 123, 65))]
    llm = engine(sources[source], max_num_batched_tokens=96)
    assert run(llm, prompts) == [reference(tuple(p)) for p in prompts]


def test_a_prefix_hit_computes_fewer_prompt_tokens_and_gives_the_same_tokens(sources):
    """A shared 300-token system prompt: the second request takes the cached blocks up to the state
    snapshot at 256 tokens and recomputes the rest."""
    system = prompt(300, seed=7)
    first, second = system + prompt(20, seed=1), system + prompt(30, seed=2)
    llm = engine(sources["hf"])
    run(llm, [first])
    assert llm.engine.recurrent.pool.num_snapshots == 2  # at 256 and at its last full block (304)
    before = llm.engine.stats().prefix_cache_hits
    assert run(llm, [second]) == [reference(tuple(second))]
    assert llm.engine.stats().prefix_cache_hits - before == 256


def test_preemption_under_a_tiny_pool_gives_the_same_tokens(sources):
    prompts = [prompt(n, seed) for seed, n in enumerate((90, 60, 75, 40))]
    llm = engine(sources["gguf"], num_kv_blocks=14, max_num_batched_tokens=64)
    assert run(llm, prompts) == [reference(tuple(p)) for p in prompts]
    assert llm.engine.scheduler.num_preemptions > 0


def test_n_completions_fork_the_state_of_the_prompt(sources):
    ids = prompt(150, seed=4)
    assert run(engine(sources["hf"]), [ids], greedy(n=3)) == [reference(tuple(ids))] * 3


@pytest.mark.parametrize("method", ["ngram", "draft", "suffix"])
def test_speculation_gives_plain_greedy_tokens(sources, method):
    """Rejected drafts leave nothing in the state: a verify step's checkpoints roll it back to the last
    accepted token. The first prompt ends with a's tail followed earlier by a's greedy output, which
    ngram and suffix propose and the model (whose state has seen more) rejects; a second run of a
    makes suffix decoding propose a's output, which is accepted."""
    draft = {"draft_model": str(arch_checkpoint("qwen3").hf_dir)} if method == "draft" else {}
    llm = engine(sources["hf"], speculative_method=method, num_speculative_tokens=3, adaptive_speculation=False,
                 **draft)
    a = prompt(40, seed=5)
    prompts = [a + reference(tuple(a))[:20] + a[-3:], a]
    assert run(llm, prompts) + run(llm, [a]) == [reference(tuple(p)) for p in prompts + [a]]
    stats = llm.engine.stats()
    assert stats.spec_accepted < stats.spec_proposed
    assert stats.spec_accepted > 0 or method != "suffix"

