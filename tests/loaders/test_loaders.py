"""Model loaders on real files: stories260K in .bin and .gguf, HF directories written by transformers,
GGUF files written with gguf.GGUFWriter, and every kind of broken input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from kvgen.config import ModelConfig
from kvgen.errors import ModelLoadError
from kvgen.loaders import expected_shapes, load_model
from kvgen.loaders.tokenizers import SentencePieceTokenizer

STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


@pytest.fixture(scope="module")
def stories_bin(stories_dir: Path):
    return load_model(stories_dir / "stories260K.bin")


@pytest.fixture(scope="module")
def stories_gguf(stories_dir: Path):
    return load_model(stories_dir / "stories260K.gguf")


@pytest.fixture(scope="module")
def transformers_gguf_tensors(stories_dir: Path) -> dict[str, torch.Tensor]:
    """stories260K.gguf as transformers' own GGUF loader converts it (reverse_permute on q/k included)."""
    config = AutoConfig.from_pretrained(stories_dir, gguf_file="stories260K.gguf")
    config.pad_token_id = None
    model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(stories_dir / "stories260K.gguf"), return_tensors=True, model_to_load=model)
    model.load_state_dict(tensors["tensors"], strict=True)  # the mapping covers the whole model
    return model.state_dict()


# --- stories260K: .bin, .gguf and transformers agree ---------------------------------------------------


def test_bin_and_gguf_give_the_same_model(stories_bin, stories_gguf):
    differing = {"max_position_embeddings", "tie_word_embeddings"}  # GGUF: context 2048, output.weight stored
    for field in set(vars(stories_bin.config)) - differing - {"extra"}:
        assert getattr(stories_bin.config, field) == getattr(stories_gguf.config, field), field
    assert stories_bin.config.max_position_embeddings == 512
    assert stories_bin.config.tie_word_embeddings and not stories_gguf.config.tie_word_embeddings
    assert set(stories_gguf.weights) == set(stories_bin.weights) | {"lm_head.weight"}
    for name, tensor in stories_bin.weights.items():
        assert torch.equal(tensor, stories_gguf.weights[name]), name
    assert torch.equal(stories_gguf.weights["lm_head.weight"], stories_bin.weights["model.embed_tokens.weight"])


@pytest.mark.parametrize("fixture", ["stories_bin", "stories_gguf"])
def test_weights_equal_transformers_gguf_loader(fixture, request, transformers_gguf_tensors):
    ours = request.getfixturevalue(fixture).weights
    for name, expected in transformers_gguf_tensors.items():
        tied_head = name == "lm_head.weight" and name not in ours  # .bin: the classifier is the embedding
        assert torch.equal(ours["model.embed_tokens.weight" if tied_head else name], expected), name


def test_transformers_from_pretrained_gguf_agrees(stories_dir, stories_gguf):
    pytest.importorskip("accelerate", reason="transformers needs accelerate for from_pretrained(gguf_file=...)")
    config = AutoConfig.from_pretrained(stories_dir, gguf_file="stories260K.gguf")
    config.pad_token_id = None
    model = AutoModelForCausalLM.from_pretrained(stories_dir, gguf_file="stories260K.gguf", config=config)
    for name, expected in model.state_dict().items():
        torch.testing.assert_close(stories_gguf.weights[name], expected.float(), rtol=0, atol=1e-6)


def test_converted_weights_are_a_working_model(stories_bin):
    """The rotate-half permutation is right, not merely consistent: the story scores a low loss."""
    model = LlamaForCausalLM(_llama_config(stories_bin.config)).eval()
    model.load_state_dict(stories_bin.weights, strict=False)  # lm_head is tied to the embedding
    ids = torch.tensor([stories_bin.tokenizer.encode(STORY)])
    with torch.no_grad():
        assert model(ids, labels=ids).loss.item() < 0.5  # the stored (interleaved) layout scores about 2.5


def test_llama2c_specifics(stories_bin, stories_dir):
    tok = stories_bin.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.extra_stop_ids) == (1, 2, frozenset({1}))
    assert tok.stop_token_ids == {1, 2}
    assert (stories_bin.config.rope_theta, stories_bin.config.rms_norm_eps) == (10000.0, 1e-5)
    assert "lm_head.weight" not in stories_bin.weights
    bf16 = load_model(stories_dir / "stories260K.bin", dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in bf16.weights.values())


def test_llama2c_tokenizer_override(stories_dir, tmp_path):
    checkpoint = tmp_path / "model.bin"
    shutil.copy(stories_dir / "stories260K.bin", checkpoint)  # no tok*.bin beside it
    with pytest.raises(ModelLoadError, match="tok"):
        load_model(checkpoint)
    loaded = load_model(checkpoint, tokenizer_path=stories_dir / "tok512.model")
    assert isinstance(loaded.tokenizer, SentencePieceTokenizer)


# --- Hugging Face directories ----------------------------------------------------------------------------


def _llama_config(config) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=None,
    )


def _tiny_hf_model(family: str, tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    shape |= dict(num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied)
    shape |= dict(bos_token_id=1, eos_token_id=2, pad_token_id=None)
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
    return LlamaForCausalLM(LlamaConfig(**shape)).eval()


def _save_hf(model: torch.nn.Module, directory: Path, stories_dir: Path, **save_kwargs) -> Path:
    """A complete HF directory: weights, config and (SentencePiece) tokenizer files."""
    model.save_pretrained(directory, **save_kwargs)
    shutil.copy(stories_dir / "tok512.model", directory / "tokenizer.model")
    return directory


@pytest.mark.parametrize(
    "family, tied, shard",
    [("llama", False, None), ("llama", True, None), ("qwen2", False, None), ("qwen2", True, "20KB")],
)
def test_hf_directory_round_trips(family, tied, shard, tmp_path, stories_dir):
    model = _tiny_hf_model(family, tied)
    kwargs = {"max_shard_size": shard} if shard else {}
    directory = _save_hf(model, tmp_path / family, stories_dir, **kwargs)
    if shard:
        assert (directory / "model.safetensors.index.json").is_file()
        assert len(list(directory.glob("model-*.safetensors"))) > 1
    loaded = load_model(directory)
    assert (loaded.config.model_type, loaded.config.tie_word_embeddings) == (family, tied)
    assert loaded.config.qkv_bias == (family == "qwen2")
    for name, expected in model.state_dict().items():
        if tied and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        assert torch.equal(loaded.weights[name], expected), name


def test_hf_metadata_and_dtype(tmp_path, stories_dir):
    directory = _save_hf(_tiny_hf_model("llama", tied=False), tmp_path / "m", stories_dir)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "chat_template": template}))
    loaded = load_model(directory, dtype=torch.bfloat16)
    assert loaded.config.eos_token_ids == (2, 7)
    assert loaded.tokenizer.chat_template == template
    assert loaded.tokenizer.stop_token_ids == {2, 7}
    assert loaded.tokenizer.encode("Hi")[0] != loaded.tokenizer.bos_token_id  # add_bos_token: false
    assert all(t.dtype == torch.bfloat16 for t in loaded.weights.values())


# --- GGUF written here: quantized tensors, permutation, metadata ------------------------------------------

TINY = dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> GGUF interleaved pairs, as llama.cpp's convert_hf_to_gguf.py permutes q/k."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_hf_weights(vocab: int) -> dict[str, np.ndarray]:
    """Random float32 weights in HF layout (shapes checked against transformers by the round-trip tests)."""
    config = ModelConfig(
        vocab_size=vocab,
        hidden_size=TINY["hidden"],
        intermediate_size=TINY["inter"],
        num_layers=TINY["layers"],
        num_heads=TINY["heads"],
        num_kv_heads=TINY["kv_heads"],
        head_dim=TINY["hidden"] // TINY["heads"],
        max_position_embeddings=256,
    )
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in expected_shapes(config).items()}


# Written out independently of the loader's own table, so a wrong pair there cannot go unnoticed.
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
GGUF_NAMES |= {"lm_head.weight": "output.weight"}
GGUF_BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.<module>.weight
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_BLOCK_NAMES[module]}.{suffix}"


def _write_gguf(path: Path, weights: dict[str, np.ndarray], vocab: dict, qtype=QType.F32, arch="llama", drop=()):
    """A llama GGUF from HF-layout float32 weights: q/k permuted, 2-D tensors stored as `qtype`, norms F32."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["inter"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_scores(vocab["scores"])
    writer.add_token_types(vocab["types"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for hf_name, array in weights.items():
        name = _gguf_name(hf_name)
        if name in drop:
            continue
        if ".attn_q." in name or ".attn_k." in name:
            array = _llama_cpp_permute(array, TINY["heads"] if ".attn_q." in name else TINY["kv_heads"])
        if array.ndim == 2 and qtype != QType.F32:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def stories_vocab(stories_dir: Path) -> dict:
    fields = gguf.GGUFReader(stories_dir / "stories260K.gguf").fields
    keys = {"tokens": "tokens", "scores": "scores", "types": "token_type"}
    return {ours: fields[f"tokenizer.ggml.{key}"].contents() for ours, key in keys.items()}


def _reference(array: np.ndarray, qtype: QType) -> torch.Tensor:
    """What a lossless dequantization of `array` stored as `qtype` must give."""
    if array.ndim != 2 or qtype == QType.F32:
        return torch.from_numpy(array)
    if qtype == QType.BF16:
        return torch.from_numpy(array).to(torch.bfloat16).float()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype).reshape(array.shape))


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16, QType.Q8_0], ids=lambda q: q.name)
def test_gguf_tensor_types_dequantize(qtype, tmp_path, stories_vocab):
    weights = _tiny_hf_weights(len(stories_vocab["tokens"]))
    loaded = load_model(_write_gguf(tmp_path / "tiny.gguf", weights, stories_vocab, qtype))
    config = loaded.config
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (64, 128, 2)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.rope_theta) == (4, 2, 16, 500000.0)
    assert (config.max_position_embeddings, config.vocab_size, config.rms_norm_eps) == (256, 512, 1e-5)
    for name, array in weights.items():
        # q/k come back in HF layout after the inverse permutation; values match a lossless dequantization.
        assert torch.equal(loaded.weights[name], _reference(array, qtype)), name
        if qtype == QType.Q8_0 and array.ndim == 2:
            step = np.abs(array).max() / 127  # one quantization step of the widest block
            torch.testing.assert_close(loaded.weights[name], torch.from_numpy(array), rtol=0, atol=step)


def test_gguf_loads_in_half_precision(tmp_path, stories_vocab):
    weights = _tiny_hf_weights(len(stories_vocab["tokens"]))
    loaded = load_model(_write_gguf(tmp_path / "tiny.gguf", weights, stories_vocab, QType.F16), dtype=torch.float16)
    name = "model.layers.1.mlp.down_proj.weight"
    assert loaded.weights[name].dtype == torch.float16
    assert torch.equal(loaded.weights[name], torch.from_numpy(weights[name]).half())


# --- broken input: always ModelLoadError naming the file -----------------------------------------------


# Each builder makes one broken model in tmp_path and returns (what to load, the file the error must name).


def _truncated_bin(tmp_path: Path, stories_dir: Path) -> tuple[Path, Path]:
    shutil.copy(stories_dir / "tok512.bin", tmp_path / "tok512.bin")
    path = tmp_path / "stories260K.bin"
    path.write_bytes((stories_dir / "stories260K.bin").read_bytes()[:100_000])
    return path, path


def _truncated_tokenizer(tmp_path: Path, stories_dir: Path) -> tuple[Path, Path]:
    shutil.copy(stories_dir / "stories260K.bin", tmp_path / "stories260K.bin")
    path = tmp_path / "tok512.bin"
    path.write_bytes((stories_dir / "tok512.bin").read_bytes()[:3000])
    return tmp_path / "stories260K.bin", path


def _bad_gguf_magic(tmp_path: Path, stories_dir: Path) -> tuple[Path, Path]:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUX" + (stories_dir / "stories260K.gguf").read_bytes()[4:])
    return path, path


def _truncated_gguf(tmp_path: Path, stories_dir: Path) -> tuple[Path, Path]:
    path = tmp_path / "model.gguf"
    path.write_bytes((stories_dir / "stories260K.gguf").read_bytes()[:500_000])
    return path, path


MINI_VOCAB = {"tokens": ["<unk>", "<s>", "</s>", "a"], "scores": [0.0] * 4, "types": [2, 3, 3, 1]}


def _gguf_missing_tensor(tmp_path: Path, stories_dir: Path) -> tuple[Path, Path]:
    path = _write_gguf(tmp_path / "m.gguf", _tiny_hf_weights(4), MINI_VOCAB, drop={"blk.1.ffn_up.weight"})
    return path, path


def _gguf_wrong_shape(tmp_path: Path, stories_dir: Path) -> tuple[Path, Path]:
    weights = _tiny_hf_weights(4)
    weights["model.layers.0.self_attn.k_proj.weight"] = np.zeros((48, TINY["hidden"]), np.float32)
    path = _write_gguf(tmp_path / "m.gguf", weights, MINI_VOCAB)
    return path, path


def _gguf_other_arch(tmp_path: Path, stories_dir: Path) -> tuple[Path, Path]:
    path = _write_gguf(tmp_path / "m.gguf", _tiny_hf_weights(4), MINI_VOCAB, arch="gpt2")
    return path, path


def _hf_dir(tmp_path: Path, stories_dir: Path, **save_kwargs) -> Path:
    return _save_hf(_tiny_hf_model("llama", tied=False), tmp_path / "hf", stories_dir, **save_kwargs)


def _rewrite_safetensors(directory: Path, edit) -> Path:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")
    return directory / "model.safetensors"


def _safetensors_wrong_shape(tmp_path: Path, stories_dir: Path) -> tuple[Path, Path]:
    directory = _hf_dir(tmp_path, stories_dir)
    edit = lambda tensors: tensors.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(47, 32)})  # noqa: E731
    return directory, _rewrite_safetensors(directory, edit)


def _safetensors_missing_lm_head(tmp_path: Path, stories_dir: Path) -> tuple[Path, Path]:
    directory = _hf_dir(tmp_path, stories_dir)
    _rewrite_safetensors(directory, lambda tensors: tensors.pop("lm_head.weight"))
    return directory, directory


def _missing_config(tmp_path: Path, stories_dir: Path) -> tuple[Path, Path]:
    directory = _hf_dir(tmp_path, stories_dir)
    (directory / "config.json").unlink()
    return directory, directory / "config.json"


def _missing_shard(tmp_path: Path, stories_dir: Path) -> tuple[Path, Path]:
    directory = _hf_dir(tmp_path, stories_dir, max_shard_size="20KB")
    shard = sorted(directory.glob("model-*.safetensors"))[0]
    shard.unlink()
    return directory, shard


def _corrupt_safetensors(tmp_path: Path, stories_dir: Path) -> tuple[Path, Path]:
    directory = _hf_dir(tmp_path, stories_dir)
    (directory / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    return directory, directory / "model.safetensors"


def _unknown_extension(tmp_path: Path, stories_dir: Path) -> tuple[Path, Path]:
    path = tmp_path / "model.pt"
    path.write_bytes(b"\x80\x04not a pickle we would ever open")
    return path, path


def _empty_bin(tmp_path: Path, stories_dir: Path) -> tuple[Path, Path]:
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    return path, path


def _pickle_checkpoint(tmp_path: Path, stories_dir: Path) -> tuple[Path, Path]:
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"\x80\x02}q\x00." + bytes(100))
    return path, path


def _missing_file(tmp_path: Path, stories_dir: Path) -> tuple[Path, Path]:
    return tmp_path / "absent.gguf", tmp_path / "absent.gguf"


BROKEN = {
    "unknown extension": (_unknown_extension, "unknown model format"),
    "missing file": (_missing_file, "no such file"),
    "truncated .bin": (_truncated_bin, "truncated"),
    "empty .bin": (_empty_bin, "too short"),
    "pickle .bin": (_pickle_checkpoint, "never unpickles"),
    "truncated tok.bin": (_truncated_tokenizer, "truncated tokenizer"),
    "bad GGUF magic": (_bad_gguf_magic, "GGUF"),
    "truncated GGUF": (_truncated_gguf, "GGUF"),
    "GGUF missing tensor": (_gguf_missing_tensor, "mlp.up_proj"),
    "GGUF wrong shape": (_gguf_wrong_shape, r"k_proj.weight has shape \(48, 64\)"),
    "GGUF other architecture": (_gguf_other_arch, "architecture 'gpt2'"),
    "safetensors wrong shape": (_safetensors_wrong_shape, r"up_proj.weight has shape \(47, 32\)"),
    "untied without lm_head": (_safetensors_missing_lm_head, "lm_head.weight is missing"),
    "missing config.json": (_missing_config, "config.json"),
    "missing shard": (_missing_shard, "missing shard"),
    "corrupt safetensors": (_corrupt_safetensors, "safetensors"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_input_raises_model_load_error(case, tmp_path, stories_dir):
    make, message = BROKEN[case]
    model_path, bad_file = make(tmp_path, stories_dir)
    with pytest.raises(ModelLoadError, match=message) as error:
        load_model(model_path)
    assert str(bad_file) in str(error.value)
