"""A mixture of experts' router statistics over a real server: /metrics counts the tokens each expert
of each layer got (`kvgen_moe_expert_tokens`), and /dashboard/state carries them for the heat map."""

from __future__ import annotations

import re

from kvgen import LLM
from kvgen.server.app import create_app
from tests.loaders.arch_fixtures import arch_checkpoint
from tests.server.harness import API_KEY, Server, running

PROMPT = list(range(3, 43))  # 40 token ids
NEW = 5


def test_metrics_and_dashboard_count_tokens_per_expert():
    ckpt = arch_checkpoint("olmoe")  # 8 experts, top-4, 2 layers
    llm = LLM(ckpt.hf_dir, quantization="none", num_kv_blocks=64, block_size=16, enable_prefix_caching=False)
    app = create_app(llm.engine, model_name="olmoe", api_key=API_KEY)
    with running(app) as url, Server(url, app).client() as http:
        done = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": NEW, "ignore_eos": True})
        assert done.status_code == 200, done.text
        metrics = http.get("/metrics").text
        state = http.get("/dashboard/state").json()
    samples = re.findall(r'kvgen_moe_expert_tokens_total\{expert="(\d+)",layer="(\d+)"\} (\S+)', metrics)
    per_layer: dict[str, float] = {}
    for expert, layer, value in samples:
        per_layer[layer] = per_layer.get(layer, 0) + float(value)
    assert len(samples) == 2 * 8
    # every token the model ran (the prompt, then each new token but the last) went to 4 experts a layer
    assert per_layer == {"0": (len(PROMPT) + NEW - 1) * 4, "1": (len(PROMPT) + NEW - 1) * 4}
    assert [row["layer"] for row in state["experts"]] == [0, 1]
    assert sum(state["experts"][0]["tokens"]) == per_layer["0"]
