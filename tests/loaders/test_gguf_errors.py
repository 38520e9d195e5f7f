"""Broken GGUF files: each gives one ModelLoadError line naming the file and the problem; the CLI exits 2."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from kvgen.errors import ModelLoadError
from kvgen.loaders import load_model
from tests.loaders.gguf_builder import Dims, QType, gguf_name, gpt2_vocab, random_model, write_gguf
from tests.test_cli import assert_user_error, run

SMALL = Dims(hidden=256, inter=256, layers=1, heads=4, kv_heads=2)


def _model(qtype=QType.Q4_K) -> dict:
    return random_model(qtype, 400, SMALL)


def _vocab():
    return gpt2_vocab("gpt2")


def _truncated(path: Path) -> None:
    write_gguf(path, _model(), _vocab(), SMALL)
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])


def _truncated_header(path: Path) -> None:
    write_gguf(path, _model(), _vocab(), SMALL)
    path.write_bytes(path.read_bytes()[:3000])


def _bad_tensor_type_id(path: Path) -> None:
    """The first tensor's type field set to 99, a number no GGUF type has."""
    model = _model()
    write_gguf(path, model, _vocab(), SMALL)
    data = bytearray(path.read_bytes())
    name = gguf_name(next(iter(model))).encode()
    info = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, info)[0]
    struct.pack_into("<I", data, info + 4 + 8 * n_dims, 99)
    path.write_bytes(bytes(data))


def _iq_tensor(path: Path) -> None:
    """ffn_up stored as IQ4_NL (a valid GGUF type kvgen does not read): 18 bytes per 32 weights."""
    model = _model()
    rows, cols = model["model.layers.0.mlp.up_proj.weight"][1].shape[0], SMALL.hidden
    blocks = np.random.default_rng(0).integers(0, 256, (rows, cols // 32 * 18), dtype=np.uint8)
    blocks.reshape(rows, -1, 18)[..., :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    model["model.layers.0.mlp.up_proj.weight"] = (QType.IQ4_NL, blocks)
    write_gguf(path, model, _vocab(), SMALL)


def _other_architecture(path: Path) -> None:
    write_gguf(path, _model(), _vocab(), SMALL, arch="mamba")


def _tensors_of_another_architecture(path: Path) -> None:
    """Llama's separate q/k/v and gate/up under Phi-3's name, whose checkpoints fuse them."""
    write_gguf(path, _model(), _vocab(), SMALL, arch="phi3")


def _unknown_tokenizer(path: Path) -> None:
    vocab = _vocab()
    vocab.model = "bert"
    write_gguf(path, _model(), vocab, SMALL)


BROKEN = {
    "truncated": (_truncated, "truncated or corrupt"),
    "truncated header": (_truncated_header, "truncated or corrupt"),
    "unknown type id": (_bad_tensor_type_id, "truncated or corrupt"),
    "IQ4_NL tensor": (_iq_tensor, "tensor blk.0.ffn_up.weight is IQ4_NL, which kvgen does not read"),
    "other architecture": (_other_architecture, "architecture 'mamba' is not supported"),
    "tensors of another architecture": (_tensors_of_another_architecture,
                                        "missing tensors: model.layers.0.self_attn.qkv_proj.weight"),
    "unknown tokenizer": (_unknown_tokenizer, "GGUF tokenizer 'bert' is not supported"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_gguf_is_one_line_naming_the_file(case, tmp_path, capsys):
    make, message = BROKEN[case]
    path = tmp_path / "broken.gguf"
    make(path)
    with pytest.raises(ModelLoadError, match=message) as error:
        load_model(path)
    assert str(error.value).startswith(f"{path}: ") and "\n" not in str(error.value)
    code, _, err = run(capsys, "generate", "--model", path, "--max-tokens", 1)
    assert_user_error(code, err, str(path), message)
