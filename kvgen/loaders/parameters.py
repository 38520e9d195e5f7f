"""How many parameters a model holds, and how many a token uses: a mixture of experts reads only its
routed experts (kvgen.architectures.spec.MoESpec), so its active count is what a decode step streams
from memory, far below the total. Counted from the tensors the config implies (`expected_shapes`)."""

from __future__ import annotations

import math

from kvgen.architectures.spec import MoESpec
from kvgen.config import ModelConfig
from kvgen.loaders.weights import expected_shapes


def parameter_counts(config: ModelConfig) -> tuple[int, int]:
    """(total parameters, parameters a token uses): the experts a token is not routed to left out."""
    total = sum(math.prod(shape) for shape in expected_shapes(config).values())
    idle = 0
    for i in range(config.num_layers):
        for branch in config.arch.layer_spec(i, config).branches:
            if isinstance(branch.block, MoESpec):
                per_expert = sum(math.prod(shape[1:]) for name, shape in branch.block.tensors(config).items()
                                 if ".experts." in name)
                idle += (config.num_experts - config.experts_per_token) * per_expert
    return total, total - idle


def describe_parameters(config: ModelConfig) -> str:
    """One line for the start-up log and `kvgen kv-size`."""
    total, active = parameter_counts(config)
    line = f"parameters: {_count(total)} total"
    if config.is_moe:
        line += (f", {_count(active)} active per token ({config.experts_per_token} of {config.num_experts} experts "
                 f"a layer, {active / total:.1%})")
    return line


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
