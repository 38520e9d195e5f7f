"""Qwen3: Llama's layer with QK-norm (an RMSNorm over each head of q and of k, before RoPE) and an
explicit head_dim.

    GGUF blk.N.attn_q_norm / attn_k_norm  ->  model.layers.N.self_attn.q_norm / k_norm
"""

from kvgen.architectures.spec import (GGUF_BLOCK_NAMES, GGUF_QK_NORM_NAMES, Architecture, AttentionSpec,
                                      GatedMLPSpec, pre_norm_layer, sliding_window_if_used)

ARCHITECTURE = Architecture(
    name="qwen3",
    hf_model_types=("qwen3",),
    gguf_name="qwen3",
    layer=pre_norm_layer(AttentionSpec(qk_norm=True), GatedMLPSpec(activation="silu")),
    gguf_names=GGUF_BLOCK_NAMES | GGUF_QK_NORM_NAMES,
    hf_fields=sliding_window_if_used,
)
