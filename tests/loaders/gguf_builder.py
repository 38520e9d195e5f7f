"""Small llama GGUF files for tests, written with gguf's own writer: random weights in any tensor type,
with a SentencePiece-style (`llama`) or a byte-level BPE (`gpt2`) vocabulary.

Weights are made per tensor as raw blocks in HF row order (`random_blocks`); the writer permutes q/k
rows the way llama.cpp's converter does, so what a reader must give back is `dequantize(blocks)`.
gguf 0.19 quantizes the float and legacy types (`gguf.quants.quantize`) but not the K-quants; those get
random block bytes with finite fp16 scales, which are as valid a file as any quantizer writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import TokenType

from kvgen.config import ModelConfig
from kvgen.loaders import expected_shapes

ALL_TYPES = [QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1,
             QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K]
# Byte offsets of the fp16 scale fields in one block (ggml's block_q*_K layouts), d first.
K_SCALE_OFFSETS = {QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2),
                   QType.Q6_K: (208,)}
WEIGHT_STD = 0.05  # about what trained small models have; keeps logits apart for greedy comparisons


@dataclass(frozen=True)
class Dims:
    """K-quant rows are 256 weights long, so hidden and intermediate are multiples of 256."""

    hidden: int = 256
    inter: int = 512
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2

    def config(self, vocab_size: int) -> ModelConfig:
        return ModelConfig(vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=self.inter,
                           num_layers=self.layers, num_heads=self.heads, num_kv_heads=self.kv_heads,
                           head_dim=self.hidden // self.heads, max_position_embeddings=256)


@dataclass
class Vocab:
    """`tokenizer.*` metadata: model 'llama' (tokens + scores) or 'gpt2' (tokens + merges + pre)."""

    model: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    bos: int = 1
    eos: int = 2
    extra: dict = field(default_factory=dict)  # more key -> value metadata, e.g. add_bos_token


def llama_vocab(stories_dir: Path) -> Vocab:
    """stories260K's 512-piece SentencePiece vocabulary, from its GGUF."""
    fields = gguf.GGUFReader(stories_dir / "stories260K.gguf").fields
    read = {k: fields[f"tokenizer.ggml.{k}"].contents() for k in ("tokens", "scores", "token_type")}
    return Vocab("llama", read["tokens"], read["token_type"], scores=read["scores"])


GPT2_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GPT2_ADDED = ["<think>"]
CORPUS = """The quick brown fox jumps over the lazy dog. It's 2024, and we're testing 1234567 tokens.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
Café, naïve, résumé; 日本語のテキスト; Ελληνικά; русский текст; emoji 🙂🚀.
    Indented   text   with   runs of spaces,\ttabs\tand\n\nnewlines.  I'll, you've, she'd, THEY'RE.
{"key": [1, 2, 3], "other": null, "pi": 3.14159}
""" * 3


def gpt2_vocab(pre: str, size: int = 400) -> Vocab:
    """A byte-level BPE trained on CORPUS (deterministic), with control and user-defined tokens.

    For `smollm` it is trained with each digit on its own, as SmolLM's vocabulary was (its merges join
    no digits), otherwise with GPT-2's pre-tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), tok.pre_tokenizer])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=GPT2_SPECIAL + GPT2_ADDED, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    spec = json.loads(tok.to_str())["model"]
    vocab = sorted(spec["vocab"].items(), key=lambda item: item[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    types = [TokenType.CONTROL if t in GPT2_SPECIAL else TokenType.USER_DEFINED if t in GPT2_ADDED
             else TokenType.NORMAL for t in tokens]
    return Vocab("gpt2", tokens, types, merges=merges, pre=pre, bos=1, eos=2, extra={"add_bos_token": False})


def random_blocks(qtype: QType, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random weights of `shape` stored as `qtype`: float32/float16 values, or uint8 [rows, bytes] blocks."""
    values = (rng.standard_normal(shape) * WEIGHT_STD).astype(np.float32)
    if qtype == QType.F32:
        return values
    if qtype == QType.F16:
        return values.astype(np.float16)
    if qtype not in K_SCALE_OFFSETS:
        return gguf.quants.quantize(values, qtype)
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    rows, blocks = shape[0], shape[1] // gguf.GGML_QUANT_SIZES[qtype][0]
    raw = rng.integers(0, 256, (rows, blocks, block_bytes), dtype=np.uint8)

    def with_scales(d: float, dmin: float) -> np.ndarray:
        out = raw.copy()
        for offset, value in zip(K_SCALE_OFFSETS[qtype], (d, dmin)):
            out[..., offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
        return out.reshape(rows, -1)

    # w = d * A - dmin * B: pick dmin so the mean is about 0, then scale both to WEIGHT_STD.
    if len(K_SCALE_OFFSETS[qtype]) == 2:
        a, b = (gguf.quants.dequantize(with_scales(*s), qtype).mean() for s in ((1.0, 0.0), (0.0, -1.0)))
        dmin = a / b if b else 0.0
    else:
        dmin = 0.0
    std = gguf.quants.dequantize(with_scales(1.0, dmin), qtype).std()
    return with_scales(WEIGHT_STD / std, dmin * WEIGHT_STD / std)


def as_float(stored: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    """What `stored` means, by gguf's dequantizer: the reference every reader must match."""
    if stored.dtype != np.uint8:
        return stored.astype(np.float32)
    return gguf.quants.dequantize(stored, qtype).reshape(shape)


def random_model(qtype: QType, vocab_size: int, dims: Dims, seed: int = 0) -> dict[str, tuple[QType, np.ndarray]]:
    """HF name -> (type, stored array) for a whole model: matrices as `qtype`, norms F32 (as llama.cpp writes)."""
    rng = np.random.default_rng(seed)
    model = {}
    for name, shape in expected_shapes(dims.config(vocab_size)).items():
        if len(shape) == 1:
            model[name] = (QType.F32, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            model[name] = (qtype, random_blocks(qtype, shape, rng))
    return model


def q4_k_m_style_model(vocab_size: int, dims: Dims) -> dict[str, tuple[QType, np.ndarray]]:
    """`random_model` as a Q4_K_M file mixes types: Q4_K matrices, but v and down in Q6_K."""
    model = random_model(QType.Q4_K, vocab_size, dims, seed=4)
    six = random_model(QType.Q6_K, vocab_size, dims, seed=5)
    return {name: six[name] if name.endswith(("v_proj.weight", "down_proj.weight")) else value
            for name, value in model.items()}


GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    if hf_name in GLOBAL:
        return GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{BLOCK[module]}.{suffix}"


def llama_cpp_rows(rows: int, n_head: int) -> np.ndarray:
    """Row order llama.cpp's converter gives q/k: HF rotate-half -> interleaved pairs, per head."""
    return np.arange(rows).reshape(n_head, 2, rows // n_head // 2).swapaxes(1, 2).reshape(rows)


def write_gguf(path: Path, model: dict[str, tuple[QType, np.ndarray]], vocab: Vocab, dims: Dims = Dims(),
               arch: str = "llama") -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(dims.layers)
    writer.add_context_length(256)
    writer.add_embedding_length(dims.hidden)
    writer.add_feed_forward_length(dims.inter)
    writer.add_head_count(dims.heads)
    writer.add_head_count_kv(dims.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    _add_vocab(writer, vocab)
    for hf_name, (qtype, stored) in model.items():
        name = gguf_name(hf_name)
        if ".attn_q." in name or ".attn_k." in name:
            stored = stored[llama_cpp_rows(stored.shape[0], dims.heads if ".attn_q." in name else dims.kv_heads)]
        if stored.dtype == np.uint8:
            writer.add_tensor(name, stored, raw_dtype=qtype)
        else:
            writer.add_tensor(name, stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_vocab(writer: gguf.GGUFWriter, vocab: Vocab) -> None:
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges is not None:
        writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos)
    writer.add_eos_token_id(vocab.eos)
    for key, value in vocab.extra.items():
        getattr(writer, f"add_{key}")(value)


def rewrite_gguf(source: Path, path: Path, fields: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of the GGUF `source` at `path`, with `fields` (key -> new value, of the old field's type; a
    new key is a uint32 or a string) and more `tensors` (name -> fp32 array, or name -> a function of the old
    tensors giving them)."""
    fields = dict(fields or {})
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(path, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, fields.pop(field.name, field.contents()), field.types[0], sub_type=sub_type)
    for name, value in fields.items():
        writer.add_key_value(name, value, gguf.GGUFValueType.STRING if isinstance(value, str) else
                             gguf.GGUFValueType.UINT32)
    old = {t.name: np.array(t.data) for t in reader.tensors}
    for name, data in (old | (tensors(old) if callable(tensors) else tensors or {})).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return path
