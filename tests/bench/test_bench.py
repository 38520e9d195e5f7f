"""`kvgen bench`: every mode end to end on stories260K with tiny settings, plus its helpers."""

from __future__ import annotations

import importlib.util
import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import models
from benchmarks.peers import llama_cpp_build_note, load_peer
from kvgen.bench.report import Metric, comparison_table, distribution, loglog_slope
from kvgen.bench.scaling import SPEEDUP_AT, positions, total_times
from kvgen.bench.serve import arrival_offsets
from kvgen.bench.system import BenchRequest, PeerUnavailable, System
from kvgen.bench.workload import make_requests
from kvgen.cli import main
from tests.support.servers import wait_healthy

TINY = ["--model", "stories260k", "--threads", "1"]
TINY_ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320, tie_word_embeddings=True, rope_theta=100000.0,
                 max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """--threads sets torch's global thread count; give the rest of the suite its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def bench(tmp_path: Path, *argv: str) -> dict:
    assert main(["bench", *argv, "--output-dir", str(tmp_path)]) == 0
    return json.loads((tmp_path / f"{argv[0]}.json").read_text())


def positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0 and math.isfinite(value)


# -- the modes --------------------------------------------------------------------------------------


def test_latency_with_hf(tmp_path, capsys):
    data = bench(tmp_path, "latency", *TINY, "--prompt-len", "16", "--gen-len", "8", "--repeats", "1",
                 "--bandwidth-size", "8MiB", "--compare", "hf")
    assert set(data["results"]) == {"kvgen", "hf"}
    for result in data["results"].values():
        for key in ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "decode_bytes_per_s",
                    "bandwidth_fraction"):
            assert positive(result[key]), key
    assert [run["output_tokens"] for run in data["runs"]["kvgen"] + data["runs"]["hf"]] == [8, 8]
    assert positive(data["memory_bandwidth_bytes_per_s"])
    weights = data["decode_bytes_per_token"]["weights"]
    assert 900_000 < weights < 1_100_000  # stories260K: ~260K fp32 parameters, embedding tied
    assert set(data["ratios"]["kvgen/hf"]) >= {"ttft_s", "decode_tokens_per_s"}
    assert data["machine"]["torch_threads"] == 1 and data["machine"]["cpu"]
    out = capsys.readouterr().out
    assert "kvgen/hf" in out and "decode tokens/s" in out and "memory bandwidth" in out


def test_throughput_batched_sequential_and_hf(tmp_path, capsys):
    data = bench(tmp_path, "throughput", *TINY, "--num-requests", "6", "--prompt-len-range", "8", "32",
                 "--output-len-range", "4", "16", "--sequential", "--compare", "hf", "--batch-sizes", "1,4")
    requests = data["requests"]
    assert len(requests) == 6 and all(4 <= r["output_len"] <= 16 and 8 <= r["prompt_len"] <= 32 for r in requests)
    assert set(data["results"]) == {"kvgen", "kvgen-sequential", "hf"}
    for result in data["results"].values():
        assert result["output_tokens"] == sum(r["output_len"] for r in requests)
        assert all(positive(result[k]) for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"))
    assert data["results"]["hf"]["batch_size"] in (1, 4)
    assert set(data["results"]["hf"]["elapsed_s_by_batch_size"]) == {"1", "4"}
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert "best static batch" in capsys.readouterr().out


def test_scaling(tmp_path, capsys):
    data = bench(tmp_path, "scaling", *TINY, "--max-len", "160", "--points", "4", "--steps", "2")
    assert set(data["results"]) == {"none", "contiguous", "paged"}
    for series in data["results"].values():
        assert max(series["positions"]) <= 160 - 3 and 128 in series["positions"]
        assert all(positive(t) for t in series["step_s"] + series["total_s"])
        assert math.isfinite(series["step_slope"]) and math.isfinite(series["total_slope"])
    assert set(data["speedup_over_none"]) == {"128"}
    assert positive(data["speedup_over_none"]["128"]["contiguous"])
    assert (tmp_path / "scaling.png").stat().st_size > 0
    assert "none/contiguous" in capsys.readouterr().out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    """`kvgen serve` (the default model) in a subprocess on a free loopback port."""
    pytest.importorskip("kvgen.server.cli", reason="kvgen serve is not available")
    port = free_port()
    command = [sys.executable, "-m", "kvgen.cli", "serve", "--port", str(port), "--num-kv-blocks", "128"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 60, proc.stderr.read)
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


@pytest.mark.parametrize("rate", ["inf", "50"])
def test_serve(tmp_path, server_url, rate, capsys):
    data = bench(tmp_path, "serve", "--url", server_url, "--rate", rate, "--num-requests", "5",
                 "--prompt-len-range", "4", "24", "--output-len-range", "2", "12")
    assert (data["completed"], data["failed"]) == (5, 0)
    assert all(positive(data[k]) for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"))
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        stats = data["latency"][key]
        assert all(positive(stats[s]) for s in ("mean", "p50", "p90", "p99")), key
        assert stats["p50"] <= stats["p90"] <= stats["p99"]
    assert data["latency"]["ttft_s"]["p99"] <= data["latency"]["e2e_s"]["p99"]
    assert "TTFT (ms)" in capsys.readouterr().out


def test_serve_refuses_other_hosts(tmp_path, capsys):
    assert main(["bench", "serve", "--url", "http://192.0.2.1:8000", "--output-dir", str(tmp_path)]) == 2
    assert "only targets this machine" in capsys.readouterr().err


def test_bad_settings_are_one_line_errors(tmp_path, capsys):
    assert main(["bench", "latency", *TINY, "--gen-len", "1", "--output-dir", str(tmp_path)]) == 2
    assert main(["bench", "scaling", *TINY, "--max-len", "8", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--gen-len must be at least 2" in err and "--max-len 8 leaves no room" in err


def test_plot_redraws_from_json(tmp_path, capsys):
    bench(tmp_path, "scaling", *TINY, "--max-len", "40", "--points", "3", "--steps", "2")
    (tmp_path / "scaling.png").unlink()
    assert main(["bench", "plot", "--output-dir", str(tmp_path)]) == 0
    assert (tmp_path / "scaling.png").is_file()


# -- peers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("peer, module, pip_name", [("llama.cpp", "llama_cpp", "llama-cpp-python"),
                                                     ("ct2", "ctranslate2", "ctranslate2")])
def test_missing_peer_says_how_to_install(peer, module, pip_name):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed")
    with pytest.raises(PeerUnavailable, match=rf"^{peer}: not installed \(pip install {pip_name}\)$"):
        load_peer(peer, models.resolve("stories260k"), "float32", 64)


@pytest.mark.parametrize("amx, said", [("", " (no AMX)"), (" AMX_INT8 = 1 |", "")])
def test_the_report_says_what_llama_cpp_was_built_with(amx, said):
    """llama.cpp 0.3.36's system info, as built here without AMX, and as a build with it would add."""
    info = ("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 |"
            f"{amx} OPENMP = 1 | KLEIDIAI = 0 | ")
    features = "SSE3, AVX, AVX2, AVX512, AVX512_VNNI, AVX512_BF16, LLAMAFILE" + (", AMX_INT8" if amx else "") + ", OPENMP"
    assert llama_cpp_build_note(info) == f"llama.cpp built with {features}{said}"


def test_missing_llama_server_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv("KVGEN_LLAMA_SERVER", str(tmp_path / "absent"))
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(PeerUnavailable, match=r"^llama-server: no binary \(build llama.cpp with -DLLAMA_BUILD_SERVER"):
        load_peer("llama-server", models.resolve("stories260k"), "float32", 64)


def test_throughput_against_llama_server_at_each_slot_count(tmp_path, capsys):
    """The real llama-server (where one is built here: see benchmarks/llama_server.py), started per
    slot count on the stories260K GGUF, answering every request with its tokens."""
    from benchmarks.llama_server import find_binary

    try:
        find_binary()
    except PeerUnavailable as e:
        pytest.skip(str(e))
    data = bench(tmp_path, "throughput", *TINY, "--num-requests", "6", "--prompt-len-range", "8", "32",
                 "--output-len-range", "4", "16", "--compare", "llama-server", "--batch-sizes", "1,4")
    result = data["results"]["llama-server"]
    assert result["output_tokens"] == sum(r["output_len"] for r in data["requests"])
    assert set(result["elapsed_s_by_batch_size"]) == {"1", "4"} and positive(result["output_tokens_per_s"])
    assert "llama-server: best slot count" in capsys.readouterr().out


def test_llama_server_draft_needs_kvgens_draft_file():
    with pytest.raises(PeerUnavailable, match=r"^llama-server-draft: needs --draft-model, a GGUF file"):
        load_peer("llama-server-draft", models.resolve("stories260k"), "float32", 64)


def test_latency_against_llama_servers_own_draft_speculation(tmp_path, smollm_gguf):
    """The real llama-server speculating with the draft kvgen uses (SmolLM2 drafting for itself: every
    draft token is accepted on both sides), its tokens timed as kvgen's are."""
    from benchmarks.llama_server import find_binary

    try:
        find_binary()
    except PeerUnavailable as e:
        pytest.skip(str(e))
    data = bench(tmp_path, "latency", "--model", str(smollm_gguf), "--threads", "1", "--prompt-len", "32",
                 "--gen-len", "16", "--repeats", "1", "--bandwidth-size", "1MiB", "--speculative-method", "draft",
                 "--draft-model", str(smollm_gguf), "--num-speculative-tokens", "4",
                 "--compare", "llama-server-draft")
    assert positive(data["results"]["llama-server-draft"]["decode_tokens_per_s"])


# -- models -----------------------------------------------------------------------------------------


def test_generated_model_is_built_once_and_loads_the_same_everywhere(tmp_path, monkeypatch):
    from kvgen.llm import LLM

    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(models.ARCHITECTURES, "tiny", TINY_ARCH)
    model = models.resolve("tiny", seed=3)
    assert model.path == tmp_path / "bench-models" / "tiny-seed3"
    stamp = (model.path / "model.safetensors").stat().st_mtime_ns
    assert models.resolve("tiny", seed=3).path == model.path
    assert (model.path / "model.safetensors").stat().st_mtime_ns == stamp
    prompt = [5, 17, 99, 3, 250]
    hf = models.load_hf_model(model, torch.float32)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    from kvgen import SamplingParams

    got = LLM(model.path).generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert got[0].token_ids == want


def test_peer_conversions_of_stories_are_cached_and_faithful(tmp_path, monkeypatch):
    """What llama.cpp and CTranslate2 get for the packaged stories260K (a llama2.c .bin): a cached GGUF
    export in each dtype; a plain HF directory (exported through transformers' GGUF reader) with the
    same logits."""
    from kvgen.loaders import load_model
    from kvgen.model.decoder import DecoderModel
    from kvgen.phases import prefill

    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path))
    model = models.resolve("stories260k")
    assert model.gguf is None
    exact = models.gguf_for(model, "float32")
    assert exact.is_relative_to(tmp_path) and models.gguf_for(model, "float32") == exact
    half = models.gguf_for(model, "float16")
    assert half.is_relative_to(tmp_path) and models.gguf_for(model, "float16") == half
    exported = models.plain_hf_dir(model)
    assert (exported / "model.safetensors").is_file() and models.plain_hf_dir(model) == exported
    ids = [1, 300, 20, 45, 100]
    logits = [prefill(DecoderModel(m.config, m.weights), ids, "none")[0] for m in map(load_model, (exported, model.path))]
    assert (logits[0] - logits[1]).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("float16", 2e-3), ("bfloat16", 2e-2)])
def test_gguf_export_matches_transformers(tmp_path, dtype, tolerance):
    """The GGUF written for llama.cpp reads back, through kvgen's reader and transformers' own GGUF reader,
    to the logits of the original HF model (so names, q/k permutation and metadata are right)."""
    from kvgen.loaders import load_model
    from kvgen.model.decoder import DecoderModel
    from kvgen.phases import prefill

    source = tmp_path / "hf"
    models.build_random_model(TINY_ARCH, 0, source)
    ids = [5, 17, 99, 3, 250, 42]
    want = models.load_hf_model(models.BenchModel("hf", source), torch.float32)(torch.tensor([ids])).logits[0, -1]
    out = tmp_path / "model.gguf"
    models.write_gguf(source, out, dtype)
    loaded = load_model(out)
    got, _ = prefill(DecoderModel(loaded.config, loaded.weights), ids, "none")
    assert (got - want).abs().max().item() < tolerance
    if dtype != "bfloat16":  # transformers does not read BF16 GGUF tensors
        hf_gguf = models.load_hf_model(models.BenchModel("gguf", out, out), torch.float32)
        assert (hf_gguf(torch.tensor([ids])).logits[0, -1] - want).abs().max().item() < tolerance


# -- helpers ----------------------------------------------------------------------------------------


def test_requests_are_seeded_and_in_range():
    a = make_requests(50, (10, 20), (3, 5), vocab_size=100, seed=1)
    assert a == make_requests(50, (10, 20), (3, 5), vocab_size=100, seed=1)
    assert a != make_requests(50, (10, 20), (3, 5), vocab_size=100, seed=2)
    assert all(10 <= len(r.prompt) <= 20 and 3 <= r.output_len <= 5 for r in a)
    assert {len(r.prompt) for r in a} >= {10, 20} and all(3 <= t < 100 for r in a for t in r.prompt)


class _BatchLog(System):
    """Records the prompt lengths of each static batch it is given (bench bookkeeping only)."""

    name = "log"

    def __init__(self, sorts_by_length: bool) -> None:
        self.sorts_by_length = sorts_by_length
        self.batches: list[list[int]] = []

    def generate_timed(self, prompt, output_len):
        raise NotImplementedError

    def run_batch(self, requests):
        self.batches.append([len(r.prompt) for r in requests])


@pytest.mark.parametrize("sorts, expected", [(False, [[5, 1], [4, 2], [3]]), (True, [[1, 2], [3, 4], [5]])])
def test_static_batches_follow_arrival_or_prompt_length(sorts, expected):
    requests = [BenchRequest([0] * n, 1) for n in (5, 1, 4, 2, 3)]
    system = _BatchLog(sorts)
    system.run_at(requests, 2)
    assert system.batches == expected


def test_arrivals():
    assert arrival_offsets(4, math.inf, np.random.default_rng(0)) == [0.0] * 4
    offsets = arrival_offsets(4000, 10.0, np.random.default_rng(0))
    assert offsets == sorted(offsets) and offsets[-1] / 4000 == pytest.approx(0.1, rel=0.1)


def test_statistics():
    stats = distribution(list(range(1, 101)))
    assert stats["mean"] == 50.5 and stats["p50"] == 50.5 and 90 < stats["p90"] < stats["p99"] < 100
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    x = [8, 16, 64, 512]
    assert loglog_slope(x, [3 * v**2 for v in x]) == pytest.approx(2.0)
    assert total_times([1, 100], [2.0, 2.0], [10, 50]) == [20.0, 100.0]
    assert total_times([0, 10], [0.0, 10.0], [4]) == [0.0 + 1 + 2 + 3]


def test_positions_are_geometric_and_include_speedup_points():
    at = positions(2044, 6)
    assert at[0] == 8 and at[-1] == 2044 and {128, 512} <= set(at) and 2048 not in at
    assert positions(60, 4) == [8, 16, 31, 60]
    assert set(SPEEDUP_AT) <= set(positions(4096, 3))


def test_comparison_table_ratios():
    metrics = [Metric("tps", "tokens/s"), Metric("ttft_s", "TTFT (ms)", 1e3)]
    table, ratios = comparison_table("t", metrics, {"kvgen": {"tps": 200.0, "ttft_s": 0.01},
                                                    "hf": {"tps": 100.0, "ttft_s": None}})
    assert ratios == {"kvgen/hf": {"tps": 2.0, "ttft_s": None}}
    text = table.render()
    assert text.splitlines()[1].split() == ["metric", "kvgen", "hf", "kvgen/hf"]
    assert "2.00x" in text and "10" in text.splitlines()[3]


@pytest.mark.slow
def test_latency_on_generated_smollm2(tmp_path):
    """The default benchmark model: SmolLM2-135M's shape (builds ~540 MB of weights on first use)."""
    data = bench(tmp_path, "latency", "--prompt-len", "32", "--gen-len", "8", "--repeats", "1",
                 "--bandwidth-size", "64MiB", "--compare", "hf")
    assert data["settings"]["model"] == "smollm2-135m"
    # 135M fp32 parameters, 28 bits each where kvgen's coded fp32 kernel runs (kvgen/model/kernels/coded.py)
    assert 450e6 < data["decode_bytes_per_token"]["weights"] < 600e6
    assert positive(data["results"]["hf"]["decode_tokens_per_s"])
