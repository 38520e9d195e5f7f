"""One decoder for every architecture of kvgen.architectures (Llama 2/3, Mistral, SmolLM, Qwen2/3,
Phi-3, Gemma 3, Gemma 4): an embedding, layers composed of blocks as the architecture's description says
(kvgen.model.blocks), a final norm and the LM head.

Pure tensors: the model maps a flat batch of tokens (any mix of sequences) to hidden states and
logits. Where K/V come from and go to, and which keys each layer's window lets a query see, is the
job of the `Attention` backend passed to `forward`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from kvgen.config import ModelConfig
from kvgen.loaders.shard import first_rows
from kvgen.model.attention import Attention
from kvgen.model.blocks import BuildContext, StateBatch, StepContext
from kvgen.model.blocks.embedding import embed, embedding_scale
from kvgen.model.blocks.layer import DecoderLayer
from kvgen.model.blocks.per_layer_input import PerLayerInputs
from kvgen.model.blocks.moe import MoEBlock
from kvgen.model.fused import DecodePrograms
from kvgen.model.layers import RotaryEmbedding, make_rms_norm, make_rope
from kvgen.model.linear import RowKernels
from kvgen.model.linear_choice import ACTIVATIONS, Embedding, LayerBuilder, Weight, describe


def head_weight(config: ModelConfig, weights: Mapping[str, Weight]) -> Weight:
    """The LM head's matrix [vocab, hidden]: the embedding table where the model ties them."""
    return weights["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]


class DecoderModel:
    """Weights plus the forward pass. Built from Hugging Face-named weights (see `kvgen.loaders`):
    float tensors, or GGUF matrices kept packed (`LoadedModel.quantized`), which get quantized
    linear layers (kvgen.model.linear_choice). `quantization` "int8" / "int4" packs float matrices;
    `activations` is how packed layers quantize x (kvgen.model.linear_choice.ACTIVATIONS by default).
    `fused_decode` lets decode steps run as one list of C kernel calls (kvgen.model.fused).
    `head_rows`: the LM head covers token ids [0, head_rows) only, and logits have that many columns
    (a draft's vocabulary, kvgen.engine.speculative.draft_vocab); None: the whole vocabulary."""

    reads_hidden = False  # its input is token ids only (an MTP head also reads hidden states: kvgen.model.mtp)

    def __init__(self, config: ModelConfig, weights: Mapping[str, Weight],
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 quantization: str = "none", fused_decode: bool = True, activations: str = ACTIVATIONS,
                 head_rows: int | None = None) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        build = LayerBuilder(self.device, dtype, quantization, activations)
        head = head_weight(config, weights)
        self.lm_head = build.linear([head if head_rows is None else first_rows(head, head_rows)], logits=True)
        self.embed = Embedding(weights["model.embed_tokens.weight"], build,
                               self.lm_head if config.tie_word_embeddings and head_rows is None else None)
        self.embed_scale = embedding_scale(config.arch, config, dtype)
        # A RoPE table per (base, head size): ropes[0] the global layers' (with the scaling); a hybrid
        # model's windowed layers may have their own base, and Gemma 4's their own head size.
        layer_ropes = [(config.rope_theta_of(i), config.head_dim_of(i)) for i in range(config.num_layers)]
        first_global = next((i for i in range(config.num_layers) if config.window(i) is None), 0)
        global_rope = (config.rope_theta, config.head_dim_of(first_global))
        ropes = [global_rope, *sorted(set(layer_ropes) - {global_rope})]
        self.norm = make_rms_norm(self.device, dtype)
        self.rotate = make_rope(self.device, dtype)  # may rotate in place: q/k are fresh buffers
        context = BuildContext(config, weights, build, self.norm, self.rotate,
                               lambda i: ropes.index(layer_ropes[i]))
        self.layers = [DecoderLayer.build(config.arch.layer_spec(i, config), i, context)
                       for i in range(config.num_layers)]
        self.final_norm = build.float(weights["model.norm.weight"])
        self.per_layer_inputs = PerLayerInputs(config, weights, build, self.norm) if config.per_layer_input_size \
            else None
        self.ropes = [RotaryEmbedding(replace(config, rope_theta=theta, head_dim=dim,
                                              rope_scaling=config.rope_scaling if theta == config.rope_theta else None),
                                      config.max_position_embeddings, self.device, dtype) for theta, dim in ropes]
        self.rope = self.ropes[0]
        self.decode_programs = DecodePrograms(self, fused_decode)
        # The multi-token-prediction layers a checkpoint may carry (HF names): for speculation
        # (kvgen.model.mtp); decoding never reads them.
        self.mtp: Mapping[str, Weight] = {}

    def kernels(self) -> dict[str, tuple[str, int]]:
        """Per projection role: (the kernel its layers run, their weight bytes over all layers)."""
        roles: dict[str, list] = {}
        for layer in self.layers:
            for role, linear in layer.projections().items():
                roles.setdefault(role, []).append(linear)
        roles["lm_head"] = [self.lm_head]
        report = {}
        for role, layers in roles.items():
            described = [describe(layer) for layer in layers]
            kernels = sorted({kernel for kernel, _ in described})
            report[role] = (" + ".join(kernels), sum(size for _, size in described))
        experts = [block.experts for layer in self.layers for block in layer.blocks if isinstance(block, MoEBlock)]
        if experts:  # a mixture's experts, stacked per layer (kvgen.model.experts)
            kernels = sorted({s.kernel for e in experts for s in (e.gate_up, e.down)})
            report["experts"] = (" + ".join(kernels), sum(e.nbytes for e in experts))
        return report

    def step_weight_bytes(self) -> int:
        """The weight bytes a batch-1 decode step reads: every projection's, and of a mixture's experts
        the share a token is routed to (top-k of them, each read once)."""
        report = self.kernels()
        share = self.config.experts_per_token / self.config.num_experts if self.config.is_moe else 0.0
        return sum(size for role, (_, size) in report.items() if role != "experts") + \
            round(report.get("experts", ("", 0))[1] * share)

    def expert_tokens(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """Per mixture-of-experts layer: (its index, the tokens routed to each of its experts so far)."""
        return tuple((layer.index, tuple(block.experts.counts.tolist())) for layer in self.layers
                     for block in layer.blocks if isinstance(block, MoEBlock))

    @property
    def max_positions(self) -> int:
        return self.rope.max_positions

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                rows: RowKernels | None = None, states: StateBatch | None = None) -> torch.Tensor:
        """token_ids, positions [T] -> hidden states [T, hidden] after the final norm.
        `rows`, if given, fixes each row's matmul kernel by its role (see kvgen.model.linear; the
        layers of a fused decode step never depend on the rows beside a row). A decode step runs
        from C where it can (kvgen.model.fused), with the same bits as the layers below. `states`:
        the recurrent layers' state slots (kvgen.model.blocks.StateBatch), where the model has any."""
        x = self.embed_tokens(token_ids)
        per_layer = None if self.per_layer_inputs is None else self.per_layer_inputs(token_ids, x, rows)
        program = self.decode_programs.find(token_ids.shape[0], attention, states)
        if program is not None:
            return program(x, positions, attention, rows, states, per_layer)
        step = StepContext(positions, [rope.tables(positions) for rope in self.ropes], attention, rows, states,
                           per_layer)
        for layer in self.layers:
            layer.forward(x, step)
        return self.norm(x, self.final_norm, self.config.rms_norm_eps)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [T] -> [T, hidden], a fresh tensor (scaled for Gemma)."""
        return embed(self.embed, self.embed_scale, token_ids)

    def logits(self, hidden: torch.Tensor, rows: RowKernels | None = None) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab] (soft-capped where the model says so)."""
        return self.soft_cap(self.lm_head(hidden, rows).float())

    def soft_cap(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits soft-capped where the model says so (in place)."""
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits.div_(cap)).mul_(cap)
