"""llama2.c legacy checkpoints (`.bin`) and their `tok*.bin` tokenizers, read with numpy (no pickle).

Checkpoint layout: 7 little-endian int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
seq_len), then fp32 arrays in the order of `_tensor_layout`; a negative vocab_size means an untied
classifier follows the RoPE tables. q/k rows are stored for interleaved-pair RoPE and are permuted
to HF's rotate-half layout here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvgen.config import ModelConfig
from kvgen.errors import ModelLoadError
from kvgen.loaders.rope_layout import interleaved_to_half
from kvgen.loaders.weights import LoadedModel, finalize_weights, shard_plan
from kvgen.loaders.tokenizers import BPEVocabTokenizer
from kvgen.tokenizer import Tokenizer

HEADER_INTS = 7
BOS_ID, EOS_ID = 1, 2
# llama2.c v1/v2 exports start with this magic ("ak42"); only the legacy layout is read here.
EXPORT_MAGIC = 0x616B3432
# torch.save files (e.g. pytorch_model.bin): a zip archive, or a raw pickle of protocol 2-5.
PICKLE_MAGICS = {b"PK", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05"}


def load_llama2c(
    path: Path,
    *,
    tokenizer: Tokenizer | None,
    device: str | torch.device,
    dtype: torch.dtype,
    shard: tuple[int, int] | None = None,
) -> LoadedModel:
    """Loads a llama2.c legacy checkpoint and the `tok*.bin` beside it (unless `tokenizer` is given)."""
    if path.stat().st_size < 4 * HEADER_INTS:
        raise ModelLoadError(path, f"file is {path.stat().st_size} bytes, too short for a llama2.c header")
    data = np.memmap(path, dtype=np.uint8, mode="r")  # read lazily: checkpoints can be many GB
    config, shared_classifier = _read_header(path, data)
    arrays = _read_arrays(path, data, config, shared_classifier)
    weights = _to_hf(arrays, config)
    if tokenizer is None:
        tokenizer = load_llama2c_tokenizer(_find_tokenizer(path, config.vocab_size), config.vocab_size)
    plan = shard_plan(config, shard, path)
    return LoadedModel(config, finalize_weights(weights, config, path, device, dtype, plan=plan), tokenizer,
                       str(path), shard=plan)


def load_llama2c_tokenizer(path: Path, vocab_size: int | None = None) -> BPEVocabTokenizer:
    """Reads a llama2.c `tok*.bin`; `vocab_size`, when given, must match its token count.

    The exporter wrote BOS/EOS as "\\n<s>\\n" and "\\n</s>\\n" (for printing); they are read back as "<s>", "</s>".
    """
    pieces, scores = _read_pieces(Path(path))
    if vocab_size is not None and len(pieces) != vocab_size:
        raise ModelLoadError(path, f"tokenizer has {len(pieces)} tokens, the model expects {vocab_size}")
    pieces = [p.strip("\n") if i in (BOS_ID, EOS_ID) else p for i, p in enumerate(pieces)]
    return BPEVocabTokenizer(
        pieces,
        scores,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        unk_token_id=0 if pieces and pieces[0] == "<unk>" else None,
        extra_stop_ids={BOS_ID},  # llama2.c ends a story when the model emits BOS again
    )


def _read_pieces(path: Path) -> tuple[list[str], list[float]]:
    """int32 max_token_length, then per token: float32 score, int32 byte length, UTF-8 bytes."""
    data = path.read_bytes()
    if len(data) < 4:
        raise ModelLoadError(path, "file is too short for a llama2.c tokenizer header")
    pieces, scores = [], []
    offset = 4  # skip max_token_length: pieces are read by their own lengths
    while offset < len(data):
        if offset + 8 > len(data):
            raise ModelLoadError(path, f"truncated tokenizer: token {len(pieces)} has no score/length")
        score, length = np.frombuffer(data, dtype="<f4", count=1, offset=offset)[0], _int32(data, offset + 4)
        offset += 8
        if length < 0 or offset + length > len(data):
            raise ModelLoadError(path, f"truncated tokenizer: token {len(pieces)} wants {length} bytes")
        try:
            pieces.append(data[offset : offset + length].decode("utf-8"))
        except UnicodeDecodeError:
            raise ModelLoadError(path, f"token {len(pieces)} is not valid UTF-8") from None
        scores.append(float(score))
        offset += length
    return pieces, scores


def _read_header(path: Path, data: np.ndarray) -> tuple[ModelConfig, bool]:
    """The config from the 7-int header, and whether the classifier shares the embedding."""
    if bytes(data[:2]) in PICKLE_MAGICS:
        raise ModelLoadError(path, "a PyTorch pickle checkpoint; kvgen never unpickles, convert it to safetensors")
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = (_int32(data, 4 * i) for i in range(HEADER_INTS))
    if dim == EXPORT_MAGIC:
        raise ModelLoadError(path, "llama2.c v1/v2 export format is not supported, only the legacy checkpoint")
    if min(dim, hidden, layers, heads, kv_heads, abs(vocab), seq_len) <= 0 or dim % heads or heads % kv_heads:
        raise ModelLoadError(
            path,
            f"bad llama2.c header (dim={dim}, hidden_dim={hidden}, n_layers={layers}, n_heads={heads}, "
            f"n_kv_heads={kv_heads}, vocab_size={vocab}, seq_len={seq_len})",
        )
    config = ModelConfig(
        vocab_size=abs(vocab),
        hidden_size=dim,
        intermediate_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim // heads,
        max_position_embeddings=seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=vocab > 0,
        bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID,),
    )
    return config, vocab > 0


def _tensor_layout(config: ModelConfig, shared_classifier: bool) -> list[tuple[str, tuple[int, ...]]]:
    """The fp32 arrays after the header, in file order, with their shapes."""
    dim, hidden, layers = config.hidden_size, config.intermediate_size, config.num_layers
    kv_dim, half_head = config.num_kv_heads * config.head_dim, config.head_dim // 2
    layout = [
        ("token_embedding", (config.vocab_size, dim)),
        ("rms_att", (layers, dim)),
        ("wq", (layers, dim, dim)),
        ("wk", (layers, kv_dim, dim)),
        ("wv", (layers, kv_dim, dim)),
        ("wo", (layers, dim, dim)),
        ("rms_ffn", (layers, dim)),
        ("w1", (layers, hidden, dim)),
        ("w2", (layers, dim, hidden)),
        ("w3", (layers, hidden, dim)),
        ("rms_final", (dim,)),
        ("freq_cis_real", (config.max_position_embeddings, half_head)),
        ("freq_cis_imag", (config.max_position_embeddings, half_head)),
    ]
    return layout if shared_classifier else layout + [("wcls", (config.vocab_size, dim))]


def _read_arrays(path: Path, data: np.ndarray, config: ModelConfig, shared_classifier: bool) -> dict[str, np.ndarray]:
    """Views of every array in the file; the file size must match the header exactly."""
    layout = _tensor_layout(config, shared_classifier)
    expected = 4 * HEADER_INTS + 4 * sum(int(np.prod(shape)) for _, shape in layout)
    if len(data) != expected:
        problem = "truncated" if len(data) < expected else "longer than its header implies"
        raise ModelLoadError(path, f"file is {problem}: {len(data)} bytes, the header implies {expected}")
    arrays, offset = {}, 4 * HEADER_INTS
    for name, shape in layout:
        count = int(np.prod(shape))
        arrays[name] = np.frombuffer(data, dtype="<f4", count=count, offset=offset).reshape(shape)
        offset += 4 * count
    return arrays


def _to_hf(arrays: dict[str, np.ndarray], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names and layout: w1/w3/w2 are gate/up/down, q/k rows go from interleaved to rotate-half."""
    t = {name: torch.from_numpy(a.copy()) for name, a in arrays.items()}  # copy: frombuffer views are read-only
    weights = {"model.embed_tokens.weight": t["token_embedding"], "model.norm.weight": t["rms_final"]}
    if "wcls" in t:
        weights["lm_head.weight"] = t["wcls"]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": t["rms_att"][i],
            p + "self_attn.q_proj.weight": interleaved_to_half(t["wq"][i], config.num_heads),
            p + "self_attn.k_proj.weight": interleaved_to_half(t["wk"][i], config.num_kv_heads),
            p + "self_attn.v_proj.weight": t["wv"][i],
            p + "self_attn.o_proj.weight": t["wo"][i],
            p + "post_attention_layernorm.weight": t["rms_ffn"][i],
            p + "mlp.gate_proj.weight": t["w1"][i],
            p + "mlp.up_proj.weight": t["w3"][i],
            p + "mlp.down_proj.weight": t["w2"][i],
        }
    return weights


def _find_tokenizer(path: Path, vocab_size: int) -> Path:
    """The `tok*.bin` beside the checkpoint: `tok{vocab}.bin` or `tokenizer.bin` if several, else the only one."""
    candidates = sorted(p for p in path.parent.glob("tok*.bin") if p != path)
    for preferred in (f"tok{vocab_size}.bin", "tokenizer.bin"):
        if path.parent / preferred in candidates:
            return path.parent / preferred
    if len(candidates) != 1:
        found = ", ".join(p.name for p in candidates) or "none"
        raise ModelLoadError(path, f"cannot pick a tok*.bin tokenizer beside it (found: {found}); pass tokenizer_path")
    return candidates[0]


def _int32(data: bytes | np.ndarray, offset: int) -> int:
    return int(np.frombuffer(data, dtype="<i4", count=1, offset=offset)[0])
