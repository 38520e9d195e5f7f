"""Qwen3.5's gated full attention: attention as kvgen.model.blocks.attention runs it, with a sigmoid
gate on its output that q_proj computes beside the query, and RoPE on part of each head.

    q_proj(h) per head: [ query (D) | gate (D) ]
    out = o_proj(attention(rope(norm(q)), rope(norm(k)), v) * sigmoid(gate))

Only the first `config.rotary_dim` dimensions of q and k are rotated (a quarter of the head in
Qwen3.5); the model's RoPE tables are that wide. No fused form: the layer runs layer by layer inside
a fused decode step.
"""

from __future__ import annotations

import torch

from kvgen.architectures.spec import GatedAttentionSpec
from kvgen.model.blocks.attention import AttentionBlock
from kvgen.model.blocks.base import Block, BuildContext, StepContext, register


@register(GatedAttentionSpec.kind)
class GatedAttentionBlock(AttentionBlock):
    kind = GatedAttentionSpec.kind
    fused_calls = Block.fused_calls  # not the ungated block's calls: this one has no fused form
    reserve_buffers = Block.reserve_buffers

    def __init__(self, spec: GatedAttentionSpec, index: int, ctx: BuildContext) -> None:
        super().__init__(spec, index, ctx)  # qkv: hidden -> (2 H + 2 KV) * D, each head's query and gate
        if self.q_norm is None:
            raise ValueError(f"{ctx.config.architecture}: gated attention is built with QK-norm")
        self.rotary_dim = ctx.config.rotary_dim or self.dim

    def forward(self, h: torch.Tensor, step: StepContext) -> torch.Tensor:
        heads, kv_heads, dim = self.heads, self.kv_heads, self.dim
        q_size, kv_size = heads * dim, kv_heads * dim
        q_gate, k, v = self.qkv(h, step.rows).split((2 * q_size, kv_size, kv_size), dim=-1)
        q_gate = q_gate.unflatten(1, (heads, 2 * dim))                          # [T, H, 2D]
        q = self.norm(q_gate[..., :dim].reshape(-1, dim), self.q_norm, self.eps).view(-1, heads, dim)
        k = self.norm(k.reshape(-1, dim), self.k_norm, self.eps).view(-1, kv_heads, dim)
        qk = torch.cat((q, k), dim=1)                                           # [T, H + KV, D]
        rot = self.rotary_dim
        qk[..., :rot] = self.rotate(qk[..., :rot].contiguous(), *step.tables[self.rope])
        q, k = qk.split((heads, kv_heads), dim=1)
        attn = step.attention(self.index, q, k, v.reshape(-1, kv_heads, dim))  # [T, H, D]
        gate = torch.sigmoid(q_gate[..., dim:].reshape(-1, q_size))
        return self.o(attn.reshape(-1, q_size) * gate, step.rows)
