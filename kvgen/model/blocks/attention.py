"""Softmax attention over the KV cache: q/k/v in one matmul (biases where the architecture has them),
optional per-head RMSNorm of q and k, RoPE of the layer's base, the backend's attention, o.

Gemma 4's options: the layer's own head size and KV heads; V RMS-normed without a weight; V taken
from the key projection (k_eq_v); and a layer sharing an earlier layer's K/V, which projects only
q and attends over its donor's cache (`Attention.attend_shared`). gpt-oss's: a sink logit per head in
each softmax's denominator, handed to the backend (`Attention.__call__`'s `sinks`)."""

from __future__ import annotations

import math

import torch

from kvgen.architectures.spec import AttentionSpec
from kvgen.config import ModelConfig
from kvgen.model.blocks.base import Block, BuildContext, FusedProgram, StepContext, register
from kvgen.model.kernels.build import KernelCall
from kvgen.model.linear import Linear


@register(AttentionSpec.kind)
class AttentionBlock(Block):
    kind = AttentionSpec.kind

    def __init__(self, spec: AttentionSpec, index: int, ctx: BuildContext) -> None:
        cfg, w, build = ctx.config, ctx.weights, ctx.build
        p = f"model.layers.{index}.{spec.prefix}."
        self.index, self.rope, self.donor = index, ctx.rope_index(index), cfg.kv_donor(index)
        self.dim, self.kv_heads = spec.dims(cfg)
        self.heads, self.shared, self.k_eq_v = cfg.num_heads, spec.shared_kv, spec.k_eq_v
        self.norm, self.rotate, self.eps = ctx.norm, ctx.rotate, cfg.rms_norm_eps
        projected = "q" if spec.shared_kv else "qk" if spec.k_eq_v else "qkv"
        qkv_bias = build.float(torch.cat([w[p + n + "_proj.bias"] for n in projected])) if cfg.qkv_bias else None
        o_bias = build.float(w[p + "o_proj.bias"]) if cfg.o_bias else None
        names = ["qkv_proj"] if spec.fused_qkv else [n + "_proj" for n in projected]
        self.qkv: Linear = build.linear([w[p + n + ".weight"] for n in names], qkv_bias)  # hidden -> (H + 2 KV) * D
        self.o: Linear = build.linear([w[p + "o_proj.weight"]], o_bias)  # H * D -> hidden
        self.q_norm: torch.Tensor | None = None  # [D] (or [H * D], whole), times the query scale
        self.k_norm: torch.Tensor | None = None  # [D] (or [KV * D], whole)
        self.q_width, self.k_width = (self.heads * self.dim, self.kv_heads * self.dim) if spec.qk_norm_whole \
            else (self.dim, self.dim)  # how many values each RMSNorm of q and k spans
        self.v_norm = build.float(torch.ones(self.dim)) if spec.value_norm else None  # [D] RMS only
        self.sinks = build.float(w[p + "sinks"]) if spec.sink_logits else None  # [H]
        if spec.qk_norm:
            self.q_norm = build.float(w[p + "q_norm.weight"].float() * query_scale(cfg, self.dim))
            self.k_norm = None if spec.shared_kv else build.float(w[p + "k_norm.weight"])
        elif cfg.attention_scale is not None and query_scale(cfg, self.dim) != 1.0:
            raise ValueError(f"{cfg.architecture}: a query scale other than 1/sqrt(head_dim) needs QK-norm to carry it")

    def projections(self) -> dict[str, Linear]:
        return {"qkv": self.qkv, "o": self.o}

    def fuses(self) -> bool:
        """V taken from the key projection (k_eq_v, Gemma 4 31B's global layers) and sink logits
        (gpt-oss) have no fused form yet: such a layer runs layer by layer in a fused step."""
        return not self.k_eq_v and self.sinks is None

    def forward(self, h: torch.Tensor, step: StepContext) -> torch.Tensor:
        q_size, kv_size = self.heads * self.dim, self.kv_heads * self.dim
        if self.shared:
            return self._forward_shared(h, step)
        if self.k_eq_v:
            qk = self.qkv(h, step.rows)
            v = qk[:, q_size:]  # V is the key projection, before K's norm and RoPE
        else:
            qk, v = self.qkv(h, step.rows).split((q_size + kv_size, kv_size), dim=-1)
        v = v.reshape(-1, self.kv_heads, self.dim)
        if self.v_norm is not None:
            v = self.norm(v.reshape(-1, self.dim), self.v_norm, self.eps).view(-1, self.kv_heads, self.dim)
        qk = self.rotate(self._qk_heads(qk), *step.tables[self.rope])  # q, k at once
        q, k = qk.split((self.heads, self.kv_heads), dim=1)
        attn = step.attention(self.index, q, k, v, self.sinks)
        return self.o(attn.reshape(-1, q_size), step.rows)

    def _forward_shared(self, h: torch.Tensor, step: StepContext) -> torch.Tensor:
        """Only q is projected, normed and rotated; K/V are the donor layer's, already cached."""
        q = self.qkv(h, step.rows).view(-1, self.heads, self.dim)
        if self.q_norm is not None:
            q = self.norm(q.reshape(-1, self.dim), self.q_norm, self.eps).view(-1, self.heads, self.dim)
        q = self.rotate(q, *step.tables[self.rope])
        attn = step.attention.attend_shared(self.donor, q)
        return self.o(attn.reshape(-1, self.heads * self.dim), step.rows)

    def _qk_heads(self, qk: torch.Tensor) -> torch.Tensor:
        """The q and k parts of a qkv row [T, (H + KV) * D] -> [T, H + KV, D], each head normed where
        the architecture norms q and k."""
        heads, dim = self.heads + self.kv_heads, self.dim
        if self.q_norm is None:
            return qk.view(-1, heads, dim)
        q, k = qk.view(-1, heads, dim).split((self.heads, self.kv_heads), dim=1)
        q = self.norm(q.reshape(-1, self.q_width), self.q_norm, self.eps).view(-1, self.heads, dim)
        k = self.norm(k.reshape(-1, self.k_width), self.k_norm, self.eps).view(-1, self.kv_heads, dim)
        return torch.cat((q, k), dim=1)

    def reserve_buffers(self, program: FusedProgram) -> None:
        self._buffers(program)

    def _buffers(self, program: FusedProgram) -> dict[str, torch.Tensor]:
        """The step's buffers this layer's calls use, named by head size (Gemma 4's layers have two):
        the projection's output, q and k normed (where the model norms them), V normed (where it norms
        V), attention's output."""
        q_size, kv_size, dim = self.heads * self.dim, self.kv_heads * self.dim, self.dim
        buffers = {"qkv": program.buffer(f"q{dim}", (q_size,)) if self.shared else
                   program.buffer(f"qkv{dim}", (q_size + 2 * kv_size,)),
                   "attn": program.buffer(f"attn{dim}", (q_size,))}
        if self.q_norm is not None:
            buffers["qk"] = program.buffer(f"qk{dim}", (self.heads + self.kv_heads, dim))
        if self.v_norm is not None and not self.shared:
            buffers["v"] = program.buffer(f"v{dim}", (self.kv_heads, dim))
        return buffers

    def fused_calls(self, program: FusedProgram) -> list[KernelCall | None] | None:
        if not self.fuses():
            return None
        rows, heads, dim = program.rows, self.heads, self.dim
        q_size = heads * dim
        buffers = self._buffers(program)
        qkv, attn = buffers["qkv"], buffers["attn"].view(rows, heads, dim)
        qk_rows = qkv[:, : q_size + self.kv_heads * dim]  # [rows, q_size] alone where K/V are shared
        calls = [self.qkv.call(program.h, qkv)]
        if self.q_norm is None:
            qk = qk_rows.view(rows, -1, dim)
        else:
            qk = buffers["qk"][:, : qk_rows.shape[1] // dim]  # [rows, H (+ KV), D]
            calls += self._row_norms(program, qk_rows[:, :q_size], self.q_norm, self.q_width, qk[:, :heads])
            if not self.shared:
                calls += self._row_norms(program, qk_rows[:, q_size:], self.k_norm, self.k_width, qk[:, heads:])
        calls.append(program.rope.call(qk, *program.rope_tables(self.rope)))
        if self.shared:
            attend = program.attend_cached_calls(self.donor, qk, attn)
        else:
            v = qkv[:, q_size + self.kv_heads * dim :].view(rows, self.kv_heads, dim)
            if self.v_norm is not None:
                calls += self._row_norms(program, v, self.v_norm, dim, buffers["v"])
                v = buffers["v"]
            attend = program.attend_calls(self.index, qk[:, :heads], qk[:, heads:], v, attn)
        if attend is None:
            return None
        return [*calls, *attend, self.o.call(buffers["attn"], program.out)]

    def _row_norms(self, program: FusedProgram, x: torch.Tensor, weight: torch.Tensor, width: int,
                   out: torch.Tensor) -> list[KernelCall]:
        """out = the norm of x over each `width` values, x and out [rows, ...] with contiguous rows: a
        call per row (x's rows lie apart in the projection's output), as the layered forward's rows."""
        return [program.norm.call(x[r].view(-1, width), weight, self.eps, out[r].view(-1, width))
                for r in range(program.rows)]


def query_scale(config: ModelConfig, head_dim: int) -> float:
    """What q is multiplied by so that attention's 1/sqrt(head_dim) becomes `attention_scale`: folded
    into q's norm weight (exactly 1 where, as in Gemma 3 270M, the two agree)."""
    if config.attention_scale is None:
        return 1.0
    return config.attention_scale * math.sqrt(head_dim)
