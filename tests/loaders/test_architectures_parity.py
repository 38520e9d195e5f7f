"""Every architecture kvgen runs, from a HF directory and from the GGUF llama.cpp's converter writes of
it, against transformers on the same weights: greedy tokens through the paged engine (fp32, the
weights dequantized), over a prompt that crosses Gemma 3's sliding window of 8."""

import pytest

from kvgen import LLM, SamplingParams
from tests.loaders.arch_fixtures import ARCHS, GGUF_ARCHS, hf_greedy
from tests.loaders.test_arch_fixtures import prompt_for

N = 16
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def kvgen_greedy(path, prompt: list[int], **options) -> list[int]:
    llm = LLM(path, quantization="none", block_size=4, num_kv_blocks=64, **options)
    out = llm.generate([prompt], GREEDY)[0]
    assert llm.engine.kv.num_used_blocks == 0
    return out.token_ids


def slow_qwen2moe(names: list[str]) -> list:
    """qwen2moe: Qwen2's 151936-token vocabulary makes transformers' reference ~30 s (test_moe_models
    covers the mixture in the default suite): slow."""
    return [pytest.param(a, marks=pytest.mark.slow) if a == "qwen2moe" else a for a in names]


@pytest.mark.parametrize("arch", slow_qwen2moe(ARCHS))
def test_hf_directory_matches_transformers(arch_ckpt, arch):
    ckpt = arch_ckpt(arch)
    prompt = prompt_for(ckpt.config["vocab_size"])
    assert kvgen_greedy(ckpt.hf_dir, prompt) == hf_greedy(ckpt.hf_dir, prompt, N)


@pytest.mark.parametrize("arch", slow_qwen2moe(GGUF_ARCHS))
def test_gguf_matches_transformers(arch_ckpt, arch):
    """The converter's GGUF read by kvgen gives the HF directory's tokens as transformers computes them
    (test_arch_fixtures checks transformers reads the GGUF back to the same tokens)."""
    ckpt = arch_ckpt(arch)
    prompt = prompt_for(ckpt.config["vocab_size"])
    assert kvgen_greedy(ckpt.gguf, prompt) == hf_greedy(ckpt.hf_dir, prompt, N)


@pytest.mark.parametrize("arch", ["gemma3", "gemma3-hf"])
def test_hybrid_cache_gives_back_windowed_blocks(arch_ckpt, arch):
    """The windowed layers' pool holds about a window per sequence however long it runs; the global
    layers' pool every token; the tokens are those of the layer-by-layer contiguous cache."""
    ckpt = arch_ckpt(arch)
    prompt = prompt_for(ckpt.config["vocab_size"])
    llm = LLM(ckpt.hf_dir, quantization="none", block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    assert llm.engine.layer_kinds[1].window == 8
    contiguous = LLM(ckpt.hf_dir, quantization="none", kv_cache="contiguous")
    llm.engine.add_request("r", prompt, GREEDY)
    peaks, tokens = [0, 0], None
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            tokens = out.outputs[0].token_ids
        for i, kind in enumerate(llm.engine.kv.kinds):
            peaks[i] = max(peaks[i], kind.num_used_blocks)
    total = len(prompt) + N
    assert peaks[0] == -(-total // 4)  # every token of the global layers
    assert peaks[1] <= -(-(8 + 8) // 4) + 2  # a window, one step's chunk and a block of slack each side
    assert llm.engine.kv.num_used_blocks == 0
    assert tokens == contiguous.generate([prompt], GREEDY)[0].token_ids
