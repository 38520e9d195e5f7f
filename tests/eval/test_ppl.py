"""`kvgen eval-ppl` on stories260K: the engine's streamed perplexity against a plain forward pass,
bounded policies against full, and the table / JSON / PNG it writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvgen.cli import main
from kvgen.eval import ppl
from kvgen.loaders import load_model
from kvgen.model.attention import NoCacheAttention
from kvgen.model.decoder import DecoderModel

CONTEXT = 512  # stories260K's
GPL3 = Path("/usr/share/common-licenses/GPL-3")


def eval_ppl(capsys, tmp_path: Path, *argv: str) -> tuple[dict, str, str]:
    """Runs `kvgen eval-ppl ... --json` -> (the JSON, stdout, stderr)."""
    out_file = tmp_path / "ppl.json"
    code = main(["eval-ppl", *map(str, argv), "--json", str(out_file)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out_file.read_text()), out, err


def perplexities(report: dict) -> dict[str, float]:
    return {p["policy"]: p["perplexity"] for p in report["policies"]}


def reference_nll(model_path: Path, token_ids: list[int]) -> torch.Tensor:
    """-log p(token i+1 | tokens 0..i) from one forward pass over the whole text, no KV cache."""
    loaded = load_model(model_path)
    model = DecoderModel(loaded.config, loaded.weights)
    tokens = torch.tensor(token_ids)
    with torch.no_grad():
        logits = model.logits(model.forward(tokens, torch.arange(len(tokens)), NoCacheAttention()))
    return -logits[:-1].log_softmax(-1).gather(1, tokens[1:, None]).squeeze(1).double()


@pytest.fixture(scope="module")
def covering(tmp_path_factory, stories_bin):
    """full, and every bounded policy with a budget that holds the whole (context-cut) text."""
    out_file = tmp_path_factory.mktemp("ppl") / "covering.json"
    code = main(["eval-ppl", "--model", str(stories_bin), "--policy", "full", "--policy", "window:511",
                 "--policy", "sinks:4,507", "--policy", "h2o:8,503", "--json", str(out_file)])
    assert code == 0
    return json.loads(out_file.read_text())


def test_full_matches_a_forward_pass_without_cache(covering, stories_bin):
    settings = covering["settings"]
    assert settings["tokens_streamed"] == CONTEXT - 1 < settings["text_tokens"]
    loaded = load_model(stories_bin)
    token_ids = ppl.text_token_ids(loaded.tokenizer, ppl.read_text(None))[: CONTEXT - 1]
    assert token_ids[0] == loaded.tokenizer.bos_token_id
    expected = reference_nll(stories_bin, token_ids)
    full = covering["policies"][0]
    assert full["policy"] == "full" and full["tokens_scored"] == CONTEXT - 2
    assert torch.allclose(torch.tensor(full["nll"], dtype=torch.float64), expected, atol=1e-4)
    assert full["perplexity"] == pytest.approx(math.exp(expected.mean().item()), rel=1e-4)


def test_budgets_that_hold_the_text_give_exactly_full_perplexity(covering):
    by_policy = {p["policy"]: p for p in covering["policies"]}
    full = by_policy.pop("full")
    for policy, result in by_policy.items():
        assert result["perplexity"] == full["perplexity"], policy
        assert result["nll"] == full["nll"], policy
        assert result["ratio_to_full"] == 1.0


def test_small_budgets_cost_perplexity_and_every_output_is_written(capsys, tmp_path):
    png = tmp_path / "ppl.png"
    report, out, err = eval_ppl(capsys, tmp_path, "--policy", "full", "--policy", "window:64",
                                "--policy", "sinks:4,60", "--policy", "h2o:32,32", "--max-tokens", 200,
                                "--plot", png)
    assert "note:" not in err  # --max-tokens given: nothing was cut silently
    lines = out.strip().splitlines()
    assert lines[0] == "perplexity over 200 tokens, one token per step"
    assert lines[1].split() == ["policy", "KV", "kept", "scored", "perplexity", "vs", "full"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert rows["full"][:2] == ["all", "199"] and rows["window:64"][:2] == ["64", "199"]
    ppls = perplexities(report)
    for policy in ("window:64", "sinks:4,60", "h2o:32,32"):
        assert ppls[policy] >= ppls["full"], policy
        assert float(rows[policy][2]) == pytest.approx(ppls[policy], abs=1e-4)
    assert all(len(p["nll"]) == p["tokens_scored"] == 199 for p in report["policies"])
    assert [p["kv_kept"] for p in report["policies"]] == [None, 64, 64, 64]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sinks_alone_stream_the_whole_text_past_the_context(capsys, tmp_path):
    report, _, err = eval_ppl(capsys, tmp_path, "--policy", "sinks:4,60")
    settings = report["settings"]
    assert "note:" not in err
    assert settings["tokens_streamed"] == settings["text_tokens"] > CONTEXT
    assert report["policies"][0]["tokens_scored"] == settings["text_tokens"] - 1


def test_a_long_system_text(capsys, tmp_path):
    """The issue's own check: a long plain-text file every Debian-style Linux system carries."""
    if not GPL3.is_file():
        pytest.skip(f"{GPL3} is absent (it ships with base-files on Debian and Ubuntu)")
    report, out, _ = eval_ppl(capsys, tmp_path, "--text", GPL3, "--policy", "full", "--policy", "sinks:4,60",
                              "--max-tokens", 300)
    ppls = perplexities(report)
    assert report["settings"]["tokens_streamed"] == 300
    assert math.isfinite(ppls["full"]) and ppls["sinks:4,60"] >= ppls["full"]
    assert "sinks:4,60" in out


@pytest.mark.parametrize("argv, needle", [
    (["--policy", "bogus:3"], "is not one of full"),
    (["--policy", "full", "--text", "/no/such/file.txt"], "/no/such/file.txt"),
    (["--policy", "full", "--max-tokens", "1"], "at least 2"),
    (["--policy", "full", "--max-tokens", "600"], "at most 511 tokens"),
    (["--policy", "sinks:4,600"], "more than the model's context"),
    (["--policy", "full", "--kv-cache", "contiguous"], "paged engine"),
])
def test_errors_exit_2_with_one_line(capsys, argv, needle):
    assert main(["eval-ppl", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgen: error:") and needle in err and "Traceback" not in err


def test_an_empty_text_is_an_error(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    assert main(["eval-ppl", "--policy", "full", "--text", str(empty)]) == 2
    assert "the text is empty" in capsys.readouterr().err


def test_cumulative_perplexity():
    result = ppl.PolicyResult("full", None, [math.log(2), math.log(8)])
    assert result.perplexity == pytest.approx(4.0)
    assert result.cumulative_perplexity() == pytest.approx([2.0, 4.0])


# -- the KV dtype sweep (--text-set, --tokens): text x length x weights x KV pool dtype -----------------


def test_the_text_set_ships_three_kinds_of_text_of_2000_smollm2_tokens_or_more():
    texts = {name: ppl.bundled_text(name) for name in ppl.TEXT_SET}
    assert set(texts) == {"gpl-3.0.txt", "python-textwrap.txt", "chat.txt"}
    assert "def wrap(" in texts["python-textwrap.txt"]
    assert texts["chat.txt"].count("<|im_start|>assistant\n") >= 10
    assert all(len(text) > 8000 for text in texts.values())  # >= 2,000 SmolLM2 tokens each (data/README.md)


def test_sweep_table_against_the_float32_pool(capsys, tmp_path):
    """stories260K: each text once per pool at the longest length; the shorter length is the first
    tokens of the same stream, which is exactly what a separate run of that length gives."""
    report, out, _ = eval_ppl(capsys, tmp_path, "--text-set", "--tokens", "100,40", "--quantizations", "auto",
                              "--kv-cache-dtypes", "auto,int8,fp8")
    rows = report["rows"]
    assert len(rows) == 3 * 2 * 3  # texts x lengths x (float32 = auto, int8, fp8)
    assert [r["tokens"] for r in rows[:6]] == [40, 40, 40, 100, 100, 100]
    assert {r["kv_cache_dtype"] for r in rows} == {"float32", "int8", "fp8"}
    for r in rows:
        assert math.isfinite(r["perplexity"])
        if r["kv_cache_dtype"] == "float32":
            assert r["perplexity"] == r["float32_kv_perplexity"] and r["change_percent"] == 0
    assert "vs float32 KV" in out and "ref" in out and "python-textwrap.txt" in out
    alone, _, _ = eval_ppl(capsys, tmp_path, "--text", _data("chat.txt"),
                           "--policy", "full", "--max-tokens", 40, "--kv-cache-dtype", "int8")
    chat40 = next(r for r in rows if r["text"] == "chat.txt" and r["tokens"] == 40 and r["kv_cache_dtype"] == "int8")
    assert chat40["perplexity"] == pytest.approx(perplexities(alone)["full"], rel=1e-12)
    assert_rendered_by_bench_report(tmp_path / "ppl.json", report, capsys)


def assert_rendered_by_bench_report(path: Path, report: dict, capsys) -> None:
    """BENCHMARKS.md's table of quantized KV perplexity comes from this JSON: one row per sweep row, the
    command as typed, the machine."""
    path.write_text(json.dumps(report))  # the last eval_ppl call wrote another report over it
    assert main(["bench", "report", str(path)]) == 0
    page = capsys.readouterr().out
    assert "perplexity by KV pool dtype, policy full" in page and report["machine"]["cpu"] in page
    assert "kvgen eval-ppl --text-set --tokens 100,40" in page
    lines = [line for line in page.splitlines() if line.startswith(("| gpl-3.0.txt", "| python-textwrap", "| chat"))]
    assert len(lines) == len(report["rows"])
    int8 = next(r for r in report["rows"] if r["kv_cache_dtype"] == "int8")
    assert f"| {int8['text']} | {int8['tokens']} | auto | int8 | {int8['perplexity']:.4f} | " \
           f"{int8['change_percent']:+.2f}% |" in lines


def _data(name: str) -> Path:
    return Path(ppl.__file__).with_name("data") / name


@pytest.mark.parametrize("argv, needle", [
    (["--text-set", "--tokens", "1"], "at least 2"),
    (["--text-set", "--tokens", "a,b"], "comma-separated token counts"),
    (["--text-set", "--kv-cache-dtypes", "int4"], "--kv-cache-dtypes"),
    (["--text-set", "--max-tokens", "50"], "--tokens, not --max-tokens"),
    (["--text-set", "--policy", "full", "--policy", "window:8"], "one --policy"),
])
def test_sweep_errors_exit_2_with_one_line(capsys, argv, needle):
    assert main(["eval-ppl", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgen: error:") and needle in err and "Traceback" not in err


@pytest.mark.slow
def test_smollm2_quantized_kv_stays_within_the_bounds_on_every_text(capsys, tmp_path, smollm_gguf):
    """Issue 34: on each text of the set at 500 tokens, with packed and with dequantized weights,
    int8 KV within +0.5% of the same weights' float32 KV perplexity and fp8 within +2%; the packed
    weights' default pool (auto: bf16) within +0.5% too (~3 minutes on one core; docs/kv-cache.md has
    the table at 500 and 2,000 tokens)."""
    report, out, _ = eval_ppl(capsys, tmp_path, "--model", smollm_gguf, "--text-set", "--tokens", 500)
    rows = [r for r in report["rows"] if r["kv_cache_dtype"] != "float32"]
    pools = {(r["weights"], r["kv_cache_dtype"]) for r in rows}
    assert pools == {("auto", "bfloat16"), ("auto", "int8"), ("auto", "fp8"), ("none", "int8"), ("none", "fp8")}
    assert len(rows) == 3 * len(pools)
    bound = {"bfloat16": 0.5, "int8": 0.5, "fp8": 2.0}
    over = [r for r in rows if r["change_percent"] > bound[r["kv_cache_dtype"]]]
    assert not over, out
