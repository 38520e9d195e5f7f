"""The `kvgen` command, in-process through `kvgen.cli.main(argv)`, and once through the console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvgen.cli import main
from kvgen.model.linear import BlasLinear, CodedF32Linear
from kvgen.model.linear_choice import make_linear

JSON_FIELDS = {"text", "token_ids", "prompt_token_ids", "finish_reason", "ttft_s", "decode_tokens_per_s",
               "speculative"}

LLAMA2_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float16",
}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """main(argv) -> (exit code, stdout, stderr); argparse's own errors exit through SystemExit."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def gen_json(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, "generate", "--json", *argv)
    assert code == 0, err
    assert len(out.strip().splitlines()) == 1
    return json.loads(out)


def assert_user_error(code: int, err: str, *needles: str) -> str:
    """Exit code 2, one `kvgen...: error:` line (the last one) naming the problem, no traceback."""
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and errors[0] == lines[-1], err
    assert errors[0].startswith("kvgen")
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


# -- generate ---------------------------------------------------------------------------------


def test_generate_streams_a_story_with_the_default_model(capsys):
    code, out, err = run(capsys, "generate", "--max-tokens", 30)
    assert code == 0, err
    assert out.startswith("Once upon a time, there was a little girl named Lily.")
    assert out.endswith("\n")
    code, out2, _ = run(capsys, "generate", "--prompt", "Once upon a time", "--max-tokens", 30)
    assert code == 0 and out2.startswith("Once upon a time, there was")


def test_generate_json(capsys, stories_bin):
    result = gen_json(capsys, "--model", stories_bin, "--prompt", "Once upon a time", "--max-tokens", 12)
    assert set(result) == JSON_FIELDS | {"weights"}
    # stories260K: fp32, 5 layers of q/k/v 128x64, o 64x64, gate/up 344x64, down 64x172; tied 512x64 head
    fp32_layer = type(make_linear(torch.zeros(1, 1)))  # (Coded)F32Linear, or BlasLinear without AVX-512
    gate_up_rows = 344 if fp32_layer is BlasLinear else 352  # panels of 32 rows, zeros past 344
    assert {role: w["kernel"] for role, w in result["weights"].items()} == dict.fromkeys(
        ("qkv", "o", "gate_up", "down", "lm_head"), fp32_layer.__name__)
    for role, n in (("qkv", 5 * 128 * 64), ("o", 5 * 64 * 64), ("gate_up", 5 * gate_up_rows * 64),
                    ("down", 5 * 64 * 172), ("lm_head", 512 * 64)):
        held = result["weights"][role]["bytes"]
        # 4 bytes a weight; coded: 28 bits, and a table and the outliers apart (a few percent at most)
        assert held == 4 * n if fp32_layer is not CodedF32Linear else 3.5 * n < held < 3.6 * n, role
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 12
    assert result["prompt_token_ids"][0] == 1 and result["text"].startswith(", there was")
    assert result["ttft_s"] > 0 and result["decode_tokens_per_s"] > 0
    # the streamed text is the prompt and the same completion
    code, out, _ = run(capsys, "generate", "--prompt", "Once upon a time", "--max-tokens", 12)
    assert out == "Once upon a time" + result["text"] + "\n"


@pytest.mark.parametrize("mode", ["contiguous", "none"])
def test_generate_kv_cache_modes(capsys, mode):
    paged = gen_json(capsys, "--max-tokens", 16)
    other = gen_json(capsys, "--kv-cache", mode, "--max-tokens", 16)
    assert (other["text"], other["token_ids"]) == (paged["text"], paged["token_ids"])


def test_generate_attention_backends(capsys):
    args = ("--prompt", "Tom and Lily went to the park", "--max-tokens", 30)
    native = gen_json(capsys, *args, "--attention-backend", "native")
    assert gen_json(capsys, *args, "--attention-backend", "sdpa")["token_ids"] == native["token_ids"]
    code, _, err = run(capsys, "generate", *args, "--dtype", "float16", "--attention-backend", "native")
    assert_user_error(code, err, "attention_backend 'native'", "float32 or bfloat16")


def test_generate_stop(capsys):
    result = gen_json(capsys, "--max-tokens", 40, "--stop", "Lily", "--stop", "park")
    assert result["text"] == "Once upon a time, there was a little girl named "
    assert result["finish_reason"] == "stop"


def test_generate_seed(capsys):
    args = ("--prompt", "The dog", "--max-tokens", 16, "--temperature", 1.0)
    a = gen_json(capsys, *args, "--seed", 1)
    assert gen_json(capsys, *args, "--seed", 1)["token_ids"] == a["token_ids"]
    assert gen_json(capsys, *args, "--seed", 2)["token_ids"] != a["token_ids"]


def test_console_script_entry_point(tmp_path):
    script = Path(sys.executable).with_name("kvgen")
    script = str(script) if script.exists() else shutil.which("kvgen")
    assert script, "the kvgen console script is not installed"
    proc = subprocess.run([script, "generate", "--max-tokens", "8"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Once upon a time")
    assert "KV cache:" in proc.stderr and "Traceback" not in proc.stderr


# -- batch ------------------------------------------------------------------------------------


BATCH = [
    {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0},
    {"prompt": "The dog", "max_tokens": 24, "temperature": 0, "stop": ["."]},
    {"prompt": [1, 403], "max_tokens": 5, "temperature": 0},
    {"prompt": "", "max_tokens": 30, "temperature": 0, "stop": ["Lily"]},
    {"prompt": "Tom", "max_tokens": 6, "temperature": 0.9, "seed": 5, "top_k": 20},
]


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_batch_matches_individual_generate_results(capsys, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [BATCH[0], BATCH[1], "", BATCH[2], BATCH[3], BATCH[4]])
    dst = tmp_path / "out.jsonl"
    code, out, err = run(capsys, "batch", "--input", src, "--output", dst)
    assert code == 0, err
    assert "5 requests" in err
    results = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(results) == len(BATCH)
    for request, result in zip(BATCH, results):
        assert set(result) == JSON_FIELDS
        args = ["--max-tokens", request["max_tokens"], "--temperature", request["temperature"]]
        for stop in request.get("stop", []):
            args += ["--stop", stop]
        if "seed" in request:
            args += ["--seed", request["seed"], "--top-k", request["top_k"]]
        if isinstance(request["prompt"], str):
            single = gen_json(capsys, "--prompt", request["prompt"], *args)
            for key in ("text", "token_ids", "prompt_token_ids", "finish_reason"):
                assert result[key] == single[key], (request, key)
        else:
            assert result["prompt_token_ids"] == request["prompt"]
    assert results[0]["text"].startswith(", there was")
    assert results[1]["finish_reason"] == "stop" and "." not in results[1]["text"]
    assert results[2]["token_ids"] == results[3]["token_ids"][1:6]  # [BOS, "Once"] goes on as the story from BOS
    assert results[3]["text"] == "Once upon a time, there was a little girl named "


BAD_BATCH_LINES = [
    ("{not json", "expected a JSON object"),
    ('["Once upon a time"]', "expected a JSON object"),
    ('"Once upon a time"', "expected a JSON object"),
    ('{"max_tokens": 4}', "'prompt'"),
    ('{"prompt": 42}', "'prompt'"),
    ('{"prompt": "a", "temprature": 0.5}', "temprature"),
    ('{"prompt": "a", "temperature": -1}', "temperature"),
    ('{"prompt": "a", "temperature": "hot"}', "temperature"),
    ('{"prompt": "a", "stop": 5}', "stop"),
    ('{"prompt": [1, 99999]}', "token ids"),
    ('{"prompt": "a", "max_tokens": 100000}', "context"),
]


@pytest.mark.parametrize(("line", "needle"), BAD_BATCH_LINES, ids=[b[0] for b in BAD_BATCH_LINES])
def test_bad_batch_line(capsys, tmp_path, line, needle):
    src = write_jsonl(tmp_path / "in.jsonl", [BATCH[0], line])
    code, out, err = run(capsys, "batch", "--input", src, "--output", tmp_path / "out.jsonl")
    assert_user_error(code, err, f"{src}:2", needle)


def test_batch_missing_input_and_unwritable_output(capsys, tmp_path):
    code, _, err = run(capsys, "batch", "--input", tmp_path / "missing.jsonl", "--output", tmp_path / "o.jsonl")
    assert_user_error(code, err, "missing.jsonl")
    src = write_jsonl(tmp_path / "in.jsonl", [BATCH[0]])
    code, _, err = run(capsys, "batch", "--input", src, "--output", tmp_path / "no" / "such" / "dir" / "o.jsonl")
    assert_user_error(code, err, "o.jsonl")


# -- kv-size ----------------------------------------------------------------------------------


@pytest.fixture()
def llama70b(tmp_path) -> Path:
    path = tmp_path / "llama-2-70b" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA2_70B))
    return path


def test_kv_size_llama2_70b(capsys, llama70b):
    code, out, err = run(capsys, "kv-size", llama70b, "--dtype", "fp16")
    assert code == 0, err
    assert "layers 80, kv_heads 8, head_dim 128, float16 (2 bytes)" in out
    assert "per token, per layer: 2 x 8 x 128 x 2 = 4,096 bytes" in out
    assert "per token, all layers: 327,680 bytes (327.7 KB)" in out

    code, out, err = run(capsys, "kv-size", llama70b.parent, "--tokens", 100000)  # the directory, default fp16
    assert code == 0, err
    assert "327,680 bytes" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("100,000 tokens: 409,600,000 bytes per layer (409.6 MB)")
    assert "32,768,000,000 bytes in all (32.8 GB" in last


def test_kv_size_json(capsys, llama70b):
    code, out, _ = run(capsys, "kv-size", llama70b, "--tokens", 100000, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["layers"] == 80 and report["kv_heads"] == 8 and report["head_dim"] == 128
    assert report["dtype"] == "float16" and report["bytes_per_element"] == 2
    assert report["bytes_per_token_per_layer"] == 4096
    assert report["bytes_per_token"] == 327_680
    assert report["bytes_per_layer"] == 409_600_000
    assert report["bytes_total"] == 32_768_000_000
    code, out, _ = run(capsys, "kv-size", llama70b, "--dtype", "float32", "--json")
    assert json.loads(out)["bytes_per_token"] == 655_360


def test_kv_size_of_a_hybrid_model_gives_each_kind(capsys, hf_model):
    """Gemma 3's layout (three windowed layers of 8 around a global one): each kind's bytes per token
    and what a sequence holds in it."""
    path, _ = hf_model("gemma3-hybrid")
    code, out, err = run(capsys, "kv-size", path, "--tokens", 1000, "--dtype", "float32", "--json")
    assert code == 0, err
    report = json.loads(out)
    per_layer = 2 * 2 * 32 * 4  # K and V, 2 KV heads of 32, fp32
    assert report["kinds"] == [
        {"layers": 1, "window": None, "bytes_per_token": per_layer, "tokens_held": 1000, "bytes": per_layer * 1000},
        {"layers": 3, "window": 8, "bytes_per_token": 3 * per_layer, "tokens_held": 8, "bytes": 3 * per_layer * 8}]
    assert report["bytes_total_hybrid"] == per_layer * (1000 + 24)
    code, out, _ = run(capsys, "kv-size", path, "--tokens", 1000)
    assert "hybrid cache, 3 window 8 layers: 768 bytes per token, 8 tokens held" in out  # fp16 by default


def test_kv_size_of_stories260k(capsys, stories_dir):
    # 5 layers x 4 KV heads x head_dim 8, K and V, fp16: 640 bytes per token, whatever the file format
    for model in ([], [stories_dir / "stories260K.bin"], [stories_dir / "stories260K.gguf"]):
        argv = ["kv-size", *model]
        code, out, err = run(capsys, *argv, "--json")
        assert code == 0, err
        assert json.loads(out)["bytes_per_token"] == 640


def test_kv_size_counts_the_scales_of_quantized_pools(capsys, llama70b):
    # Llama 2 70B: 80 layers x 8 KV heads x head_dim 128; int8 and fp8 add float32 scales per (token, head):
    # 128 / 16 = 8 for K, 1 for V
    quantized = 8 * (2 * 128 + 4 * (8 + 1))
    for dtype, per_layer in (("float16", 2 * 8 * 128 * 2), ("int8", quantized), ("fp8", quantized)):
        code, out, err = run(capsys, "kv-size", llama70b, "--kv-cache-dtype", dtype, "--json")
        assert code == 0, err
        report = json.loads(out)
        assert report["bytes_per_token_per_layer"] == per_layer and report["bytes_per_token"] == 80 * per_layer
    code, out, _ = run(capsys, "kv-size", llama70b, "--kv-cache-dtype", "int8")
    assert "8 x (2 x 128 x 1 + 36) = 2,336 bytes" in out


@pytest.mark.parametrize(("args", "needle"), [
    (["--tokens", "-5"], "--tokens"),
    (["--tokens", "0"], "--tokens"),
])
def test_kv_size_bad_tokens(capsys, llama70b, args, needle):
    code, _, err = run(capsys, "kv-size", llama70b, *args)
    assert_user_error(code, err, needle)


def test_kv_size_bad_config(capsys, tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{\"model_type\": \"llama\",")
    code, _, err = run(capsys, "kv-size", broken)
    assert_user_error(code, err, "broken.json")
    partial = tmp_path / "partial" / "config.json"
    partial.parent.mkdir()
    partial.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    code, _, err = run(capsys, "kv-size", partial.parent)
    assert_user_error(code, err, "config.json")
    code, _, err = run(capsys, "kv-size", tmp_path / "nothing.json")
    assert_user_error(code, err, "nothing.json")


# -- user errors ------------------------------------------------------------------------------


def test_unknown_model_file(capsys):
    code, _, err = run(capsys, "generate", "--model", "/nonexistent.bin")
    assert_user_error(code, err, "/nonexistent.bin")


def test_model_file_with_an_unknown_extension(capsys, tmp_path):
    path = tmp_path / "model.xyz"
    path.write_bytes(b"\0" * 64)
    code, _, err = run(capsys, "generate", "--model", path)
    assert_user_error(code, err, "model.xyz")
    code, _, err = run(capsys, "kv-size", path)
    assert_user_error(code, err, "model.xyz")


def test_truncated_bin(capsys, tmp_path, stories_bin):
    path = tmp_path / "truncated.bin"
    path.write_bytes(stories_bin.read_bytes()[:100])
    shutil.copy(stories_bin.with_name("tok512.bin"), tmp_path / "tok512.bin")
    code, _, err = run(capsys, "generate", "--model", path)
    assert_user_error(code, err, "truncated.bin")


def test_prompt_too_long(capsys):
    code, _, err = run(capsys, "generate", "--max-tokens", 100000)
    assert_user_error(code, err, "100000", "context")


@pytest.mark.parametrize(("args", "field"), [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--min-p", "2"], "min_p"),
    (["--repetition-penalty", "0"], "repetition_penalty"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--stop", ""], "stop"),
])
def test_bad_sampling_parameter(capsys, args, field):
    code, _, err = run(capsys, "generate", *args)
    assert_user_error(code, err, field)
    assert "KV cache" not in err  # reported before the model is loaded


def test_bad_kv_cache_memory(capsys):
    # not a size: argparse rejects it (usage, then the error line naming the option)
    code, _, err = run(capsys, "generate", "--kv-cache-memory", "lots")
    assert_user_error(code, err, "--kv-cache-memory", "'lots'")
    # a size too small for one block
    code, _, err = run(capsys, "generate", "--kv-cache-memory", "1KB")
    assert_user_error(code, err, "KV")


# -- speculative decoding -----------------------------------------------------------------------


def test_generate_json_with_speculation_reports_its_counters_and_the_same_tokens(capsys, stories_bin):
    prompt = ["--prompt", "Lily and Tom went to the park. Lily and Tom", "--max-tokens", "40"]
    plain = gen_json(capsys, *prompt)
    spec = gen_json(capsys, *prompt, "--speculative-method", "draft", "--draft-model", stories_bin,
                    "--draft-quantization", "int4", "--num-speculative-tokens", "3", "--no-adaptive-speculation")
    assert spec["token_ids"] == plain["token_ids"]
    assert plain["speculative"] == {"proposed": 0, "accepted": 0, "mean_accepted_length": None}
    assert spec["speculative"]["proposed"] >= spec["speculative"]["accepted"] > 0
    assert spec["speculative"]["mean_accepted_length"] > 1


@pytest.mark.parametrize("args, needle", [
    (["--speculative-method", "ngram", "--num-speculative-tokens", "0"], "num_speculative_tokens must be"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "99"], "num_speculative_tokens must be"),
    (["--speculative-method", "draft"], "needs a draft_model"),
    (["--speculative-method", "ngram", "--kv-policy", "sinks:4,60"], "does not compose with speculative"),
])
def test_bad_speculative_options(capsys, args, needle):
    code, _, err = run(capsys, "generate", "--max-tokens", "4", *args)
    assert code == 2 and needle in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("kvgen: error:")]) == 1


def test_a_draft_with_another_vocabulary_exits_2(capsys, hf_model):
    path, _ = hf_model("llama-gqa")
    code, _, err = run(capsys, "generate", "--max-tokens", "4", "--speculative-method", "draft",
                       "--draft-model", path)
    assert code == 2 and f"{path}: the draft model's vocabulary has 320 tokens, the target's 512" in err
