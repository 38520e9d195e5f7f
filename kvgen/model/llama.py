"""One Llama-family decoder for every supported family (Llama 2/3, Mistral, Qwen2, TinyLlama, SmolLM).

Pure tensors: the model maps a flat batch of tokens (any mix of sequences) to hidden states and
logits. Where K/V come from and go to is the job of the `Attention` backend passed to `forward`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvgen.config import ModelConfig
from kvgen.model.attention import Attention
from kvgen.model.fused import DecodePrograms
from kvgen.model.layers import RotaryEmbedding, make_rms_norm, make_rope, make_silu_mul
from kvgen.model.linear import Linear, RowKernels
from kvgen.model.projections import ACTIVATIONS, Embedding, LayerBuilder, Weight, describe


@dataclass
class LayerWeights:
    """One decoder layer, with q/k/v and gate/up fused so each is a single matmul."""

    input_norm: torch.Tensor
    qkv: Linear  # hidden -> (heads + 2 * kv_heads) * D, with the q/k/v biases if the family has them
    o: Linear  # heads * D -> hidden
    post_norm: torch.Tensor
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden


class LlamaModel:
    """Weights plus the forward pass. Built from Hugging Face-named weights (see `kvgen.loaders`):
    float tensors, or GGUF matrices kept packed (`LoadedModel.quantized`), which get quantized
    linear layers (kvgen.model.projections). `quantization` "int8" / "int4" packs float matrices;
    `activations` is how packed layers quantize x (kvgen.model.projections.ACTIVATIONS by default).
    `fused_decode` lets decode steps run as one list of C kernel calls (kvgen.model.fused)."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, Weight],
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 quantization: str = "none", fused_decode: bool = True, activations: str = ACTIVATIONS) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        build = LayerBuilder(self.device, dtype, quantization, activations)
        head = weights["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
        self.lm_head = build.linear([head])
        self.embed = Embedding(weights["model.embed_tokens.weight"], build,
                               self.lm_head if config.tie_word_embeddings else None)
        self.layers = [_layer_weights(weights, i, config, build) for i in range(config.num_layers)]
        self.final_norm = build.float(weights["model.norm.weight"])
        self.rope = RotaryEmbedding(config, config.max_position_embeddings, self.device, dtype)
        self.norm = make_rms_norm(self.device, dtype)
        self.rotate = make_rope(self.device, dtype)  # may rotate in place: q/k are the qkv layer's fresh output
        self.silu_mul = make_silu_mul(self.device, dtype)
        self.decode_programs = DecodePrograms(self, fused_decode)

    def kernels(self) -> dict[str, tuple[str, int]]:
        """Per projection role: (the kernel its layers run, their weight bytes over all layers)."""
        roles = {"qkv": [l.qkv for l in self.layers], "o": [l.o for l in self.layers],
                 "gate_up": [l.gate_up for l in self.layers], "down": [l.down for l in self.layers],
                 "lm_head": [self.lm_head]}
        report = {}
        for role, layers in roles.items():
            described = [describe(layer) for layer in layers]
            kernels = sorted({kernel for kernel, _ in described})
            report[role] = (" + ".join(kernels), sum(size for _, size in described))
        return report

    @property
    def max_positions(self) -> int:
        return self.rope.max_positions

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                rows: RowKernels | None = None) -> torch.Tensor:
        """token_ids, positions [T] -> hidden states [T, hidden] after the final norm.
        `rows`, if given, fixes each row's matmul kernel by its role (see kvgen.model.linear; the
        layers of a fused decode step never depend on the rows beside a row). A decode step runs
        from C where it can (kvgen.model.fused), with the same bits as the layers below."""
        cfg = self.config
        x = self.embed(token_ids)
        program = self.decode_programs.find(token_ids.shape[0], attention)
        if program is not None:
            return program(x, positions, attention, self.rope.cos, self.rope.sin)
        cos, sin = self.rope.tables(positions)  # [T, 1, D]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for index, layer in enumerate(self.layers):
            h = self.norm(x, layer.input_norm, cfg.rms_norm_eps)
            qk, v = layer.qkv(h, rows).split((q_size + kv_size, kv_size), dim=-1)
            qk = self.rotate(qk.view(-1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), cos, sin)  # q, k at once
            q, k = qk.split((cfg.num_heads, cfg.num_kv_heads), dim=1)
            attn = attention(index, q, k, v.view(-1, cfg.num_kv_heads, cfg.head_dim))
            x.add_(layer.o(attn.reshape(-1, q_size), rows))
            h = self.norm(x, layer.post_norm, cfg.rms_norm_eps)
            x.add_(layer.down(self.silu_mul(layer.gate_up(h, rows)), rows))
        return self.norm(x, self.final_norm, cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab]."""
        return self.lm_head(hidden, rows).float()


def _layer_weights(w: Mapping[str, Weight], i: int, config: ModelConfig, build: LayerBuilder) -> LayerWeights:
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    qkv_bias = None
    if config.qkv_bias:
        qkv_bias = build.float(torch.cat([w[attn + n + "_proj.bias"] for n in ("q", "k", "v")]))
    o_bias = build.float(w[attn + "o_proj.bias"]) if config.o_bias else None
    return LayerWeights(
        input_norm=build.float(w[p + "input_layernorm.weight"]),
        qkv=build.linear([w[attn + n + "_proj.weight"] for n in ("q", "k", "v")], qkv_bias),
        o=build.linear([w[attn + "o_proj.weight"]], o_bias),
        post_norm=build.float(w[p + "post_attention_layernorm.weight"]),
        gate_up=build.linear([w[mlp + "gate_proj.weight"], w[mlp + "up_proj.weight"]]),
        down=build.linear([w[mlp + "down_proj.weight"]]),
    )
