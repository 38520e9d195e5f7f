"""The vocabulary of architecture descriptions: blocks, the residual branches that hold them, layers,
and an architecture (its layers, its norms and embedding, its checkpoints' names and config fields).

Pure data, torch-free and model-free: the loaders and `kvgen.config` read these descriptions (tensor
names and shapes, config fields), and kvgen.model.blocks builds the runnable blocks from them. A
description names a block by its `kind`; the model side has a registry from kind to code, so a new
kind of block is a new spec class here plus a new module there, and no existing file changes.

    Branch:    x += out_norm(block(norm(x)))     (out_norm only where the architecture has one)
    LayerSpec: branches in order: (attention, gated MLP) for every decoder kvgen runs today

`config` arguments below are a `kvgen.config.ModelConfig` (read by attribute; not imported, since the
config module sits above this one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

ACTIVATIONS = ("silu", "gelu_tanh")  # of the gated MLP: act(gate) * up

# GGUF block tensors most architectures share (llama.cpp's names -> HF's, after "blk.N." / "model.layers.N.").
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
GGUF_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


@dataclass(frozen=True)
class BlockSpec:
    """One block of a layer. `kind` selects the model-side block (kvgen.model.blocks.BLOCKS); its
    tensors sit under `model.layers.{i}.{prefix}.` by their HF names."""

    kind: ClassVar[str] = ""
    prefix: str = ""

    def tensors(self, config: Any) -> dict[str, tuple[int, ...]]:
        """Every tensor of the block, by name under the layer (`{prefix}.q_proj.weight`) -> shape."""
        raise NotImplementedError


@dataclass(frozen=True)
class AttentionSpec(BlockSpec):
    """Softmax attention over the KV cache: q/k/v and o projections, RoPE, optional per-head
    RMSNorm of q and k. Window and RoPE base are per layer and come from the config
    (`config.window(i)`, `config.rope_theta_of(i)`). Biases: `qkv_bias` always (Qwen2), and where a
    config's `attention_bias` says so (`config.qkv_bias` / `config.o_bias`)."""

    kind: ClassVar[str] = "attention"
    prefix: str = "self_attn"
    qk_norm: bool = False
    qkv_bias: bool = False
    fused_qkv: bool = False  # the HF checkpoint stores one qkv_proj (Phi-3); kept fused, as kvgen runs it
    output_gate: bool = False  # q carries a sigmoid gate on the output (Qwen3.5): no block runs it yet
    qk_norm_whole: bool = False  # QK-norm over the whole q and k projections, not per head (OLMoE)

    def tensors(self, config: Any) -> dict[str, tuple[int, ...]]:
        p, hidden, dim = self.prefix + ".", config.hidden_size, config.head_dim
        q_rows, kv_rows = config.num_heads * dim, config.num_kv_heads * dim
        if self.fused_qkv:
            shapes = {p + "qkv_proj.weight": (q_rows + 2 * kv_rows, hidden)}
        else:
            shapes = {p + f"{n}_proj.weight": (rows, hidden) for n, rows in (("q", q_rows), ("k", kv_rows),
                                                                               ("v", kv_rows))}
        shapes[p + "o_proj.weight"] = (hidden, q_rows)
        if self.qk_norm:
            q_width, k_width = (q_rows, kv_rows) if self.qk_norm_whole else (dim, dim)
            shapes |= {p + "q_norm.weight": (q_width,), p + "k_norm.weight": (k_width,)}
        if config.qkv_bias:
            shapes |= {p + f"{n}_proj.bias": (rows,) for n, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))}
        if config.o_bias:
            shapes[p + "o_proj.bias"] = (hidden,)
        return shapes


@dataclass(frozen=True)
class GatedMLPSpec(BlockSpec):
    """down(act(gate(x)) * up(x)): SwiGLU (`silu`) or GeGLU (`gelu_tanh`)."""

    kind: ClassVar[str] = "gated_mlp"
    prefix: str = "mlp"
    activation: str = "silu"
    fused_gate_up: bool = False  # one gate_up_proj in the HF checkpoint (Phi-3)

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")

    def tensors(self, config: Any) -> dict[str, tuple[int, ...]]:
        p, hidden, inter = self.prefix + ".", config.hidden_size, config.intermediate_size
        if self.fused_gate_up:
            shapes = {p + "gate_up_proj.weight": (2 * inter, hidden)}
        else:
            shapes = {p + "gate_proj.weight": (inter, hidden), p + "up_proj.weight": (inter, hidden)}
        return shapes | {p + "down_proj.weight": (hidden, inter)}


@dataclass(frozen=True)
class MoESpec(BlockSpec):
    """A mixture of experts: a router picks `config.experts_per_token` of `config.num_experts` gated
    MLPs per token (softmax over the router's logits, top-k, renormalised where
    `config.norm_topk_prob`), whose outputs are summed with those weights.

    Experts are stored stacked per layer, as GGUF holds them (`ffn_{gate,up,down}_exps`):
    `experts.gate_proj` / `up_proj` [experts, inner, hidden], `experts.down_proj` [experts, hidden,
    inner]; the HF loader stacks a checkpoint's per-expert tensors so (kvgen.loaders.experts).
    `shared_expert`: every token also runs one gated MLP of `config.shared_expert_intermediate_size`,
    scaled by sigmoid(`shared_expert_gate` . x) (Qwen2-MoE, Qwen3.5-MoE)."""

    kind: ClassVar[str] = "moe"
    prefix: str = "mlp"
    activation: str = "silu"
    shared_expert: bool = False

    def __post_init__(self) -> None:
        if self.activation != "silu":
            raise ValueError(f"expert activation {self.activation!r} is not supported (silu is)")

    def tensors(self, config: Any) -> dict[str, tuple[int, ...]]:
        p, hidden = self.prefix + ".", config.hidden_size
        experts, inner = config.num_experts, config.expert_intermediate_size
        shapes = {p + "gate.weight": (experts, hidden),
                  p + "experts.gate_proj.weight": (experts, inner, hidden),
                  p + "experts.up_proj.weight": (experts, inner, hidden),
                  p + "experts.down_proj.weight": (experts, hidden, inner)}
        if self.shared_expert:
            shared = config.shared_expert_intermediate_size
            shapes |= {p + "shared_expert.gate_proj.weight": (shared, hidden),
                       p + "shared_expert.up_proj.weight": (shared, hidden),
                       p + "shared_expert.down_proj.weight": (hidden, shared),
                       p + "shared_expert_gate.weight": (1, hidden)}
        return shapes


# GGUF names of a routed MoE layer (llama.cpp's -> HF's stacked ones, kvgen.loaders.experts).
GGUF_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
GGUF_SHARED_EXPERT_NAMES = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


@dataclass(frozen=True)
class Branch:
    """x += out_norm(block(norm(x))): `norm` and `out_norm` name RMSNorm weights under the layer."""

    norm: str
    block: BlockSpec
    out_norm: str | None = None


@dataclass(frozen=True)
class LayerSpec:
    """A decoder layer: its branches, run in order on the residual stream."""

    branches: tuple[Branch, ...]

    def norm_names(self) -> tuple[str, ...]:
        return tuple(n for b in self.branches for n in (b.norm, b.out_norm) if n is not None)

    def tensors(self, config: Any) -> dict[str, tuple[int, ...]]:
        shapes = {name + ".weight": (config.hidden_size,) for name in self.norm_names()}
        for branch in self.branches:
            shapes |= branch.block.tensors(config)
        return shapes


def pre_norm_layer(attention: AttentionSpec, mlp: GatedMLPSpec) -> LayerSpec:
    """Llama's layer: RMSNorm before attention and before the MLP, no norm after either."""
    return LayerSpec((Branch("input_layernorm", attention), Branch("post_attention_layernorm", mlp)))


ConfigFields = Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class Architecture:
    """A decoder architecture: its layers' blocks, and what its checkpoints look like.

    `layer` is every layer's composition; `layer_of(index, config)`, where given, picks per layer (a
    model mixing layer kinds, as Qwen3.5's delta-net and attention layers). `hf_fields(hf_config,
    config)` and `gguf_fields(prefix, metadata, config)` return the ModelConfig fields the
    architecture adds or overrides beyond the common ones (Gemma 3's windows and query scale)."""

    name: str
    hf_model_types: tuple[str, ...]  # config.json model_type values
    gguf_name: str  # general.architecture
    layer: LayerSpec
    layer_of: Callable[[int, Any], LayerSpec] | None = None
    embedding_scale: bool = False  # embeddings times sqrt(hidden) (Gemma)
    norm_plus_one: bool = False  # HF checkpoints store w where the norm multiplies by (1 + w)
    tied_by_default: bool = False  # tie_word_embeddings where the HF config does not say
    gguf_names: Mapping[str, str] = field(default_factory=lambda: dict(GGUF_BLOCK_NAMES))  # llama.cpp -> HF
    gguf_interleaved_rope: bool = False  # llama.cpp's converter permuted the q/k rows
    hf_fields: ConfigFields | None = None
    gguf_fields: ConfigFields | None = None

    def layer_spec(self, index: int, config: Any) -> LayerSpec:
        return self.layer if self.layer_of is None else self.layer_of(index, config)

    def blocks(self) -> list[BlockSpec]:
        return [branch.block for branch in self.layer.branches]

    @property
    def qkv_bias(self) -> bool:
        return any(isinstance(b, AttentionSpec) and b.qkv_bias for b in self.blocks())

    @property
    def fused_checkpoint(self) -> bool:
        """Projections stored fused (qkv_proj / gate_up_proj), which a tensor-parallel split would cut."""
        return any(getattr(b, "fused_qkv", False) or getattr(b, "fused_gate_up", False) for b in self.blocks())

    @property
    def sandwich_norms(self) -> bool:
        """Norms on the branch outputs too (Gemma), which tensor parallelism does not apply yet."""
        return any(branch.out_norm is not None for branch in self.layer.branches)


def sliding_window_if_used(cfg: dict[str, Any], config: Any) -> dict[str, Any]:
    """An `hf_fields` for configs (Qwen's) that keep a `sliding_window` set but off unless
    `use_sliding_window` turns it on."""
    return {} if cfg.get("use_sliding_window", False) else {"sliding_window": None}


def rope_parameters(cfg: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """RoPE theta and scaling of an HF config for one layer type. transformers 5 nests them in
    `rope_parameters` (per layer type where they differ, as Gemma 3's `full_attention` /
    `sliding_attention`); 4.x has `rope_theta` + `rope_scaling`, which Gemma 3 applies to its global
    layers only."""
    params = dict(cfg.get("rope_parameters") or {})
    if layer_type in params:
        return dict(params[layer_type])
    if params and isinstance(next(iter(params.values())), dict):  # per layer type, not this one
        return {}
    if layer_type != "full_attention":
        return {}
    if "rope_theta" not in params and "rope_theta" in cfg:
        params["rope_theta"] = cfg["rope_theta"]
    if cfg.get("rope_scaling"):
        params.update(cfg["rope_scaling"])
    return params


def rope_scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    """The scaling of `rope_parameters`' result, or None (kvgen runs linear and llama3 scaling)."""
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"rope scaling {kind!r} is not supported (linear and llama3 are)")
    return {k: v for k, v in rope.items() if k not in ("rope_theta", "type")} | {"rope_type": kind}


def float32_value(value: float) -> float:
    """A float32 GGUF metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))
