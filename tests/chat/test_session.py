"""ChatSession on the real engine (stories260K, which has no chat template: role-line prompts)."""

from __future__ import annotations

import pytest

from kvgen import LLM, SamplingParams
from kvgen.chat.session import PLAIN_STOP, ChatSession
from kvgen.errors import InvalidRequestError


@pytest.fixture(scope="module")
def engine():
    return LLM(max_model_len=96, num_kv_blocks=32).engine


def session(engine, max_tokens: int = 24) -> ChatSession:
    return ChatSession(engine, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def test_replies_stream_and_the_plain_fallback_stops_at_the_next_user_line(engine):
    chat = session(engine)
    assert PLAIN_STOP in chat.params.stop
    text = "".join(chat.reply("Hi"))
    assert chat.last_prompt == "<|user|>\nHi\n<|assistant|>\n"
    assert chat.transcript() == {"messages": [{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": text}]}
    assert chat.last_stats.reply_tokens > 0 and not chat.last_stats.stopped


def test_a_full_context_drops_whole_turns_from_the_prompt_only(engine):
    chat = session(engine, max_tokens=40)
    for name in ("Lily", "Tom", "Sue"):
        "".join(chat.reply(f"Tell me about {name}."))
    assert chat.dropped_turns >= 1
    assert chat.messages[chat.first_kept].role == "user"
    assert chat.last_prompt.startswith(f"<|user|>\n{chat.messages[chat.first_kept].content}\n")
    assert chat.last_stats.prompt_tokens + 40 <= engine.max_model_len
    assert len(chat.transcript()["messages"]) == 6


def test_a_turn_that_alone_cannot_fit_is_taken_back(engine):
    chat = session(engine, max_tokens=40)
    with pytest.raises(InvalidRequestError, match="does not fit the context"):
        chat.reply("Once upon a time " * 20)
    assert chat.messages == [] and not engine.has_unfinished()


def test_closing_the_stream_stops_the_reply_and_keeps_what_it_said(engine):
    chat = session(engine)
    pieces = chat.reply("Hi")
    said = next(pieces) + next(pieces)
    pieces.close()
    assert not engine.has_unfinished() and engine.stats().kv_blocks_used == 0
    assert chat.last_stats.stopped and chat.messages[-1].content == said


def test_system_message_and_reset(engine):
    chat = session(engine)
    chat.set_system("Be brief.")
    first = "".join(chat.reply("Hi"))
    chat.reset()
    assert chat.messages == [] and chat.last_stats is None
    assert "".join(chat.reply("Hi")) == first
    assert chat.last_prompt.startswith("<|system|>\nBe brief.\n<|user|>\nHi\n")
    chat.set_system("")
    assert chat.transcript()["messages"][0]["role"] == "user"
