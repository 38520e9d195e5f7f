"""Gemma 4 text models (E2B, E4B, 31B; the MoE 26B-A4B waits for issue 43).

    layer:  x += rms_norm(attention(rms_norm(x)))     input_layernorm, post_attention_layernorm
            x += rms_norm(geglu_mlp(rms_norm(x)))     pre_feedforward_layernorm, post_feedforward_layernorm
            x += rms_norm(per_layer_input(x))         post_per_layer_input_norm   (E2B/E4B only)
            x *= layer_scalar

Gemma 3's layer with: window and global layers of different head sizes (256 / 512 in the released
models) and KV heads; attention scale 1 (q and k are RMS-normed per head, V too, without a weight);
the last `num_kv_shared_layers` layers compute no K/V and attend over the K/V of the last earlier
layer of their kind (kvgen.cache.shared_kv); "proportional" RoPE on the global layers (only the first
quarter of the frequency pairs rotate); MLPs twice as wide on the sharing layers where
`use_double_wide_mlp` says so (E2B); per-layer inputs from a table of their own (E2B/E4B); norms
multiply by w itself (not 1 + w as in Gemma 3); final logit soft-capping; `attention_k_eq_v`: the
global layers' V is their key projection (no v_proj).

What its HF config and GGUF metadata say is read in kvgen.architectures.gemma4_fields.
"""

from __future__ import annotations

from typing import Any

from kvgen.architectures.gemma4_fields import gguf_fields, gguf_tensor_fields, hf_fields
from kvgen.architectures.spec import (GGUF_BLOCK_NAMES, GGUF_QK_NORM_NAMES, Architecture, AttentionSpec, Branch,
                                      GatedMLPSpec, LayerSpec, PerLayerInputSpec)


def layer_of(index: int, config: Any) -> LayerSpec:
    """Layer `index`: its attention's head size and KV heads, whether it shares K/V; the per-layer
    input branch where the model has per-layer inputs."""
    shared = config.kv_donor(index) != index
    k_eq_v = config.attention_k_eq_v and config.window(index) is None
    attention = AttentionSpec(qk_norm=True, head_dim=config.head_dim_of(index), kv_heads=config.kv_heads_of(index),
                              value_norm=True, shared_kv=shared, k_eq_v=k_eq_v)
    wide = config.intermediate_size * 2 if config.double_wide_mlp and shared else None
    branches = [Branch("input_layernorm", attention, out_norm="post_attention_layernorm"),
                Branch("pre_feedforward_layernorm", GatedMLPSpec(activation="gelu_tanh", intermediate_size=wide),
                       out_norm="post_feedforward_layernorm")]
    if config.per_layer_input_size:
        branches.append(Branch(None, PerLayerInputSpec(), out_norm="post_per_layer_input_norm"))
    return LayerSpec(tuple(branches), scalar="layer_scalar")


def model_tensors(config: Any) -> dict[str, tuple[int, ...]]:
    """The per-layer inputs' table, projection and norm (E2B/E4B)."""
    width = config.per_layer_input_size * config.num_layers
    if not width:
        return {}
    return {"model.embed_tokens_per_layer.weight": (config.per_layer_vocab_size, width),
            "model.per_layer_model_projection.weight": (width, config.hidden_size),
            "model.per_layer_projection_norm.weight": (config.per_layer_input_size,)}


ARCHITECTURE = Architecture(
    name="gemma4",
    hf_model_types=("gemma4_text", "gemma4"),
    gguf_name="gemma4",
    layer=LayerSpec((
        Branch("input_layernorm", AttentionSpec(qk_norm=True, value_norm=True), out_norm="post_attention_layernorm"),
        Branch("pre_feedforward_layernorm", GatedMLPSpec(activation="gelu_tanh"),
               out_norm="post_feedforward_layernorm"),
    ), scalar="layer_scalar"),
    layer_of=layer_of,
    embedding_scale=True,
    tied_by_default=True,
    gguf_names=GGUF_BLOCK_NAMES | GGUF_QK_NORM_NAMES | {
        "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm", "inp_gate": "per_layer_input_gate",
        "proj": "per_layer_projection", "post_norm": "post_per_layer_input_norm",
        "layer_output_scale": "layer_scalar"},
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    gguf_tensor_fields=gguf_tensor_fields,
    model_tensors=model_tensors,
)
