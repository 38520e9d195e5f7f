"""The Gated DeltaNet pieces compose into Qwen3.5: a plain torch forward of the tiny `qwen35` fixture
(tests/loaders/arch_fixtures.py) built from kvgen.model.delta_net_layer for its linear layers (and a few
lines of gated attention for the full one) gives transformers' logits, from the HF directory and from the
GGUF llama.cpp's converter wrote. The GGUF is read as the converter left it (tiled value heads, ssm_a =
-exp(A_log), norms stored as 1 + w), so this also checks what arch_fixtures.py's docstring says the GGUF
holds. It is a test harness, not the model: the blocks-based Qwen3.5 model will own the real forward.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from kvgen.config import RecurrentShape
from kvgen.model.delta_net_layer import DeltaNetLayer, prefill
from tests.loaders.conftest import arch_ckpt  # noqa: F401 (the fixture, shared with the loader tests)

# Relative to the logits' scale: a few hundred fp32 roundings through 4 layers and 80 tokens (measured 2e-6
# to 6e-6 of it); a wrong convention (w vs 1 + w, the value-head order, the gate) moves logits by O(1).
REL_TOL = 1e-5


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, positions, rot_dim, theta):
    """Partial rotate-half RoPE on the first rot_dim dimensions of x [T, H, D]."""
    inv = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    ang = positions[:, None].float() * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    r, rest = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated = torch.cat([-r[..., half:], r[..., :half]], -1)
    return torch.cat([r * cos + rotated * sin, rest], -1)


def forward(w, c, ids, gguf):
    """Logits [T, vocab] of the fixture from weights `w` (GGUF names when `gguf`, else HF names)."""
    eps, T = c["rms_norm_eps"], len(ids)
    norm = (lambda name: w[name]) if gguf else (lambda name: 1 + w[name])  # the GGUF stores 1 + w
    name = (lambda i, g, h: f"blk.{i}.{g}") if gguf else (lambda i, g, h: f"model.layers.{i}.{h}")
    embed = w["token_embd.weight" if gguf else "model.embed_tokens.weight"]
    h = embed[torch.tensor(ids)]
    shape = RecurrentShape(c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                           c["linear_value_head_dim"], c["linear_conv_kernel_dim"])
    heads, kv_heads, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    for i, kind in enumerate(c["layer_types"]):
        x = rms(h, norm(name(i, "attn_norm.weight", "input_layernorm.weight")), eps)
        if kind == "linear_attention":
            p = (lambda g, hf: w[name(i, g, "linear_attn." + hf)])
            if gguf:
                layer = DeltaNetLayer(shape, p("ssm_conv1d.weight", ""), p("ssm_dt.bias", ""), p("ssm_a", ""),
                                      p("ssm_norm.weight", ""), eps, "tiled")
                proj = [p(n, "") for n in ("attn_qkv.weight", "attn_gate.weight", "ssm_alpha.weight", "ssm_beta.weight")]
                out_w = p("ssm_out.weight", "")
            else:
                layer = DeltaNetLayer.from_hf(shape, p("", "conv1d.weight"), p("", "A_log"), p("", "dt_bias"),
                                              p("", "norm.weight"), eps)
                proj = [p("", f"in_proj_{n}.weight") for n in ("qkv", "z", "a", "b")]
                out_w = p("", "out_proj.weight")
            y, _, _ = prefill(layer, *(x @ m.t() for m in proj))
            h = h + y @ out_w.t()
        else:
            p = (lambda g, hf: w[name(i, g, "self_attn." + hf)])
            qg = (x @ p("attn_q.weight", "q_proj.weight").t()).view(T, heads, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:]
            q = rms(q, norm(name(i, "attn_q_norm.weight", "self_attn.q_norm.weight")), eps)
            k = rms((x @ p("attn_k.weight", "k_proj.weight").t()).view(T, kv_heads, hd),
                    norm(name(i, "attn_k_norm.weight", "self_attn.k_norm.weight")), eps)
            v = (x @ p("attn_v.weight", "v_proj.weight").t()).view(T, kv_heads, hd)
            pos, rot = torch.arange(T), int(hd * c["rope_parameters"]["partial_rotary_factor"])
            q, k = rope(q, pos, rot, c["rope_parameters"]["rope_theta"]), rope(k, pos, rot, c["rope_parameters"]["rope_theta"])
            rep = heads // kv_heads
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                               v.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True,
                                               scale=1 / math.sqrt(hd)).transpose(0, 1)
            h = h + (o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))) @ p("attn_output.weight", "o_proj.weight").t()
        x = rms(h, norm(name(i, "post_attention_norm.weight", "post_attention_layernorm.weight")), eps)
        m = (lambda g, hf: w[name(i, g, "mlp." + hf)])
        h = h + (F.silu(x @ m("ffn_gate.weight", "gate_proj.weight").t()) * (x @ m("ffn_up.weight", "up_proj.weight").t())
                 ) @ m("ffn_down.weight", "down_proj.weight").t()
    return rms(h, norm("output_norm.weight" if gguf else "model.norm.weight"), eps) @ embed.t()


def hf_weights(hf_dir):
    from safetensors.torch import load_file

    return load_file(hf_dir / "model.safetensors")


def gguf_weights(path):
    from gguf import GGUFReader

    return {t.name: torch.from_numpy(t.data.copy()).float() for t in GGUFReader(path).tensors}


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_pieces_give_transformers_logits(arch_ckpt, source):
    from tests.loaders.arch_fixtures import hf_logits
    from tests.loaders.test_arch_fixtures import prompt_for

    ckpt = arch_ckpt("qwen35")
    ids = prompt_for(ckpt.config["vocab_size"]) * 2  # 80 tokens: past one 64-token chunk
    weights = hf_weights(ckpt.hf_dir) if source == "hf" else gguf_weights(ckpt.gguf)
    with torch.no_grad():
        got = forward(weights, ckpt.config, ids, gguf=source == "gguf")
        ref = hf_logits(ckpt.hf_dir, ids)
    err = float((got - ref).abs().max())
    print(f"\n{source}: max |logit diff| {err:.2e} (logits up to {float(ref.abs().max()):.1f})")
    assert err <= REL_TOL * float(ref.abs().max())
    assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()
