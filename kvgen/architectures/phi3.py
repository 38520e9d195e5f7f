"""Phi-3 mini (4k): Llama's layer, stored with fused qkv_proj and gate_up_proj tensors, which kvgen
keeps fused (they are the one matmul it runs anyway).

    GGUF blk.N.attn_qkv  ->  model.layers.N.self_attn.qkv_proj
         blk.N.ffn_up    ->  model.layers.N.mlp.gate_up_proj   (gate and up, stacked)
"""

from kvgen.architectures.spec import GGUF_BLOCK_NAMES, Architecture, AttentionSpec, GatedMLPSpec, pre_norm_layer

ARCHITECTURE = Architecture(
    name="phi3",
    hf_model_types=("phi3",),
    gguf_name="phi3",
    layer=pre_norm_layer(AttentionSpec(fused_qkv=True), GatedMLPSpec(activation="silu", fused_gate_up=True)),
    gguf_names=GGUF_BLOCK_NAMES | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
)
