"""Qwen3.5 dense text models (0.8B to 27B): three Gated DeltaNet layers to one of gated attention.

    linear layer:  x += linear_attn(rms_norm(x))   Gated DeltaNet over a per-sequence state
    full layer:    x += gated_attn(rms_norm(x))    q carries a sigmoid output gate; QK-norm, partial RoPE
    both:          x += swiglu_mlp(rms_norm(x))

Norms multiply by (1 + w) (HF stores w, GGUF 1 + w) but the delta-net's gated norm (w in both). A HF
`Qwen3_5ForConditionalGeneration` holds the text model under `model.language_model.` beside a vision
tower, which kvgen leaves. A GGUF keeps llama.cpp's delta-net layout (tiled value heads, the decay rate
itself: spec.GatedDeltaNetSpec). The MTP layers (`mtp_num_hidden_layers`; a GGUF's `nextn_predict_layers`,
counted in its block_count) are kept beside the model for speculation (kvgen.model.mtp).
"""

from typing import Any

from kvgen.architectures.spec import (GGUF_BLOCK_NAMES, GGUF_QK_NORM_NAMES, Architecture, Branch,
                                      GatedAttentionSpec, GatedDeltaNetSpec, GatedMLPSpec, LayerSpec,
                                      RecurrentShape, rope_parameters)

MLP = Branch("post_attention_layernorm", GatedMLPSpec())
FULL, LINEAR = (LayerSpec((Branch("input_layernorm", b), MLP)) for b in (GatedAttentionSpec(), GatedDeltaNetSpec()))
def recurrent_layers(num_layers: int, full: list[bool] | None, interval: int) -> tuple[int, ...]:
    """The delta-net layers: those `full` says are not full attention, else all but every `interval`-th."""
    full = [(i + 1) % interval == 0 for i in range(num_layers)] if full is None else full[:num_layers]
    if len(full) != num_layers:
        raise ValueError(f"{len(full)} layer types for {num_layers} layers")
    return tuple(i for i, is_full in enumerate(full) if not is_full)


def hf_fields(cfg: dict[str, Any], config: Any) -> dict[str, Any]:
    kinds, rope = cfg.get("layer_types"), rope_parameters(cfg, "full_attention")
    if set(kinds or ()) - {"linear_attention", "full_attention"}:
        raise ValueError(f"Qwen3.5 layer types {sorted(set(kinds))} are not supported")
    return dict(rotary_dim=int(config.head_dim * float(rope.get("partial_rotary_factor", 1.0))),
                mtp_layers=int(cfg.get("mtp_num_hidden_layers", 0)),
                recurrent=RecurrentShape(*(int(cfg[f"linear_{n}"]) for n in (
                    "num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel_dim"))),
                recurrent_layers=recurrent_layers(config.num_layers, kinds and [k == "full_attention" for k in kinds],
                                                  int(cfg.get("full_attention_interval", 4))))


def gguf_fields(p: str, meta: dict[str, Any], config: Any) -> dict[str, Any]:
    """llama.cpp's ssm keys: group_count (key heads), state_size (their size), time_step_rank (value heads),
    inner_size (value heads x size); block_count counts the MTP layers too."""
    v_heads, mtp, full = int(meta[p + "ssm.time_step_rank"]), int(meta.get(p + "nextn_predict_layers", 0)), \
        meta.get(p + "attention.recurrent_layers")
    return dict(num_layers=config.num_layers - mtp, mtp_layers=mtp, recurrent_layout="gguf",
                rotary_dim=int(meta.get(p + "rope.dimension_count", config.head_dim)),
                recurrent=RecurrentShape(int(meta[p + "ssm.group_count"]), v_heads, int(meta[p + "ssm.state_size"]),
                                         int(meta[p + "ssm.inner_size"]) // v_heads, int(meta[p + "ssm.conv_kernel"])),
                recurrent_layers=recurrent_layers(config.num_layers - mtp, full and [not r for r in full],
                                                  int(meta.get(p + "full_attention_interval", 4))))


ARCHITECTURE = Architecture(
    name="qwen35", hf_model_types=("qwen3_5_text", "qwen3_5"), gguf_name="qwen35", layer=FULL,
    layer_of=lambda i, config: LINEAR if i in config.recurrent_layers else FULL, norm_plus_one=True,
    gguf_names=GGUF_BLOCK_NAMES | GGUF_QK_NORM_NAMES | {"post_attention_norm": "post_attention_layernorm"} | {
        g: "linear_attn." + h for g, h in (
            ("attn_qkv", "in_proj_qkv"), ("attn_gate", "in_proj_z"), ("ssm_alpha", "in_proj_a"), ("ssm_beta", "in_proj_b"),
            ("ssm_a", "decay_rate"), ("ssm_conv1d", "conv1d"), ("ssm_dt.bias", "dt_bias"), ("ssm_norm", "norm"),
            ("ssm_out", "out_proj"))},
    hf_fields=hf_fields, gguf_fields=gguf_fields, plain_norms=("linear_attn.norm.weight",),
)
