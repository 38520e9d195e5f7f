"""The KV pools' default dtype (kvgen/cache/kv_dtype.py): 16-bit where the weights are packed, the
model's dtype elsewhere (fp32 for the parity settings), an explicit --kv-cache-dtype always kept."""

import pytest

from kvgen.cache.kv_dtype import default_kv_dtype, resolve_kv_dtype
from kvgen.config import EngineConfig
from kvgen.engine.llm_engine import LLMEngine
from kvgen.loaders import load_model
from kvgen.sampling_params import SamplingParams
from tests.engine.test_continuous_batching import run_all


@pytest.fixture(scope="module")
def stories(stories_bin):
    return load_model(stories_bin)


@pytest.fixture(scope="module")
def smollm_packed(smollm_gguf):
    from kvgen.llm import load

    return load(smollm_gguf, EngineConfig())


@pytest.fixture(scope="module")
def smollm_float(smollm_gguf):
    from kvgen.llm import load

    return load(smollm_gguf, EngineConfig(quantization="none"))


def test_packed_gguf_weights_get_a_bf16_pool(smollm_packed):
    assert smollm_packed.quantized
    assert default_kv_dtype(smollm_packed, EngineConfig()) == "bfloat16"
    eng = LLMEngine(smollm_packed, EngineConfig(num_kv_blocks=8))
    assert eng.config.kv_dtype == "bfloat16" and eng.kv_plan.kv_dtype == "bfloat16"
    assert eng.bytes_per_token == 30 * 3 * 64 * 2 * 2  # SmolLM2-135M: 30 layers, 3 KV heads of 64, K and V


def test_fp32_models_keep_fp32_pools_for_parity(stories, smollm_float):
    assert default_kv_dtype(stories, EngineConfig()) == "float32"  # a llama2.c checkpoint, fp32
    assert default_kv_dtype(smollm_float, EngineConfig(quantization="none")) == "float32"
    eng = LLMEngine(smollm_float, EngineConfig(quantization="none", num_kv_blocks=8))
    assert eng.config.kv_dtype == "float32"


def test_the_parity_fixture_runs_on_fp32_kv(smollm_llm):
    assert smollm_llm.engine.config.kv_dtype == "float32"


def test_int_packed_floats_half_precision_models_and_overrides(stories):
    assert default_kv_dtype(stories, EngineConfig(quantization="int4")) == "bfloat16"
    assert default_kv_dtype(stories, EngineConfig(quantization="int8")) == "bfloat16"
    assert default_kv_dtype(stories, EngineConfig(dtype="bfloat16")) == "bfloat16"
    assert default_kv_dtype(stories, EngineConfig(dtype="float16")) == "float16"
    assert default_kv_dtype(stories, EngineConfig(device="cuda", quantization="int4")) == "float32"
    for explicit in ("float32", "float16", "int8", "fp8"):
        config = EngineConfig(quantization="int4", kv_cache_dtype=explicit)
        assert resolve_kv_dtype(stories, config) is config
    contiguous = EngineConfig(kv_cache="contiguous", quantization="int4")
    assert resolve_kv_dtype(stories, contiguous) is contiguous  # K/V in the model's dtype, "auto" kept


def test_packed_default_generates(smollm_packed):
    """bf16 pools on the packed file: the fused step and the kernel run, and the greedy text starts as
    fp32 pools' does."""
    params = SamplingParams(temperature=0, max_tokens=16)
    out = {kv: run_all(LLMEngine(smollm_packed, EngineConfig(num_kv_blocks=32, kv_cache_dtype=kv)),
                       [("The capital of France is", params)])[0] for kv in ("auto", "float32")}
    assert out["auto"][:4] == out["float32"][:4]
