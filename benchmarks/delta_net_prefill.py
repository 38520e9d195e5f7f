"""One Gated DeltaNet layer's prefill, torch's chunked form against the C kernel, in one run: ms per layer
(conv, gates, rule and gated norm: kvgen.model.delta_net_layer.prefill between the projections, which run
on the model's matmul kernels either way), on a benchmark model's linear-attention shape.

    python benchmarks/delta_net_prefill.py --model qwen35-0.8b --tokens 512 --threads 2

Random inputs at the scales a layer sees (the conv's inputs ~N(0, 1), gates from Qwen3.5's formula);
best of --repeats runs of each after one warm-up, torch and C interleaved so that load on a shared
machine falls on both alike. Also a ragged batch: --tokens split over --sequences prompts in one call.
"""

from __future__ import annotations

import argparse
import time

import kvgen.threads  # noqa: F401  (before torch: OpenMP's wait policy)
import torch

from benchmarks.models import ARCHITECTURES
from kvgen.config import RecurrentShape
from kvgen.model.delta_net_layer import DeltaNetLayer, prefill, prefill_ragged
from kvgen.model.kernels.gated_delta_net import gated_delta_net_kernel


def layer_shape(model: str) -> RecurrentShape:
    """The linear-attention layer of a benchmark model (benchmarks/models.py), from its config fields."""
    c = ARCHITECTURES[model]
    return RecurrentShape(c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                          c["linear_value_head_dim"], c["linear_conv_kernel_dim"])


def random_layer(shape: RecurrentShape, gen: torch.Generator) -> DeltaNetLayer:
    return DeltaNetLayer(shape, torch.randn(shape.conv_dim, shape.conv_kernel, generator=gen) * 0.5,
                         torch.randn(shape.v_heads, generator=gen),
                         -torch.empty(shape.v_heads).uniform_(0.01, 16, generator=gen),
                         torch.randn(shape.v_dim, generator=gen))


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen35-0.8b", help="a benchmarks/models.py architecture with DeltaNet layers")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=4, help="prompts of the ragged batch")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = gated_delta_net_kernel()
    if kernel is None:
        raise SystemExit("the Gated DeltaNet kernel did not build (see the log)")
    gen = torch.Generator().manual_seed(0)
    shape = layer_shape(args.model)
    layer = random_layer(shape, gen)
    T = args.tokens
    mixed, z = torch.randn(T, shape.conv_dim, generator=gen), torch.randn(T, shape.v_heads * shape.v_dim, generator=gen)
    a, b = torch.randn(T, shape.v_heads, generator=gen), torch.randn(T, shape.v_heads, generator=gen)
    print(f"{args.model}: {shape}, {T} tokens, {args.threads} threads, best of {args.repeats}")
    times: dict[str, list[float]] = {"torch chunked": [], "C": []}
    for _ in range(2):  # interleaved
        times["torch chunked"].append(best_ms(lambda: prefill(layer, mixed, z, a, b), args.repeats))
        times["C"].append(best_ms(lambda: prefill(layer, mixed, z, a, b, kernel=kernel), args.repeats))
    torch_ms, c_ms = min(times["torch chunked"]), min(times["C"])
    print(f"  one prompt:  torch chunked {torch_ms:.1f} ms/layer, C {c_ms:.1f} ms/layer ({torch_ms / c_ms:.1f}x)")
    lengths = [T // args.sequences + (n < T % args.sequences) for n in range(args.sequences)]
    pools = (torch.zeros(args.sequences, *shape.conv_window), torch.zeros(args.sequences, *shape.state))
    slots = torch.arange(args.sequences)
    ragged = {name: best_ms(lambda: prefill_ragged(layer, mixed, z, a, b, *pools, slots, lengths, kernel=k),
                            args.repeats) for name, k in (("torch chunked", None), ("C", kernel))}
    print(f"  {args.sequences} prompts of {lengths[0]} in one batch: torch chunked {ragged['torch chunked']:.1f} "
          f"ms/layer, C {ragged['C']:.1f} ms/layer ({ragged['torch chunked'] / ragged['C']:.1f}x)")


if __name__ == "__main__":
    main()
