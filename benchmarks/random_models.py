"""Seeded random-weight checkpoints for the bench, and llama.cpp's quantized GGUF files of them.

`build_random_model` writes a Hugging Face directory tensor by tensor, without ever holding the model
(a 3B checkpoint in bfloat16 is 6.4 GB; transformers would build it in float32 first): the names and
shapes come from the architecture's transformers model (its `Family`: LlamaForCausalLM unless it says
otherwise) on the meta device, each tensor is drawn from one seeded generator as transformers' own
init draws it (matrices N(0, initializer_range), vectors 1), and the safetensors are cut into shards
of at most SHARD_BYTES. The dtype is the architecture's `dtype` (default float32).

`build_quantized_gguf` makes the file a llama.cpp user would have: llama.cpp's `convert_hf_to_gguf.py`
to BF16, then `llama-quantize` to the mix (benchmarks.llama_tools). The converter needs a vocabulary
it recognises: for Llama a SentencePiece placeholder (the pieces benchmarks.models' own GGUF writer
uses: <unk> <s> </s>, 256 byte tokens, then ▁w<i>), so token ids mean the same; for the Qwen families,
whose converter reads only byte-level BPEs, Qwen2's real vocabulary (llama.cpp's ggml-vocab-qwen2.gguf),
which the converter pads to the config's vocabulary with [PAD<i>] tokens. Benchmarks send token ids,
so either vocabulary serves.

Every file is built into a temporary sibling and renamed, so an interrupted build leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import llama_tools
from kvgen.paths import cache_root

SHARD_BYTES = 1 << 30
# The mixes `--model NAME:MIX` makes with llama-quantize (BF16: the converter's output as it is;
# MXFP4_MOE: experts in MXFP4 and the rest Q8_0, as gpt-oss is published).
QUANT_MIXES = ("Q4_K_M", "Q4_0", "Q5_K_M", "Q6_K", "Q8_0", "MXFP4_MOE", "BF16")


def build_atomically(path: Path, build: Callable[[Path], None], directory: bool = True) -> None:
    """Builds `path` (a directory, or with directory=False a file) into a temporary sibling that
    `build` fills, then renames it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    else:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
        os.close(fd)
        tmp = Path(name)
    try:
        build(tmp)
        tmp.chmod(0o755 if directory else 0o644)  # mkdtemp's / mkstemp's owner-only modes would hide it from others
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True) if directory else tmp.unlink(missing_ok=True)
        raise


# -- Hugging Face directories ----------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """The transformers classes of a generated architecture, the vocabulary llama.cpp's converter is
    given for it ("placeholder" SentencePiece, "placeholder-json" a BPE one as a tokenizer.json, or
    "qwen2" BPE), the converter's extra flags, and the multi-token-prediction layers its checkpoints carry
    (`mtp.*` as Qwen3.5's: a copy of the first full-attention layer's tensors, `fc` and three norms)."""

    config_class: str = "LlamaConfig"
    model_class: str = "LlamaForCausalLM"
    vocabulary: str = "placeholder"
    convert_flags: tuple[str, ...] = ()
    mtp_layers: int = 0


LLAMA = Family()


def family_of(architecture: dict[str, Any]) -> tuple[Family, dict[str, Any]]:
    """An architecture's `family` entry (Llama where it has none) and its config fields without it."""
    fields = dict(architecture)
    return fields.pop("family", LLAMA), fields


def build_random_model(architecture: dict[str, Any], seed: int, path: Path) -> None:
    """Saves a seeded random-weight model of `architecture` (its family's config fields, and optionally
    `family`) and a WordLevel tokenizer of its vocabulary into `path`."""
    import transformers
    from safetensors.torch import save_file

    family, fields = family_of(architecture)
    config = getattr(transformers, family.config_class)(**fields)
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, config.dtype or "float32")
    path.mkdir(parents=True, exist_ok=True)
    index: dict[str, str] = {}  # tensor -> the shard it is in, numbered as written
    total = 0
    for number, shard in enumerate(_shards(_random_tensors(config, family, dtype, seed)), 1):
        save_file(shard, str(path / f"shard-{number}"), metadata={"format": "pt"})  # one shard in memory at a time
        index |= dict.fromkeys(shard, f"shard-{number}")
        total += sum(t.numel() * t.element_size() for t in shard.values())
    count = len(set(index.values()))
    names = {f"shard-{n}": "model.safetensors" if count == 1 else f"model-{n:05d}-of-{count:05d}.safetensors"
             for n in range(1, count + 1)}
    for written, name in names.items():
        (path / written).rename(path / name)
    if count > 1:
        weight_map = {tensor: names[shard] for tensor, shard in index.items()}
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config.dtype, config.architectures = dtype, [family.model_class]  # the converter picks its model by the latter
    if family.mtp_layers:
        config.mtp_num_hidden_layers = family.mtp_layers
    config.save_pretrained(path)
    save_placeholder_tokenizer(config.vocab_size, path)


def weight_shapes(config, family: Family = LLAMA) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the family's model saves for `config` (a tied lm_head left out)."""
    import transformers

    with torch.device("meta"):
        state = getattr(transformers, family.model_class)(config).state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    return shapes | mtp_shapes(config, shapes, family.mtp_layers)


def mtp_shapes(config, shapes: dict[str, tuple[int, ...]], layers: int) -> dict[str, tuple[int, ...]]:
    """The `mtp.*` tensors of `layers` MTP layers, each shaped as the model's first full-attention layer."""
    if not layers:
        return {}
    full = f"model.layers.{config.layer_types.index('full_attention')}."
    hidden = config.hidden_size
    out = {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.norm.weight": (hidden,),
           "mtp.pre_fc_norm_embedding.weight": (hidden,), "mtp.pre_fc_norm_hidden.weight": (hidden,)}
    for j in range(layers):
        out |= {f"mtp.layers.{j}." + name.removeprefix(full): shape for name, shape in shapes.items()
                if name.startswith(full)}
    return out


def _random_tensors(config, family: Family, dtype: torch.dtype, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    for name, shape in weight_shapes(config, family).items():
        if len(shape) == 1:  # norms' weights as transformers initialises them; gates' biases and decays alike
            yield name, torch.ones(shape, dtype=dtype)
        else:
            yield name, torch.randn(shape, generator=generator).mul_(config.initializer_range).to(dtype)


def _shards(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive tensors grouped into shards of at most SHARD_BYTES (a larger tensor alone)."""
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > SHARD_BYTES:
            yield shard
            shard, size = {}, 0
        shard[name], size = tensor, size + nbytes
    if shard:
        yield shard


def save_placeholder_tokenizer(vocab_size: int, path: Path) -> None:
    """tokenizer.json + tokenizer_config.json with words w0 .. w{n-1}: loadable by kvgen, transformers and
    CTranslate2's converter (benchmarks send token ids, so the vocabulary only has to exist)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2").save_pretrained(path)


def placeholder_pieces(vocab_size: int) -> Iterator[tuple[str, str]]:
    """(piece, kind) of the placeholder SentencePiece vocabulary: <unk>, <s>, </s>, the 256 byte tokens
    <0x00>..<0xFF>, then ▁w<i>; kind is one of unknown, control, byte, normal."""
    for i in range(vocab_size):
        if i < 3:
            yield ("<unk>", "<s>", "</s>")[i], ("unknown", "control", "control")[i]
        elif i < 259:
            yield f"<0x{i - 3:02X}>", "byte"
        else:
            yield f"\u2581w{i}", "normal"


def save_spm_placeholder(vocab_size: int, path: Path) -> None:
    """`path`/tokenizer.model: the placeholder vocabulary as a SentencePiece BPE model (byte fallback)."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    model = spm.ModelProto()
    model.trainer_spec.model_type = spm.TrainerSpec.BPE
    model.trainer_spec.vocab_size = vocab_size
    model.trainer_spec.byte_fallback = True
    model.normalizer_spec.name = "identity"
    kinds = {"unknown": spm.ModelProto.SentencePiece.UNKNOWN, "control": spm.ModelProto.SentencePiece.CONTROL,
             "byte": spm.ModelProto.SentencePiece.BYTE, "normal": spm.ModelProto.SentencePiece.NORMAL}
    for i, (text, kind) in enumerate(placeholder_pieces(vocab_size)):
        piece = model.pieces.add()
        piece.piece, piece.type, piece.score = text, kinds[kind], -float(i) if kind == "normal" else 0.0
    (path / "tokenizer.model").write_bytes(model.SerializeToString())


def save_bpe_placeholder_json(vocab_size: int, path: Path) -> None:
    """A SentencePiece-style BPE placeholder as a tokenizer.json (Gemma 4's converter reads only that, and
    llama.cpp's gemma4 vocabulary needs merges): <unk> <s> </s>, the 256 byte tokens, '▁', 'w', the
    digits, '▁w', then ▁w0, ▁w1, ...; each ▁w<n> is the merge of ▁w<n // 10> (or ▁w) and its last digit."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "w", *"0123456789", "\u2581w"]
    words = [f"\u2581w{n}" for n in range(vocab_size - len(pieces))]
    merges = [("\u2581", "w")] + [(f"\u2581w{n // 10}" if n >= 10 else "\u2581w", str(n % 10)) for n in range(len(words))]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces + words)}, merges, byte_fallback=True,
                               fuse_unk=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(path)


# -- llama.cpp's GGUF files ------------------------------------------------------------------------


def build_quantized_gguf(hf_dir: Path, out: Path, mix: str, family: Family = LLAMA) -> Path:
    """`out`: the HF directory as llama.cpp makes a `mix` file of it (BF16 GGUF beside it, cached)."""
    if mix not in QUANT_MIXES:
        raise ValueError(f"unknown quantization mix {mix!r}; the bench makes {', '.join(QUANT_MIXES)}")
    with llama_tools.file_lock(out.parent / f".{out.name}.lock"):
        if out.is_file():
            return out
        bf16 = out.with_name(out.name.replace(mix, "BF16")) if mix != "BF16" else out
        if not bf16.is_file():
            build_atomically(bf16, lambda tmp: _convert(hf_dir, tmp, family), directory=False)
        if mix != "BF16":
            build_atomically(out, lambda tmp: llama_tools.quantize(bf16, tmp, mix), directory=False)
    return out


def _convert(hf_dir: Path, out: Path, family: Family) -> None:
    """convert_hf_to_gguf.py --outtype bf16 on a staged copy of `hf_dir` (links to its config and
    weights) with the family's vocabulary as its only tokenizer."""
    config = json.loads((hf_dir / "config.json").read_text())
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".stage-") as stage:
        for f in hf_dir.iterdir():
            if f.name == "config.json" or f.name.startswith("model"):
                (Path(stage) / f.name).symlink_to(f.resolve())
        if family.vocabulary == "qwen2":
            for f in llama_tools.qwen2_tokenizer_dir(cache_root()).iterdir():
                shutil.copy(f, Path(stage) / f.name)
        elif family.vocabulary == "placeholder-json":
            save_bpe_placeholder_json(config["vocab_size"], Path(stage))
        else:
            save_spm_placeholder(config["vocab_size"], Path(stage))
        llama_tools.convert(Path(stage), out, "bf16", cache_root(), family.convert_flags)
