"""The numerics options against each other, pairwise, on stories260K: model dtype x kv_cache_dtype x
attention_backend x fused decode. Every pair of values of two options meets in at least one case
(tests.support.pairwise.all_pairs, generated from the options' declared values: kvgen.config's for the KV and
attention options), so a combination that breaks shows up without running the whole product (72 cases; run
once by hand: all passed, the native backend refused for fp16 models).

Each case runs a few greedy requests against the plain path of its model dtype (default options)
and checks:
- the output: bit for bit where nothing lossy differs (same attention path, a pool holding every
  value of the model's dtype: `auto`, the model's own dtype, or float32); else within the declared
  bound of the lossiest difference (tests/support/tolerances.py, KV_ROUNDING, KV_GAIN): the pool's rounding,
  or a half-precision model's other attention path (its rounding), or an fp32 model's (fp32's);
- that every KV block went back, and that the engine then serves the next request;
- a combination the engine refuses raises the error kvgen.option_space declares for it, never an
  internal error (the native backend for an fp16 model); tests/engine/test_option_pairs.py runs every
  other option against these pairwise.
"""

from __future__ import annotations

import itertools
import re

import pytest

from kvgen import LLM, SamplingParams
from kvgen.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES
from kvgen.option_space import refusal_of
from tests.support.pairwise import all_pairs
from tests.support.tolerances import KV_ROUNDING, agreeing_prefix, logprob_gap, trace

OPTIONS = {
    "dtype": ("float32", "bfloat16", "float16"),
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "attention_backend": tuple(b for b in ATTENTION_BACKENDS if b != "auto"),  # auto is one of the two
    "fused_decode": (True, False),
}
TEXTS = ["Once upon a time", "Lily had a red ball and", "Tom"]
PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)


CASES = all_pairs(OPTIONS)


def case_id(case: dict) -> str:
    return "-".join(str(v) if not isinstance(v, bool) else ("fused" if v else "layered") for v in case.values())


def pool_rounding(dtype: str, kv_cache_dtype: str) -> float:
    """The relative error the pool adds to the model's values: none where it holds them all."""
    if kv_cache_dtype in ("auto", dtype, "float32"):
        return 0.0
    return KV_ROUNDING[kv_cache_dtype]


def path_rounding(dtype: str, same_path: bool) -> float:
    """The relative error between two attention paths, or batch compositions, of a model of `dtype`:
    a half-precision model rounds its results to its dtype at different points (the kernel once
    from fp32, SDPA in bf16); fp32 models differ by fp32 rounding only (logprob_gap)."""
    return 0.0 if same_path or dtype == "float32" else KV_ROUNDING[dtype]


@pytest.fixture(scope="module")
def plain() -> dict[str, tuple[LLM, list]]:
    """Per model dtype: the plain engine (default options) and its output."""
    engines = {dtype: LLM(dtype=dtype, block_size=4) for dtype in OPTIONS["dtype"]}
    return {dtype: (llm, [trace(o.outputs[0]) for o in llm.generate(TEXTS, PARAMS)]) for dtype, llm in engines.items()}


def test_the_cases_cover_every_pair_in_fewer_runs_than_the_product():
    for a, b in itertools.combinations(OPTIONS, 2):
        assert {(c[a], c[b]) for c in CASES} == set(itertools.product(OPTIONS[a], OPTIONS[b]))
    assert len(CASES) < len(list(itertools.product(*OPTIONS.values()))) // 2


@pytest.mark.parametrize("case", CASES, ids=map(case_id, CASES))
def test_options_compose(case, plain):
    if (refusal := refusal_of(case)) is not None:
        with pytest.raises(refusal.error, match=re.escape(refusal.message)):
            LLM(block_size=4, **case)
        return
    llm = LLM(block_size=4, **case)
    reference, want = plain[case["dtype"]]
    got = [trace(o.outputs[0]) for o in llm.generate(TEXTS, PARAMS)]
    same_path = (llm.engine.runner.decode_kernel is None) == (reference.engine.runner.decode_kernel is None)
    u = max(pool_rounding(case["dtype"], case["kv_cache_dtype"]), path_rounding(case["dtype"], same_path))
    for g, w in zip(got, want, strict=True):
        if u == 0.0 and same_path:
            assert g == w  # tokens and logprobs, bit for bit (fused decode changes no bit)
        elif u == 0.0:  # an fp32 model's other attention path: fp32 rounding, over any context it holds
            assert g[0] == w[0]
            config, context = llm.engine.model_config, llm.engine.max_model_len
            assert all(abs(x[t] - y[t]) <= logprob_gap(config, context, abs(y[t]))
                       for x, y in zip(g[1], w[1], strict=True) for t in x.keys() & y.keys())
        else:
            agreeing_prefix(g, w, u)
    assert llm.engine.kv.num_used_blocks == 0
    # The next request: alone, its prompt's first block a prefix-cache hit. Other rows beside it
    # change a bf16 model's rounding as another path does; an fp32 model's, fp32's only.
    (again,) = llm.generate(TEXTS[:1], PARAMS)
    assert again.outputs[0].finish_reason == "length"
    alone = max(u, path_rounding(case["dtype"], same_path=False))
    if alone == 0.0:
        assert again.outputs[0].token_ids == got[0][0]
    else:
        agreeing_prefix(trace(again.outputs[0]), got[0], alone)
    assert llm.engine.kv.num_used_blocks == 0
