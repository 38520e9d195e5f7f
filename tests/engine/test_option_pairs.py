"""Every engine and sampling option against every other, pairwise (kvgen.option_space declares them,
their tested values and the pairs refused by design; tests/support/pairwise.py generates the cases).

Each allowed case runs three greedy prompts (logprobs on) and checks:
- each completion against the plain engine options (kvgen.option_space.PLAIN) run with the case's
  numerics (dtype, quantization, activations) and its request (kv_policy, grammar): a bounded policy legitimately
  changes the output, so it is compared with itself. Equal tokens and logprobs within fp32 rounding
  (logprob_gap) where nothing lossy differs; else within the stated bound (tests/support/tolerances.py): the
  pool's rounding, a bf16 model's other path, or a quantized model's activation rounding;
- that every KV block went back, and that the engine then serves a plain request;
- never an internal error: a finish_reason "error" or an exception fails the case.
Each refused pair runs in a case of its own (the plain values and the pair) and must give its
declared error; an engine that refuses a request then still serves the next.
The lossy numerics themselves (bf16, int8, int4, a GGUF's own blocks) are checked against the fp32
plain path with their stated bound (WEIGHT_ROUNDING).

Fast (default suite): stories260K, tensor_parallel_size 1. Slow (-m slow): the full space with
tensor_parallel_size 2, on stories260K and on the SmolLM2 Q4_1 file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvgen import LLM, SamplingParams
from kvgen.option_space import BY_NAME, OPTIONS, PLAIN, REFUSED, kind, refusal_of, refused, refused_pairs_markdown
from kvgen.sample.grammar import GrammarSpec
from tests.support.pairwise import all_pairs, allowed_pairs, pairs_of
from tests.support.tolerances import (
    ACTIVATION_ROUNDING, KV_ROUNDING, WEIGHT_ROUNDING, agreeing_prefix_within, kv_bound, logprob_gap, trace,
)

TEXTS = ["Once upon a time", "Lily had a red ball and", "Tom"]
MAX_TOKENS = 24
GRAMMARS = {
    None: None,
    "json_schema": GrammarSpec.json_schema({"type": "object", "properties": {"name": {"type": "string"}},
                                            "required": ["name"]}),
    "regex": GrammarSpec.regex(r"[A-Za-z ]{1,60}\."),
}
SPACE = {o.name: o.tested for o in OPTIONS}
FAST_SPACE = SPACE | {"tensor_parallel_size": (1,)}
FAST = all_pairs(FAST_SPACE, refused)
FULL = all_pairs(SPACE, refused)
# One case per refused pair of tested values: the plain values, and the pair.
REFUSAL_CASES = [PLAIN | {a: va, b: vb} for (a, va), (b, vb) in sorted(
    allowed_pairs(SPACE) - allowed_pairs(SPACE, refused), key=repr)]
ENGINE_OPTIONS = [o.name for o in OPTIONS if o.where == "engine"]


def case_id(case: dict) -> str:
    short = {True: "on", False: "off", None: "none"}
    return "-".join(short.get(v, str(v)) if isinstance(v, (bool, type(None))) else str(v) for v in case.values())


def params_of(case: dict) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=case["grammar"] is None, logprobs=2,
                          n=case["n"], kv_policy=case["kv_policy"], grammar=GRAMMARS[case["grammar"]])


def build(model, case: dict) -> LLM:
    """The case's engine; speculation on every step (the adaptive switch would skip most of them)."""
    spec = {"adaptive_speculation": False} if case["speculative_method"] else {}
    return LLM(model, block_size=4, num_kv_blocks=256, **{name: case[name] for name in ENGINE_OPTIONS}, **spec)


# -- the generator and the declared space ----------------------------------------------------------

def test_the_cases_cover_every_allowed_pair_and_no_refused_one():
    for space, cases in ((FAST_SPACE, FAST), (SPACE, FULL)):
        names = list(space)
        covered = set().union(*(pairs_of(c, names) for c in cases))
        assert covered == allowed_pairs(space, refused)
        assert all(refusal_of(c) is None for c in cases)
    product = 1
    for values in SPACE.values():
        product *= len(values)
    assert len(FULL) < 60 < product  # 14 options: 294,912 combinations of the tested values


def test_the_generator_covers_a_constrained_toy_space():
    space = {"a": (1, 2, 3), "b": ("x", "y"), "c": (True, False), "d": (0, 1, 2)}
    no_3x = lambda a, va, b, vb: (a, va, b, vb) == ("a", 3, "b", "x")  # noqa: E731
    cases = all_pairs(space, no_3x)
    assert set().union(*(pairs_of(c, list(space)) for c in cases)) == allowed_pairs(space, no_3x)
    assert all(not (c["a"] == 3 and c["b"] == "x") for c in cases)
    assert len(cases) <= 10 and all_pairs(space, no_3x) == cases  # small, deterministic


def test_every_refusal_names_tested_or_declared_values():
    for r in REFUSED:
        for name, values in (r.first, r.second):
            declared = {kind(name, v) for v in BY_NAME[name].values if v != "1.."} | {"> 1"}
            assert set(values) <= declared, (name, values)
    assert {refusal_of(c).when for c in REFUSAL_CASES} == {"engine", "request"}


def test_the_refusals_follow_the_engines_constants():
    from kvgen.engine.speculative.speculator import UNSPECULATED_POLICIES

    (spec,) = [r for r in REFUSED if (r.first[0], r.second[0]) == ("speculative_method", "kv_policy")]
    assert spec.second[1] == UNSPECULATED_POLICIES


def test_the_docs_list_the_declared_refusals():
    text = (Path(__file__).resolve().parents[2] / "docs" / "options.md").read_text()
    start = text.index("-->\n", text.index("<!-- refused pairs")) + len("-->\n")
    assert text[start:text.index("<!-- end of refused pairs -->")] == refused_pairs_markdown(), \
        "docs/options.md: regenerate the table with python -m kvgen.option_space"


# -- the references ----------------------------------------------------------------------------------

MODELS = {"stories260K": None, "smollm2": "smollm_gguf"}


@pytest.fixture(scope="module")
def references(request):
    """references(model, case) -> the plain options' traces, per prompt, for the case's numerics and
    request: every one a model needs computed in one batch per (dtype, quantization), once."""
    cache: dict = {}

    def get(model_name: str, case: dict) -> list:
        numerics = (case["dtype"], case["quantization"], case["activations"])
        key = (model_name, *numerics, case["kv_policy"], case["grammar"])
        if key not in cache:
            fixture = MODELS[model_name]
            model = request.getfixturevalue(fixture) if fixture else None
            wanted = [(p, g) for p in SPACE["kv_policy"] for g in SPACE["grammar"]]
            llm = LLM(model, block_size=4, num_kv_blocks=512, dtype=case["dtype"], quantization=case["quantization"],
                      activations=case["activations"])
            params = [params_of(PLAIN | {"kv_policy": p, "grammar": g}) for p, g in wanted for _ in TEXTS]
            outs = llm.generate(TEXTS * len(wanted), params)
            for i, (p, g) in enumerate(wanted):
                traces = [trace(o.outputs[0]) for o in outs[i * len(TEXTS):(i + 1) * len(TEXTS)]]
                cache[(model_name, *numerics, p, g)] = traces
            llm.close()
        return cache[key]

    return get


def rounding(model_name: str, case: dict) -> float:
    """The relative error a case may add to its reference's K/V and activations (0: fp32's only): the
    pool's rounding, a bf16 model's other path (batching, chunking, another kernel round elsewhere:
    on both sides, as the reference runs its prompts in one batch of 36), and a quantized model's
    int8 activations, summed (bf16 + int8 weights + an int8 pool on stories260K measured a gain of
    24 on that sum, 61 on its largest term alone; SmolLM2's bf16 contiguous path 34 on one bf16 u)."""
    pool = case["kv_cache_dtype"]
    gguf_blocks = case["quantization"] == "auto" and model_name != "stories260K"
    quantized = case["quantization"] in ("int8", "int4") or gguf_blocks
    if pool == "auto" and quantized and case["dtype"] == "float32" and case["kv_cache"] == "paged":
        pool = "bfloat16"  # packed weights default to 16-bit pools (kvgen/cache/kv_dtype.py)
    u_pool = 0.0 if pool in ("auto", case["dtype"], "float32") else KV_ROUNDING[pool]
    u_path = 2 * KV_ROUNDING["bfloat16"] if case["dtype"] == "bfloat16" else 0.0  # the reference's own batch too
    if case["dtype"] == "bfloat16" and case["tensor_parallel_size"] > 1:
        u_path += KV_ROUNDING["bfloat16"]  # each row-parallel layer's all-reduce rounds its partial sums
    return u_pool + u_path + (ACTIVATION_ROUNDING if quantized else 0.0)  # to first order, errors add


def bound_for(llm: LLM, u: float):
    if u == 0.0:
        config, context = llm.engine.model_config, llm.engine.max_model_len
        return lambda logprob: logprob_gap(config, context, abs(logprob))
    return lambda logprob: kv_bound(u, logprob)


def used_blocks(llm: LLM) -> int:
    kv = getattr(llm.engine, "kv", None)
    return kv.num_used_blocks if kv is not None else llm.engine.stats().kv_blocks_used


def serves_a_plain_request(llm: LLM, want: list, bound) -> None:
    (again,) = llm.generate(TEXTS[:1], params_of(PLAIN | {"n": 1}))
    assert again.outputs[0].finish_reason == "length", again.outputs[0].finish_reason
    agreeing_prefix_within(trace(again.outputs[0]), want[0], bound)
    assert used_blocks(llm) == 0


# -- the matrix ----------------------------------------------------------------------------------------

def run_case(model_name: str, case: dict, references) -> None:
    want = references(model_name, case)
    plain_want = references(model_name, case | {"kv_policy": "full", "grammar": None})
    llm = build(MODEL_PATHS[model_name], case)
    try:
        outs = llm.generate(TEXTS, params_of(case))
        bound = bound_for(llm, rounding(model_name, case))
        for out, w in zip(outs, want, strict=True):
            assert len(out.outputs) == case["n"]
            for completion in out.outputs:
                assert completion.finish_reason in ("length", "stop"), completion.finish_reason
                agreeing_prefix_within(trace(completion), w, bound)
        assert used_blocks(llm) == 0
        serves_a_plain_request(llm, plain_want, bound)
    finally:
        llm.close()


MODEL_PATHS: dict[str, object] = {"stories260K": None}


@pytest.fixture(scope="module")
def smollm_path(smollm_gguf):
    MODEL_PATHS["smollm2"] = smollm_gguf
    return smollm_gguf


@pytest.mark.parametrize("case", FAST, ids=map(case_id, FAST))
def test_stories_pairs(case, references):
    run_case("stories260K", case, references)


@pytest.mark.slow
@pytest.mark.parametrize("case", FULL, ids=map(case_id, FULL))
def test_stories_pairs_full(case, references):
    run_case("stories260K", case, references)


# One case on SmolLM2 in the default suite: of the paged fp32 cases on its own packed Q4_1 blocks, the
# one furthest from the plain path (two model loads, about 15 s).
SMOLLM_FAST = max((c for c in FULL if (c["dtype"], c["quantization"], c["kv_cache"], c["tensor_parallel_size"])
                   == ("float32", "auto", "paged", 1)),
                  key=lambda c: sum(c[k] != PLAIN[k] for k in c))


def test_smollm2_one_far_case(references, smollm_path):
    run_case("smollm2", SMOLLM_FAST, references)


# Measured beyond its bound: one logprob of one step 1.2 off (-2.58 against -1.36), a gain of 44 on the
# summed u where KV_GAIN declares 32; TP=2 without speculation or the fp16 pool shows it too, TP=1 not.
OUTLIERS = {"bfloat16-int8-float16-paged-window:8-ngram-none-1-on-512-off-native-2-int8x2": (
    "bug? SmolLM2 bf16 + int8 weights under tensor_parallel_size 2: a logprob 1.2 off the TP=1 path at "
    "one step, beyond the stated bf16/int8 bound (gain 44 > KV_GAIN 32); not yet explained")}


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    pytest.param(c, marks=[pytest.mark.xfail(reason=OUTLIERS[case_id(c)], strict=False)]
                 if case_id(c) in OUTLIERS else [])
    for c in FULL], ids=map(case_id, FULL))
def test_smollm2_pairs_full(case, references, smollm_path):
    run_case("smollm2", case, references)


# -- refused pairs ---------------------------------------------------------------------------------

def check_refusal(model_name: str, case: dict, references) -> None:
    refusal = refusal_of(case)
    if refusal.when == "engine":
        with pytest.raises(refusal.error, match=re.escape(refusal.message)):
            build(MODEL_PATHS[model_name], case)
        return
    llm = build(MODEL_PATHS[model_name], case)
    try:
        with pytest.raises(refusal.error, match=re.escape(refusal.message)):
            llm.generate(TEXTS, params_of(case))
        assert used_blocks(llm) == 0
        u = rounding(model_name, case)
        serves_a_plain_request(llm, references(model_name, case | {"kv_policy": "full", "grammar": None}),
                               bound_for(llm, u))
    finally:
        llm.close()


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=[pytest.mark.slow] if c["tensor_parallel_size"] > 1 and refusal_of(c).when == "request"
                 else [])
    for c in REFUSAL_CASES], ids=map(case_id, REFUSAL_CASES))
def test_stories_refused_pairs(case, references):
    check_refusal("stories260K", case, references)


@pytest.mark.slow
@pytest.mark.parametrize("case", REFUSAL_CASES, ids=map(case_id, REFUSAL_CASES))
def test_smollm2_refused_pairs(case, references, smollm_path):
    check_refusal("smollm2", case, references)


# -- the lossy numerics against the fp32 plain path ----------------------------------------------------

BASES = [(d, q) for d in SPACE["dtype"] for q in SPACE["quantization"] if (d, q) != ("float32", "none")]


def weight_rounding(model_name: str, dtype: str, quantization: str) -> float:
    gguf_blocks = quantization == "auto" and model_name != "stories260K"
    weights = WEIGHT_ROUNDING["int4"] if gguf_blocks else WEIGHT_ROUNDING.get(quantization, 0.0)
    return weights + WEIGHT_ROUNDING.get(dtype, 0.0) + (ACTIVATION_ROUNDING if weights else 0.0)


def check_base(model_name: str, dtype: str, quantization: str, references) -> None:
    case = PLAIN | {"dtype": dtype, "quantization": quantization}
    got, want = references(model_name, case), references(model_name, PLAIN)
    u = weight_rounding(model_name, dtype, quantization)
    for g, w in zip(got, want, strict=True):
        if u == 0.0:  # stories260K's quantization "auto" is its float weights
            assert g == w
        else:
            agreeing_prefix_within(g, w, lambda logprob: kv_bound(u, logprob))


@pytest.mark.parametrize(("dtype", "quantization"), BASES)
def test_stories_lossy_numerics_within_their_bound(dtype, quantization, references):
    check_base("stories260K", dtype, quantization, references)


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "quantization"), BASES)
def test_smollm2_lossy_numerics_within_their_bound(dtype, quantization, references, smollm_path):
    check_base("smollm2", dtype, quantization, references)


# -- what the CLI user gets ------------------------------------------------------------------------------

CLI_REFUSALS = [c for c in REFUSAL_CASES if c["tensor_parallel_size"] == 1 or refusal_of(c).when == "engine"]


def cli_flags(case: dict) -> list[str]:
    """The CLI flags of a case's values that differ from PLAIN (the refused pair: value options only)."""
    return [str(a) for name, v in case.items() if v != PLAIN[name] for a in (BY_NAME[name].flag, v)]


@pytest.mark.parametrize("case", CLI_REFUSALS, ids=map(case_id, CLI_REFUSALS))
def test_the_cli_refuses_each_pair_in_one_line(capsys, case):
    from tests.test_cli import assert_user_error, run

    code, _, err = run(capsys, "generate", "--prompt", "Tom", "--max-tokens", "4", *cli_flags(case))
    assert_user_error(code, err, refusal_of(case).message)
