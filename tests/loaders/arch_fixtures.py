"""Tiny random-weight checkpoints of real architectures, in both formats, for parity tests.

For each architecture in `ARCHS`, `arch_checkpoint(arch)` builds (once, then from the on-disk cache):

- a Hugging Face directory saved by transformers itself (`save_pretrained`, safetensors, float32),
  with a real tokenizer the GGUF converter accepts for that architecture;
- the GGUF files llama.cpp's own `convert_hf_to_gguf.py` writes from that directory (F32 and Q8_0).

`hf_greedy(path, prompt_ids, n)` is the reference: transformers' greedy decoding in float32.

The converter is taken from the llama-cpp-python source package (`pip download`), which vendors
llama.cpp: only `convert_hf_to_gguf.py`, `conversion/` and `gguf-py/` are unpacked, once, into the
cache (benchmarks.llama_tools, which the bench's 1B/3B files use too). The converter runs as a
subprocess with that vendored gguf-py first on its path (it needs a newer `gguf` than the
pip-installed one). Failing to get it is an error, never a skip.

Cache: $KVGEN_TEST_MODELS, default ~/.cache/kvgen-test-models/, one folder per fixture and
FIXTURE_VERSION (bump it when a spec changes; old folders are simply left behind).

Tokenizers (the converter must accept them; see _bpe_tokenizer_dir for why these two BPEs):
- llama, phi3, gemma3, gemma3-hf: stories260K's SentencePiece tok512.model (512 pieces) as
  tokenizer.model -> GGUF tokenizer.ggml.model "llama", pre "default";
- qwen2: Qwen2's own BPE (151936), from the converter's sdist -> "gpt2", pre "qwen2";
- qwen3, qwen35, qwen35moe: SmolLM2's BPE (49152), from the shared SmolLM2 GGUF -> "gpt2", pre "smollm";
- gemma4: tok512 as transformers' fast tokenizer saves it (tokenizer.json, a BPE with byte fallback):
  the Gemma 4 converter reads only a tokenizer.json (gguf LlamaHfVocab) -> tokenizer.ggml.model "gemma4".

What GGUF cannot say (the fixtures are chosen so that llama.cpp's reading and transformers' reading
of each GGUF agree with the HF directory, which `test_arch_fixtures.py` checks):
- Gemma 3: no `query_pre_attn_scalar` key (llama.cpp scales by 1/sqrt(head_dim), or by
  1/sqrt(hidden/heads) for the 62-layer 27B), no layer pattern (llama.cpp: every 6th layer is full),
  and transformers ignores `rope.freq_base_swa` (it takes 10000). Hence `gemma3` keeps head_dim ==
  query_pre_attn_scalar == 256, the 5:1 pattern and local theta 10000, as gemma-3-270m does;
  `gemma3-hf` exercises the rest (query_pre_attn_scalar != head_dim, another local theta, a custom
  `layer_types`) as a HF directory only (its `gguf` is None).
- Qwen 3: transformers does not read `attention.key_length` back and takes Qwen3Config's default
  head_dim 128, so the fixture's explicit head_dim is 128 (!= hidden / heads = 16).
- Qwen 3.5 (`qwen35`): the converter asserts on MTP layers unless run with `--no-mtp` (transformers'
  save_pretrained keeps none), so the fixture converts with it. transformers 5.25 has no GGUF mapping
  for qwen35: the GGUF's only reader is llama.cpp, and what it reads differs from the HF directory in
  ways a loader must undo or follow:
  * value heads are reordered from grouped (HF: value head j reads key head j // (v_heads / k_heads))
    to tiled (GGUF: key head j % k_heads) in the V rows of attn_qkv, attn_gate (z), ssm_alpha / ssm_beta
    (a, b), ssm_a, ssm_dt.bias, the V channels of ssm_conv1d and the columns of ssm_out: read the GGUF
    with `v_head_order="tiled"` (kvgen.model.gated_delta_net) or permute back;
  * ssm_a holds -exp(A_log) (the decay rate itself), ssm_dt.bias is dt_bias, ssm_conv1d is [conv_dim, 4];
  * every RMSNorm weight but ssm_norm (the gated norm, plain w) is stored as 1 + w;
  * the linear layers' shapes are ssm.group_count (key heads), ssm.state_size (key head dim),
    ssm.time_step_rank (value heads), ssm.inner_size (value heads x value head dim), ssm.conv_kernel;
    which layers are linear is attention.recurrent_layers (also full_attention_interval);
  * partial RoPE is rope.dimension_count (8 = 0.25 x key_length 32); rope.dimension_sections
    [11, 11, 10, 0] is the multimodal RoPE's split, which text positions (equal on every axis) ignore;
  * attn_q holds the query and its output gate interleaved per head, [heads x (q 32 | gate 32)], as HF.
- gpt-oss (`gpt-oss`): the converter splits transformers' interleaved gate_up_proj (and its bias) into
  ffn_gate_exps / ffn_up_exps and transposes the experts to [experts, out, in]; it writes YaRN's factor, original
  context and betas but not `truncate` (kvgen's gpt-oss reading takes it off, as the config says), nor the
  window pattern or the SwiGLU's alpha and limit (llama.cpp's constants, which the fixture keeps).
  Its experts are fp32, so the GGUF's are F32; `mxfp4_checkpoint` writes them as gpt-oss is released
  (`*_blocks` / `*_scales`, quant_method "mxfp4"), which the converter keeps MXFP4, beside a HF directory of
  the values they hold (the reference: transformers reads them so, bit for bit, tests/loaders/test_experts.py).
- Mixtures (`qwen3moe`, `olmoe`): the converter stacks the experts into ffn_{gate,up,down}_exps
  [experts, out, in] and the router into ffn_gate_inp; OLMoE's file says rms eps 1e-5 whatever the
  config did (the fixture uses 1e-5), and neither says whether the top-k weights are renormalised
  (llama.cpp fixes it per architecture: qwen3moe yes, olmoe no). transformers 5.25 cannot read these
  GGUFs back (see TRANSFORMERS_GGUF_ARCHS): the HF directory is the reference.
- Qwen3.5-MoE (`qwen35moe`): qwen35's layout plus the mixture's and shared expert's (ffn_*_shexp,
  ffn_gate_inp_shexp); no feed_forward_length. transformers loads a qwen3_5_moe_text directory's tokenizer
  as Qwen3_5Tokenizer whatever tokenizer_config.json says, which the converter recognises only with Qwen3.5's
  own vocabulary: it converts a config.json without model_type (`convert_config`; it then reads the file as
  it is, and AutoTokenizer the saved class), writing the tensors and metadata it writes for the real model.
- Gemma 4 (`gemma4`): the GGUF says the window pattern (attention.sliding_window_pattern), both head
  sizes (key_length 32 for global layers, key_length_swa 16), shared_kv_layers, per-layer input width
  and the soft-cap; the global layers' proportional partial RoPE is written as rope.dimension_count =
  the full head size plus a rope_freqs tensor whose factors 1e30 stop the unrotated pairs (0.25 of the
  pairs keep factor 1). Sharing layers hold no attn_k / attn_v / attn_k_norm (nor does the HF file).
  transformers 5.25 maps `gemma4` GGUF keys only in part: it rebuilds the config with its defaults for
  key_length_swa, the global head size and the per-layer inputs, so its reading of this file fails on
  the weights' shapes (llama.cpp is the GGUF's reference). The HF directory is the reference here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import llama_tools
from benchmarks.llama_tools import QWEN2_VOCAB

FIXTURE_VERSION = "3"

REPO = Path(__file__).resolve().parents[2]
SHARED_MODELS = REPO.parent / "shared" / "models"
SPM_512 = SHARED_MODELS / "stories260K" / "tok512.model"  # a real SentencePiece model, 512 pieces
SMOLLM2_GGUF = SHARED_MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("KVGEN_TEST_MODELS", Path.home() / ".cache" / "kvgen-test-models"))


class FixtureError(RuntimeError):
    """A fixture could not be built; the message says which step and why."""


@dataclasses.dataclass(frozen=True)
class ArchCheckpoint:
    arch: str
    hf_dir: Path  # config.json, model.safetensors (float32), tokenizer files
    gguf: Path | None  # F32 GGUF from convert_hf_to_gguf.py; None where GGUF cannot hold the config
    gguf_q8: Path | None  # the same, Q8_0
    config: dict  # config.json as saved


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    config_cls: str
    model_cls: str
    config: dict
    tokenizer: str  # "spm512": tok512.model as tokenizer.model ("spm512-json": as tokenizer.json);
    # "smollm2", "qwen2": byte-level BPEs
    gguf: bool = True
    # Weights: N(0, init_range) (transformers' init with initializer_range), then every embedding row
    # rescaled to norm emb_norm. transformers' default 0.02 makes these tiny models repeat one token
    # (or copy the last prompt token, when embeddings are tied) with top-2 logit margins ~1e-3; these
    # values were picked, per family, for greedy outputs that vary and margins well above fp32 noise.
    init_range: float = 0.5
    emb_norm: float = 4.0
    convert_flags: tuple[str, ...] = ()  # more flags for convert_hf_to_gguf.py
    convert_config: dict | None = None  # config.json as the converter reads it: these keys set (None: removed)
    bias_std: float = 0.0  # biases (transformers zeroes them) drawn N(0, bias_std), so that a dropped bias shows


# GQA everywhere: 4 query heads over 2 KV heads.
_BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
_NO_MLP = {k: v for k, v in _BASE.items() if k != "intermediate_size"}
_SPM = dict(vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # tok512: <unk> <s> </s>
_SMOL = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)  # <|im_start|> <|im_end|>
_QWEN = dict(vocab_size=151936, bos_token_id=151643, eos_token_id=151643, pad_token_id=151643)  # <|endoftext|>

SPECS: dict[str, ArchSpec] = {
    "llama": ArchSpec("LlamaConfig", "LlamaForCausalLM", _BASE | _SPM | dict(
        num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), "spm512",
        init_range=1.0),
    "qwen2": ArchSpec("Qwen2Config", "Qwen2ForCausalLM", _BASE | _QWEN | dict(
        num_hidden_layers=2, tie_word_embeddings=True,  # as Qwen2.5-0.5B; q/k/v carry biases
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), "qwen2"),
    "qwen3": ArchSpec("Qwen3Config", "Qwen3ForCausalLM", _BASE | _SMOL | dict(
        num_hidden_layers=2, head_dim=128, tie_word_embeddings=True,  # q/k norms, no biases
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), "smollm2"),
    "phi3": ArchSpec("Phi3Config", "Phi3ForCausalLM", _BASE | _SPM | dict(
        num_hidden_layers=2, original_max_position_embeddings=512,  # fused qkv_proj, gate_up_proj
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}),
        "spm512", init_range=0.2, emb_norm=0.2 * 8),
    "gemma3": ArchSpec("Gemma3TextConfig", "Gemma3ForCausalLM", _BASE | _SPM | dict(
        num_hidden_layers=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=8,
        tie_word_embeddings=True,
        layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}), "spm512",
        init_range=1.0, emb_norm=0.5),  # Gemma multiplies embeddings by sqrt(hidden) and ties them: larger ones get copied
    "gemma3-hf": ArchSpec("Gemma3TextConfig", "Gemma3ForCausalLM", _BASE | _SPM | dict(
        num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=48, sliding_window=8,
        tie_word_embeddings=True, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                     "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}), "spm512",
        gguf=False, init_range=0.2, emb_norm=0.25),
    # Qwen3.5 dense: 4 layers, the 4th full (gated) attention, the others Gated DeltaNet with 2 key heads
    # of 16 serving 4 value heads of 16 (2 each, so the converter's V-head reordering shows), conv 4.
    "qwen35": ArchSpec("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _BASE | _SMOL | dict(
        num_hidden_layers=4, head_dim=32, tie_word_embeddings=True,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_interleaved": True, "mrope_section": [11, 11, 10]}), "smollm2",
        convert_flags=("--no-mtp",)),
    # Gemma 4 text: 6 layers, the last 2 reading the K/V of the last earlier layer of their kind
    # (num_kv_shared_layers), window layers of head_dim 16 and global ones of 32 (proportional partial
    # RoPE), per-layer embeddings of 8, final soft-capping.
    "gemma4": ArchSpec("Gemma4TextConfig", "Gemma4ForCausalLM", _BASE | _SPM | dict(
        num_hidden_layers=6, head_dim=16, global_head_dim=32, sliding_window=8, tie_word_embeddings=True,
        num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
        final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}}), "spm512-json",
        init_range=1.0, emb_norm=0.5),
    # Mixtures of experts (issue 43): 8 experts of 32, every layer routed (no dense MLP layers).
    # Qwen3-MoE: top-2 with renormalised weights, QK-norm per head (head_dim 128 as qwen3's, for the same reason).
    "qwen3moe": ArchSpec("Qwen3MoeConfig", "Qwen3MoeForCausalLM", _BASE | _SMOL | dict(
        num_hidden_layers=2, head_dim=128, tie_word_embeddings=True, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), "smollm2"),
    # OLMoE: top-4, weights not renormalised, QK-norm over the whole q and k projections; eps 1e-5, which
    # the converter writes whatever the config says.
    "olmoe": ArchSpec("OlmoeConfig", "OlmoeForCausalLM", _BASE | _SMOL | dict(
        num_hidden_layers=2, intermediate_size=32, rms_norm_eps=1e-5, num_experts=8, num_experts_per_tok=4, norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), "smollm2"),
    # Qwen3.5-MoE: qwen35's layers with Qwen2-MoE's mixture for the MLP (top-2 of 8 experts of 32, always
    # renormalised; a gated shared expert of 64) and, as its configs, no intermediate_size. At init 0.5 two
    # logits of a ragged-batch prompt tie within 1e-5 (transformers' generate and forward disagree); 0.3: >= 0.018.
    "qwen35moe": ArchSpec("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", _NO_MLP | _SMOL | dict(
        num_hidden_layers=4, head_dim=32, tie_word_embeddings=True,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_interleaved": True, "mrope_section": [11, 11, 10]}), "smollm2",
        init_range=0.3, convert_flags=("--no-mtp",), convert_config={"model_type": None}),
    # Qwen2-MoE: q/k/v biases, top-2 of 8 experts not renormalised, and a shared expert of 64 behind a
    # sigmoid gate (the shape Qwen3.5-MoE's layers have too).
    "qwen2moe": ArchSpec("Qwen2MoeConfig", "Qwen2MoeForCausalLM", _BASE | _QWEN | dict(
        num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), "qwen2"),
    # gpt-oss: 4 layers, even ones sliding a window of 128 (as the real model's), YaRN RoPE (factor 32, untruncated
    # correction range), q/k/v/o biases and a sink logit per head; top-4 of 8 experts of 32 with biases and the clamped
    # SwiGLU, a router with a bias. Its experts saved by transformers in its fused layout (gate_up_proj [experts,
    # hidden, 2 * inner], gate and up interleaved), in fp32, so the converter writes them F32 (MXFP4 only comes
    # from an MXFP4 checkpoint).
    "gpt-oss": ArchSpec("GptOssConfig", "GptOssForCausalLM", _BASE | _SMOL | dict(
        num_hidden_layers=4, head_dim=16, intermediate_size=32, rms_norm_eps=1e-5, num_local_experts=8,
        num_experts_per_tok=4, sliding_window=128, attention_bias=True,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}),
        "smollm2", bias_std=0.5),
}
ARCHS = list(SPECS)
GGUF_ARCHS = [a for a in ARCHS if SPECS[a].gguf]
# GGUFs transformers 5.25 reads back into the same model. Not: qwen35 and qwen35moe (no GGUF mapping), gemma4
# (read with its config defaults for what it does not map: head sizes 256/512, per-layer inputs of 256,
# so the weights do not fit), the mixtures (a qwen3moe GGUF read without expert_feed_forward_length, its
# default 768 not fitting the experts; no olmoe or qwen2moe mapping).
TRANSFORMERS_GGUF_ARCHS = ["llama", "qwen2", "qwen3", "phi3", "gemma3"]


def _log(msg: str) -> None:
    print(f"[arch_fixtures] {msg}", file=sys.stderr, flush=True)


# -- the converter ---------------------------------------------------------------------------------

def converter_dir() -> Path:
    """llama.cpp's convert_hf_to_gguf.py with conversion/ and gguf-py/ beside it, in this cache."""
    try:
        return llama_tools.converter_dir(cache_root())
    except llama_tools.ToolError as e:
        raise FixtureError(str(e)) from None


def convert(arch: str, hf_dir: Path, out: Path, outtype: str, flags: tuple[str, ...] | None = None) -> Path:
    """Runs convert_hf_to_gguf.py with `flags` (the spec's by default) on `hf_dir` or, where the spec edits
    the config the converter reads (`convert_config`), on a sibling folder of links to its files beside the
    edited config.json; raises FixtureError with its output on failure."""
    spec, source = SPECS[arch], out.parent / f".{out.stem}-source"
    shutil.rmtree(source, ignore_errors=True)
    try:
        if spec.convert_config is not None:
            shutil.copytree(hf_dir, source, copy_function=os.symlink, ignore=shutil.ignore_patterns("config.json"))
            config = json.loads((hf_dir / "config.json").read_text()) | spec.convert_config
            (source / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
        return llama_tools.convert(source if source.exists() else hf_dir, out, outtype, cache_root(),
                                   spec.convert_flags if flags is None else flags)
    except llama_tools.ToolError as e:
        raise FixtureError(str(e)) from None
    finally:
        shutil.rmtree(source, ignore_errors=True)


# -- tokenizers ------------------------------------------------------------------------------------

def _bpe_tokenizer_dir(kind: str) -> Path:
    """A real byte-level BPE tokenizer as transformers rebuilds it from a GGUF and saves it, cached:
    - "smollm2": SmolLM2's (49152 tokens), from the shared SmolLM2 GGUF; llama.cpp's converter
      recognises its pre-tokenizer as 'smollm' when transformers loads it as TokenizersBackend;
    - "qwen2": Qwen2's (151936 tokens), from llama.cpp's ggml-vocab-qwen2.gguf; transformers 5
      always loads a model_type=qwen2 directory's tokenizer as Qwen2Tokenizer, whose output the
      converter only recognises ('qwen2') with Qwen's own vocabulary."""
    source = SMOLLM2_GGUF if kind == "smollm2" else converter_dir() / QWEN2_VOCAB
    try:
        return llama_tools.gguf_tokenizer_dir(source, _mkdir(cache_root() / "tokenizers") / kind)
    except llama_tools.ToolError as e:
        raise FixtureError(str(e)) from None


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _write_tokenizer(kind: str, path: Path) -> None:
    if kind == "spm512":
        if not SPM_512.is_file():
            raise FixtureError(f"{SPM_512} is missing")
        shutil.copy(SPM_512, path / "tokenizer.model")
        (path / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "legacy": False}, indent=1))
    elif kind == "spm512-json":  # the same pieces as transformers' fast tokenizer: a tokenizer.json
        from transformers import AutoTokenizer

        _write_tokenizer("spm512", path)
        tok = AutoTokenizer.from_pretrained(path)
        (path / "tokenizer.model").unlink()
        tok.save_pretrained(path)
        (path / "chat_template.jinja").unlink(missing_ok=True)
    elif kind in ("smollm2", "qwen2"):
        for f in _bpe_tokenizer_dir(kind).iterdir():
            shutil.copy(f, path / f.name)
    else:
        raise ValueError(kind)


# -- checkpoints -----------------------------------------------------------------------------------

def build_hf(arch: str, path: Path) -> dict:
    """Saves the seeded random-weight model of `arch` to `path` (float32 safetensors + tokenizer)."""
    import torch
    import transformers

    spec = SPECS[arch]
    torch.manual_seed(0)
    config = getattr(transformers, spec.config_cls)(**(spec.config | {"initializer_range": spec.init_range}))
    model = getattr(transformers, spec.model_cls)(config).to(torch.float32).eval()
    with torch.no_grad():
        emb = model.get_input_embeddings().weight  # the padding row stays zero
        emb.copy_(emb / emb.norm(dim=1, keepdim=True).clamp_min(1e-12) * spec.emb_norm)
        for name, p in model.named_parameters():  # norm weights off their init (1 or, for Gemma, 0)
            if "norm" in name:  # so that a wrong norm convention (w vs 1 + w) shows in the tokens
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("bias") and spec.bias_std:
                p.add_(torch.randn_like(p) * spec.bias_std)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(spec.tokenizer, path)
    return json.loads((path / "config.json").read_text())


def fixture_dir(arch: str) -> Path:
    return cache_root() / f"{arch}-v{FIXTURE_VERSION}"


def arch_checkpoint(arch: str) -> ArchCheckpoint:
    """The fixture of `arch` (one of ARCHS), built on first use and cached on disk."""
    if arch not in SPECS:
        raise ValueError(f"unknown arch {arch!r}; known: {ARCHS}")
    spec, root = SPECS[arch], fixture_dir(arch)
    gguf = root / f"{arch}-f32.gguf" if spec.gguf else None
    if not _built(root, gguf):
        with llama_tools.file_lock(cache_root() / f".{arch}.lock"):
            if not _built(root, gguf):
                _build(arch, spec, root)
    q8 = root / f"{arch}-q8_0.gguf" if spec.gguf else None
    return ArchCheckpoint(arch, root / "hf", gguf, q8, json.loads((root / "hf" / "config.json").read_text()))


def _built(root: Path, gguf: Path | None) -> bool:
    """Done, with the GGUF the spec asks for (a spec that once had none left a fixture without it)."""
    return (root / "DONE").is_file() and (gguf is None or gguf.is_file())


def _build(arch: str, spec: ArchSpec, root: Path) -> None:
    if root.exists():
        shutil.rmtree(root)
    tmp = Path(tempfile.mkdtemp(dir=_mkdir(cache_root()), prefix=f".{arch}-"))
    try:
        timing = {}
        t = time.perf_counter()
        build_hf(arch, tmp / "hf")
        timing["build_hf_s"] = round(time.perf_counter() - t, 2)
        if spec.gguf:
            for outtype in ("f32", "q8_0"):
                t = time.perf_counter()
                convert(arch, tmp / "hf", tmp / f"{arch}-{outtype}.gguf", outtype)
                timing[f"convert_{outtype}_s"] = round(time.perf_counter() - t, 2)
        (tmp / "DONE").write_text(json.dumps(timing))
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the fixture from other users of the cache
        tmp.rename(root)
        _log(f"built {arch} in {root}: {timing}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def with_context(arch: str, max_positions: int) -> ArchCheckpoint:
    """The fixture of `arch` with max_position_embeddings raised to `max_positions` (the same weights:
    RoPE is computed, not stored, so it is the same model), for prompts past the fixtures' 512
    positions: the HF directory and its F32 GGUF (no Q8_0), built once and cached like the others."""
    base, root = arch_checkpoint(arch), cache_root() / f"{arch}-ctx{max_positions}-v{FIXTURE_VERSION}"
    if not (root / "DONE").is_file():
        with llama_tools.file_lock(cache_root() / f".{arch}-ctx{max_positions}.lock"):
            if not (root / "DONE").is_file():
                tmp = Path(tempfile.mkdtemp(dir=cache_root(), prefix=f".{arch}-ctx-"))
                try:
                    shutil.copytree(base.hf_dir, tmp / "hf")
                    config = json.loads((tmp / "hf" / "config.json").read_text()) | {
                        "max_position_embeddings": max_positions}
                    (tmp / "hf" / "config.json").write_text(json.dumps(config, indent=2))
                    convert(arch, tmp / "hf", tmp / f"{arch}-f32.gguf", "f32")
                    (tmp / "DONE").write_text("{}")
                    tmp.chmod(0o755)
                    shutil.rmtree(root, ignore_errors=True)
                    tmp.rename(root)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    return ArchCheckpoint(arch, root / "hf", root / f"{arch}-f32.gguf", None,
                          json.loads((root / "hf" / "config.json").read_text()))


def to_mxfp4(w):
    """w fp32 [..., K] (K a multiple of 32) -> (blocks uint8 [..., K / 32, 16], scales uint8 [..., K / 32],
    values fp32 [..., K]) in gpt-oss's layout: per 32 values an e8m0 exponent (bias 127) and 4-bit e2m1
    codes, value 2j in the low nibble of byte j, 2j + 1 in the high one; `values` are what they hold."""
    import torch

    from kvgen.loaders.experts import E2M1

    groups = w.reshape(*w.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0))  # max |w| / 2^e <= 6
    scaled = groups / torch.exp2(exponent)[..., None]
    table = torch.tensor(E2M1)
    codes = (scaled[..., None] - table).abs().argmin(-1).to(torch.uint8)  # nearest value ([..., G, 32])
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    values = (table[codes.long()] * torch.exp2(exponent)[..., None]).reshape(w.shape)
    return blocks, (exponent + 127).to(torch.uint8), values


def mxfp4_checkpoint(arch: str = "gpt-oss") -> tuple[Path, Path, Path]:
    """gpt-oss's fixture with its experts in MXFP4, as gpt-oss is released: (a HF directory holding them as
    gpt-oss's `*_blocks` / `*_scales` under quant_method "mxfp4"; the F32 GGUF llama.cpp's converter writes
    of it, experts MXFP4; a HF directory of the values those experts hold, fp32: the reference)."""
    root = cache_root() / f"{arch}-mxfp4-v{FIXTURE_VERSION}"
    hf, gguf, reference = root / "hf-mxfp4", root / f"{arch}-mxfp4.gguf", root / "hf-dequantized"
    if not (root / "DONE").is_file():
        with llama_tools.file_lock(cache_root() / f".{arch}-mxfp4.lock"):
            if not (root / "DONE").is_file():
                tmp = Path(tempfile.mkdtemp(dir=cache_root(), prefix=f".{arch}-mxfp4-"))
                try:
                    _build_mxfp4(arch, tmp)
                    tmp.chmod(0o755)
                    shutil.rmtree(root, ignore_errors=True)
                    tmp.rename(root)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    return hf, gguf, reference


def _build_mxfp4(arch: str, out: Path) -> None:
    """The MXFP4 directory, its GGUF and the dequantized reference of `mxfp4_checkpoint`, in `out`."""
    from safetensors.torch import load_file, save_file

    base = arch_checkpoint(arch).hf_dir
    weights, packed = load_file(base / "model.safetensors"), {}
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales, values = to_mxfp4(weights[name].transpose(1, 2).contiguous())  # [experts, out, in]
        packed |= {name + "_blocks": blocks, name + "_scales": scales}
        weights[name] = values.transpose(1, 2).contiguous()  # what the blocks hold, in transformers' layout
    for folder, tensors, extra in (("hf-dequantized", weights, {}),
                                   ("hf-mxfp4", {n: w for n, w in weights.items() if not n.endswith("_proj")} | packed,
                                    {"quantization_config": {"quant_method": "mxfp4"}})):
        shutil.copytree(base, out / folder, ignore=shutil.ignore_patterns("model.safetensors"))
        save_file(tensors, out / folder / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((base / "config.json").read_text()) | extra
        (out / folder / "config.json").write_text(json.dumps(config, indent=2))
    convert(arch, out / "hf-mxfp4", out / f"{arch}-mxfp4.gguf", "f32")
    (out / "DONE").write_text("{}")


def mtp_checkpoint(arch: str = "qwen35") -> ArchCheckpoint:
    """`arch`'s fixture with one multi-token-prediction layer, as Qwen3.5 checkpoints carry: HF's
    `mtp.*` tensors (`fc` over [embedding | hidden], the two pre-fc norms, a full-attention decoder
    layer and a final norm), seeded random like the rest, `mtp_num_hidden_layers` 1 in config.json,
    and the F32 GGUF the converter writes of it with its `blk.N.nextn.*` layer (no `--no-mtp`).
    transformers reads the directory and ignores `mtp.*`."""
    root = cache_root() / f"{arch}-mtp-v{FIXTURE_VERSION}"
    if not (root / "DONE").is_file():
        with llama_tools.file_lock(cache_root() / f".{arch}-mtp.lock"):
            if not (root / "DONE").is_file():
                tmp = Path(tempfile.mkdtemp(dir=cache_root(), prefix=f".{arch}-mtp-"))
                try:
                    _build_mtp(arch, tmp)
                    tmp.chmod(0o755)
                    shutil.rmtree(root, ignore_errors=True)
                    tmp.rename(root)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    return ArchCheckpoint(arch, root / "hf", root / f"{arch}-mtp-f32.gguf", None,
                          json.loads((root / "hf" / "config.json").read_text()))


def _build_mtp(arch: str, out: Path) -> None:
    """The directory and GGUF of `mtp_checkpoint` in `out`: the MTP layer is a copy of the names of
    the base's first full-attention layer, with fresh N(0, init_range) matrices and norms off 0."""
    import torch
    from safetensors.torch import load_file, save_file

    base, spec = arch_checkpoint(arch), SPECS[arch]
    weights = load_file(base.hf_dir / "model.safetensors")
    full = base.config["layer_types"].index("full_attention")
    hidden = base.config["hidden_size"]
    generator = torch.Generator().manual_seed(1)
    layer = f"model.layers.{full}."
    shapes = {"mtp.layers.0." + n.removeprefix(layer): w.shape for n, w in weights.items() if n.startswith(layer)} | {
        "mtp.fc.weight": (hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": (hidden,),
        "mtp.pre_fc_norm_hidden.weight": (hidden,), "mtp.norm.weight": (hidden,)}
    for name, shape in shapes.items():  # norms are stored as w (the norm multiplies by 1 + w)
        scale = 0.1 if "norm" in name else spec.init_range
        weights[name] = torch.randn(shape, generator=generator) * scale
    shutil.copytree(base.hf_dir, out / "hf", ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(weights, out / "hf" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((base.hf_dir / "config.json").read_text()) | {"mtp_num_hidden_layers": 1}
    (out / "hf" / "config.json").write_text(json.dumps(config, indent=2))
    convert(arch, out / "hf", out / f"{arch}-mtp-f32.gguf", "f32", tuple(f for f in spec.convert_flags if f != "--no-mtp"))
    (out / "DONE").write_text("{}")


def build_timing(arch: str) -> dict:
    return json.loads((fixture_dir(arch) / "DONE").read_text())


# -- the reference ---------------------------------------------------------------------------------

_MODELS: dict[tuple[str, str | None], object] = {}


def load_hf_model(path: Path | str):
    """transformers' float32 model from a HF directory or a .gguf file (dequantized), memoized."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    key = (str(path.parent), path.name) if path.suffix == ".gguf" else (str(path), None)
    if key not in _MODELS:
        if key[1] is None:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        _MODELS[key] = model.eval()
    return _MODELS[key]


def hf_greedy(path: Path | str, prompt_ids: list[int], n: int) -> list[int]:
    """The `n` tokens transformers' greedy decoding (do_sample=False, float32) appends to `prompt_ids`,
    from a HF directory or a .gguf file. EOS does not stop it: always exactly n tokens."""
    import torch
    from transformers import GenerationConfig

    model = load_hf_model(path)
    config = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=0, eos_token_id=None,
                              pad_token_id=0, bos_token_id=None)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             generation_config=config)
    new = out[0, len(prompt_ids):].tolist()
    if len(new) != n:
        raise FixtureError(f"transformers generated {len(new)} tokens, not {n}")
    return new


def hf_logits(path: Path | str, ids: list[int]):
    """transformers' float32 logits for every position of `ids`: shape (len(ids), vocab)."""
    import torch

    with torch.no_grad():
        return load_hf_model(path)(torch.tensor([ids])).logits[0]
