"""Qwen3.5 checkpoints beyond the fixture's two files: a GGUF that carries multi-token-prediction layers
(llama.cpp's converter writes them as blocks after the decoder's, `blk.N.nextn.*` among them, counted
by `nextn_predict_layers` and in `block_count`) loads, the MTP tensors kept beside the model under
HF's names (kvgen.model.mtp) and decoding the model's own; and a `Qwen3_5ForConditionalGeneration` directory (the text model under
`model.language_model.`, a vision tower and MTP weights beside it, the text config nested) runs its
text part, as does Qwen3.5-MoE's."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvgen import LLM, SamplingParams
from tests.loaders.arch_fixtures import arch_checkpoint
from tests.loaders.gguf_builder import rewrite_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def with_mtp_layer(source, path):
    """`source` with one MTP layer: a copy of its last (full attention) layer as blk.4 plus the nextn
    tensors llama.cpp names, block_count 5 and nextn_predict_layers 1."""
    def mtp(old: dict) -> dict:
        hidden = old["token_embd.weight"].shape[1]
        return {n.replace("blk.3.", "blk.4."): w for n, w in old.items() if n.startswith("blk.3.")} | {
            "blk.4.nextn.eh_proj.weight": np.ones((hidden, 2 * hidden), np.float32)} | {
            f"blk.4.nextn.{n}.weight": np.ones(hidden, np.float32) for n in ("enorm", "hnorm", "shared_head_norm")}

    return rewrite_gguf(source, path, {"qwen35.block_count": 5, "qwen35.nextn_predict_layers": 1}, mtp)


@pytest.mark.parametrize("quantization", ["none", pytest.param("auto", marks=pytest.mark.slow)])
def test_mtp_layers_are_kept_beside_the_model_and_decoding_is_unchanged(tmp_path, quantization):
    plain = arch_checkpoint("qwen35").gguf
    mtp = LLM(str(with_mtp_layer(plain, tmp_path / "mtp.gguf")), quantization=quantization)
    prompt = list(range(10, 50))
    assert mtp.engine.model_config.num_layers == 4 and mtp.engine.model_config.mtp_layers == 1
    assert {"mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= set(mtp.engine.model.mtp)
    expected = LLM(str(plain), quantization=quantization).generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert mtp.generate([prompt], GREEDY)[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("arch,model_type,architecture", [
    ("qwen35", "qwen3_5", "Qwen3_5ForConditionalGeneration"),
    ("qwen35moe", "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")])
def test_the_text_part_of_a_multimodal_checkpoint_runs(tmp_path, arch, model_type, architecture):
    source = arch_checkpoint(arch).hf_dir
    path = shutil.copytree(source, tmp_path / "vl", ignore=shutil.ignore_patterns("model.safetensors", "config.json"))
    text = json.loads((source / "config.json").read_text())
    config = {"model_type": model_type, "architectures": [architecture],
              "tie_word_embeddings": True, "text_config": text | {"tie_word_embeddings": False},
              "vision_config": {"depth": 1}}
    (path / "config.json").write_text(json.dumps(config))
    weights = {name.replace("model.", "model.language_model.", 1): w for name, w in
               load_file(source / "model.safetensors").items()}
    save_file(weights | {"model.visual.patch_embed.proj.weight": torch.ones(4, 3), "mtp.fc.weight": torch.ones(4, 8)},
              path / "model.safetensors")
    prompt = list(range(10, 50))
    expected = LLM(str(source), quantization="none").generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert LLM(str(path), quantization="none").generate([prompt], GREEDY)[0].outputs[0].token_ids == expected
