"""No single request may hurt the server: abusive requests get a 4xx at once, a full queue gets 429,
and a fault in the engine fails only the requests it touches. Real servers on loopback ports, real
clients, real (deliberately broken) checkpoints."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from kvgen import LLM, SamplingParams
from kvgen.server.app import create_app
from tests.conftest import POISON
from tests.server.harness import Server, blocks_used, metric_samples, running, sse_events

MODEL = "stories260K"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    app = create_app(LLM(num_kv_blocks=256, max_num_seqs=16).engine, model_name=MODEL)
    with running(app) as url:
        yield Server(url, app)


def still_serving(server: Server) -> None:
    with server.client() as http:
        assert http.get("/health").json() == {"status": "ok"}
        done = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8})
        assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] == "length"


# -- abusive requests: a 4xx before admission, naming the field and the limit ---------------------

ABUSE = {
    "n": ({"prompt": "hi", "n": 100_000}, 400, "n is 100000, over this server's limit of 128"),
    "prompts": ({"prompt": ["hi"] * 5000}, 400, "the number of prompts is 5000, over this server's limit of 256"),
    "logit_bias_body": ({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(100_000)}}, 413, "over the "
                        "server's limit of 1048576 bytes"),
    "logit_bias": ({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(2000)}}, 400,
                   "the number of logit_bias entries is 2000, over this server's limit of 1024"),
    "stop": ({"prompt": "hi", "stop": [f"s{i}" for i in range(10_000)]}, 400,
             "the number of stop strings is 10000, over this server's limit of 16"),
    "stop_length": ({"prompt": "hi", "stop": ["x" * 1000]}, 400, "the length of a stop string is 1000 characters"),
    "seed": ({"prompt": "hi", "seed": 2**80}, 400, "seed is 1208925819614629174706176, which does not fit in a "
             "64-bit integer"),
    "top_k": ({"prompt": "hi", "top_k": 10**9}, 400, "top_k is 1000000000, more than the vocabulary of 512"),
    "max_tokens": ({"prompt": "hi", "max_tokens": 10**12}, 400,
                   "max_tokens is 1000000000000, over this server's limit of 65536"),
    "logprobs": ({"prompt": "hi", "logprobs": 1000}, 400, "logprobs is 1000, over this server's limit of 20"),
    "token_ids": ({"prompt": [1, 2**70]}, 400, "prompt.1 is 1180591620717411303424, which does not fit"),
}


@pytest.mark.parametrize("case", sorted(ABUSE))
def test_abusive_request_is_refused_at_once_and_the_server_goes_on(server, case):
    """Refused before admission, so the engine never works on it: no prompt token is counted. Checked
    by the counter, not by a time bound: the round trip of a 1 MB body took 1.4 s on a VM with steal time."""
    body, status, message = ABUSE[case]
    admitted = metric_samples(server)[("kvgen_prompt_tokens_total", ())]
    with server.client() as http:
        response = http.post("/v1/completions", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]
    assert metric_samples(server)[("kvgen_prompt_tokens_total", ())] == admitted
    still_serving(server)


def test_chat_fields_are_bounded_too(server):
    messages = [{"role": "user", "content": "hi"}]
    with server.client() as http:
        for extra, message in (({"n": 500}, "n is 500"), ({"logprobs": True, "top_logprobs": 50}, "logprobs is 50"),
                               ({"max_completion_tokens": 10**9}, "max_tokens is 1000000000")):
            response = http.post("/v1/chat/completions", json={"messages": messages, **extra})
            assert response.status_code == 400 and message in response.json()["error"]["message"]


def test_limits_are_counted_in_metrics(server):
    before = metric_samples(server).get(("kvgen_requests_rejected_total", (("reason", "over_limit"),)), 0)
    with server.client() as http:
        assert http.post("/v1/completions", json={"prompt": "hi", "n": 1000}).status_code == 400
    after = metric_samples(server)[("kvgen_requests_rejected_total", (("reason", "over_limit"),))]
    assert after == before + 1


def test_logit_bias_steers_the_tokens_as_offline(server):
    offline = LLM(num_kv_blocks=256)
    bias = {"300": 100.0}
    want = offline.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=6, logit_bias={300: 100}))
    with server.client() as http:
        got = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
                                                 "logit_bias": bias}).json()
    assert want[0].token_ids == [300] * 6
    assert got["choices"][0]["text"] == want[0].text
    with server.client() as http:
        bad = http.post("/v1/completions", json={"prompt": "hi", "logit_bias": {"cat": 1}})
        assert bad.status_code == 400 and "logit_bias keys must be token ids" in bad.json()["error"]["message"]
        outside = http.post("/v1/completions", json={"prompt": "hi", "logit_bias": {"600": 1}})
        assert outside.status_code == 400 and "outside the vocabulary" in outside.json()["error"]["message"]


# -- backpressure -------------------------------------------------------------------------------


def test_full_queue_gets_429_with_retry_after_and_the_queue_drains():
    """One sequence runs at a time and one may wait: with a stream running and a request queued
    behind it, the next request is turned away at once."""
    app = create_app(LLM(num_kv_blocks=64, max_num_seqs=1).engine, model_name=MODEL, max_queued_requests=1)
    # A bounded cache policy runs past the context: the stream occupies the engine until dropped.
    long = {"prompt": "Once upon a time", "max_tokens": 60000, "ignore_eos": True, "kv_policy": "sinks:4,60"}
    with running(app) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
        server = Server(url, app)
        with server.client() as http, http.stream("POST", "/v1/completions", json=long | {"stream": True}) as stream:
            lines = stream.iter_lines()  # held: a dropped iterator closes the stream
            assert stream.status_code == 200 and next(lines).startswith("data: ")  # its request is running
            queued = pool.submit(lambda: server.client().post("/v1/completions", json={"prompt": "hi", "max_tokens": 8}))
            deadline = time.monotonic() + 10
            while metric_samples(server)[("kvgen_num_requests_waiting", ())] < 1:
                assert time.monotonic() < deadline and not queued.done()
                time.sleep(0.01)
            start = time.monotonic()
            busy = http.post("/v1/completions", json=long)
            assert time.monotonic() - start < 1.0
        assert busy.status_code == 429, busy.text
        assert busy.headers["Retry-After"] == "1" and busy.json()["error"]["code"] == "queue_full"
        assert queued.result().status_code == 200  # the queue drains once the stream is dropped
        assert metric_samples(server)[("kvgen_requests_rejected_total", (("reason", "queue_full"),))] == 1
        assert blocks_used(server) == 0
        still_serving(server)


# -- faults in the engine -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def broken(broken_model) -> Iterator[Server]:
    engine = LLM(broken_model, num_kv_blocks=64, block_size=4).engine
    app = create_app(engine, model_name="broken")
    with running(app) as url:
        yield Server(url, app)


def completion(server: Server, prompt: str, **extra) -> httpx.Response:
    with server.client() as http:
        return http.post("/v1/completions", json={"model": "broken", "prompt": prompt, "max_tokens": 12,
                                                  "temperature": 0, "ignore_eos": True, **extra})


def test_nan_logits_fail_that_request_alone(broken):
    good = "w5 w17 w40 w8"
    alone = completion(broken, good).json()["choices"][0]["text"]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        poisoned = pool.submit(completion, broken, f"w5 w{POISON} w8")
        neighbours = [pool.submit(completion, broken, good) for _ in range(2)]
        failed, ok = poisoned.result(), [f.result() for f in neighbours]
    assert failed.status_code == 500
    assert "NaN or infinite logits" in failed.json()["error"]["message"]
    assert [r.json()["choices"][0]["text"] for r in ok] == [alone, alone]
    assert blocks_used(broken) == 0
    requests = metric_samples(broken)
    assert requests[("kvgen_requests_total", (("finish_reason", "error"),))] >= 1


def test_a_stream_that_fails_ends_with_an_error_event(broken):
    with broken.client() as http:
        with http.stream("POST", "/v1/completions", json={"model": "broken", "prompt": f"w{POISON}",
                                                          "max_tokens": 12, "stream": True}) as response:
            assert response.status_code == 200
            events = sse_events(response)
    assert "NaN or infinite logits" in events[-1]["error"]["message"]
    assert blocks_used(broken) == 0
