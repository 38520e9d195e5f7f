"""Mixtures of experts (Qwen3-MoE, OLMoE, Qwen2-MoE and Qwen3.5-MoE with their shared experts, the latter
between Gated DeltaNet layers, and gpt-oss: attention sinks, windows of 128 alternating with full layers,
YaRN, biased experts with the clamped SwiGLU) from a HF directory and from the GGUF llama.cpp's converter writes of it,
against transformers on the same weights: greedy fp32 tokens through the paged engine over a 300-token
prompt, alone and in a ragged batch of 6; prefix caching and ngram speculation give the plain engine's
tokens; every KV block and state slot is given back."""

import pytest

from kvgen import LLM, SamplingParams
from tests.loaders.arch_fixtures import hf_greedy

# qwen2moe's fixture has Qwen2's 151936-token vocabulary: ~40 s a test, so slow.
# qwen35moe: slow here (~15 s a test: transformers' delta-net in torch); its 40-token parity, HF and GGUF, is in
# test_architectures_parity.
MOE_ARCHS = ["qwen3moe", "olmoe", "gpt-oss", pytest.param("qwen35moe", marks=pytest.mark.slow),
             pytest.param("qwen2moe", marks=pytest.mark.slow)]
N = 32
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def long_prompt(length: int = 300, seed: int = 0) -> list[int]:
    """Ids past the specials, varied enough that the router spreads tokens over every expert."""
    return [3 + (i * 37 + 11 * seed + 5) % 997 for i in range(length)]


def ragged_prompts() -> list[list[int]]:
    return [long_prompt(length, seed) for seed, length in enumerate((300, 17, 120, 1, 64, 233))]


def kvgen_llm(path, **options) -> LLM:
    return LLM(path, quantization="none", block_size=16, num_kv_blocks=256, **options)


def tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    out = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert llm.engine.kv.num_used_blocks == 0
    assert llm.engine.recurrent is None or llm.engine.recurrent.pool.num_used == 0  # qwen35moe's state slots
    return out


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_hf_and_gguf_match_transformers_at_batch_1(arch_ckpt, arch):
    ckpt = arch_ckpt(arch)
    prompt = long_prompt()
    want = hf_greedy(ckpt.hf_dir, prompt, N)
    for path in (ckpt.hf_dir, ckpt.gguf):
        assert tokens(kvgen_llm(path), [prompt]) == [want], path


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_ragged_batch_matches_transformers(arch_ckpt, arch):
    """Six prompts of 1 to 300 tokens at once (chunked prefill beside decodes, tokens of every
    sequence routed together), from the GGUF: each sequence gets transformers' tokens."""
    ckpt = arch_ckpt(arch)
    prompts = ragged_prompts()
    want = [hf_greedy(ckpt.hf_dir, p, N) for p in prompts]
    assert tokens(kvgen_llm(ckpt.gguf, max_num_batched_tokens=128), prompts) == want


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_prefix_caching_and_ngram_speculation_give_plain_tokens(arch_ckpt, arch):
    """A shared prefix of 280 tokens: 272 in cached blocks, 256 for qwen35moe, whose hit also needs the
    delta-net state, snapshot every 256 tokens."""
    ckpt = arch_ckpt(arch)
    prompts = [long_prompt(), long_prompt()[:280] + long_prompt(50, seed=3)]
    plain = tokens(kvgen_llm(ckpt.hf_dir, enable_prefix_caching=False), prompts)
    cached = kvgen_llm(ckpt.hf_dir)
    assert [tokens(cached, [p])[0] for p in prompts] == plain  # one after the other: the second hits the first's blocks
    assert cached.engine.kv.prefix_hits >= 256
    speculative = kvgen_llm(ckpt.hf_dir, speculative_method="ngram", num_speculative_tokens=3)
    assert tokens(speculative, prompts) == plain


@pytest.mark.slow  # ~4 s each; the fused step's bits are the layered ones by construction (tests/model/test_fused.py)
@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe"])  # qwen2moe's biases and shared expert run layer by layer
def test_fused_decode_steps_give_the_layered_tokens(arch_ckpt, arch):
    """Decode steps run the router and the expert kernel from the fused call list (fp32), with the
    layer-by-layer forward's tokens; the packed Q8_0 experts likewise."""
    ckpt = arch_ckpt(arch)
    prompts = ragged_prompts()[:3]
    for path, quantization in ((ckpt.hf_dir, "none"), (ckpt.gguf_q8, "auto")):
        fused = LLM(path, quantization=quantization, block_size=16, num_kv_blocks=256)
        layered = LLM(path, quantization=quantization, block_size=16, num_kv_blocks=256, fused_decode=False)
        assert tokens(fused, prompts) == tokens(layered, prompts)
        model = fused.engine.runner.model
        assert model.decode_programs.fused_steps > 0 and all(layer.fuses() for layer in model.layers)
        packed = model.layers[0].blocks[1].experts.gate_up.kernel.startswith("moe packed")
        assert packed == (quantization == "auto")


def test_int4_packs_a_q8_files_experts_and_keeps_its_router_in_floats(arch_ckpt):
    """`--quantization int4` on a Q8_0 file: its experts in 4 bits like its dense matrices, its router
    in floats (its logits pick the experts); the engine runs and gives every block back."""
    llm = LLM(arch_ckpt("qwen3moe").gguf_q8, quantization="int4", block_size=16, num_kv_blocks=256)
    report = llm.engine.model.kernels()
    assert report["experts"][0] == "moe packed u4 g32" and report["qkv"][0].startswith("qmatmul_u4")
    assert not report["router"][0].startswith("qmatmul"), report["router"]
    assert all(len(t) == N for t in tokens(llm, ragged_prompts()[:3]))


@pytest.mark.parametrize("options", [dict(kv_cache="contiguous"), dict(kv_cache="none"),
                                     dict(attention_backend="sdpa", block_size=16, num_kv_blocks=256)],
                         ids=["contiguous", "no-cache", "paged-sdpa"])
def test_gpt_oss_sinks_in_every_attention_path(arch_ckpt, options):
    """The paged engine's C kernels are the tests above; the sink logits through SDPA give the same tokens
    in the contiguous and no-cache engines and the paged engine without the kernels (300 tokens, batch 1)."""
    ckpt = arch_ckpt("gpt-oss")
    prompt = long_prompt()
    llm = LLM(ckpt.hf_dir, quantization="none", **options)
    assert [o.token_ids for o in llm.generate([prompt], GREEDY)] == [hf_greedy(ckpt.hf_dir, prompt, N)]


@pytest.mark.slow  # ~10 s the first time (its fixture), ~4 s after; MXFP4's values: tests/loaders/test_experts.py
def test_gpt_oss_mxfp4_matches_transformers_on_its_values():
    """gpt-oss's experts as released, MXFP4, in its HF directory and through llama.cpp's converter: read
    without quantization, both give transformers' tokens on the values the blocks hold (300 tokens, batch
    1); kept packed, the GGUF's experts run the packed e2m1 kernel (int8 activations: not these tokens,
    tests/model/test_moe_kernel.py)."""
    from tests.loaders.arch_fixtures import FixtureError, mxfp4_checkpoint

    try:
        hf, gguf, reference = mxfp4_checkpoint()
    except FixtureError as e:
        pytest.fail(str(e), pytrace=False)
    prompt = long_prompt()
    want = hf_greedy(reference, prompt, N)
    for path in (hf, gguf):
        assert tokens(kvgen_llm(path), [prompt]) == [want], path
    packed = LLM(gguf, quantization="auto", block_size=16, num_kv_blocks=256)
    assert packed.engine.runner.model.layers[0].blocks[1].experts.gate_up.kernel == "moe packed e2m1 g32"
