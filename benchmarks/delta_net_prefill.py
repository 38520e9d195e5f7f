"""One Gated DeltaNet layer's prefill, torch's chunked form against the C kernel, in one run: ms per layer
(conv, gates, rule and gated norm: kvgen.model.delta_net_layer.prefill between the projections, which run
on the model's matmul kernels either way), on a benchmark model's linear-attention shape.

    python benchmarks/delta_net_prefill.py --model qwen35-0.8b --tokens 512 --threads 2

Random inputs at the scales a layer sees (the conv's inputs ~N(0, 1), gates from Qwen3.5's formula);
best of --repeats runs of each after one warm-up, torch and C interleaved so that load on a shared
machine falls on both alike. Also a ragged batch: --tokens split over --sequences prompts in one call.
Each figure is wall-clock ms and, beside it, the process's CPU ms (all threads, spinning OpenMP workers
included): on a loaded machine the wall clock counts the time other jobs ran, the CPU time does not,
so at one thread the CPU time is the steadier figure.
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


def best_ms(fn, repeats: int) -> tuple[float, float]:
    """(wall ms, CPU ms): the best of `repeats` calls of fn after one, each."""
    fn()
    wall = cpu = float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    return wall * 1e3, cpu * 1e3


def compare(label: str, torch_fn, c_fn, repeats: int) -> None:
    """Both forms, interleaved twice (each figure the best of both rounds), and their ratio."""
    torch_runs, c_runs = zip(*[(best_ms(torch_fn, repeats), best_ms(c_fn, repeats)) for _ in range(2)])
    (torch_wall, torch_cpu), (c_wall, c_cpu) = (map(min, zip(*torch_runs)), map(min, zip(*c_runs)))
    print(f"  {label}: torch chunked {torch_wall:.1f} ms/layer (CPU {torch_cpu:.1f}), "
          f"C {c_wall:.1f} (CPU {c_cpu:.1f}): "
          f"{torch_wall / c_wall:.1f}x wall, {torch_cpu / c_cpu:.1f}x CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen35-0.8b",
                        help="a benchmarks/models.py architecture with DeltaNet layers")
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
    compare("one prompt", lambda: prefill(layer, mixed, z, a, b), lambda: prefill(layer, mixed, z, a, b, kernel=kernel),
            args.repeats)
    lengths = [T // args.sequences + (n < T % args.sequences) for n in range(args.sequences)]
    pools = (torch.zeros(args.sequences, *shape.conv_window), torch.zeros(args.sequences, *shape.state))
    slots = torch.arange(args.sequences)
    compare(f"{args.sequences} prompts of {lengths[0]} in one batch",
            lambda: prefill_ragged(layer, mixed, z, a, b, *pools, slots, lengths),
            lambda: prefill_ragged(layer, mixed, z, a, b, *pools, slots, lengths, kernel=kernel), args.repeats)

if __name__ == "__main__":
    main()
