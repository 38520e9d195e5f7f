"""Memory arithmetic of models whose layers keep a recurrent state (Qwen3.5's Gated DeltaNet layers)
beside attention layers with a KV cache: bytes per sequence of state, bytes per token of KV, apart.

A recurrent (linear-attention) layer holds, per sequence and whatever the text's length,

    conv window      [conv_dim, K - 1]      conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    recurrent state  [v_heads, k_dim, v_dim]

while an attention layer holds 2 * kv_heads * head_dim values per token. No torch here: `kvgen kv-size`
prints these without loading a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgen.cache.sizing import kv_bytes_per_token
from kvgen.config import ModelConfig, RecurrentShape


def state_bytes_per_sequence(shape: RecurrentShape, num_layers: int, state_bytes: int = 4,
                             conv_bytes: int = 4) -> int:
    """Bytes of state one sequence holds across `num_layers` recurrent layers, at any length."""
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    return num_layers * shape.bytes(state_bytes, conv_bytes)


@dataclass(frozen=True)
class HybridShape:
    """A model of attention layers (KV per token) and recurrent layers (state per sequence)."""

    attention_layers: int
    recurrent_layers: int
    kv_heads: int
    head_dim: int
    recurrent: RecurrentShape

    @classmethod
    def from_hf_config(cls, config: dict) -> HybridShape:
        """From a Qwen3.5 config.json (`qwen3_5_text`, or the text_config of a `qwen3_5` one)."""
        config = config.get("text_config", config)
        num_layers = config["num_hidden_layers"]
        kinds = config.get("layer_types") or [
            "full_attention" if (i + 1) % config.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(num_layers)]
        recurrent = sum(kind == "linear_attention" for kind in kinds)
        return cls(num_layers - recurrent, recurrent, config["num_key_value_heads"],
                   config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                   RecurrentShape(config["linear_num_key_heads"], config["linear_num_value_heads"],
                                  config["linear_key_head_dim"], config["linear_value_head_dim"],
                                  config.get("linear_conv_kernel_dim", 4)))

    @classmethod
    def from_config(cls, config: ModelConfig) -> HybridShape | None:
        """From a loaded config (a GGUF's metadata), None for a model without recurrent layers."""
        if not config.recurrent_layers:
            return None
        return cls(len(config.kv_holders), len(config.recurrent_layers), config.num_kv_heads, config.head_dim,
                   config.recurrent)

    @property
    def num_layers(self) -> int:
        return self.attention_layers + self.recurrent_layers

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """KV bytes a token takes in the attention layers only."""
        if self.attention_layers == 0:
            return 0
        return kv_bytes_per_token(self.attention_layers, self.kv_heads, self.head_dim, dtype_bytes)

    def state_bytes_per_sequence(self, state_bytes: int = 4, conv_bytes: int = 4) -> int:
        return state_bytes_per_sequence(self.recurrent, self.recurrent_layers, state_bytes, conv_bytes)

    def sequence_bytes(self, tokens: int, kv_dtype_bytes: int = 4, state_bytes: int = 4) -> int:
        """What one sequence of `tokens` tokens holds: KV of its attention layers plus the state."""
        return tokens * self.kv_bytes_per_token(kv_dtype_bytes) + self.state_bytes_per_sequence(state_bytes)

    def full_attention_bytes(self, tokens: int, kv_dtype_bytes: int = 4) -> int:
        """What the same sequence would hold if every layer were attention with this KV shape."""
        return tokens * kv_bytes_per_token(self.num_layers, self.kv_heads, self.head_dim, kv_dtype_bytes)

    def report(self, tokens: int, kv_dtype_bytes: int = 4, state_bytes: int = 4) -> dict:
        """The figures `kvgen kv-size` prints for such a model: KV per token and state per sequence apart."""
        hybrid, full = self.sequence_bytes(tokens, kv_dtype_bytes, state_bytes), self.full_attention_bytes(
            tokens, kv_dtype_bytes)
        return {"attention_layers": self.attention_layers, "recurrent_layers": self.recurrent_layers,
                "kv_bytes_per_token": self.kv_bytes_per_token(kv_dtype_bytes),
                "state_bytes_per_sequence": self.state_bytes_per_sequence(state_bytes),
                "state_bytes_per_layer": self.recurrent.bytes(state_bytes, state_bytes),
                "tokens": tokens, "kv_bytes": tokens * self.kv_bytes_per_token(kv_dtype_bytes),
                "sequence_bytes": hybrid, "full_attention_bytes": full, "ratio": hybrid / full}


RECURRENT_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


def hybrid_shape_of(path) -> HybridShape | None:
    """The HybridShape of a Qwen3.5 HF directory or config.json at `path`, None for any other model
    (a GGUF, another architecture: `kvgen kv-size` then sizes it as before)."""
    import json
    from pathlib import Path

    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    if config_file.name != "config.json" or not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    if config.get("model_type") not in RECURRENT_MODEL_TYPES:
        return None
    return HybridShape.from_hf_config(config)


def describe(report: dict) -> list[str]:
    """`HybridShape.report`'s figures as `kvgen kv-size` prints them."""
    from kvgen.cache.sizing import format_bytes

    return [
        f"{report['attention_layers']} attention layers: {report['kv_bytes_per_token']:,} bytes of KV per token",
        f"{report['recurrent_layers']} recurrent layers: {report['state_bytes_per_sequence']:,} bytes of state per "
        f"sequence ({report['state_bytes_per_layer']:,} per layer: conv window + delta-rule state, fp32), "
        "whatever its length",
        f"{report['tokens']:,} tokens: {report['kv_bytes']:,} bytes of KV + {report['state_bytes_per_sequence']:,} of "
        f"state = {report['sequence_bytes']:,} bytes ({format_bytes(report['sequence_bytes'])}), "
        f"{report['ratio']:.1%} of every layer holding every token ({format_bytes(report['full_attention_bytes'])})",
    ]
