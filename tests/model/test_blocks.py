"""Models built from blocks: every architecture is a small file found by the registry, and a layer
whose block has no fused form runs layer by layer inside the fused decode step, with the bits of a
step run layer by layer throughout."""

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar


import kvgen.architectures as architectures
from kvgen import LLM, SamplingParams
from kvgen.architectures import ARCHITECTURES, BY_GGUF_NAME, BY_HF_MODEL_TYPE
from kvgen.architectures.spec import Branch, GatedMLPSpec, LayerSpec
from kvgen.model.blocks import BLOCKS, Block
from kvgen.model.blocks.mlp import GatedMLP


def test_every_architecture_is_one_small_file_found_by_the_registry():
    assert sorted(ARCHITECTURES) == ["gemma3", "gemma4", "gpt-oss", "llama", "olmoe", "phi3", "qwen2", "qwen2moe",
                                     "qwen3", "qwen35", "qwen35moe", "qwen3moe"]
    assert BY_HF_MODEL_TYPE["mistral"].name == "llama" and BY_GGUF_NAME["gemma3"].name == "gemma3"
    for name in ARCHITECTURES:  # gpt-oss, as llama.cpp names it, in gpt_oss.py
        lines = (Path(architectures.__file__).parent / f"{name.replace('-', '_')}.py").read_text().splitlines()
        assert len(lines) <= 80, f"{name}.py has {len(lines)} lines"
    assert {"attention", "gated_mlp", "moe", "gated_attention", "gated_delta_net"} <= set(BLOCKS)


@dataclass(frozen=True)
class UnfusedMLPSpec(GatedMLPSpec):
    kind: ClassVar[str] = "test_unfused_mlp"


class UnfusedMLP(GatedMLP):
    """The gated MLP without a fused form: a block the fused step does not know."""

    kind = UnfusedMLPSpec.kind
    fused_calls = Block.fused_calls


def generate(path, fused_decode):
    llm = LLM(path, enable_prefix_caching=False, max_num_seqs=3, fused_decode=fused_decode)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    outputs = llm.generate([list(range(100, 160)), [7], list(range(5, 30))], params)
    return outputs, llm.engine.runner.model.decode_programs.fused_steps


def test_a_layer_with_a_block_the_fused_step_does_not_know_runs_layer_by_layer_inside_it(
        stories_bin, monkeypatch, caplog):
    llama = ARCHITECTURES["llama"]
    attention, mlp = llama.layer.branches
    odd = LayerSpec((attention, Branch(mlp.norm, UnfusedMLPSpec(activation="silu"))))
    monkeypatch.setitem(BLOCKS, UnfusedMLPSpec.kind, UnfusedMLP)
    monkeypatch.setitem(ARCHITECTURES, "llama", replace(llama, layer_of=lambda i, config: odd if i == 2 else
                                                        llama.layer))
    with caplog.at_level(logging.INFO, logger="kvgen.model.fused"):
        fused, steps = generate(stories_bin, fused_decode=True)
    assert steps > 20
    assert any("1 of 5 layers have a block without a fused form (test_unfused_mlp, first layer 2)" in r.message
               for r in caplog.records)
    layered, none = generate(stories_bin, fused_decode=False)
    assert none == 0
    for a, b in zip(fused, layered, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # floats compared exactly
    monkeypatch.undo()
    plain, _ = generate(stories_bin, fused_decode=True)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in fused]
