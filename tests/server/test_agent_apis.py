"""The agent-facing APIs with the real `anthropic` and `openai` clients against a live `kvgen serve` on
the real Qwen2.5-Coder-0.5B-Instruct (its GGUF template teaches hermes tool calls): a complete agent
loop in each API (tools offered -> the model calls one with valid arguments -> the client sends the
result -> the model answers), streamed and not, with the same answer both ways; Anthropic's event
sequence; a Claude-Code-style conversation whose long system prompt is served from the prefix cache."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.agents import KEY, serve

MODEL = "qwen-coder"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "description": "the city's name"}},
           "required": ["city"]}
A_TOOLS = [{"name": "get_weather", "description": "Get the current weather in a city", "input_schema": WEATHER}]
O_TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
            "parameters": WEATHER}]
QUESTION = "What is the weather in Paris?"
RESULT = "Sunny, 22 degrees Celsius."
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def url(qwen_coder_gguf) -> Iterator[str]:
    with serve("--model", str(qwen_coder_gguf), "--served-model-name", MODEL, "--max-model-len", "4096",
               "--kv-cache-memory", "256MiB", "--max-num-seqs", "4") as url:
        yield url


@pytest.fixture(scope="module")
def claude(url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oai(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)


def _blocks(message) -> list[tuple]:
    return [(b.type, b.name, b.input) if b.type == "tool_use" else (b.type, getattr(b, "text", None))
            for b in message.content]


def _turn(claude, messages, stream: bool, **fields):
    fields = dict(model=MODEL, max_tokens=96, tools=A_TOOLS, messages=messages, extra_body=GREEDY) | fields
    if not stream:
        return claude.messages.create(**fields)
    with claude.messages.stream(**fields) as events:
        for _ in events:
            pass
        return events.get_final_message()


def _agent_loop(claude, stream: bool, **answer_fields) -> tuple[list, list]:
    """Tools offered -> a valid call -> the result sent back as a tool_result (with `answer_fields`, such
    as a tool_choice) -> the model's reply."""
    call_message = _turn(claude, [{"role": "user", "content": QUESTION}], stream)
    assert call_message.stop_reason == "tool_use", call_message
    (call,) = [b for b in call_message.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    assert "paris" in call.input["city"].lower()
    history = [{"role": "user", "content": QUESTION},
               {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in call_message.content]}]
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": RESULT}]}
    final = _turn(claude, history + [result], stream, **answer_fields)
    # the result reached the model's prompt, inside the template's own tool-response turn
    without = claude.messages.count_tokens(model=MODEL, messages=history + [{"role": "user", "content": "?"}],
                                           tools=A_TOOLS, **answer_fields).input_tokens
    assert final.usage.input_tokens > without and final.usage.output_tokens > 0
    assert final.stop_reason in ("end_turn", "tool_use", "max_tokens") and final.content
    for block in final.content:
        assert block.type in ("text", "tool_use")
        if block.type == "tool_use":
            jsonschema.validate(block.input, WEATHER)
    return _blocks(call_message), _blocks(final)


def test_messages_agent_loop_streamed_and_not(claude):
    """The 0.5B model calls the tool and gets the result; what it replies then is its own (greedy, it
    tends to call again): the reply is well formed and the same streamed or not."""
    assert _agent_loop(claude, stream=True) == _agent_loop(claude, stream=False)


def test_messages_event_sequence(url):
    """Anthropic's exact sequence: message_start, ping, blocks (start, deltas, stop), message_delta with
    stop_reason and usage, message_stop; each `event:` name matches its data's type."""
    body = {"model": MODEL, "max_tokens": 24, "messages": [{"role": "user", "content": "Say hello."}], "stream": True,
            **GREEDY}
    with httpx.stream("POST", f"{url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[::2]]
    data = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [d["type"] for d in data] == names
    assert re.fullmatch(r"message_start ping (content_block_start (content_block_delta )+content_block_stop )+"
                        r"message_delta message_stop", " ".join(names)), names
    assert data[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens") and data[-2]["usage"]["output_tokens"] > 0
    assert data[0]["message"]["usage"]["input_tokens"] > 0


def test_messages_forced_tool_is_valid_for_its_schema(claude):
    """tool_choice any / a named tool: decoding under the grammar, so the input always fits the schema."""
    strict = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
    tools = [{"name": "forecast", "description": "A forecast for some days", "input_schema": strict}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "forecast"}):
        message = claude.messages.create(model=MODEL, max_tokens=48, tools=tools, tool_choice=choice,
                                         messages=[{"role": "user", "content": "Forecast for Rome, 3 days."}],
                                         extra_body=GREEDY)
        (call,) = message.content
        assert call.type == "tool_use" and call.name == "forecast" and message.stop_reason == "tool_use"
        jsonschema.validate(call.input, strict)


def test_count_tokens_matches_the_prompt_the_model_gets(claude):
    messages = [{"role": "user", "content": QUESTION}]
    counted = claude.messages.count_tokens(model=MODEL, messages=messages, tools=A_TOOLS).input_tokens
    used = claude.messages.create(model=MODEL, max_tokens=1, messages=messages, tools=A_TOOLS, extra_body=GREEDY)
    assert counted == used.usage.input_tokens > 50


def _items(response) -> list[tuple]:
    return [(i.type, i.name, json.loads(i.arguments)) if i.type == "function_call" else
            (i.type, "".join(c.text for c in i.content)) for i in response.output]


def _respond(oai, stream: bool, **fields):
    fields = dict(model=MODEL, tools=O_TOOLS, max_output_tokens=96, temperature=0) | fields
    if not stream:
        return oai.responses.create(**fields)
    kinds, completed = [], None
    for event in oai.responses.create(stream=True, **fields):
        kinds.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            completed = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.completed" if completed.status == "completed" else "response.incomplete")
    return completed, kinds


def test_responses_agent_loop_streamed_and_not(oai):
    answers = {}
    for stream in (False, True):
        first = _respond(oai, stream, input=QUESTION)
        first, kinds = first if stream else (first, None)
        calls = [i for i in first.output if i.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather", first.output
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
        if stream:
            assert "response.function_call_arguments.delta" in kinds
        second = _respond(oai, stream, previous_response_id=first.id,
                          input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": RESULT}])
        second, kinds = second if stream else (second, None)
        assert second.status in ("completed", "incomplete") and second.output
        assert second.usage.input_tokens > first.usage.input_tokens
        if stream and second.output_text:
            assert "response.output_text.delta" in kinds
        answers[stream] = (_items(first), _items(second))
    assert answers[True] == answers[False]


def test_responses_stateless_with_the_whole_conversation(oai):
    """store: false, the earlier turn sent back as items (a function_call and its output)."""
    first = oai.responses.create(model=MODEL, input=QUESTION, tools=O_TOOLS, store=False, max_output_tokens=96,
                                 temperature=0)
    (call,) = [i for i in first.output if i.type == "function_call"]
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=MODEL, input="again", previous_response_id=first.id, max_output_tokens=4)
    items = [{"role": "user", "content": QUESTION},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    second = oai.responses.create(model=MODEL, input=items, tools=O_TOOLS, store=False, max_output_tokens=96,
                                  temperature=0, instructions="Answer in one sentence.")
    assert second.output and second.usage.input_tokens > first.usage.input_tokens


def test_chat_completions_read_the_models_hermes_calls(oai):
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["parameters"]}} for t in O_TOOLS]
    fields = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=tools, max_tokens=96,
                  temperature=0)
    whole = oai.chat.completions.create(**fields).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls[0].function.name == "get_weather"
    calls, finish = {}, None
    for chunk in oai.chat.completions.create(stream=True, **fields):
        for delta in chunk.choices[0].delta.tool_calls or []:
            calls[delta.index] = (delta.function.name, delta.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls.values()) == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def _prefix_hits(url) -> float:
    text = httpx.get(f"{url}/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "kvgen_prefix_cache_hits_total" or s.name == "kvgen_prefix_cache_hits")


def test_claude_code_style_conversation_hits_the_prefix_cache(claude, url):
    """A scripted multi-turn Messages conversation as a coding agent sends it: a system prompt of 1,000+
    tokens (a real agent's runs to several thousand: the same blocks, more prefill), tools, tool_use /
    tool_result turns. From the second turn on, the prompt's earlier part comes from the prefix cache."""
    rules = " ".join(f"Rule {i}: keep answers short, cite files by path, never invent tool results." for i in range(55))
    system = [{"type": "text", "text": f"You are a coding agent working in a repository. {rules}",
               "cache_control": {"type": "ephemeral"}}]
    tools = A_TOOLS + [{"name": "read_file", "description": "Read a file", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
    assert claude.messages.count_tokens(model=MODEL, system=system, messages=[{"role": "user", "content": "hi"}],
                                        tools=tools).input_tokens > 1000
    messages = [{"role": "user", "content": "Read the file README.md."}]
    turns = [{"type": "tool_result", "content": "# kvgen\nAn inference engine."},
             {"type": "text", "text": "Now tell me what the project is, in one sentence."}]
    hits = [_prefix_hits(url)]
    for turn in range(3):
        reply = claude.messages.create(model=MODEL, max_tokens=48, system=system, tools=tools, messages=messages,
                                       extra_body=GREEDY)
        hits.append(_prefix_hits(url))
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        used = [b for b in reply.content if b.type == "tool_use"]
        if turn == 2:
            break
        nxt = dict(turns[min(turn, 1)])
        if nxt["type"] == "tool_result":
            if not used:
                nxt = {"type": "text", "text": "Go on."}
            else:
                nxt["tool_use_id"] = used[0].id
        if used and nxt["type"] == "text":
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "ok"}
                                                         for u in used] + [nxt]})
        else:
            messages.append({"role": "user", "content": [nxt]})
    assert hits[2] - hits[1] > 1000 and hits[3] - hits[2] > 1000, hits


@pytest.mark.slow
def test_messages_agent_loop_on_the_1_5b(qwen_coder_15b_gguf):
    """The same loop on Qwen2.5-Coder-1.5B, which writes its calls in a ```json fence; after the result,
    with tool_choice none, it answers in text (Messages, Responses and chat completions)."""
    with serve("--model", str(qwen_coder_15b_gguf), "--served-model-name", MODEL, "--max-model-len", "4096",
               "--kv-cache-memory", "256MiB", "--max-num-seqs", "4") as url:
        claude = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=600)
        assert _agent_loop(claude, stream=True) == _agent_loop(claude, stream=False)
        # Told not to call again (tool_choice none hides the tools from the template), it answers in text.
        _, answer = _agent_loop(claude, stream=True, tool_choice={"type": "none"})
        assert answer == _agent_loop(claude, stream=False, tool_choice={"type": "none"})[1]
        assert [kind for kind, _ in answer] == ["text"] and "get_weather" not in answer[0][1], answer
        # The same loop in the Responses API: the function's output sent back, tool_choice none, a message.
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)
        replies = []
        for stream in (False, True):
            first = _respond(oai, stream, input=QUESTION)
            first = first[0] if stream else first
            (call,) = [i for i in first.output if i.type == "function_call"]
            second = _respond(oai, stream, previous_response_id=first.id, tool_choice="none",
                              input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}])
            replies.append(_items(second[0] if stream else second))
        assert replies[0] == replies[1] and [kind for kind, _ in replies[0]] == ["message"], replies
        assert "get_weather" not in replies[0][0][1]
        # And in chat completions: the call, then the tool message, then an answer under tool_choice none.
        tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                   "parameters": t["parameters"]}} for t in O_TOOLS]
        messages = [{"role": "user", "content": QUESTION}]
        call = oai.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=96,
                                           temperature=0).choices[0].message
        (tool_call,) = call.tool_calls
        messages += [call.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tool_call.id, "content": RESULT}]
        fields = dict(model=MODEL, messages=messages, tools=tools, tool_choice="none", max_tokens=96, temperature=0)
        answer = oai.chat.completions.create(**fields).choices[0]
        streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **fields))
        assert answer.finish_reason == "stop" and not answer.message.tool_calls
        assert answer.message.content == streamed and "get_weather" not in streamed
