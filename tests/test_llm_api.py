"""The offline Python API, `LLM(model).generate(prompts, params)`, on stories260K."""

from __future__ import annotations

import pytest

from kvgen import LLM, CompletionOutput, InvalidRequestError, RequestOutput, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPTS = ["Once upon a time", "Lily and Tom went to the park.", "The dog"]




@pytest.fixture(scope="module")
def llm(stories_bin) -> LLM:
    return LLM(stories_bin)


@pytest.fixture(scope="module")
def singles(llm) -> dict[str, RequestOutput]:
    return {p: llm.generate(p, GREEDY)[0] for p in PROMPTS}


def test_a_string_prompt(llm, singles):
    outs = llm.generate("Once upon a time", GREEDY)
    assert len(outs) == 1
    out = outs[0]
    assert isinstance(out, RequestOutput) and out.finished
    assert out.prompt == "Once upon a time"
    assert out.prompt_token_ids == llm.tokenizer.encode("Once upon a time") and out.prompt_token_ids[0] == 1
    assert out.text == singles["Once upon a time"].text and out.text.startswith(",")
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(out.prompt_token_ids + out.token_ids)[len("Once upon a time"):]
    (completion,) = out.outputs
    assert isinstance(completion, CompletionOutput)
    assert (completion.text, completion.token_ids, completion.finish_reason) == (out.text, out.token_ids, "length")
    assert out.metrics.ttft is not None and out.metrics.ttft >= 0


def test_a_list_of_strings_comes_back_in_order(llm, singles):
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt for o in outs] == PROMPTS
    assert [o.token_ids for o in outs] == [singles[p].token_ids for p in PROMPTS]
    assert [o.text for o in outs] == [singles[p].text for p in PROMPTS]
    assert len({o.request_id for o in outs}) == len(PROMPTS)


def test_token_id_prompts(llm, singles):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(ids, GREEDY)  # a list of token-id lists
    assert [o.prompt_token_ids for o in outs] == ids
    assert [o.token_ids for o in outs] == [singles[p].token_ids for p in PROMPTS]
    assert all(o.prompt is None for o in outs)
    (one,) = llm.generate(ids[1], GREEDY)  # a single token-id list is one prompt
    assert one.prompt_token_ids == ids[1] and one.token_ids == singles[PROMPTS[1]].token_ids
    (mixed_a, mixed_b) = llm.generate([PROMPTS[0], ids[2]], GREEDY)
    assert mixed_a.token_ids == singles[PROMPTS[0]].token_ids and mixed_b.token_ids == singles[PROMPTS[2]].token_ids


def test_one_params_per_prompt(llm, singles):
    params = [SamplingParams(temperature=0, max_tokens=3), GREEDY, SamplingParams(max_tokens=5, seed=11)]
    outs = llm.generate(PROMPTS, params)
    assert outs[0].token_ids == singles[PROMPTS[0]].token_ids[:3]
    assert outs[1].token_ids == singles[PROMPTS[1]].token_ids
    assert len(outs[2].token_ids) == 5
    assert outs[2].token_ids == llm.generate(PROMPTS[2], params[2])[0].token_ids  # seeded: repeatable


def test_params_list_of_the_wrong_length(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(PROMPTS, [GREEDY, GREEDY])
    assert not llm.engine.has_unfinished()


def test_default_params(llm):
    (out,) = llm.generate("Once upon a time")
    assert len(out.token_ids) == SamplingParams().max_tokens and out.finish_reason == "length"


def test_empty_prompt_starts_from_bos(llm):
    bos = llm.tokenizer.bos_token_id
    assert bos == 1
    a, b = llm.generate(["", []], GREEDY)
    assert a.prompt_token_ids == b.prompt_token_ids == [bos]
    assert a.token_ids == b.token_ids
    assert a.text.startswith("Once upon a time")
    assert llm.generate([], GREEDY) == []


def test_n_completions(llm):
    (out,) = llm.generate("The dog", SamplingParams(n=3, seed=40, max_tokens=6))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    # completion i is the run with seed + i
    assert out.outputs[2].token_ids == llm.generate("The dog", SamplingParams(seed=42, max_tokens=6))[0].token_ids


def test_kv_cache_modes_give_identical_greedy_tokens(stories_bin, llm):
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (20, 9, 14)]
    want = [o.token_ids for o in llm.generate(PROMPTS, params)]
    for mode in ("contiguous", "none"):
        other = LLM(stories_bin, kv_cache=mode)
        assert [o.token_ids for o in other.generate(PROMPTS, params)] == want, mode
    # a small block size and a sliver of KV memory (prompts wait for blocks) change nothing either
    small = LLM(stories_bin, block_size=4, num_kv_blocks=24, max_num_seqs=2)
    assert [o.token_ids for o in small.generate(PROMPTS, params)] == want


@pytest.mark.parametrize("prompt", [[1, 512], [1, -1], [1, 10**9], [1, 2.0], [1, "a"]])
def test_token_id_out_of_vocab(llm, prompt):
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([prompt], GREEDY)


def test_a_bad_request_leaves_nothing_behind(llm, singles):
    with pytest.raises(InvalidRequestError):
        llm.generate(["Once upon a time", [1, 9999]], GREEDY)
    assert not llm.engine.has_unfinished()
    assert llm.generate("The dog", GREEDY)[0].token_ids == singles["The dog"].token_ids


def test_prompt_too_long(llm):
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate("Once upon a time", SamplingParams(max_tokens=600))
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate([[1] + [400] * 600], GREEDY)
    assert not llm.engine.has_unfinished()


def test_progress_bar(llm, capsys):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=True)
    assert len(outs) == 3
    assert "requests" in capsys.readouterr().err
