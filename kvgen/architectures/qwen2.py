"""Qwen2, Qwen2.5: Llama's layer with biases on q, k and v.

A config's `sliding_window` applies only with `use_sliding_window` (Qwen leaves it set but off).
"""

from kvgen.architectures.spec import Architecture, AttentionSpec, GatedMLPSpec, pre_norm_layer, sliding_window_if_used

ARCHITECTURE = Architecture(
    name="qwen2",
    hf_model_types=("qwen2",),
    gguf_name="qwen2",
    layer=pre_norm_layer(AttentionSpec(qkv_bias=True), GatedMLPSpec(activation="silu")),
    hf_fields=sliding_window_if_used,
)
