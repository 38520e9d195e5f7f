"""The architecture fixtures (arch_fixtures.py) are sound: each HF directory has the features it is
meant to exercise, transformers' greedy reference is self-consistent, and transformers reads each
GGUF written by llama.cpp's converter back into the same model (same greedy tokens)."""

import json

import pytest
import torch
from safetensors import safe_open

from tests.loaders.arch_fixtures import (ARCHS, SPECS, TRANSFORMERS_GGUF_ARCHS, build_timing, hf_greedy,
                                         hf_logits)

N = 16


def prompt_for(vocab_size: int) -> list[int]:
    """40 ids past the specials, so that the prompt crosses Gemma 3's sliding window of 8."""
    return [3 + (i * 37 + 5) % min(vocab_size - 3, 500) for i in range(40)]


def tensor_names(hf_dir) -> set[str]:
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        return set(f.keys())


def gguf_fields(path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name not in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
            continue
        if not field.types or len(field.data) != 1:
            continue
        value = field.parts[field.data[0]]
        out[name] = bytes(value).decode() if field.types[0].name == "STRING" else value.tolist()[0]
    return out


def gguf_archs(*slow):
    """TRANSFORMERS_GGUF_ARCHS, those in `slow` marked slow (transformers takes ~40 s to read qwen2's 151936-token
    GGUF, ~11 s for qwen3's 49152: it parses the whole vocabulary to build the model's config)."""
    return [pytest.param(a, marks=pytest.mark.slow) if a in slow else a for a in TRANSFORMERS_GGUF_ARCHS]


@pytest.mark.parametrize("arch", ARCHS)
def test_features(arch_ckpt, arch):
    """Each fixture's config and tensors have what it is there to exercise."""
    ckpt = arch_ckpt(arch)
    c, names = ckpt.config, tensor_names(ckpt.hf_dir)
    print(f"\n{arch}: {json.dumps(c, sort_keys=True)}\nbuild timing: {build_timing(arch)}")
    assert (c["num_attention_heads"], c["num_key_value_heads"]) == (4, 2)  # GQA
    assert c["torch_dtype" if "torch_dtype" in c else "dtype"] == "float32"
    with safe_open(ckpt.hf_dir / "model.safetensors", "pt") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"F32"}
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in names and "model.layers.0.self_attn.k_proj.bias" in names
    if arch == "qwen3":
        assert c["head_dim"] * c["num_attention_heads"] != c["hidden_size"]
        assert "model.layers.0.self_attn.q_norm.weight" in names
    if arch == "phi3":
        assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    if arch.startswith("gemma3"):
        assert c["model_type"] == "gemma3_text" and c["architectures"] == ["Gemma3ForCausalLM"]
        assert set(c["layer_types"]) == {"sliding_attention", "full_attention"}
        assert c["sliding_window"] < len(prompt_for(c["vocab_size"]))
        thetas = {c["rope_parameters"][k]["rope_theta"] for k in ("sliding_attention", "full_attention")}
        assert len(thetas) == 2
    if arch == "gemma3-hf":
        assert c["query_pre_attn_scalar"] != c["head_dim"]
    if arch == "qwen35":
        assert c["model_type"] == "qwen3_5_text" and c["architectures"] == ["Qwen3_5ForCausalLM"]
        assert c["layer_types"].count("full_attention") >= 1 and c["layer_types"].count("linear_attention") >= 1
        assert c["linear_num_value_heads"] > c["linear_num_key_heads"]  # key heads shared by value heads
        assert "model.layers.0.linear_attn.A_log" in names and "model.layers.3.self_attn.q_norm.weight" in names
        assert not any(n.startswith("mtp.") for n in names)
    if arch == "qwen35moe":  # Qwen3.5's layers, each MLP a mixture with a gated shared expert
        assert c["model_type"] == "qwen3_5_moe_text" and "intermediate_size" not in c
        assert {"model.layers.0.linear_attn.A_log", "model.layers.3.mlp.shared_expert_gate.weight",
                "model.layers.3.mlp.experts.7.up_proj.weight"} <= names
    if arch == "gemma4":
        assert c["model_type"] == "gemma4_text" and c["architectures"] == ["Gemma4ForCausalLM"]
        assert c["num_kv_shared_layers"] > 0 and c["hidden_size_per_layer_input"] > 0
        assert c["per_layer_config"]["2"]["head_dim"] != c["head_dim"]  # two head sizes
        assert c["sliding_window"] < len(prompt_for(c["vocab_size"]))
        shared = range(c["num_hidden_layers"] - c["num_kv_shared_layers"], c["num_hidden_layers"])
        assert all(f"model.layers.{i}.self_attn.k_proj.weight" not in names for i in shared)
        assert "model.layers.0.self_attn.k_proj.weight" in names


@pytest.mark.parametrize("arch", ARCHS)
def test_reference_is_self_consistent(arch_ckpt, arch):
    """transformers' generate (with its KV cache, sliding layers included) gives the argmax of a full
    recomputation at every step, and the tokens vary (a model that repeats one token tests little)."""
    ckpt = arch_ckpt(arch)
    prompt = prompt_for(ckpt.config["vocab_size"])
    tokens = hf_greedy(ckpt.hf_dir, prompt, N)
    logits = hf_logits(ckpt.hf_dir, prompt + tokens[:-1])[len(prompt) - 1:]
    assert logits.argmax(-1).tolist() == tokens
    top2 = logits.topk(2, dim=-1).values
    print(f"\n{arch}: {tokens} (min top-2 margin {float((top2[:, 0] - top2[:, 1]).min()):.4f})")
    assert len(set(tokens)) >= 4, tokens


@pytest.mark.parametrize("arch", gguf_archs("qwen2", "qwen3"))
def test_gguf_roundtrip(arch_ckpt, arch):
    """transformers reads the F32 GGUF back into the same model: the same greedy tokens."""
    ckpt = arch_ckpt(arch)
    fields = gguf_fields(ckpt.gguf)
    print(f"\n{arch}: {fields}")
    gguf_arch = fields["general.architecture"]
    assert gguf_arch == {"gemma3": "gemma3", "phi3": "phi3", "qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama"}[arch]
    assert fields[f"{gguf_arch}.attention.head_count_kv"] == 2
    assert fields["tokenizer.ggml.model"] == ("llama" if SPECS[arch].tokenizer == "spm512" else "gpt2")
    if arch == "gemma3":
        assert fields["gemma3.attention.sliding_window"] == ckpt.config["sliding_window"]
        assert fields["gemma3.rope.freq_base"] == 1e6 and fields["gemma3.rope.freq_base_swa"] == 1e4
    prompt = prompt_for(ckpt.config["vocab_size"])
    assert hf_greedy(ckpt.gguf, prompt, N) == hf_greedy(ckpt.hf_dir, prompt, N)


def test_gguf_qwen35_fields(arch_ckpt):
    """The converter accepts the Qwen3.5 directory (with --no-mtp) and writes the layer pattern and the
    linear layers' shapes where llama.cpp reads them (transformers cannot read this GGUF)."""
    ckpt = arch_ckpt("qwen35")
    c, fields = ckpt.config, gguf_fields(ckpt.gguf)
    print(f"\nqwen35: {fields}")
    assert fields["general.architecture"] == "qwen35"
    assert fields["qwen35.ssm.group_count"] == c["linear_num_key_heads"]
    assert fields["qwen35.ssm.time_step_rank"] == c["linear_num_value_heads"]
    assert fields["qwen35.ssm.state_size"] == c["linear_key_head_dim"]
    assert fields["qwen35.ssm.inner_size"] == c["linear_num_value_heads"] * c["linear_value_head_dim"]
    assert fields["qwen35.ssm.conv_kernel"] == c["linear_conv_kernel_dim"]
    assert fields["qwen35.rope.dimension_count"] == c["head_dim"] // 4
    assert fields["qwen35.attention.key_length"] == c["head_dim"]
    from gguf import GGUFReader

    reader = GGUFReader(ckpt.gguf)
    recurrent = reader.fields["qwen35.attention.recurrent_layers"]
    assert [bool(recurrent.parts[i][0]) for i in recurrent.data] == [t == "linear_attention" for t in c["layer_types"]]
    names = {t.name for t in reader.tensors}
    assert {"blk.0.ssm_a", "blk.0.ssm_conv1d.weight", "blk.0.attn_qkv.weight", "blk.0.attn_gate.weight",
            "blk.3.attn_q.weight", "blk.3.attn_k_norm.weight"} <= names
    assert not any("nextn" in n or "mtp" in n for n in names)


def test_gguf_qwen35moe_fields(arch_ckpt):
    """The converter, reading the Qwen3.5-MoE directory's config without model_type (arch_fixtures'
    docstring), writes qwen35moe: the experts' and shared expert's widths, no dense width, the saved
    tokenizer, and the mixture's tensors beside the delta-net's."""
    ckpt = arch_ckpt("qwen35moe")
    c, fields = ckpt.config, gguf_fields(ckpt.gguf)
    assert fields["general.architecture"] == "qwen35moe" and fields["tokenizer.ggml.pre"] == "smollm"
    assert (fields["qwen35moe.expert_count"], fields["qwen35moe.expert_used_count"]) == (8, 2)
    assert fields["qwen35moe.expert_feed_forward_length"] == c["moe_intermediate_size"]
    assert fields["qwen35moe.expert_shared_feed_forward_length"] == c["shared_expert_intermediate_size"]
    assert "qwen35moe.feed_forward_length" not in fields
    from gguf import GGUFReader

    names = {t.name for t in GGUFReader(ckpt.gguf).tensors}
    assert {"blk.0.ssm_a", "blk.0.ffn_gate_inp.weight", "blk.0.ffn_up_exps.weight", "blk.3.ffn_down_shexp.weight",
            "blk.3.ffn_gate_inp_shexp.weight"} <= names


def test_gguf_gemma4_fields(arch_ckpt):
    """The converter accepts the Gemma 4 directory: both head sizes, the window pattern and the shared
    layers are in the GGUF, and the sharing layers carry no K/V weights."""
    ckpt = arch_ckpt("gemma4")
    c, fields = ckpt.config, gguf_fields(ckpt.gguf)
    print(f"\ngemma4: {fields}")
    assert fields["general.architecture"] == "gemma4"
    assert fields["gemma4.attention.key_length"] == c["per_layer_config"]["2"]["head_dim"]
    assert fields["gemma4.attention.key_length_swa"] == c["head_dim"]
    assert fields["gemma4.attention.shared_kv_layers"] == c["num_kv_shared_layers"]
    assert fields["gemma4.attention.sliding_window"] == c["sliding_window"]
    assert fields["gemma4.embedding_length_per_layer_input"] == c["hidden_size_per_layer_input"]
    from gguf import GGUFReader

    reader = GGUFReader(ckpt.gguf)
    names = {t.name for t in reader.tensors}
    first_shared = c["num_hidden_layers"] - c["num_kv_shared_layers"]
    assert all(f"blk.{i}.attn_k.weight" in names for i in range(first_shared))
    assert not any(f"blk.{i}.attn_k.weight" in names or f"blk.{i}.attn_v.weight" in names
                   for i in range(first_shared, c["num_hidden_layers"]))
    factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data.tolist()
    assert factors.count(1.0) == len(factors) // 4  # proportional RoPE: a quarter of the pairs rotate


@pytest.mark.parametrize("arch", gguf_archs("qwen2", "qwen3"))
def test_gguf_q8_0(arch_ckpt, arch):
    """The Q8_0 GGUF is the same model up to quantization: last-position logits nearly parallel."""
    ckpt = arch_ckpt(arch)
    assert gguf_fields(ckpt.gguf_q8)["general.file_type"] == 7  # MOSTLY_Q8_0
    prompt = prompt_for(ckpt.config["vocab_size"])
    ref, q8 = hf_logits(ckpt.hf_dir, prompt)[-1], hf_logits(ckpt.gguf_q8, prompt)[-1]
    assert torch.nn.functional.cosine_similarity(ref, q8, dim=0) > 0.99
