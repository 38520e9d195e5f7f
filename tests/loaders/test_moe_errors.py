"""Mixture-of-experts checkpoints kvgen cannot run are refused in one line naming the file: an expert
missing or of another shape (HF), MXFP4 blocks without their scales (gpt-oss), an expert layout kvgen
does not know (GGUF), mixtures of architectures kvgen does not run yet, and tensor parallelism over
experts."""

import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvgen import LLM
from kvgen.errors import ModelLoadError
from kvgen.loaders import load_model


def refused(path: Path, **options) -> str:
    with pytest.raises(ModelLoadError) as error:
        LLM(path, quantization="none", **options)
    message = str(error.value)
    assert "\n" not in message and str(path) in message, message
    return message


def hf_copy(arch_ckpt, tmp_path: Path, edit_weights=None, edit_config=None, arch: str = "qwen3moe") -> Path:
    src, dst = arch_ckpt(arch).hf_dir, tmp_path / "hf"
    shutil.copytree(src, dst)
    if edit_weights:
        weights = load_file(src / "model.safetensors")
        edit_weights(weights)
        save_file(weights, dst / "model.safetensors")
    if edit_config:
        config = json.loads((src / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def gguf_copy(src: Path, dst: Path, rename: dict[str, str]) -> Path:
    """The GGUF at `src` written again with some tensors renamed."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch=reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    for t in reader.tensors:
        writer.add_tensor(rename.get(t.name, t.name), t.data, raw_shape=list(reversed(t.shape.tolist())),
                          raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_a_missing_expert_is_one_line(arch_ckpt, tmp_path):
    path = hf_copy(arch_ckpt, tmp_path, lambda w: w.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    assert "up_proj is missing for experts [5]" in refused(path)


def test_an_expert_of_another_shape_is_one_line(arch_ckpt, tmp_path):
    def widen(w):
        w["model.layers.0.mlp.experts.3.down_proj.weight"] = torch.zeros(64, 48)

    assert "differ in shape" in refused(hf_copy(arch_ckpt, tmp_path, widen))


def test_experts_of_another_width_than_the_config_is_one_line(arch_ckpt, tmp_path):
    def narrower(c):
        c["moe_intermediate_size"] = 16

    assert "config implies" in refused(hf_copy(arch_ckpt, tmp_path, edit_config=narrower))


def test_mxfp4_blocks_without_their_scales_are_one_line(arch_ckpt, tmp_path):
    """gpt-oss's MXFP4 experts come as blocks and scales; blocks alone cannot be read."""
    def blocks_only(w):
        w["model.layers.0.mlp.experts.down_proj_blocks"] = torch.zeros(8, 64, 1, 16, dtype=torch.uint8)
        del w["model.layers.0.mlp.experts.down_proj"]

    message = refused(hf_copy(arch_ckpt, tmp_path, blocks_only, arch="gpt-oss"))
    assert "down_proj has MXFP4 ['blocks'] without its scales" in message


@pytest.mark.slow  # ~10 s: gguf's writer copies a 49152-token vocabulary
def test_an_unknown_gguf_expert_layout_is_one_line(arch_ckpt, tmp_path):
    """llama.cpp's fused gate/up experts tensor (ffn_gate_up_exps) is a layout kvgen does not read."""
    src = arch_ckpt("qwen3moe").gguf
    path = gguf_copy(src, tmp_path / "fused.gguf", {"blk.0.ffn_gate_exps.weight": "blk.0.ffn_gate_up_exps.weight"})
    assert "ffn_gate_up_exps" in refused(path)


def test_gemma4s_mixture_is_one_line(arch_ckpt, tmp_path):
    """Gemma 4's own file refuses its MoE."""
    extra = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2}
    refused(hf_copy(arch_ckpt, tmp_path, edit_config=lambda c: c.update(model_type="gemma4_text", **extra)))


def test_tensor_parallel_experts_are_one_line(arch_ckpt):
    path = arch_ckpt("qwen3moe").hf_dir
    with pytest.raises(ModelLoadError) as error:
        load_model(path, shard=(0, 2))
    assert "\n" not in str(error.value) and "mixtures of experts" in str(error.value)


def test_a_mixture_off_the_cpu_is_one_line(arch_ckpt):
    """The expert kernel is C over host memory: another device is refused as the model is built."""
    from kvgen.model.decoder import DecoderModel

    loaded = load_model(arch_ckpt("olmoe").hf_dir)
    with pytest.raises(ValueError, match="mixtures of experts run on the CPU only") as error:
        DecoderModel(loaded.config, loaded.weights, device="meta")
    assert "\n" not in str(error.value)
