"""A fault in the engine fails only the requests it touches; their blocks go back and the engine goes on.
The faults come from a real, deliberately broken checkpoint (see `broken_model` in tests/conftest.py)."""

import pytest

from kvgen import LLM, SamplingParams
from tests.conftest import BEYOND, POISON

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
GOOD = ["w5 w17 w40 w8", "w9 w2 w77", "w100 w3"]


@pytest.fixture(scope="module")
def llm(broken_model) -> LLM:
    return LLM(broken_model, num_kv_blocks=64, block_size=4)


def test_nan_logits_fail_their_request_and_the_batch_goes_on(llm):
    alone = [o.token_ids for o in llm.generate(GOOD, GREEDY)]
    outs = llm.generate(GOOD[:2] + [f"w5 w{POISON}"] + GOOD[2:], GREEDY)
    failed = outs.pop(2)
    assert failed.finished and failed.finish_reason == "error" and failed.token_ids == []
    assert failed.error == "the model produced NaN or infinite logits"
    assert [o.token_ids for o in outs] == alone and all(o.error is None for o in outs)
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.num_used_blocks == 0


def test_nan_logits_after_a_fork_fail_every_completion(llm):
    (out,) = llm.generate(f"w{POISON}", SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=5))
    assert [c.finish_reason for c in out.outputs] == ["error"] * 3
    assert llm.engine.kv.num_used_blocks == 0


def test_an_exception_in_a_step_fails_that_step_and_the_next_steps_run(llm):
    failed = llm.generate(f"w3 w{BEYOND}", GREEDY)[0]  # the embedding lookup raises IndexError
    assert failed.finish_reason == "error" and "IndexError" in failed.error
    assert llm.engine.kv.num_used_blocks == 0
    llm.engine.kv.check_invariants()
    assert llm.generate(GOOD, GREEDY)[0].finish_reason == "length"


def test_the_reference_engine_fails_a_request_alone_too(broken_model):
    llm = LLM(broken_model, kv_cache="contiguous")
    outs = llm.generate([f"w{POISON}", f"w{BEYOND}", GOOD[0]], GREEDY)
    assert [o.finish_reason for o in outs] == ["error", "error", "length"]
