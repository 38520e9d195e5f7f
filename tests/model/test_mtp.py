"""The MTP head (kvgen.model.mtp) against one built from transformers' own Qwen3.5 modules: the same
decoder layer class, RMSNorm and rotary embedding, on the fixture's `mtp.*` weights, fed the target's
final hidden states as transformers computes them. The wiring between them (which hidden state, which
token, which position) is llama.cpp's `graph_mtp` for qwen35 and vLLM's Qwen3.5 MTP model."""

import pytest
import torch

from kvgen import LLM
from kvgen.model.attention import NoCacheAttention
from kvgen.model.linear_choice import LayerBuilder
from kvgen.model.mtp import MTPHead, mtp_refusal
from tests.loaders.arch_fixtures import load_hf_model, mtp_checkpoint
from tests.support.tolerances import fp32_gap, model_reduction_length

PROMPT = [(7 * i + 3) % 500 + 10 for i in range(40)]


def target_hidden(ids: list[int], arch: str = "qwen35") -> torch.Tensor:
    """transformers' final hidden states (after the model's norm) [len(ids), hidden]."""
    with torch.no_grad():
        return load_hf_model(mtp_checkpoint(arch).hf_dir).model(torch.tensor([ids])).last_hidden_state[0]


def fused_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's experts as saved one by one (`mlp.experts.{e}.gate_proj.weight`) in the fused layout of
    transformers' modules: gate_up_proj [experts, 2 inner, hidden], down_proj [experts, hidden, inner]."""
    count = len([n for n in weights if n.endswith(".gate_proj.weight") and ".experts." in n])
    if not count:
        return weights
    out = {n: w for n, w in weights.items() if ".experts." not in n}
    per = [{p: weights[f"mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")} for e in range(count)]
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat((x["gate"], x["up"])) for x in per])
    out["mlp.experts.down_proj"] = torch.stack([x["down"] for x in per])
    return out


def reference_head_logits(ids: list[int], arch: str = "qwen35") -> torch.Tensor:
    """[len(ids) - 1, vocab]: row i, the head at position i (the token at i + 1, the target's state at
    i) over every position before it, by the classes of transformers' own model: its full-attention
    decoder layer (a mixture's with its experts), its RMSNorm, its rotary embedding."""
    from safetensors.torch import load_file

    checkpoint = mtp_checkpoint(arch)
    model = load_hf_model(checkpoint.hf_dir)
    config = model.config
    weights = {n: w for n, w in load_file(checkpoint.hf_dir / "model.safetensors").items() if n.startswith("mtp.")}
    full = config.layer_types.index("full_attention")
    layer = type(model.model.layers[full])(config, full).eval()
    layer.load_state_dict(fused_experts({n.removeprefix("mtp.layers.0."): w for n, w in weights.items()
                                         if n.startswith("mtp.layers.0.")}))
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = type(model.model.norm)(config.hidden_size, config.rms_norm_eps)
        norms[name].weight.data.copy_(weights[f"mtp.{name}.weight"])
    n = len(ids) - 1
    with torch.no_grad():
        e = model.model.embed_tokens(torch.tensor([ids[1:]]))
        h = target_hidden(ids, arch)[None, :n]
        x = torch.cat((norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](h)), dim=-1)
        x = x @ weights["mtp.fc.weight"].T
        positions = torch.arange(n).view(1, 1, n).expand(3, 1, n)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = layer(x, position_embeddings=model.model.rotary_emb(x, positions), attention_mask=mask)
        return model.lm_head(norms["norm"](x))[0]


def kvgen_head(path) -> MTPHead:
    llm = LLM(str(path), quantization="none")
    model = llm.engine.model
    return MTPHead(model, model.mtp, LayerBuilder(model.device, model.dtype))


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_the_head_gives_the_logits_of_transformers_modules(source, arch):
    """fp32, the same weights from either file: the head over a 40-token prompt, every position."""
    checkpoint = mtp_checkpoint(arch)
    head = kvgen_head(checkpoint.hf_dir if source == "hf" else checkpoint.gguf)
    n = len(PROMPT) - 1
    hidden = target_hidden(PROMPT, arch)[:n].contiguous()
    out = head.forward(torch.tensor(PROMPT[1:]), torch.arange(n), NoCacheAttention(), hidden=hidden)
    got, want = head.logits(out), reference_head_logits(PROMPT, arch)
    # One layer's chain of sums as a model's (the fc's 2 x hidden terms before it), on logits this large.
    bound = fp32_gap(model_reduction_length(head.config, n) + 2 * head.config.hidden_size, want.abs().max().item())
    assert (got - want).abs().max() <= bound
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_checkpoint_without_mtp_layers_or_of_another_kind_is_refused_in_one_line():
    from tests.loaders.arch_fixtures import arch_checkpoint

    plain = LLM(str(arch_checkpoint("qwen35").gguf), quantization="none").engine.model
    assert "carries MTP layers; this one has none" in mtp_refusal(plain.config, plain.mtp)
    llama = LLM(str(arch_checkpoint("llama").gguf), quantization="none").engine.model
    assert "this is a llama model" in mtp_refusal(llama.config, {})  # a full-attention layer of Qwen3.5's kind
    head = kvgen_head(mtp_checkpoint().gguf)
    weights = dict(head.target.mtp)
    weights["mtp.fc.weight"] = weights["mtp.fc.weight"][:, :8]
    assert "mtp.fc.weight has shape (64, 8)" in mtp_refusal(head.target.config, weights)
    del weights["mtp.norm.weight"]
    assert "lacks mtp.norm.weight" in mtp_refusal(head.target.config, weights)
