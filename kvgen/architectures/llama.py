"""Llama 2/3/3.1/3.2, Mistral, SmolLM, TinyLlama: the block every other description varies.

    layer:  x += attention(rms_norm(x))          input_layernorm, self_attn.{q,k,v,o}_proj
            x += swiglu_mlp(rms_norm(x))         post_attention_layernorm, mlp.{gate,up,down}_proj

GGUF: llama.cpp's converter permutes q/k rows for interleaved-pair RoPE; the loader undoes it.
"""

from kvgen.architectures.spec import Architecture, AttentionSpec, GatedMLPSpec, pre_norm_layer

ARCHITECTURE = Architecture(
    name="llama",
    hf_model_types=("llama", "mistral", "smollm", "tinyllama"),
    gguf_name="llama",
    layer=pre_norm_layer(AttentionSpec(), GatedMLPSpec(activation="silu")),
    gguf_interleaved_rope=True,
)
