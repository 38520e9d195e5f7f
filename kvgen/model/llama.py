"""One decoder for every architecture of kvgen.model.architectures (Llama 2/3, Mistral, SmolLM,
Qwen2/3, Phi-3, Gemma 3): the Llama block, with the options each architecture's description turns on.

Pure tensors: the model maps a flat batch of tokens (any mix of sequences) to hidden states and
logits. Where K/V come from and go to, and which keys each layer's window lets a query see, is the
job of the `Attention` backend passed to `forward`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from kvgen.config import ModelConfig
from kvgen.model.attention import Attention
from kvgen.model.fused import DecodePrograms
from kvgen.model.layers import RotaryEmbedding, make_gate_mul, make_rms_norm, make_rope
from kvgen.model.linear import Linear, RowKernels
from kvgen.model.projections import ACTIVATIONS, Embedding, LayerBuilder, Weight, describe


@dataclass
class LayerWeights:
    """One decoder layer, with q/k/v and gate/up fused so each is a single matmul. Norm weights are
    the factors the norm multiplies by (Gemma's 1 + w already added)."""

    input_norm: torch.Tensor
    qkv: Linear  # hidden -> (heads + 2 * kv_heads) * D, with the q/k/v biases if the family has them
    o: Linear  # heads * D -> hidden
    post_norm: torch.Tensor  # before the MLP
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden
    rope: int = 0  # index into LlamaModel.ropes: this layer's RoPE base
    q_norm: torch.Tensor | None = None  # [D] QK-norm (Qwen3, Gemma 3), times the query scale
    k_norm: torch.Tensor | None = None  # [D]
    attn_out_norm: torch.Tensor | None = None  # [hidden] on the attention output (Gemma's sandwich)
    mlp_out_norm: torch.Tensor | None = None  # [hidden] on the MLP output


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
        # Gemma scales embeddings by sqrt(hidden), rounded to the model's dtype first as HF does.
        self.embed_scale = (torch.tensor(math.sqrt(config.hidden_size)).to(dtype).item()
                            if config.arch.scaled_embeddings else None)
        layer_thetas = [config.rope_theta_of(i) for i in range(config.num_layers)]
        thetas = [config.rope_theta, *sorted(set(layer_thetas) - {config.rope_theta})]
        self.layers = [_layer_weights(weights, i, config, build, thetas.index(theta))
                       for i, theta in enumerate(layer_thetas)]
        self.final_norm = build.float(weights["model.norm.weight"])
        # ropes[0]: the global layers' base and scaling; a hybrid model's windowed layers may have their own.
        self.ropes = [RotaryEmbedding(config if theta == config.rope_theta else
                                      replace(config, rope_theta=theta, rope_scaling=None),
                                      config.max_position_embeddings, self.device, dtype) for theta in thetas]
        self.rope = self.ropes[0]
        self.norm = make_rms_norm(self.device, dtype)
        self.rotate = make_rope(self.device, dtype)  # may rotate in place: q/k are fresh buffers
        self.gate_mul = make_gate_mul(config.arch.activation, self.device, dtype)
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
        x = self.embed_tokens(token_ids)
        program = self.decode_programs.find(token_ids.shape[0], attention)
        if program is not None:
            return program(x, positions, attention)
        tables = [rope.tables(positions) for rope in self.ropes]  # each cos, sin [T, 1, D]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for index, layer in enumerate(self.layers):
            h = self.norm(x, layer.input_norm, cfg.rms_norm_eps)
            qk, v = layer.qkv(h, rows).split((q_size + kv_size, kv_size), dim=-1)
            qk = self._qk_heads(qk, layer)
            qk = self.rotate(qk, *tables[layer.rope])  # q, k at once
            q, k = qk.split((cfg.num_heads, cfg.num_kv_heads), dim=1)
            attn = attention(index, q, k, v.view(-1, cfg.num_kv_heads, cfg.head_dim))
            x.add_(self._branch_out(layer.o(attn.reshape(-1, q_size), rows), layer.attn_out_norm))
            h = self.norm(x, layer.post_norm, cfg.rms_norm_eps)
            x.add_(self._branch_out(layer.down(self.gate_mul(layer.gate_up(h, rows)), rows), layer.mlp_out_norm))
        return self.norm(x, self.final_norm, cfg.rms_norm_eps)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [T] -> [T, hidden], a fresh tensor (scaled for Gemma)."""
        x = self.embed(token_ids)
        return x if self.embed_scale is None else x.mul_(self.embed_scale)

    def _qk_heads(self, qk: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """The q and k parts of a qkv row [T, (heads + kv_heads) * D] -> [T, heads + kv_heads, D], each
        head normed where the architecture norms q and k."""
        cfg = self.config
        heads, dim = cfg.num_heads + cfg.num_kv_heads, cfg.head_dim
        if layer.q_norm is None:
            return qk.view(-1, heads, dim)
        q, k = qk.view(-1, heads, dim).split((cfg.num_heads, cfg.num_kv_heads), dim=1)
        eps = cfg.rms_norm_eps
        q = self.norm(q.reshape(-1, dim), layer.q_norm, eps).view(-1, cfg.num_heads, dim)
        k = self.norm(k.reshape(-1, dim), layer.k_norm, eps).view(-1, cfg.num_kv_heads, dim)
        return torch.cat((q, k), dim=1)

    def _branch_out(self, out: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """An attention or MLP output, normed before its residual add where the architecture does so."""
        return out if norm is None else self.norm(out, norm, self.config.rms_norm_eps)

    def logits(self, hidden: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab] (soft-capped where the model says so)."""
        logits = self.lm_head(hidden, rows).float()
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits.div_(cap)).mul_(cap)


def _layer_weights(w: Mapping[str, Weight], i: int, config: ModelConfig, build: LayerBuilder,
                   rope: int) -> LayerWeights:
    arch = config.arch
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    qkv_bias = None
    if config.qkv_bias:
        qkv_bias = build.float(torch.cat([w[attn + n + "_proj.bias"] for n in ("q", "k", "v")]))
    o_bias = build.float(w[attn + "o_proj.bias"]) if config.o_bias else None
    qkv = [w[attn + "qkv_proj.weight"]] if arch.fused_checkpoint else [w[attn + n + "_proj.weight"] for n in "qkv"]
    gate_up = [w[mlp + "gate_up_proj.weight"]] if arch.fused_checkpoint else [w[mlp + n + "_proj.weight"]
                                                                               for n in ("gate", "up")]
    layer = LayerWeights(
        input_norm=build.float(w[p + "input_layernorm.weight"]),
        qkv=build.linear(qkv, qkv_bias),
        o=build.linear([w[attn + "o_proj.weight"]], o_bias),
        post_norm=build.float(w[p + arch.mlp_norm + ".weight"]),
        gate_up=build.linear(gate_up),
        down=build.linear([w[mlp + "down_proj.weight"]]),
        rope=rope,
    )
    if arch.qk_norm:
        layer.q_norm = build.float(w[attn + "q_norm.weight"].float() * _query_scale(config))
        layer.k_norm = build.float(w[attn + "k_norm.weight"])
    elif config.attention_scale is not None and _query_scale(config) != 1.0:
        raise ValueError(f"{arch.name}: a query scale other than 1/sqrt(head_dim) needs QK-norm to carry it")
    if arch.sandwich_norms:
        layer.attn_out_norm = build.float(w[p + "post_attention_layernorm.weight"])
        layer.mlp_out_norm = build.float(w[p + "post_feedforward_layernorm.weight"])
    return layer


def _query_scale(config: ModelConfig) -> float:
    """What q is multiplied by so that attention's 1/sqrt(head_dim) becomes `attention_scale`: folded
    into q's norm weight (exactly 1 where, as in Gemma 3 270M, the two agree)."""
    if config.attention_scale is None:
        return 1.0
    return config.attention_scale * math.sqrt(config.head_dim)
