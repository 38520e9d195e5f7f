"""Stopping and incremental text on stories260K: stop strings, stop ids, EOS, max_tokens, streaming.

Through `kvgen.LLM` / its engine where the model's own output is needed, and through `Request` /
`Sequence.append_token` with the model's real tokenizer where the test needs to choose the tokens
(multibyte characters split over byte-fallback tokens).
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgen import LLM, SamplingParams
from kvgen.scheduling.sequence import Request

GREEDY = dict(temperature=0)
REF_TOKENS = 40
_ids = itertools.count()




@pytest.fixture(scope="module")
def llm(stories_bin) -> LLM:
    return LLM(stories_bin)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.tokenizer


@pytest.fixture(scope="module")
def ref(llm):
    """The greedy story from BOS: 'Once upon a time, there was a little girl named Lily. ...'."""
    out = llm.generate("", SamplingParams(max_tokens=REF_TOKENS, **GREEDY))[0]
    assert out.text.startswith("Once upon a time, there was a little girl named Lily.")
    assert out.finish_reason == "length" and len(out.token_ids) == REF_TOKENS
    return out


def stream(llm: LLM, prompt, params: SamplingParams):
    """Runs one request through the engine step by step; returns (text deltas, final output)."""
    request_id = f"stream-{next(_ids)}"
    llm.engine.add_request(request_id, prompt, params)
    deltas, final = [], None
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            assert out.request_id == request_id
            deltas.append(out.outputs[0].new_text)
            assert out.outputs[0].text == "".join(deltas)  # text so far is what was streamed so far
            final = out
    assert final is not None and final.finished
    return deltas, final


def feed(tok, token_ids: list[int], prompt: list[int] | None = None, **params):
    """Appends chosen token ids to a fresh sequence one at a time; returns (deltas, sequence)."""
    request = Request(f"feed-{next(_ids)}", prompt or [tok.bos_token_id], SamplingParams(**params), tok)
    seq = request.sequences[0]
    deltas = []
    for t in token_ids:
        assert not seq.is_finished
        deltas.append(seq.append_token(t, None))
    return deltas, seq


# -- stop strings -----------------------------------------------------------------------------


@pytest.mark.parametrize("stop", [
    ["Lily"],  # a whole word
    ["girl named"],  # spans several tokens
    ["ttle"],  # starts inside a token ("little")
    [","],  # a single character that appears early
    ["park", "little"],  # several: the earliest occurrence wins
    ["Lily", "Lily."],  # overlapping stop strings
])
def test_stop_string_cuts_right_before_its_first_occurrence(llm, tok, ref, stop):
    at = min(ref.text.find(s) for s in stop if s in ref.text)
    deltas, out = stream(llm, "", SamplingParams(max_tokens=REF_TOKENS, stop=stop, **GREEDY))
    assert out.finish_reason == "stop"
    assert out.text == ref.text[:at]
    assert "".join(deltas) == out.text
    # generation stopped at the token that completed the stop string
    n = len(out.token_ids)
    assert out.token_ids == ref.token_ids[:n]
    assert any(s in tok.decode([1, *out.token_ids]) for s in stop)
    assert not any(s in tok.decode([1, *out.token_ids[:-1]]) for s in stop)


def test_stop_string_spanning_several_tokens(llm, tok, ref):
    stop = "there was a little"
    assert len(tok.encode(stop, add_special_tokens=False)) >= 3
    out = llm.generate("", SamplingParams(max_tokens=REF_TOKENS, stop=[stop], **GREEDY))[0]
    assert (out.text, out.finish_reason) == ("Once upon a time, ", "stop")


@pytest.mark.parametrize("stop", [["zebra"], ["Lily!", "a big, blue", "<END>"]])
def test_stop_string_that_never_appears_changes_nothing(llm, ref, stop):
    # "Lily!" / "a big, blue" have prefixes in the story, and so does one ending like the story:
    # text held back while it might start a stop string must come out in the end.
    stop = [*stop, ref.text[-5:] + "<END>"]
    deltas, out = stream(llm, "", SamplingParams(max_tokens=REF_TOKENS, stop=stop, **GREEDY))
    assert (out.text, out.token_ids, out.finish_reason) == (ref.text, ref.token_ids, "length")
    assert "".join(deltas) == ref.text


def test_text_that_might_start_a_stop_string_is_held_back_then_released(tok):
    ids = tok.encode("Once upon a time Lily", add_special_tokens=False)
    deltas, seq = feed(tok, ids, max_tokens=50, stop=["Lily!"])
    assert "".join(deltas) == "Once upon a time "  # "Lily" is held: it could be the start of "Lily!"
    assert seq.text == "Once upon a time "
    assert seq.append_token(tok.eos_token_id, None) == "Lily"  # EOS releases it
    assert (seq.text, seq.finish_reason) == ("Once upon a time Lily", "stop")


def test_held_back_text_is_released_at_max_tokens(tok):
    ids = tok.encode("Once upon a time Lily", add_special_tokens=False)
    deltas, seq = feed(tok, ids, max_tokens=len(ids), stop=["Lily!"])
    assert "".join(deltas) == seq.text == "Once upon a time Lily"
    assert seq.finish_reason == "length"


STORY = 'Once upon a time, there was a little girl named Lily. She said, "I like café, 你好 and 😀!" The end.'


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_stop_strings_stop_where_the_first_one_completes(tok, data):
    ids = tok.encode(STORY, add_special_tokens=False)
    text = STORY
    assert tok.decode([1, *ids]) == text
    substring = st.integers(0, len(text) - 1).flatmap(
        lambda i: st.integers(i + 1, min(len(text), i + 12)).map(lambda j: text[i:j]))
    stops = data.draw(st.lists(substring | st.sampled_from(["zebra", text[-4:] + "#", "Lily!"]),
                               min_size=1, max_size=3))
    request = Request(f"prop-{next(_ids)}", [1], SamplingParams(max_tokens=len(ids), stop=stops), tok)
    seq = request.sequences[0]
    deltas = []
    for t in ids:
        deltas.append(seq.append_token(t, None))
        assert "\ufffd" not in deltas[-1]
        if seq.is_finished:
            break
    out = seq.text
    assert "".join(deltas) == out and text.startswith(out)
    found = [(text.find(s), text.find(s) + len(s)) for s in stops if s in text]
    if not found:
        assert (out, seq.finish_reason) == (text, "length")
        return
    assert seq.finish_reason == "stop"
    p = len(out)
    assert any(text.startswith(s, p) for s in stops)  # the output ends right before a stop string
    first_end = min(end for _, end in found)
    assert p <= min(start for start, end in found if end == first_end)  # ... the first to complete
    assert all(start >= p or end > first_end for start, end in found)  # and none complete before it


# -- stop token ids, EOS, max_tokens ------------------------------------------------------------


def test_stop_token_ids(llm, tok, ref):
    token = ref.token_ids[12]
    first = ref.token_ids.index(token)
    out = llm.generate("", SamplingParams(max_tokens=REF_TOKENS, stop_token_ids=[token], **GREEDY))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref.token_ids[: first + 1]  # the stop token is the last token
    assert out.text == tok.decode([1, *ref.token_ids[:first]])  # but its text is not in the output


@pytest.fixture(scope="module")
def near_the_end(llm, tok):
    """Token ids of a story a few tokens before the model ends it (llama2.c models emit BOS to end)."""
    prompt = 'Lily smiled and said, "Thank you, mom!" They were happy.'
    story = llm.generate(prompt, SamplingParams(max_tokens=400, **GREEDY))[0]
    assert story.finish_reason == "stop" and story.token_ids[-1] in tok.stop_token_ids
    return story.prompt_token_ids + story.token_ids[:-8], story.token_ids[-8:]


def test_eos_stops_unless_ignore_eos(llm, tok, near_the_end):
    prompt, ending = near_the_end
    assert tok.stop_token_ids >= {1, 2}  # EOS, and BOS for llama2.c models
    out = llm.generate([prompt], SamplingParams(max_tokens=30, **GREEDY))[0]
    assert (out.token_ids, out.finish_reason) == (ending, "stop")
    assert out.text == tok.decode(prompt + ending)[len(tok.decode(prompt)):]  # nothing of the end token

    out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    assert out.token_ids[:8] == ending  # went on past the end token

    # ignore_eos does not switch off explicit stop token ids
    out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[ending[-1]],
                                                **GREEDY))[0]
    assert (out.token_ids, out.finish_reason) == (ending, "stop")


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_gives_length_with_exactly_that_many_tokens(llm, ref, max_tokens):
    for params in (SamplingParams(max_tokens=max_tokens, **GREEDY), SamplingParams(max_tokens=max_tokens, seed=5)):
        out = llm.generate("Once upon a time", params)[0]
        assert out.finish_reason == "length"
        assert len(out.token_ids) == max_tokens
    out = llm.generate("", SamplingParams(max_tokens=max_tokens, **GREEDY))[0]
    assert out.token_ids == ref.token_ids[:max_tokens]


# -- streaming and multibyte text ---------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["Lily said é", "你好", "The cat 😀 was happy", "café 你好 😀!"])
def test_streamed_deltas_concatenate_to_the_text_without_replacement_chars(llm, tok, prompt):
    if "你" in prompt or "😀" in prompt:
        assert any(t in range(3, 259) for t in tok.encode(prompt))  # byte-fallback tokens <0x00>..<0xFF>
    deltas, out = stream(llm, prompt, SamplingParams(max_tokens=24, **GREEDY))
    assert "".join(deltas) == out.text
    assert all("\ufffd" not in d for d in deltas) and "\ufffd" not in out.text
    assert out.text == tok.decode(out.prompt_token_ids + out.token_ids)[len(tok.decode(out.prompt_token_ids)):]
    assert out.text.strip()


def test_sampled_stream_concatenates_to_the_text(llm):
    deltas, out = stream(llm, "你好", SamplingParams(max_tokens=24, seed=3, top_k=40, stop=["."]))
    assert "".join(deltas) == out.text
    again = llm.generate("你好", SamplingParams(max_tokens=24, seed=3, top_k=40, stop=["."]))[0]
    assert (again.text, again.token_ids) == (out.text, out.token_ids)


def test_multibyte_characters_split_over_byte_tokens(tok):
    one = tok.encode("你", add_special_tokens=False)
    byte_tokens = [t for t in one if tok.decode([t]) == "\ufffd"]
    assert len(byte_tokens) == 3  # 你 = E4 BD A0: three byte-fallback tokens, each alone not a character
    text = "你好😀 é!"
    ids = tok.encode(text, add_special_tokens=False)
    deltas, seq = feed(tok, ids, max_tokens=50)
    assert "".join(deltas) == seq.text == text
    assert all("\ufffd" not in d for d in deltas)
    # nothing comes out until a character is complete, then exactly that character
    assert [d for d in deltas if d] == ["你", "好", "😀", " ", "é", "!"]
    assert deltas[:4] == ["", "", "", "你"]


def test_stop_string_made_of_multibyte_characters(tok):
    ids = tok.encode("你好😀 é!", add_special_tokens=False)
    deltas, seq = feed(tok, ids[:11], max_tokens=50, stop=["😀"])
    assert seq.is_finished and seq.finish_reason == "stop"
    assert seq.text == "".join(deltas) == "你好"
    assert len(seq.output_token_ids) == 11  # stopped at the emoji's last byte

    deltas, seq = feed(tok, ids, max_tokens=len(ids), stop=["好😀 x"])  # a prefix appears, then diverges
    assert seq.text == "".join(deltas) == "你好😀 é!" and seq.finish_reason == "length"
    assert all("\ufffd" not in d for d in deltas)


def test_character_split_between_prompt_and_output(tok):
    ni = tok.encode("你", add_special_tokens=False)  # [▁, E4, BD, A0]
    deltas, seq = feed(tok, [ni[-1], *tok.encode("好", add_special_tokens=False)[1:]], prompt=[1, *ni[:-1]],
                       max_tokens=10)
    assert "".join(deltas) == seq.text == "你好"


def test_async_llm_streams_the_same_text(llm):
    from kvgen.async_llm import AsyncLLM

    async def run():
        engine = AsyncLLM(llm.engine)
        try:
            deltas, last = [], None
            async for out in engine.generate("café 你好", SamplingParams(max_tokens=20, stop=["park"], **GREEDY)):
                deltas.append(out.outputs[0].new_text)
                last = out
            return deltas, last
        finally:
            await engine.shutdown()

    deltas, last = asyncio.run(run())
    want = llm.generate("café 你好", SamplingParams(max_tokens=20, stop=["park"], **GREEDY))[0]
    assert "".join(deltas) == last.text == want.text
    assert all("\ufffd" not in d for d in deltas)
    assert last.finish_reason == want.finish_reason
