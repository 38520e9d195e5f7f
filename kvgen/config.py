"""Model configuration: one dataclass for every decoder kvgen runs (kvgen.architectures), read
from a Hugging Face config (GGUF metadata: kvgen.loaders.gguf_file)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvgen.errors import ModelLoadError
from kvgen.architectures import ARCHITECTURES, BY_HF_MODEL_TYPE, known_names
from kvgen.architectures.spec import Architecture, RecurrentShape, rope_parameters, rope_scaling


@dataclass(frozen=True)
class ModelConfig:
    """The shape and numerics of a decoder. `architecture` names its description in
    kvgen.architectures (its layers' blocks, norms, tensor names).

    Sliding windows: `sliding_window` bounds every layer (Mistral); `layer_windows` gives each
    layer its own (None: global), as Gemma 3 interleaves them, and then `local_rope_theta` is the
    RoPE base of the windowed layers. `attention_scale` replaces 1/sqrt(head_dim) where set."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    architecture: str = "llama"
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None
    attention_scale: float | None = None
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma's option)
    # Qwen3.5 (kvgen.architectures.qwen35): RoPE on the first `rotary_dim` dimensions of each head
    # (None: all); its Gated DeltaNet layers' state shape, which layers they are, and how their
    # tensors are stored ("gguf": value heads tiled, the decay rate itself; see GatedDeltaNetSpec)
    rotary_dim: int | None = None
    recurrent: RecurrentShape | None = None
    recurrent_layers: tuple[int, ...] = ()
    recurrent_layout: str = "hf"
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint carries beside the decoder's (kvgen.model.mtp)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    # Gemma 4: per layer, its head size and KV heads (window and global layers differ; empty: head_dim
    # and num_kv_heads everywhere) and the layer whose K/V it attends over (itself, or for a layer
    # sharing K/V its donor: kvgen.cache.shared_kv; empty: itself); per-layer inputs of
    # `per_layer_input_size` from a table of `per_layer_vocab_size` rows (0: none).
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    layer_kv_donors: tuple[int, ...] = ()
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    attention_k_eq_v: bool = False  # Gemma 4: the global layers' V is their key projection (no v_proj)
    double_wide_mlp: bool = False  # Gemma 4: the layers sharing K/V have MLPs of 2 x intermediate_size
    # Mixtures of experts (kvgen.architectures.spec.MoESpec): 0 experts for a dense model.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1
    shared_expert_intermediate_size: int = 0  # the shared expert's width, where the layers have one
    swiglu_alpha: float = 1.702  # the clamped SwiGLU's (gpt-oss's experts: MoESpec's "clamped_swiglu")
    swiglu_limit: float = 7.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_key_value_heads ({self.num_kv_heads}) must divide num_attention_heads ({self.num_heads})"
            )
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts per token ({self.experts_per_token}) must be in 1..{self.num_experts}")
        for name in ("layer_windows", "layer_head_dims", "layer_kv_heads", "layer_kv_donors"):
            if getattr(self, name) and len(getattr(self, name)) != self.num_layers:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {self.num_layers} layers")
        self._check_kv_donors()

    def _check_kv_donors(self) -> None:
        """A layer reads the K/V of an earlier layer that holds its own, of the same window and shape."""
        for i, donor in enumerate(self.layer_kv_donors):
            if donor != i and not (0 <= donor < i and self.kv_donor(donor) == donor
                                   and self.window(donor) == self.window(i)
                                   and self.head_dim_of(donor) == self.head_dim_of(i)):
                raise ValueError(f"layer {i} cannot read the K/V of layer {donor}")

    @property
    def arch(self) -> Architecture:
        return ARCHITECTURES[self.architecture]

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it attends to every earlier token)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    @property
    def is_hybrid(self) -> bool:
        """Some layers slide a window and others are global (Gemma 3): the hybrid KV cache applies."""
        return len({self.window(i) for i in range(self.num_layers)}) > 1

    def rope_theta_of(self, layer: int) -> float:
        """The RoPE base of `layer`: windowed layers of a hybrid model may have their own."""
        if self.local_rope_theta is not None and self.window(layer) is not None:
            return self.local_rope_theta
        return self.rope_theta

    def head_dim_of(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def kv_donor(self, layer: int) -> int:
        """The layer whose cached K/V `layer` attends over: itself unless it shares an earlier one's."""
        return self.layer_kv_donors[layer] if self.layer_kv_donors else layer

    @property
    def kv_holders(self) -> list[int]:
        """The layers that hold K/V in the cache: every layer but those sharing an earlier one's (Gemma 4)
        and the recurrent ones, which keep a state instead (Qwen3.5: kvgen.cache.state_pool)."""
        return [i for i in range(self.num_layers) if self.kv_donor(i) == i and i not in self.recurrent_layers]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: object = "config.json") -> "ModelConfig":
        """Builds the config from a Hugging Face `config.json` dict (transformers 4.x and 5.x layouts);
        of a multimodal checkpoint, its text model's (`text_part`)."""
        cfg = text_part(cfg)
        model_type = cfg.get("model_type", "llama")
        arch = BY_HF_MODEL_TYPE.get(model_type)
        if arch is None:
            raise ModelLoadError(source, f"model_type {model_type!r} is not supported (kvgen runs: {known_names()}; "
                                         "multimodal checkpoints need their text-only part)")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            if cfg.get("mlp_bias"):
                raise ValueError("mlp_bias is not supported")
            if float(cfg.get("partial_rotary_factor") or 1.0) != 1.0:
                raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
            num_layers = int(cfg["num_hidden_layers"])
            rope = rope_parameters(cfg, "full_attention")
            config = cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                # none where every layer's MLP is a mixture of experts (Qwen3.5-MoE)
                intermediate_size=int(cfg["intermediate_size"] if "moe_intermediate_size" not in cfg
                                      else cfg.get("intermediate_size", 0)),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", 10000.0)),
                rope_scaling=rope_scaling(rope),
                qkv_bias=arch.qkv_bias or bool(cfg.get("attention_bias", False)),
                o_bias=not arch.qkv_bias and bool(cfg.get("attention_bias", False)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch.tied_by_default)),
                sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
                model_type=model_type,
                architecture=arch.name,
            )
            return replace(config, **arch.hf_fields(cfg, config)) if arch.hf_fields else config
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(source, f"bad model config: {e!r}") from None


def text_part(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a multimodal checkpoint (its `text_config`, where that names a
    model kvgen runs: Gemma 4's and Qwen3.5's ...ForConditionalGeneration), tied as the outer config
    says; else `cfg` itself."""
    text = cfg.get("text_config")
    if not (isinstance(text, dict) and text.get("model_type") in BY_HF_MODEL_TYPE):
        return cfg
    return text | {k: cfg[k] for k in ("tie_word_embeddings",) if k in cfg}


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


KV_CACHE_MODES = ("paged", "contiguous", "none")
# How paged decode attention reads K/V: "native" in place through the compiled CPU kernel
# (kvgen.model.kernels.paged_decode), "sdpa" through a gathered copy and torch's SDPA, "auto" native where it
# builds and applies (CPU, fp32/bf16), else sdpa.
ATTENTION_BACKENDS = ("auto", "native", "sdpa")
# How weights are kept: "auto" keeps a GGUF's quantized matrices packed (kvgen.model.formats); "none"
# dequantizes them to `dtype`; "int8" / "int4" pack float matrices in groups of 32.
QUANTIZATION_MODES = ("auto", "none", "int8", "int4")
# How packed matmuls quantize x, per 32 values (kvgen.model.kernels.qmatmul.ACTIVATION_PARTS): two int8
# parts (~15 bits, the default, first) or one, as llama.cpp does (docs/kernels.md, "Activations").
ACTIVATION_MODES = ("int8x2", "int8")
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}
# What the paged KV pools store: "auto" is the model's dtype; int8 and fp8 (e4m3) are quantized with
# one scale per (token, KV head), dequantized as they are read.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")
KV_OFFLOAD_DTYPES = ("auto", "int8")  # auto: the tiers hold the pool's own bytes
# torch.distributed backends for tensor parallelism: "auto" is gloo on the CPU, NCCL on CUDA.
DISTRIBUTED_BACKENDS = ("auto", "gloo", "nccl")
# Speculative decoding (kvgen.engine.speculative): "ngram" looks the next tokens up in the prompt and output
# so far, "draft" asks a smaller model sharing the tokenizer, "suffix" follows a suffix tree over the prompt,
# the output so far and recent requests' outputs, "mtp" runs the MTP layer the checkpoint carries (Qwen3.5's);
# up to K tokens are verified per target pass.
SPECULATIVE_METHODS = ("ngram", "draft", "suffix", "mtp")
ONE_PROCESS_METHODS = ("draft", "mtp")  # proposers with a model of their own, not split across ranks
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class EngineConfig:
    """Engine options, the same for every interface (`LLM(...)`, `kvgen generate/batch/serve/bench`).

    KV capacity comes from `num_kv_blocks`, else `kv_cache_memory` (bytes), else enough for
    `max_num_seqs` full-length sequences capped at `DEFAULT_KV_MEMORY`.
    """

    kv_cache: str = "paged"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str = "auto"
    activations: str = ACTIVATION_MODES[0]  # the default: two int8 parts
    tensor_parallel_size: int = 1
    distributed_backend: str = "auto"
    distributed_timeout: float = 30.0
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    draft_quantization: str = "auto"
    draft_p_min: float = 0.75  # a draft stops proposing after a token it gives less (kvgen.engine.speculative.draft)
    draft_vocab_size: int = 32768  # a draft's logits: these first ids + the text's own (speculative/draft_vocab); 0: all
    draft_suffix_match: int = 5  # the suffix tree proposes where it matches this many tokens (speculative/hybrid)
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    adaptive_speculation: bool = True  # skip speculating a step where it measures slower (docs/speculative.md)
    fused_decode: bool = True  # decode steps as one list of C kernel calls where they can (kvgen.model.fused)
    enforce_eager: bool = False  # CUDA: no decode graphs (kvgen.gpu.graphs)
    kv_offload_memory: int | None = None  # bytes of RAM for evicted prefix blocks (kvgen.cache.tiers)
    kv_cache_dir: str | None = None  # the disk tier's directory (kvgen.cache.tiers.disk)
    kv_cache_disk: int = 20 * 1024**3  # the disk tier's budget in bytes
    kv_offload_dtype: str = "auto"  # what the tiers store: the pool's bytes, or int8 (kvgen.cache.tiers.pool_io)

    @property
    def kv_tiers(self) -> bool:
        """Whether evicted prefix blocks go to a host or disk tier (kvgen.cache.tiers)."""
        return bool(self.kv_offload_memory) or self.kv_cache_dir is not None

    def __post_init__(self) -> None:
        if self.kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache must be one of {KV_CACHE_MODES}, got {self.kv_cache!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache != "paged":
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} needs the paged KV cache (--kv-cache paged)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {self.quantization!r}")
        if self.activations not in ACTIVATION_MODES:
            raise ValueError(f"activations must be one of {ACTIVATION_MODES}, got {self.activations!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.kv_cache != "paged":
            raise ValueError("tensor parallelism needs the paged KV cache (--kv-cache paged)")
        if self.distributed_backend not in DISTRIBUTED_BACKENDS:
            raise ValueError(f"distributed_backend must be one of {DISTRIBUTED_BACKENDS}, "
                             f"got {self.distributed_backend!r}")
        if self.distributed_timeout <= 0:
            raise ValueError("distributed_timeout must be positive")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self._check_speculative()
        if self.kv_offload_dtype not in KV_OFFLOAD_DTYPES:
            raise ValueError(f"kv_offload_dtype must be one of {KV_OFFLOAD_DTYPES}, got {self.kv_offload_dtype!r}")
        if self.kv_tiers and self.kv_cache != "paged":
            raise ValueError("KV tiers (kv_offload_memory, kv_cache_dir) need the paged KV cache (--kv-cache paged)")

    def _check_speculative(self) -> None:
        if self.speculative_method is None:
            if self.draft_model is not None:
                raise ValueError("draft_model needs speculative_method 'draft'")
            return
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {SPECULATIVE_METHODS}, "
                             f"got {self.speculative_method!r}")
        if self.kv_cache != "paged":
            raise ValueError("speculative decoding needs the paged KV cache (--kv-cache paged)")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        if self.speculative_method == "draft" and self.draft_model is None:
            raise ValueError("speculative_method 'draft' needs a draft_model (a checkpoint sharing the tokenizer)")
        if self.speculative_method in ONE_PROCESS_METHODS and self.tensor_parallel_size > 1:
            raise ValueError(f"speculative_method '{self.speculative_method}' runs in one process; with "
                             "tensor_parallel_size > 1 use 'ngram' or 'suffix'")
        if self.draft_quantization not in QUANTIZATION_MODES:
            raise ValueError(f"draft_quantization must be one of {QUANTIZATION_MODES}, got {self.draft_quantization!r}")
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise ValueError(f"draft_p_min must be a probability in [0, 1], got {self.draft_p_min!r}")
        if isinstance(self.draft_vocab_size, bool) or not isinstance(self.draft_vocab_size, int) \
                or self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be a whole number >= 0 (0: the whole vocabulary), "
                             f"got {self.draft_vocab_size!r}")
        if isinstance(self.draft_suffix_match, bool) or not isinstance(self.draft_suffix_match, int) \
                or self.draft_suffix_match < 0:
            raise ValueError(f"draft_suffix_match must be a whole number >= 0 (0: the draft always proposes), "
                             f"got {self.draft_suffix_match!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min and prompt_lookup_max need 1 <= min <= max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, DTYPES[self.dtype])

    @property
    def draft_weights(self) -> str:
        """How the draft's matrices are kept: draft_quantization, 'auto' being int4 on the CPU. A draft's
        numbers only steer proposals, and its steps are half the cost of a speculative step: on the real
        Qwen2.5-Coder 0.5B / 1.5B pair (an Intel Xeon, 2 threads) int4 took a draft step from 30 to 22 ms
        (Q5_0 and a Q8_0 LM head) and speculation on a copy task from 1.28x to 1.52x plain decoding, at
        the same 98% acceptance (docs/speculative.md)."""
        if self.draft_quantization == "auto" and torch.device(self.device).type == "cpu":
            return "int4"
        return self.draft_quantization

    @property
    def kv_dtype(self) -> str:
        """The pools' dtype by name, "auto" resolved to the model's."""
        return DTYPES[self.dtype] if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


DEFAULT_KV_MEMORY = 1 << 30
