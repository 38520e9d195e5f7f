"""The fused decode step (kvgen.model.fused) against the layer-by-layer forward: the same tokens and
the same log-probabilities bit for bit, on every kind of layer it runs; and it stands aside where a
piece of the step has no kernel."""

import pytest

from kvgen import LLM, SamplingParams
from kvgen.model.kernels.bf16 import bf16_kernel
from tests.loaders.arch_fixtures import arch_checkpoint
from tests.loaders.gguf_builder import Dims, llama_vocab, q4_k_m_style_model, write_gguf
from tests.loaders.test_gemma4 import variant
from tests.support.torch_threads import torch_threads

PROMPTS = [list(range(100, 228)), list(range(300, 340)), [7], list(range(5, 70)), list(range(40, 41 + 16))]


def generate(path, prompts=PROMPTS, max_tokens=24, kv_policy="full", **options):
    """(outputs, fused steps) of one engine; prompts of several lengths form several decode groups."""
    llm = LLM(path, enable_prefix_caching=False, **options)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2, kv_policy=kv_policy)
    outputs = llm.generate(prompts, params)
    return outputs, llm.engine.runner.model.decode_programs.fused_steps


def assert_same_bits(fused, layered):
    for a, b in zip(fused, layered, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # floats compared exactly


@pytest.mark.parametrize("quantization, dtype", [("none", "float32"), ("int8", "float32"), ("int4", "float32"),
                                                 ("none", "bfloat16")])  # every kind of layer the steps run
def test_fused_steps_give_the_layered_bits_on_stories(stories_bin, quantization, dtype):
    if dtype == "bfloat16" and bf16_kernel() is None:
        pytest.skip("bf16 layers run F.linear here (no AVX-512 BF16), which has no fused call")
    options = dict(quantization=quantization, dtype=dtype, max_num_seqs=3)
    fused, steps = generate(stories_bin, **options)
    layered, none = generate(stories_bin, **options, fused_decode=False)
    assert steps > 20 and none == 0
    assert_same_bits(fused, layered)


def test_fused_steps_give_the_layered_bits_on_the_real_q4_1_file(smollm_gguf):
    fused, steps = generate(smollm_gguf, max_tokens=12)
    layered, _ = generate(smollm_gguf, max_tokens=12, fused_decode=False)
    assert steps >= 11
    assert_same_bits(fused, layered)


def test_fused_steps_keep_their_bits_on_two_threads(stories_bin):
    with torch_threads(2):
        fused, steps = generate(stories_bin, quantization="int4")
        layered, _ = generate(stories_bin, quantization="int4", fused_decode=False)
    assert steps > 20
    assert_same_bits(fused, layered)


def test_a_window_composes_with_fused_steps(stories_bin):
    fused, steps = generate(stories_bin, max_tokens=40, kv_policy="window:32")
    layered, _ = generate(stories_bin, max_tokens=40, kv_policy="window:32", fused_decode=False)
    assert steps > 20
    assert_same_bits(fused, layered)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_speculative_verify_steps_run_fused_with_the_layered_bits(stories_bin, quantization):
    """A verify chunk (a decode and its K proposed tokens) attends in place too, so every step after
    the prompts' runs from C: ngram proposals on repetitive prompts, three sequences of up to K + 1
    = 4 rows each."""
    prompts = [list(range(100, 120)) * 3, [7, 8, 9] * 12, list(range(300, 310)) * 4]
    options = dict(quantization=quantization, speculative_method="ngram", num_speculative_tokens=3,
                   adaptive_speculation=False)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    results = []
    for fused_decode in (True, False):
        engine = LLM(stories_bin, enable_prefix_caching=False, fused_decode=fused_decode, **options).engine
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        outputs, steps = [], 0
        while engine.has_unfinished():
            outputs += [o for o in engine.step() if o.finished]
            steps += 1
        results.append((sorted(outputs, key=lambda o: o.request_id), steps,
                        engine.runner.model.decode_programs.fused_steps))
    (fused, steps, fused_steps), (layered, _, none) = results
    assert fused_steps == steps - 1 and none == 0  # all but the prompts' step (96+ rows)
    assert sum(o.metrics.spec_accepted for o in fused) > 0
    assert_same_bits(fused, layered)


@pytest.mark.parametrize("options", [dict(kv_cache_dtype="int8"), dict(dtype="bfloat16", quantization="int4"),
                                     dict(attention_backend="sdpa"), dict(max_num_seqs=16)])
def test_steps_without_a_kernel_for_every_piece_run_layer_by_layer(stories_bin, options):
    prompts = [[7 + i] for i in range(16)] if "max_num_seqs" in options else PROMPTS  # 16 rows: torch's norm
    _, steps = generate(stories_bin, prompts, max_tokens=4, **options)
    assert steps == 0


def test_heavy_hitter_steps_run_layer_by_layer(stories_bin):
    _, steps = generate(stories_bin, [[7]], max_tokens=8, kv_policy="h2o:4,8")
    assert steps == 0  # h2o records attention weights, which the kernel does not


@pytest.mark.parametrize("name, quantization", [("gemma3-hybrid", "none"), ("gemma3-hybrid", "int8"),
                                                ("qwen3-qk-norm", "none"), ("phi3-fused", "int4")])
def test_fused_steps_give_the_layered_bits_on_other_architectures(hf_model, name, quantization):
    """QK-norm, GeGLU, the sandwich norms, two RoPE bases and the hybrid cache's pools (Gemma 3's
    window of 8 crossed by every prompt here) run from the call list with the layered bits."""
    path, _ = hf_model(name)
    prompts = [[(7 * i + j) % 300 + 3 for i in range(n)] for j, n in enumerate((40, 12, 3))]
    options = dict(quantization=quantization, block_size=4, num_kv_blocks=256, max_num_seqs=3)
    fused, steps = generate(path, prompts, **options)
    layered, _ = generate(path, prompts, **options, fused_decode=False)
    assert steps > 20
    assert_same_bits(fused, layered)


@pytest.mark.parametrize("source, options", [("hf", {}), ("gguf", {}), ("q8", dict(quantization="auto")),
                                             ("gguf", dict(speculative_method="suffix", num_speculative_tokens=3))])
def test_fused_steps_give_the_layered_bits_on_qwen35(source, options):
    """Qwen3.5's Gated DeltaNet layers (conv windows and states updated in place in their state slots)
    and gated attention (partial RoPE, the output gate) run from the call list with the layered bits,
    every layer of a decode step. The prompts run twice: the second time suffix decoding proposes the
    first's outputs, and a step with verify chunks runs its DeltaNet layers layer by layer."""
    ckpt = arch_checkpoint("qwen35")
    path = {"hf": ckpt.hf_dir, "gguf": ckpt.gguf, "q8": ckpt.gguf_q8}[source]
    prompts = [[(7 * i + j) % 300 + 3 for i in range(n)] for j, n in enumerate((40, 12, 3))]
    options = dict(quantization="none", max_num_seqs=3, adaptive_speculation=False) | options
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    runs = {}
    for fused_decode in (True, False):
        llm = LLM(str(path), enable_prefix_caching=False, fused_decode=fused_decode, **options)
        runs[fused_decode] = (llm.generate(prompts, params) + llm.generate(prompts, params),
                              llm.engine.runner.model.decode_programs)
    (fused, programs), (layered, none) = runs[True], runs[False]
    assert programs.fused_steps > 20 and none.fused_steps == 0
    layered_layers = {program.layered for program in programs._programs.values() if program is not None}
    delta_net_layers = len(llm.engine.runner.model.config.recurrent_layers)
    assert layered_layers == ({0, delta_net_layers} if "speculative_method" in options else {0})
    assert_same_bits(fused, layered)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """The gemma4 fixture's HF directory and Q8_0 GGUF, and a variant of it whose layers sharing K/V
    have MLPs twice as wide (E2B's use_double_wide_mlp) and whose layer scalars are not 1."""
    ckpt = arch_checkpoint("gemma4")
    wide, _ = variant(tmp_path_factory.mktemp("gemma4-wide"), ckpt.hf_dir, use_double_wide_mlp=True)
    return {"hf": ckpt.hf_dir, "gguf-q8_0": ckpt.gguf_q8, "wide-scaled": wide}


@pytest.mark.parametrize("source, options", [("hf", dict(quantization="none")), ("hf", dict(quantization="int4")),
                                             ("hf", dict(dtype="bfloat16", quantization="none")),
                                             ("gguf-q8_0", {}), ("wide-scaled", {}),
                                             ("wide-scaled", dict(dtype="bfloat16", quantization="none"))])
def test_fused_steps_give_the_layered_bits_on_gemma4(gemma4, source, options):
    """Gemma 4's layers from the call list: the last two reading an earlier layer's K/V, V normed, head
    sizes 16 and 32 (proportional RoPE on the global layers), per-layer inputs, the layer scalar."""
    if options.get("dtype") == "bfloat16" and bf16_kernel() is None:
        pytest.skip("bf16 layers run F.linear here (no AVX-512 BF16), which has no fused call")
    prompts = [[(7 * i + j) % 300 + 3 for i in range(n)] for j, n in enumerate((40, 12, 3))]
    options |= dict(block_size=4, num_kv_blocks=256, max_num_seqs=3)
    fused, steps = generate(gemma4[source], prompts, **options)
    layered, _ = generate(gemma4[source], prompts, **options, fused_decode=False)
    assert steps > 20
    assert_same_bits(fused, layered)


def test_fused_steps_give_the_layered_bits_on_the_real_gemma3_file(gemma_gguf):
    prompts = [list(range(1000, 1600)), list(range(2000, 2030))]  # the first crosses the window of 512
    fused, steps = generate(gemma_gguf, prompts, max_tokens=8, kv_cache_memory=1 << 28)
    layered, _ = generate(gemma_gguf, prompts, max_tokens=8, kv_cache_memory=1 << 28, fused_decode=False)
    assert steps >= 7
    assert_same_bits(fused, layered)


@pytest.mark.parametrize("options", [
    pytest.param(dict(quantization="auto"), id="auto"), pytest.param(dict(quantization="int8"), id="int8"),
    *(pytest.param(dict(quantization="none", dtype=dtype), id=dtype, marks=pytest.mark.slow)  # ~40 s each
      for dtype in ("float32", "bfloat16"))])
def test_fused_steps_give_the_layered_bits_on_the_real_qwen2_file(qwen_coder_gguf, options):
    """Qwen2.5-Coder-0.5B Q4_K_M: q/k/v with biases (a random checkpoint's are zeros), on the file's
    K-quant layers (v in Q6_K beside Q4_K q/k in some layers, each side's bias added to its columns),
    requantized to int8, and dequantized to the fp32 and bf16 kernels."""
    prompts = [list(range(1000, 1040)), list(range(2000, 2005))]
    fused, steps = generate(qwen_coder_gguf, prompts, max_tokens=8, **options)
    layered, _ = generate(qwen_coder_gguf, prompts, max_tokens=8, **options, fused_decode=False)
    assert steps >= 7
    assert_same_bits(fused, layered)


def test_fused_steps_run_side_by_side_k_quant_layers(tmp_path, stories_dir):
    """A Q4_K_M-style file (q/k in Q4_K, v and down in Q6_K): q/k and v run as two K-quant layers
    side by side, one call of the step writing each its columns of the q/k/v buffer."""
    vocab = llama_vocab(stories_dir)
    path = write_gguf(tmp_path / "mixed.gguf", q4_k_m_style_model(len(vocab.tokens), Dims()), vocab)
    prompts = [[1, *range(20, 60)], [1, 7]]
    fused, steps = generate(path, prompts, max_tokens=12)
    layered, _ = generate(path, prompts, max_tokens=12, fused_decode=False)
    assert steps >= 11
    assert_same_bits(fused, layered)
