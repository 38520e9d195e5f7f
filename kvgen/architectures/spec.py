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
    qk_norm_whole: bool = False  # QK-norm over the whole q and k projections, not per head (OLMoE)
    # Gemma 4: the layer's own head size and KV heads where kinds of layer differ (None: the config's),
    # V normed by RMS without a weight, K/V read from an earlier layer's cache (no k/v projections),
    # V taken from the key projection (attention_k_eq_v: no v projection).
    head_dim: int | None = None
    kv_heads: int | None = None
    value_norm: bool = False
    shared_kv: bool = False
    k_eq_v: bool = False
    # gpt-oss: a learned logit per head, `{prefix}.sinks` [heads], joins each query's softmax
    # denominator with no value (attention can go nowhere).
    sink_logits: bool = False

    def dims(self, config: Any) -> tuple[int, int]:
        """(head size, KV heads) of the layer."""
        return self.head_dim or config.head_dim, self.kv_heads or config.num_kv_heads

    def tensors(self, config: Any) -> dict[str, tuple[int, ...]]:
        p, hidden = self.prefix + ".", config.hidden_size
        dim, kv_heads = self.dims(config)
        q_rows, kv_rows = config.num_heads * dim, kv_heads * dim
        if self.fused_qkv:
            shapes = {p + "qkv_proj.weight": (q_rows + 2 * kv_rows, hidden)}
        else:
            own = (("q", q_rows),) if self.shared_kv else (("q", q_rows), ("k", kv_rows), ("v", kv_rows))
            shapes = {p + f"{n}_proj.weight": (rows, hidden) for n, rows in own if not (n == "v" and self.k_eq_v)}
        shapes[p + "o_proj.weight"] = (hidden, q_rows)
        if self.qk_norm:
            q_width, k_width = (q_rows, kv_rows) if self.qk_norm_whole else (dim, dim)
            shapes |= {p + "q_norm.weight": (q_width,)} | ({} if self.shared_kv else {p + "k_norm.weight": (k_width,)})
        if config.qkv_bias:
            shapes |= {p + f"{n}_proj.bias": (rows,) for n, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))}
        if config.o_bias:
            shapes[p + "o_proj.bias"] = (hidden,)
        if self.sink_logits:
            shapes[p + "sinks"] = (config.num_heads,)
        return shapes


@dataclass(frozen=True)
class GatedMLPSpec(BlockSpec):
    """down(act(gate(x)) * up(x)): SwiGLU (`silu`) or GeGLU (`gelu_tanh`)."""

    kind: ClassVar[str] = "gated_mlp"
    prefix: str = "mlp"
    activation: str = "silu"
    fused_gate_up: bool = False  # one gate_up_proj in the HF checkpoint (Phi-3)
    intermediate_size: int | None = None  # the layer's own (Gemma 4's double-wide MLPs); None: the config's

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")

    def tensors(self, config: Any) -> dict[str, tuple[int, ...]]:
        p, hidden, inter = self.prefix + ".", config.hidden_size, self.intermediate_size or config.intermediate_size
        if self.fused_gate_up:
            shapes = {p + "gate_up_proj.weight": (2 * inter, hidden)}
        else:
            shapes = {p + "gate_proj.weight": (inter, hidden), p + "up_proj.weight": (inter, hidden)}
        return shapes | {p + "down_proj.weight": (hidden, inter)}


EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class MoESpec(BlockSpec):
    """A mixture of experts: a router picks `config.experts_per_token` of `config.num_experts` gated
    MLPs per token (softmax over the router's logits, top-k, renormalised where
    `config.norm_topk_prob`), whose outputs are summed with those weights.

    gpt-oss's options: `router` names the router's tensors (`mlp.router`), `biases` gives the router
    and every expert projection a bias, and the `clamped_swiglu` activation is
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), with
    `config.swiglu_alpha` and `config.swiglu_limit`.

    Experts are stored stacked per layer, as GGUF holds them (`ffn_{gate,up,down}_exps`):
    `experts.gate_proj` / `up_proj` [experts, inner, hidden], `experts.down_proj` [experts, hidden,
    inner]; the HF loader stacks a checkpoint's per-expert tensors so (kvgen.loaders.experts).
    `shared_expert`: every token also runs one gated MLP of `config.shared_expert_intermediate_size`,
    scaled by sigmoid(`shared_expert_gate` . x) (Qwen2-MoE, Qwen3.5-MoE)."""

    kind: ClassVar[str] = "moe"
    prefix: str = "mlp"
    activation: str = "silu"
    shared_expert: bool = False
    router: str = "gate"
    biases: bool = False
    hf_interleaved: bool = False  # transformers' gpt-oss experts: [experts, in, out], gate/up columns interleaved

    def __post_init__(self) -> None:
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert activation {self.activation!r} is not one of {EXPERT_ACTIVATIONS}")

    def tensors(self, config: Any) -> dict[str, tuple[int, ...]]:
        p, hidden = self.prefix + ".", config.hidden_size
        experts, inner = config.num_experts, config.expert_intermediate_size
        shapes = {p + self.router + ".weight": (experts, hidden),
                  p + "experts.gate_proj.weight": (experts, inner, hidden),
                  p + "experts.up_proj.weight": (experts, inner, hidden),
                  p + "experts.down_proj.weight": (experts, hidden, inner)}
        if self.biases:
            shapes |= {p + self.router + ".bias": (experts,), p + "experts.gate_proj.bias": (experts, inner),
                       p + "experts.up_proj.bias": (experts, inner), p + "experts.down_proj.bias": (experts, hidden)}
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
class GatedAttentionSpec(AttentionSpec):
    """Qwen3.5's full attention: q_proj also yields a per-head output gate (each head's rows are its
    query then its gate), and the output is attn * sigmoid(gate) before o_proj; QK-norm, and RoPE on
    the first `config.rotary_dim` dimensions of each head."""

    kind: ClassVar[str] = "gated_attention"
    qk_norm: bool = True

    def tensors(self, config: Any) -> dict[str, tuple[int, ...]]:
        shapes = super().tensors(config)
        q = self.prefix + ".q_proj.weight"
        return shapes | {q: (2 * shapes[q][0], shapes[q][1])}


@dataclass(frozen=True)
class GatedDeltaNetSpec(BlockSpec):
    """Qwen3.5's linear attention (kvgen.model.gated_delta_net): in_proj_qkv / _z / _a / _b, a causal
    depthwise conv, the delta rule over a per-sequence state, a gated norm and out_proj; its shape is
    `config.recurrent`. A GGUF stores the decay rate -exp(A_log) as `decay_rate` and the conv as
    [conv_dim, K] (`config.recurrent_layout` "gguf"), a HF checkpoint A_log and [conv_dim, 1, K]."""

    kind: ClassVar[str] = "gated_delta_net"
    prefix: str = "linear_attn"

    def tensors(self, config: Any) -> dict[str, tuple[int, ...]]:
        p, hidden, s = self.prefix + ".", config.hidden_size, config.recurrent
        gguf = config.recurrent_layout == "gguf"
        value = s.v_heads * s.v_dim
        return {p + "in_proj_qkv.weight": (s.conv_dim, hidden), p + "in_proj_z.weight": (value, hidden),
                p + "in_proj_a.weight": (s.v_heads, hidden), p + "in_proj_b.weight": (s.v_heads, hidden),
                p + "conv1d.weight": (s.conv_dim, s.conv_kernel) if gguf else (s.conv_dim, 1, s.conv_kernel),
                p + ("decay_rate" if gguf else "A_log"): (s.v_heads,), p + "dt_bias": (s.v_heads,),
                p + "norm.weight": (s.v_dim,), p + "out_proj.weight": (hidden, value)}


@dataclass(frozen=True)
class RecurrentShape:
    """One Gated DeltaNet layer's state, per sequence."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        if min(self.k_heads, self.v_heads, self.k_dim, self.v_dim, self.conv_kernel) <= 0:
            raise ValueError(f"a recurrent layer's sizes must be positive: {self}")
        if self.v_heads % self.k_heads:
            raise ValueError(f"{self.v_heads} value heads cannot share {self.k_heads} key heads evenly")

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @property
    def conv_window(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def state(self) -> tuple[int, int, int]:
        return (self.v_heads, self.k_dim, self.v_dim)

    def bytes(self, state_bytes: int = 4, conv_bytes: int = 4) -> int:
        """One sequence's bytes in this layer: its conv window and recurrent state (fp32 by default)."""
        conv, heads = self.conv_window, self.state
        return conv[0] * conv[1] * conv_bytes + heads[0] * heads[1] * heads[2] * state_bytes


@dataclass(frozen=True)
class PerLayerInputSpec(BlockSpec):
    """Gemma 4's per-layer input (E2B/E4B): proj(act(gate(x)) * per_layer_input), where the layer's
    per-layer input [T, P] comes from an embedding table of its own and a projection of the
    embeddings (computed once per step for every layer: kvgen.model.blocks.per_layer_input)."""

    kind: ClassVar[str] = "per_layer_input"
    activation: str = "gelu_tanh"

    def tensors(self, config: Any) -> dict[str, tuple[int, ...]]:
        hidden, width = config.hidden_size, config.per_layer_input_size
        return {"per_layer_input_gate.weight": (width, hidden), "per_layer_projection.weight": (hidden, width)}


@dataclass(frozen=True)
class Branch:
    """x += out_norm(block(norm(x))): `norm` and `out_norm` name RMSNorm weights under the layer
    (`norm` None: the block reads the residual stream as it is, as Gemma 4's per-layer input)."""

    norm: str | None
    block: BlockSpec
    out_norm: str | None = None


@dataclass(frozen=True)
class LayerSpec:
    """A decoder layer: its branches, run in order on the residual stream, then the stream times the
    layer's `scalar` (a one-element tensor under the layer, Gemma 4's layer_scalar) where it has one."""

    branches: tuple[Branch, ...]
    scalar: str | None = None

    def norm_names(self) -> tuple[str, ...]:
        return tuple(n for b in self.branches for n in (b.norm, b.out_norm) if n is not None)

    def tensors(self, config: Any) -> dict[str, tuple[int, ...]]:
        shapes = {name + ".weight": (config.hidden_size,) for name in self.norm_names()}
        for branch in self.branches:
            shapes |= branch.block.tensors(config)
        return shapes | ({self.scalar: (1,)} if self.scalar else {})


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
    plain_norms: tuple[str, ...] = ()  # norms stored as w where the others are 1 + w (Qwen3.5's gated norm)
    model_tensors: Callable[[Any], dict[str, tuple[int, ...]]] | None = None  # beside the layers' (config ->)
    gguf_tensor_fields: Callable[[set[str], Any], dict[str, Any]] | None = None  # what a GGUF's tensor names say

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


# RoPE scalings kvgen runs: "proportional" (Gemma 4's global layers) rotates the first
# partial_rotary_factor of the frequency pairs and leaves the others unrotated (frequency 0); "yarn"
# (gpt-oss) blends interpolated and original frequencies and scales cos and sin (kvgen.model.layers).
ROPE_SCALINGS = ("linear", "llama3", "proportional", "yarn")


def rope_scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    """The scaling of `rope_parameters`' result, or None (kvgen runs the ROPE_SCALINGS)."""
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"rope scaling {kind!r} is not supported ({', '.join(ROPE_SCALINGS)} are)")
    return {k: v for k, v in rope.items() if k not in ("rope_theta", "type")} | {"rope_type": kind}


def kv_donors(layer_types: list[str], num_kv_shared_layers: int) -> list[int]:
    """For each layer, the layer whose K/V it attends over: itself, or for the last
    `num_kv_shared_layers` (Gemma 4) the last earlier non-sharing layer of its kind (transformers'
    Gemma4TextConfig.kv_sharing_modes). ValueError where a sharing layer's kind has none."""
    n = len(layer_types)
    if not 0 <= num_kv_shared_layers <= n:
        raise ValueError(f"num_kv_shared_layers must be in [0, {n}], got {num_kv_shared_layers}")
    first_shared = n - num_kv_shared_layers
    last_of_kind = {kind: i for i, kind in enumerate(layer_types[:first_shared])}
    donors = list(range(first_shared))
    for i in range(first_shared, n):
        if layer_types[i] not in last_of_kind:
            raise ValueError(f"layer {i} ({layer_types[i]}) shares K/V, but no earlier layer of its kind computes any")
        donors.append(last_of_kind[layer_types[i]])
    return donors


def float32_value(value: float) -> float:
    """A float32 GGUF metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))
