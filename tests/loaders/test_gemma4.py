"""Gemma 4 (text) through the paged engine, against transformers (fp32, greedy) on the random fixture:
6 layers, windows of 8, head sizes 16 (window) and 32 (global, proportional RoPE), the last 2 layers
reading the K/V of an earlier one, per-layer inputs, soft-capped logits. From the HF directory and from
llama.cpp's GGUF of it: prompts of 10, 200 and 700 tokens (past the window and the 64-token chunk), 32
new tokens, chunked prefill on and off, one at a time and as a ragged batch of six. The engine's cache
features give the plain run's tokens, and the sharing layers hold no blocks."""

import json
import logging

import pytest

from kvgen import LLM, SamplingParams
from kvgen.cache.shared_kv import SharedKVShape
from kvgen.cache.sizing import plan_kv
from kvgen.config import EngineConfig, ModelConfig
from kvgen.errors import ModelLoadError
from tests.cache.test_shared_kv import E2B
from tests.loaders.arch_fixtures import FixtureError, hf_greedy, with_context

N = 32
LENGTHS = (10, 200, 700)
RAGGED = (10, 200, 700, 37, 123, 451)
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def prompt(length: int, seed: int = 0) -> list[int]:
    """`length` ids of the fixture's 512, past its specials."""
    return [3 + (i * 37 + 11 * seed + 5) % 500 for i in range(length)]


@pytest.fixture(scope="module")
def ckpt():
    """The gemma4 fixture with 1024 positions (its own 512 end before a 700-token prompt's answer)."""
    try:
        return with_context("gemma4", 1024)
    except FixtureError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="module")
def reference(ckpt):
    """prompt -> transformers' 32 greedy tokens from the HF directory, each computed once."""
    memo: dict[tuple[int, ...], list[int]] = {}

    def tokens(ids: list[int]) -> list[int]:
        if tuple(ids) not in memo:
            memo[tuple(ids)] = hf_greedy(ckpt.hf_dir, ids, N)
        return memo[tuple(ids)]

    return tokens


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate(prompts, params)
    assert llm.engine.kv.num_used_blocks == 0
    llm.engine.kv.check_invariants()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("chunk", [64, 2048], ids=["chunked", "whole"])
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_paged_engine_gives_transformers_tokens(ckpt, reference, source, chunk):
    llm = LLM(ckpt.hf_dir if source == "hf" else ckpt.gguf, quantization="none", block_size=16,
              max_num_batched_tokens=chunk)
    for length in LENGTHS:
        assert generate(llm, [prompt(length)]) == [reference(prompt(length))], length
    ragged = [prompt(length, seed) for seed, length in enumerate(RAGGED)]
    assert generate(llm, ragged) == [reference(p) for p in ragged]


@pytest.fixture(scope="module")
def plain(ckpt):
    """Prompts sharing a 96-token start, and their tokens through the plain engine (no prefix cache)."""
    system = prompt(96, 7)
    prompts = [system + prompt(n, seed) for seed, n in enumerate((60, 21, 140))]
    llm = LLM(ckpt.hf_dir, quantization="none", block_size=4, num_kv_blocks=256, enable_prefix_caching=False)
    return prompts, generate(llm, prompts)


def test_sharing_layers_hold_no_blocks_and_prefix_hits_give_the_plain_tokens(ckpt, plain):
    prompts, tokens = plain
    llm = LLM(ckpt.hf_dir, quantization="none", block_size=4, num_kv_blocks=256, max_num_batched_tokens=32)
    holders = [list(kind.layers) for kind in llm.engine.runner.kinds]
    assert sorted(sum(holders, [])) == [0, 1, 2, 3]  # layers 4 and 5 read 3's and 2's K/V
    assert [len(kind.cache.k) for kind in llm.engine.runner.kinds] == [1, 3]
    assert llm.engine.kv_plan.bytes_per_token == 2 * 2 * 4 * (32 + 3 * 16)  # K and V, 2 KV heads, fp32
    assert llm.engine.kv_plan.report().endswith("; 2 layers read an earlier layer's K/V (no blocks)")
    assert generate(llm, prompts) == tokens
    assert generate(llm, prompts) == tokens  # the second time through the prefix cache
    assert llm.engine.kv.prefix_hits > 0


def test_preemption_n3_and_speculation_give_the_plain_tokens(ckpt, plain):
    prompts, tokens = plain
    tight = LLM(ckpt.hf_dir, quantization="none", block_size=4, num_kv_blocks=70, max_num_batched_tokens=16)
    assert generate(tight, prompts) == tokens
    assert tight.engine.scheduler.num_preemptions > 0
    llm = LLM(ckpt.hf_dir, quantization="none", block_size=4, num_kv_blocks=256)
    out = llm.generate([prompts[0]], SamplingParams(n=3, temperature=0, max_tokens=N, ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [tokens[0]] * 3
    assert llm.engine.kv.num_used_blocks == 0
    ngram = LLM(ckpt.hf_dir, quantization="none", block_size=4, num_kv_blocks=256, speculative_method="ngram",
                num_speculative_tokens=3, adaptive_speculation=False)
    assert generate(ngram, prompts) == tokens
    assert ngram.engine.speculator.counters.verify_steps > 0


def test_fused_decode_runs_every_layer_from_c(ckpt, reference, caplog):
    """Shared K/V, V norm, both head sizes, per-layer inputs and the layer scalar all have fused forms
    (bit for bit against the layered forward: tests/model/test_fused.py)."""
    with caplog.at_level(logging.INFO, logger="kvgen.model.fused"):
        llm = LLM(ckpt.hf_dir, quantization="none")
    assert not any("without a fused form" in r.message for r in caplog.records)
    assert generate(llm, [prompt(40)]) == [reference(prompt(40))]
    assert llm.engine.runner.model.decode_programs.fused_steps >= N - 1


def e2b_config() -> ModelConfig:
    return ModelConfig.from_hf(E2B | {"vocab_size": 262144, "intermediate_size": 6144, "use_double_wide_mlp": True,
                                      "max_position_embeddings": 131072, "vocab_size_per_layer_input": 262144})


def test_e2b_kv_at_8k_is_the_donors_share():
    """What the engine allocates for a Gemma 4 E2B shape: pools for the 15 of 35 layers that hold K/V
    (12 window layers of head size 256, 3 global of 512, one KV head), so one 8k sequence holds the
    donors' share of kvgen.cache.shared_kv, plus the window pool's slack (a step's chunk and two
    blocks of the window layers: kvgen.cache.hybrid.LayerKind.tokens_held)."""
    config = e2b_config()
    assert config.kv_holders == list(range(15))
    plan = plan_kv(config, EngineConfig(block_size=16, max_num_seqs=1, max_num_batched_tokens=64), 8192)
    assert [len(kind.layers) for kind in plan.kinds] == [3, 12]
    assert plan.kind_layer_bytes == (2 * 512 * 4, 2 * 256 * 4)
    held = sum(len(k.layers) * b * k.tokens_held(8192, 64, 16) for k, b in zip(plan.kinds, plan.kind_layer_bytes))
    shape = SharedKVShape.from_hf_config(E2B)
    assert SharedKVShape.from_model_config(config) == shape
    donors, every_layer = shape.sequence_bytes(8192), shape.sequence_bytes(8192, shared=False)
    slack = 12 * 2 * 256 * 4 * (64 + 2 * 16)
    print(f"\nE2B at 8k, fp32: {held:,} bytes per sequence; the donors' share {donors:,} (+ {slack:,} of window "
          f"slack); every layer holding its own {every_layer:,}")
    assert donors <= held <= donors + slack < every_layer / 2


def test_moe_is_refused_in_one_line(tmp_path, ckpt):
    """The MoE variant, from a HF config (enable_moe_block) and from a GGUF (expert_count)."""
    import gguf

    config = json.loads((ckpt.hf_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"enable_moe_block": True}))
    moe_gguf = tmp_path / "moe.gguf"
    copy_gguf(ckpt.gguf, moe_gguf, {"gemma4.expert_count": (gguf.GGUFValueType.UINT32, 8)})
    for path in (tmp_path, moe_gguf):
        with pytest.raises(ModelLoadError, match="MoE arrives with issue 43") as refused:
            LLM(path, quantization="none")
        assert "\n" not in str(refused.value)


def test_the_text_part_of_a_multimodal_checkpoint_runs(tmp_path, ckpt):
    """Gemma4ForConditionalGeneration's layout (config under text_config, the text model's tensors
    under model.language_model., towers beside it): kvgen runs the text model, with its tokens."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    weights = {"model.language_model." + name[len("model."):]: w
               for name, w in load_file(ckpt.hf_dir / "model.safetensors").items()}
    save_file(weights | {"model.vision_tower.patch_embedder.weight": torch.zeros(4, 4),
                         "model.embed_vision.embedding_projection.weight": torch.zeros(64, 4)},
              tmp_path / "model.safetensors")
    text_config = json.loads((ckpt.hf_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text_config,
        "vision_config": {"model_type": "gemma4_vision"}, "tie_word_embeddings": True}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ckpt.hf_dir / name, tmp_path / name)
    text = LLM(ckpt.hf_dir, quantization="none")
    assert generate(LLM(tmp_path, quantization="none"), [prompt(40)]) == generate(text, [prompt(40)])


GEMMA4_SPECIALS = {500: "<|turn>", 501: "<turn|>", 502: "<|channel>", 503: "<channel|>"}  # ids no merge uses
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of France?"}]
# What Gemma 4's own template (llama.cpp's models/templates/google-gemma-4-31B-it.jinja, rendered by
# kvgen.server.chat.ChatTemplate) makes of CONVERSATION.
RENDERED = ("<s><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi there<turn|>\n<|turn>model\nHello!<turn|>\n"
            "<|turn>user\nCapital of France?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>")


def copy_gguf(source, out, fields: dict) -> None:
    """`source` rewritten with `fields` (key -> (value type, value[, array element type])) set."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    copy_with_new_metadata(gguf.GGUFReader(source), gguf.GGUFWriter(out, "gemma4"),
                           {key: MetadataDetails(kind, value, sub_type=sub[0] if sub else None)
                            for key, (kind, value, *sub) in fields.items()}, [])


def chat_gguf(source, out, template: str | None):
    """The fixture's GGUF with Gemma 4's turn tokens (control tokens in place of unused pieces) and
    `template` as its chat template (None: none, as a file without one)."""
    import gguf

    reader = gguf.GGUFReader(source)
    tokens = list(reader.get_field("tokenizer.ggml.tokens").contents())
    types = list(reader.get_field("tokenizer.ggml.token_type").contents())
    for i, text in GEMMA4_SPECIALS.items():
        tokens[i], types[i] = text, int(gguf.TokenType.CONTROL)
    array = gguf.GGUFValueType.ARRAY
    fields = {"tokenizer.ggml.tokens": (array, tokens, gguf.GGUFValueType.STRING),
              "tokenizer.ggml.token_type": (array, types, gguf.GGUFValueType.INT32)}
    if template is not None:
        fields["tokenizer.chat_template"] = (gguf.GGUFValueType.STRING, template)
    copy_gguf(source, out, fields)
    return out


@pytest.mark.parametrize("carried", [True, False], ids=["template-in-file", "builtin"])
def test_chat_renders_gemma4_turns_and_stops_at_the_end_of_turn(tmp_path, ckpt, carried):
    """The GGUF's chat template (or, for a file without one, kvgen's Gemma 4 one, which renders a text
    conversation as Gemma 4's own does), <turn|> a stop token, and /v1/chat/completions over it."""
    import openai

    from kvgen.loaders.chat_templates import GEMMA4
    from kvgen.server.app import create_app
    from kvgen.server.chat import ChatTemplate
    from kvgen.server.protocol import ChatMessage
    from tests.server.test_server import running

    path = chat_gguf(ckpt.gguf, tmp_path / "chat.gguf", GEMMA4 if carried else None)
    llm = LLM(path, quantization="none")
    tokenizer = llm.tokenizer
    rendered = ChatTemplate(tokenizer).render([ChatMessage(**m) for m in CONVERSATION])
    assert rendered == RENDERED
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert [i for i in ids if i in GEMMA4_SPECIALS] == [500, 501, 500, 501, 500, 501, 500, 501, 500, 502, 503]
    assert llm.engine.model_config.eos_token_ids == (2, 501) and tokenizer.extra_stop_ids == {501}  # </s>, <turn|>
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12))[0].text
    with running(create_app(llm.engine, model_name="gemma4")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        result = client.chat.completions.create(model="gemma4", messages=CONVERSATION, max_tokens=12, temperature=0)
    assert result.usage.prompt_tokens == len(ids)
    assert result.choices[0].message.content == want


def variant(path, hf_dir, **changes):
    """A checkpoint transformers saves (seeded random weights, layer scalars other than the initial 1)
    from the fixture's config with `changes`, with the fixture's tokenizer: (its directory, the
    transformers model)."""
    import torch
    import transformers

    config = json.loads((hf_dir / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("per_layer_config", "architectures", "dtype")}
    torch.manual_seed(1)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**config | changes)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((hf_dir / name).read_bytes())
    return path, model


@pytest.fixture(scope="module")
def k_eq_v(tmp_path_factory, ckpt):
    """attention_k_eq_v (Gemma 4 31B's global layers: V is the key projection, no v_proj) with the global
    layers' own KV heads: a checkpoint transformers saves from the fixture's config, and its tokens."""
    path, model = variant(tmp_path_factory.mktemp("k_eq_v"), ckpt.hf_dir, attention_k_eq_v=True,
                          num_global_key_value_heads=1, global_head_dim=32, initializer_range=0.5)
    assert not any("layers.2.self_attn.v_proj" in name for name, _ in model.named_parameters())
    return path, hf_greedy(path, prompt(40), N)


def check_k_eq_v(path, want: list[int]) -> None:
    llm = LLM(path, quantization="none")
    config = llm.engine.runner.model.config
    assert config.attention_k_eq_v and config.layer_kv_heads == (2, 2, 1, 2, 2, 1)
    assert generate(llm, [prompt(40)]) == [want]


def test_attention_k_eq_v_matches_transformers(k_eq_v, caplog):
    """Its global layers (V = K) have no fused form: they run layer by layer inside the fused step."""
    with caplog.at_level(logging.INFO, logger="kvgen.model.fused"):
        check_k_eq_v(*k_eq_v)
    assert any("2 of 6 layers have a block without a fused form (attention, first layer 2)" in r.message
               for r in caplog.records)


@pytest.mark.slow  # llama.cpp's converter: ~20 s
def test_attention_k_eq_v_from_the_gguf(k_eq_v, tmp_path):
    """llama.cpp's GGUF of it marks V = K only by the global layers' missing attn_v."""
    from tests.loaders.arch_fixtures import convert

    path, want = k_eq_v
    check_k_eq_v(convert("gemma4", path, tmp_path / "k_eq_v.gguf", "f32"), want)
