"""Qwen3.5's gated full attention: attention as kvgen.model.blocks.attention runs it, with a sigmoid
gate on its output that q_proj computes beside the query, and RoPE on part of each head.

    q_proj(h) per head: [ query (D) | gate (D) ]
    out = o_proj(attention(rope(norm(q)), rope(norm(k)), v) * sigmoid(gate))

Only the first `config.rotary_dim` dimensions of q and k are rotated (a quarter of the head in
Qwen3.5); the model's RoPE tables are that wide. On the CPU in fp32 the gate is a C kernel
(kvgen.model.kernels.output_gate), which gives the fused decode step's form its bits.
"""

from __future__ import annotations

import torch

from kvgen.architectures.spec import GatedAttentionSpec
from kvgen.model.blocks.attention import AttentionBlock
from kvgen.model.blocks.base import BuildContext, FusedProgram, StepContext, register
from kvgen.model.kernels.build import KernelCall
from kvgen.model.kernels.output_gate import output_gate_kernel


@register(GatedAttentionSpec.kind)
class GatedAttentionBlock(AttentionBlock):
    kind = GatedAttentionSpec.kind

    def __init__(self, spec: GatedAttentionSpec, index: int, ctx: BuildContext) -> None:
        super().__init__(spec, index, ctx)  # qkv: hidden -> (2 H + 2 KV) * D, each head's query and gate
        if self.q_norm is None:
            raise ValueError(f"{ctx.config.architecture}: gated attention is built with QK-norm")
        self.rotary_dim = ctx.config.rotary_dim or self.dim
        on_cpu = ctx.build.device.type == "cpu" and ctx.build.dtype == torch.float32
        self.output_gate = output_gate_kernel() if on_cpu else None

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
        gate = q_gate[..., dim:]                                                # [T, H, D]
        if self.output_gate is not None:
            return self.o(self.output_gate(attn, gate), step.rows)
        return self.o(attn.reshape(-1, q_size) * torch.sigmoid(gate.reshape(-1, q_size)), step.rows)

    def fuses(self) -> bool:
        """Its fused form needs the gate's kernel (whose bits the layer-by-layer forward has too)."""
        return super().fuses() and self.output_gate is not None

    def reserve_buffers(self, program: FusedProgram) -> None:
        q_size, kv_size = self.heads * self.dim, self.kv_heads * self.dim
        program.buffer("gated_qkv", (2 * q_size + 2 * kv_size,))
        program.buffer("qk", (self.heads + self.kv_heads, self.dim))
        program.buffer("attn", (q_size,)), program.buffer("gated", (q_size,))

    def fused_calls(self, program: FusedProgram) -> list[KernelCall | None] | None:
        """The forward's kernels: the q and k norms per row and head, RoPE on each head's first
        rotary_dim values (a call per head: the rotated part of a head is strided), attention, the gate."""
        if not self.fuses():
            return None
        rows, heads, kv_heads, dim = program.rows, self.heads, self.kv_heads, self.dim
        q_size, kv_size = heads * dim, kv_heads * dim
        qkv = program.buffer("gated_qkv", (2 * q_size + 2 * kv_size,))
        q_gate = qkv[:, : 2 * q_size].view(rows, heads, 2 * dim)
        k, v = qkv[:, 2 * q_size : 2 * q_size + kv_size], qkv[:, 2 * q_size + kv_size :].view(rows, kv_heads, dim)
        qk = program.buffer("qk", (heads + kv_heads, dim))
        attn, gated = program.buffer("attn", (q_size,)), program.buffer("gated", (q_size,))
        attend = program.attend_calls(self.index, qk[:, :heads], qk[:, heads:], v, attn.view(rows, heads, dim))
        if attend is None:
            return None
        calls = [self.qkv.call(program.h, qkv)]
        for r in range(rows):
            calls += [program.norm.call(q_gate[r, head, :dim].view(1, dim), self.q_norm, self.eps,
                                        qk[r, head].view(1, dim)) for head in range(heads)]
            calls.append(program.norm.call(k[r].view(kv_heads, dim), self.k_norm, self.eps, qk[r, heads:]))
        tables = program.rope_tables(self.rope)
        calls += [program.rope.call(qk[:, head, : self.rotary_dim].unsqueeze(1), *tables)
                  for head in range(heads + kv_heads)]
        return [*calls, *attend, self.output_gate.call(attn.view(rows, heads, dim), q_gate[..., dim:],
                                                       gated.view(rows, heads, dim)),
                self.o.call(gated, program.out)]
