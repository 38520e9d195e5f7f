"""A multi-token-prediction head: the MTP layer a Qwen3.5 checkpoint carries beside its decoder (the
design of DeepSeek-V3's), which guesses the token after next from the target's last hidden state:

    x    = fc([ norm_e(embed(t[i + 1])) | norm_h(h[i]) ])    h[i]: the target's hidden state at i, after its final norm
    x   += layer(x)                                         a full-attention decoder layer, K/V at position i
    h'[i] = norm(x)        logits = lm_head(h'[i])  ->  a guess of t[i + 2]

Chained, h'[i] stands in for the target's h[i] at the next position (as llama.cpp and vLLM run one MTP
layer for K > 1 guesses). The head shares the target's embedding, LM head and RoPE, and keeps K/V for
its one layer in a pool of its own (kvgen.engine.speculative.mtp); it runs through kvgen's
ModelRunner like a one-layer model whose rows also carry an input hidden state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from kvgen.config import ModelConfig
from kvgen.model.attention import Attention
from kvgen.model.blocks import BuildContext, StepContext
from kvgen.model.blocks.layer import DecoderLayer
from kvgen.model.decoder import DecoderModel
from kvgen.model.linear import RowKernels
from kvgen.model.linear_choice import LayerBuilder, Weight

# The architectures whose MTP layer is one more of their full-attention layers (a mixture's with its experts).
MTP_ARCHITECTURES = ("qwen35", "qwen35moe")
INPUT_NORMS = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")
LAYER_PREFIX = "mtp.layers.0."


def head_config(config: ModelConfig) -> ModelConfig:
    """The target's config as a one-layer model whose layer is a full-attention one."""
    return replace(config, num_layers=1, recurrent_layers=(), mtp_layers=0)


def mtp_refusal(config: ModelConfig, weights: Mapping[str, Weight]) -> str | None:
    """Why the head cannot be built from a checkpoint's MTP weights (None: it can)."""
    if config.architecture not in MTP_ARCHITECTURES:
        return (f"speculative_method 'mtp' runs the MTP layer of {', '.join(MTP_ARCHITECTURES)} models; "
                f"this is a {config.architecture} model")
    if not weights:
        return "speculative_method 'mtp' needs a checkpoint that carries MTP layers; this one has none"
    one = head_config(config)
    expected = {LAYER_PREFIX + name: shape for name, shape in one.arch.layer_spec(0, one).tensors(one).items()}
    hidden = config.hidden_size
    expected |= {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.norm.weight": (hidden,)}
    expected |= dict.fromkeys(INPUT_NORMS, (hidden,))
    missing = sorted(set(expected) - set(weights))
    if missing:
        return f"the checkpoint's MTP layer lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
    wrong = [name for name, shape in expected.items() if tuple(weights[name].shape) != shape]
    if wrong:
        return f"the checkpoint's MTP tensor {wrong[0]} has shape {tuple(weights[wrong[0]].shape)}, " \
               f"the config implies {expected[wrong[0]]}"
    return None


class MTPHead:
    """The MTP layer over a target model; the model interface ModelRunner drives, with `hidden`."""

    reads_hidden = True

    def __init__(self, target: DecoderModel, weights: Mapping[str, Weight], build: LayerBuilder) -> None:
        refusal = mtp_refusal(target.config, weights)
        if refusal is not None:
            raise ValueError(refusal)
        self.target = target
        self.config = head_config(target.config)
        self.device, self.dtype = target.device, target.dtype
        self.rope = target.rope
        layer_weights = {"model.layers.0." + name.removeprefix(LAYER_PREFIX): w for name, w in weights.items()
                         if name.startswith(LAYER_PREFIX)}
        context = BuildContext(self.config, layer_weights, build, target.norm, target.rotate, lambda _: 0)
        self.layer = DecoderLayer.build(self.config.arch.layer_spec(0, self.config), 0, context)
        self.fc = build.linear([weights["mtp.fc.weight"]])
        self.embedding_norm, self.hidden_norm = (build.float(weights[name]) for name in INPUT_NORMS)
        self.final_norm = build.float(weights["mtp.norm.weight"])

    @property
    def max_positions(self) -> int:
        return self.rope.max_positions

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                rows: RowKernels | None = None, states: object = None, hidden: torch.Tensor | None = None
                ) -> torch.Tensor:
        """token_ids, positions [T] (row i: the token at position i + 1, stored at i), hidden [T, hidden]
        (the hidden state that predicted it) -> the head's hidden states [T, hidden] after its norm."""
        eps = self.config.rms_norm_eps
        e = self.target.norm(self.target.embed_tokens(token_ids), self.embedding_norm, eps)
        h = self.target.norm(hidden, self.hidden_norm, eps)
        x = self.fc(torch.cat((e, h), dim=-1), rows)                            # [T, 2 hidden] -> [T, hidden]
        self.layer.forward(x, StepContext(positions, [self.rope.tables(positions)], attention, rows))
        return self.target.norm(x, self.final_norm, eps)

    def logits(self, hidden: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab], by the target's LM head."""
        return self.target.logits(hidden, rows)
