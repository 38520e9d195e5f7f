"""`kvgen bench` with speculative decoding: the repeat task, --compare-speculation, the lookup peers."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from kvgen.bench.tasks import MIN_PASSAGE_TOKENS, task_prompts
from kvgen.cli import main
from kvgen.llm import DEFAULT_MODEL
from kvgen.loaders import load_model

TINY = ["--model", "stories260k", "--threads", "1"]


@pytest.fixture(autouse=True)
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def bench(tmp_path, *argv: str) -> dict:
    assert main(["bench", *argv, "--output-dir", str(tmp_path)]) == 0
    return json.loads((tmp_path / f"{argv[0]}.json").read_text())


def test_text_tasks_hold_a_passage_and_differ_per_run():
    tokenizer = load_model(DEFAULT_MODEL).tokenizer
    for task in ("repeat", "free"):
        prompts = task_prompts(task, tokenizer, 512, 3, 16, np.random.default_rng(0))
        assert all(len(p) >= MIN_PASSAGE_TOKENS for p in prompts)
        assert len({tuple(p) for p in prompts}) == 3


def test_code_tasks_copy_the_file_and_replay_the_edit_conversation():
    from kvgen.bench.tasks import CODE, EDITS, code_messages

    code = CODE.read_text()
    assert code in code_messages("copy", 0)[0].content
    for turn in range(len(EDITS)):
        messages = code_messages("edit", turn)
        assert [m.role for m in messages] == ["user", "assistant"] * turn + ["user"]
        assert messages[-1].content.endswith(EDITS[turn][0])
        replies = [m.content for m in messages if m.role == "assistant"]
        assert all(a != b for a, b in zip([code, *replies], replies))  # each reply is the file after one more edit
    assert code_messages("edit", len(EDITS)) == code_messages("edit", 0)  # cycling
    tokenizer = load_model(DEFAULT_MODEL).tokenizer
    prompts = task_prompts("edit", tokenizer, 512, 3, 16, np.random.default_rng(0))
    assert len(prompts[0]) < len(prompts[1]) < len(prompts[2])


def test_latency_suffix_on_the_copy_task(tmp_path, smollm_gguf):
    """On SmolLM2 (stories260K's context of 512 does not hold the file in its tokens)."""
    data = bench(tmp_path, "latency", "--model", str(smollm_gguf), "--threads", "1", "--task", "copy", "--gen-len", "8", "--repeats", "1",
                 "--bandwidth-size", "1MiB", "--speculative-method", "suffix", "--compare-speculation")
    assert set(data["results"]) == {"kvgen", "kvgen-plain"} and data["settings"]["task"] == "copy"
    assert data["speculative"]["verify_steps"] > 0


def test_latency_compare_speculation_on_the_repeat_task(tmp_path, capsys):
    peers = ["--compare", "hf-lookup"]
    if importlib.util.find_spec("llama_cpp") is not None:
        peers += ["--compare", "llama.cpp-lookup"]
    data = bench(tmp_path, "latency", *TINY, "--task", "repeat", "--gen-len", "8", "--repeats", "1",
                 "--bandwidth-size", "1MiB", "--speculative-method", "ngram", "--compare-speculation", *peers)
    present = set(data["results"]) - {u.split(":")[0] for u in data["unavailable"]}
    assert {"kvgen", "kvgen-plain", "hf-lookup"} <= present
    assert "kvgen/kvgen-plain" in data["ratios"] and data["settings"]["task"] == "repeat"
    assert data["settings"]["prompt_len"] >= MIN_PASSAGE_TOKENS
    assert data["speculative"]["verify_steps"] > 0
    assert [run["output_tokens"] for runs in data["runs"].values() for run in runs] == [8] * len(data["runs"])
    assert "mean accepted length" in capsys.readouterr().out


def test_throughput_compare_speculation(tmp_path):
    data = bench(tmp_path, "throughput", *TINY, "--num-requests", "6", "--prompt-len-range", "8", "32",
                 "--output-len-range", "4", "16", "--speculative-method", "ngram", "--compare-speculation")
    assert set(data["results"]) == {"kvgen", "kvgen-plain"} and "kvgen/kvgen-plain" in data["ratios"]
    assert "adaptive" in data["speculative"]


def test_throughput_rounds_alternate_the_engines_over_fresh_requests(tmp_path):
    """--rounds 2: kvgen and kvgen-plain each run two sets of 6 requests, in turns; the rates count
    all 12."""
    data = bench(tmp_path, "throughput", *TINY, "--num-requests", "6", "--prompt-len-range", "8", "32",
                 "--output-len-range", "4", "16", "--speculative-method", "ngram", "--compare-speculation",
                 "--rounds", "2")
    assert data["settings"]["rounds"] == 2 and len(data["requests"]) == 6
    for name in ("kvgen", "kvgen-plain"):
        result = data["results"][name]
        assert result["rounds"] == 2
        assert result["output_tokens"] > sum(r["output_len"] for r in data["requests"])  # both rounds' tokens
        assert result["requests_per_s"] == pytest.approx(12 / result["elapsed_s"])


def test_rounds_must_be_positive(tmp_path):
    assert main(["bench", "throughput", *TINY, "--rounds", "0", "--output-dir", str(tmp_path)]) == 2


def test_compare_speculation_needs_a_method(tmp_path):
    assert main(["bench", "latency", *TINY, "--compare-speculation", "--output-dir", str(tmp_path)]) == 2
