"""Speculative decoding over the API: a server started with it serves the same greedy text, takes
`speculative: false`, reports its counters in /metrics; bad requests get a 400 and serving goes on."""

from collections.abc import Iterator

import pytest

from kvgen import LLM, SamplingParams
from kvgen.server.app import create_app
from tests.server.harness import API_KEY, ENGINE_OPTIONS, MODEL, Server, metric_samples, running

PROMPT = "Lily and Tom went to the park. Lily and Tom played. Lily and Tom"


@pytest.fixture(scope="module")
def spec_server() -> Iterator[Server]:
    llm = LLM(**ENGINE_OPTIONS, speculative_method="ngram", num_speculative_tokens=4, adaptive_speculation=False)
    app = create_app(llm.engine, model_name=MODEL, api_key=API_KEY)
    with running(app) as url:
        yield Server(url, app)


def complete(server: Server, **fields):
    with server.client() as http:
        return http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 40,
                                                  "temperature": 0, **fields})


def test_speculative_server_serves_the_plain_text_and_counts(spec_server, offline):
    want = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40))[0].text
    for speculative in (None, True, False):
        response = complete(spec_server, **({} if speculative is None else {"speculative": speculative}))
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == want
    samples = metric_samples(spec_server)
    proposed = samples[("kvgen_spec_decode_num_draft_tokens_total", ())]
    accepted = samples[("kvgen_spec_decode_num_accepted_tokens_total", ())]
    assert proposed >= accepted > 0
    assert samples[("kvgen_spec_decode_mean_accepted_length", ())] > 1


def test_sinks_without_opting_out_is_a_400_and_serving_goes_on(spec_server):
    response = complete(spec_server, kv_policy="sinks:4,60")
    assert response.status_code == 400
    assert "does not compose with speculative decoding" in response.json()["error"]["message"]
    assert complete(spec_server, kv_policy="sinks:4,60", speculative=False).status_code == 200


def test_speculative_on_a_server_without_it_is_a_400_and_serving_goes_on(server):
    response = complete(server, speculative=True)
    assert response.status_code == 400
    assert "runs without speculative decoding" in response.json()["error"]["message"]
    assert complete(server, speculative="yes").status_code == 400
    assert complete(server).status_code == 200
