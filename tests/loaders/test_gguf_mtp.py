"""A Qwen3.5 GGUF that carries multi-token-prediction layers (llama.cpp's converter writes them as
blocks after the decoder's, `blk.N.nextn.*` among them, counted by `nextn_predict_layers` and in
`block_count`) loads: the MTP tensors are kept beside the model, and decoding is the model's own."""

import gguf
import numpy as np
import pytest

from kvgen import LLM, SamplingParams
from tests.loaders.arch_fixtures import arch_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def with_mtp_layer(source, path):
    """`source` with one MTP layer: a copy of its last (full attention) layer as blk.4 plus the nextn
    tensors llama.cpp names, block_count 5 and nextn_predict_layers 1."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(path, "qwen35")
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value = 5 if field.name == "qwen35.block_count" else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    writer.add_key_value("qwen35.nextn_predict_layers", 1, gguf.GGUFValueType.UINT32)
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    hidden = tensors["token_embd.weight"].shape[1]
    tensors |= {n.replace("blk.3.", "blk.4."): w for n, w in tensors.items() if n.startswith("blk.3.")}
    tensors |= {"blk.4.nextn.eh_proj.weight": np.ones((hidden, 2 * hidden), np.float32)} | {
        f"blk.4.nextn.{n}.weight": np.ones(hidden, np.float32) for n in ("enorm", "hnorm", "shared_head_norm")}
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_mtp_layers_are_kept_beside_the_model_and_decoding_is_unchanged(tmp_path, quantization):
    plain = arch_checkpoint("qwen35").gguf
    mtp = LLM(str(with_mtp_layer(plain, tmp_path / "mtp.gguf")), quantization=quantization)
    prompt = list(range(10, 50))
    assert mtp.engine.model_config.num_layers == 4 and mtp.engine.model_config.mtp_layers == 1
    assert {"blk.4.nextn.eh_proj.weight", "blk.4.attn_q.weight"} <= set(mtp.engine.model.mtp)
    expected = LLM(str(plain), quantization=quantization).generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert mtp.generate([prompt], GREEDY)[0].outputs[0].token_ids == expected
