"""The decoder architectures kvgen runs, each a small description rather than a model file of its own.

Every architecture is the Llama block with options: what its layer norms are, which activation its
gated MLP uses, whether q and k are normed per head, whether projections carry biases, how its
checkpoints name and lay out their tensors (Hugging Face and GGUF). `LlamaModel` reads the options;
the loaders read the names. A new architecture is a new entry here (plus its config fields in
`kvgen.config`), not a copied model:

    llama    Llama 2/3, Mistral, SmolLM, TinyLlama: pre-norm, SwiGLU
    qwen2    + q/k/v biases
    qwen3    + per-head RMSNorm of q and k (QK-norm), an explicit head_dim
    phi3     the Llama block, stored with fused qkv_proj and gate_up_proj
    gemma3   QK-norm, GeGLU (tanh GELU), a norm before and after both attention and MLP ("sandwich"),
             RMSNorm by (1 + weight), embeddings scaled by sqrt(hidden), sliding-window layers
             interleaved with global ones (each kind with its own RoPE base)
"""

from __future__ import annotations

from dataclasses import dataclass, field

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class Architecture:
    name: str
    hf_model_types: tuple[str, ...]  # config.json model_type values
    gguf_name: str  # general.architecture
    activation: str = "silu"  # of the gated MLP: act(gate) * up
    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before RoPE
    sandwich_norms: bool = False  # norms of the attention and MLP outputs, before the residual adds
    norm_plus_one: bool = False  # HF checkpoints store w where the norm multiplies by (1 + w)
    scaled_embeddings: bool = False  # embeddings times sqrt(hidden)
    fused_checkpoint: bool = False  # qkv_proj / gate_up_proj in one tensor each (split at load)
    gguf_interleaved_rope: bool = False  # llama.cpp's converter permuted the q/k rows
    gguf_block_names: dict[str, str] = field(default_factory=dict)  # extra GGUF block tensors -> HF suffix

    def layer_norm_names(self) -> tuple[str, ...]:
        """The per-layer norm weights, by their HF names (`model.layers.{i}.` + name)."""
        if self.sandwich_norms:
            return ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                    "post_feedforward_layernorm")
        return ("input_layernorm", "post_attention_layernorm")

    @property
    def mlp_norm(self) -> str:
        """The norm before the MLP: Llama calls it post_attention_layernorm, Gemma pre_feedforward_layernorm."""
        return "pre_feedforward_layernorm" if self.sandwich_norms else "post_attention_layernorm"


# GGUF block tensors every architecture shares (llama.cpp's names -> HF's, after "blk.N." / "model.layers.N.").
GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

ARCHITECTURES = {arch.name: arch for arch in (
    Architecture("llama", ("llama", "mistral", "smollm", "tinyllama"), "llama", gguf_interleaved_rope=True),
    Architecture("qwen2", ("qwen2",), "qwen2", qkv_bias=True),
    Architecture("qwen3", ("qwen3",), "qwen3", qk_norm=True, gguf_block_names=_QK_NORM_NAMES),
    Architecture("phi3", ("phi3",), "phi3", fused_checkpoint=True,
                 gguf_block_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}),
    Architecture("gemma3", ("gemma3_text", "gemma3"), "gemma3", activation="gelu_tanh", qk_norm=True,
                 sandwich_norms=True, norm_plus_one=True, scaled_embeddings=True,
                 gguf_block_names=_QK_NORM_NAMES | {
                     "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}),
)}
BY_HF_MODEL_TYPE = {t: arch for arch in ARCHITECTURES.values() for t in arch.hf_model_types}
BY_GGUF_NAME = {arch.gguf_name: arch for arch in ARCHITECTURES.values()}


def known_names() -> str:
    """The architectures kvgen runs, for error messages."""
    return ", ".join(sorted(ARCHITECTURES))
