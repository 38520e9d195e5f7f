"""The abuse suite for the agent APIs: malformed content blocks and items, unknown tools, tool results
for unknown ids, huge tool lists and oversize inputs get a 4xx at once, in the API's own error shape
(Anthropic's under /v1/messages, OpenAI's under /v1/responses); the engine never sees them, the server
goes on serving, and no KV block is left behind (also by a client that leaves a stream)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from kvgen import LLM
from kvgen.server.app import create_app
from tests.server.harness import API_KEY, Server, blocks_used, metric_samples, running

MODEL = "stories260K"
USER = [{"role": "user", "content": "Once upon a time"}]
TOOL = {"name": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
FTOOL = {"type": "function", "name": "weather", "parameters": TOOL["input_schema"]}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    app = create_app(LLM(num_kv_blocks=256, max_num_seqs=16).engine, model_name=MODEL, api_key=API_KEY)
    with running(app) as url:
        yield Server(url, app)


def _m(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 8, "messages": USER} | fields


MESSAGES_ABUSE = {
    "no max_tokens": ({"model": MODEL, "messages": USER}, 400, "max_tokens"),
    "bad block type": (_m(messages=[{"role": "user", "content": [{"type": "video", "url": "x"}]}]), 400,
                       "content blocks of type 'video' are not supported"),
    "image block": (_m(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 400, "'image'"),
    "block without text": (_m(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, "text block"),
    "not a block": (_m(messages=[{"role": "user", "content": [42]}]), 400, "None"),
    "bad role": (_m(messages=[{"role": "tool", "content": "x"}]), 400, "role"),
    "unknown tool_result id": (_m(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]), 400, "no earlier tool_use has"),
    "tool_use of unknown tool": (_m(tools=[TOOL], messages=USER + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "rm_rf", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]), 400,
        "'rm_rf', which is not in tools"),
    "tool_choice unknown tool": (_m(tools=[TOOL], tool_choice={"type": "tool", "name": "nope"}), 400,
                                 "'nope', which is not in tools"),
    "tool_choice any without tools": (_m(tool_choice={"type": "any"}), 400, "needs tools"),
    "huge tool list": (_m(tools=[TOOL | {"name": f"t{i}"} for i in range(500)]), 400, "tools"),
    "huge schema": (_m(tools=[TOOL | {"input_schema": {"type": "object", "description": "x" * 70000}}]), 400,
                    "input_schema is over"),
    "bad tool name": (_m(tools=[TOOL | {"name": "a b"}]), 400, "tools.0.name"),
    "server tool": (_m(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400, "not supported"),
    "too many messages": (_m(messages=USER * 3000), 400, "messages"),
    "too many blocks": (_m(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 2000}]), 400,
                        "over this server's limit of 1024"),
    "max_tokens over limit": (_m(max_tokens=10**9), 400, "max_tokens is 1000000000"),
    "many stop sequences": (_m(stop_sequences=["x"] * 100), 400, "stop strings is 100"),
    "last turn assistant": (_m(messages=USER + [{"role": "assistant", "content": "The"}]), 400, "last message"),
    "template kwargs": (_m(chat_template_kwargs={"k": "x" * 5000}), 400, "chat_template_kwargs"),
    "oversize body": (_m(system="x" * (2 << 20)), 413, "over the server's limit"),
    "oversize prompt": (_m(system="Once upon a time " * 20000), 400, "prompt tokens"),
}


def _r(**fields) -> dict:
    return {"model": MODEL, "max_output_tokens": 8, "input": "Once upon a time"} | fields


RESPONSES_ABUSE = {
    "bad item type": (_r(input=[{"type": "computer_call", "action": {}}]), 400, "'computer_call' are not supported"),
    "bad part type": (_r(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), 400,
                      "'input_image' are not supported"),
    "bad role": (_r(input=[{"role": "tool", "content": "x"}]), 400, "role"),
    "unknown call_id": (_r(input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]), 400,
                        "no earlier function_call has"),
    "call of unknown tool": (_r(tools=[FTOOL], input=[{"type": "function_call", "call_id": "c1", "name": "rm",
                                                       "arguments": "{}"}]), 400, "'rm', which is not in tools"),
    "unknown previous_response_id": (_r(previous_response_id="resp_nope"), 404, "no stored response"),
    "huge tool list": (_r(tools=[FTOOL | {"name": f"t{i}"} for i in range(500)]), 400, "tools"),
    "non-function tool": (_r(tools=[{"type": "web_search"}]), 400, "not supported"),
    "required without tools": (_r(tool_choice="required"), 400, "no tools"),
    "too many items": (_r(input=[{"role": "user", "content": "x"}] * 3000), 400, "input"),
    "max_output_tokens over limit": (_r(max_output_tokens=10**9), 400, "max_tokens is 1000000000"),
    "no message": (_r(input=[{"type": "reasoning", "content": []}]), 400, "no message"),
    "oversize body": (_r(input="x" * (2 << 20)), 413, "over the server's limit"),
}


def _still_serving(server: Server) -> None:
    with server.client() as http:
        assert http.post("/v1/messages", json=_m()).json()["stop_reason"] == "max_tokens"
        assert http.post("/v1/responses", json=_r()).json()["status"] == "incomplete"
    assert _settled(server) == 0


def _settled(server: Server) -> float:
    """Blocks in use, once the engine has let go of finished requests."""
    deadline = time.monotonic() + 10
    while (used := blocks_used(server)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return used


def _post(server: Server, path: str, body: dict) -> httpx.Response:
    admitted = metric_samples(server)[("kvgen_prompt_tokens_total", ())]
    with server.client() as http:
        response = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert metric_samples(server)[("kvgen_prompt_tokens_total", ())] == admitted  # the engine never saw it
    return response


@pytest.mark.parametrize("case", sorted(MESSAGES_ABUSE))
def test_messages_abuse_is_refused_in_anthropic_shape(server, case):
    body, status, message = MESSAGES_ABUSE[case]
    response = _post(server, "/v1/messages", body)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error",
                                      413: "request_too_large"}[status]
    assert message in error["error"]["message"], error
    _still_serving(server)


@pytest.mark.parametrize("case", sorted(RESPONSES_ABUSE))
def test_responses_abuse_is_refused_in_openai_shape(server, case):
    body, status, message = RESPONSES_ABUSE[case]
    response = _post(server, "/v1/responses", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and message in error["message"], error
    _still_serving(server)


def test_auth_bearer_or_x_api_key_and_anthropic_401(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        refused = http.post("/v1/messages", json=_m(), headers={"x-api-key": "wrong"})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        assert http.post("/v1/messages", json=_m(), headers={"x-api-key": API_KEY}).status_code == 200
        assert http.post("/v1/responses", json=_r(), headers={"x-api-key": API_KEY}).status_code == 200
        assert http.post("/v1/responses", json=_r()).json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("path, body", [("/v1/messages", _m(max_tokens=400, stream=True)),
                                        ("/v1/responses", _r(max_output_tokens=400, stream=True))])
def test_a_client_that_leaves_a_stream_leaks_no_block(server, path, body):
    with server.client() as http, http.stream("POST", path, json=body) as response:
        for line in response.iter_lines():
            if "delta" in line:
                break  # leave mid-stream
    assert _settled(server) == 0
    _still_serving(server)


def test_the_response_store_is_bounded():
    from kvgen.server.openai_responses import ResponseStore

    store = ResponseStore(max_entries=3, max_bytes=10_000)
    for i in range(5):
        store.put(f"r{i}", {"id": i}, [{"role": "user", "content": "x" * 100}])
    assert list(store.entries) == ["r2", "r3", "r4"] and store.get("r0") is None
    store.get("r2")  # used: now the most recent
    store.put("big", {}, [{"role": "user", "content": "y" * 9000}])
    assert "r2" in store.entries and "r3" not in store.entries and store.size <= 10_000
    store.put("huge", {}, [{"role": "user", "content": "z" * 20_000}])  # over the whole budget: not kept
    assert "huge" not in store.entries


def test_max_tokens_past_the_context_is_cut_to_what_is_left(server):
    """Agents send max_tokens 32000 whatever the model: the reply ends at the context instead of a 400."""
    with server.client() as http:
        reply = http.post("/v1/messages", json=_m(max_tokens=60000)).json()
        assert reply["stop_reason"] in ("max_tokens", "end_turn")
        assert reply["usage"]["input_tokens"] + reply["usage"]["output_tokens"] <= 512  # stories260K's context
    assert _settled(server) == 0


def test_a_forced_tool_use_streams_as_one_block_with_its_whole_input(server):
    """content_block_start (tool_use, input {}), one input_json_delta with the whole input,
    content_block_stop; message_delta says tool_use. The same call as the non-streamed answer."""
    tool = {"name": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string",
                                                                                          "maxLength": 8}},
                                                "required": ["city"], "additionalProperties": False}}
    body = _m(max_tokens=40, tools=[tool], tool_choice={"type": "tool", "name": "weather"}, temperature=0)
    with server.client() as http:
        whole = http.post("/v1/messages", json=body).json()
        with http.stream("POST", "/v1/messages", json=body | {"stream": True}) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                           "content_block_stop", "message_delta", "message_stop"]
    start, delta = events[2]["content_block"], events[3]["delta"]
    assert start["type"] == "tool_use" and start["name"] == "weather" and start["input"] == {}
    assert delta["type"] == "input_json_delta"
    assert json.loads(delta["partial_json"]) == whole["content"][0]["input"]
    assert events[5]["delta"]["stop_reason"] == whole["stop_reason"] == "tool_use"
