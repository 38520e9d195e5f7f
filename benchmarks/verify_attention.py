"""The paged decode attention kernel (kvgen/model/kernels/paged_decode.c) alone on one layer's pools:
ms for a verify chunk of Q rows (causal, one sequence) against Q times a single decode, so that
what speculation's verify step pays for attention at a long context can be read without the model.

    python benchmarks/verify_attention.py --keys 1800 --kv-heads 3 --group 3 --head-dim 64 \
        --rows 1 2 5 8 16 --threads 2

A figure is the best of --repeats timings of --calls calls each, after one warm-up call; random
bf16 pools (the engine's default for packed models) of random keys.
"""

from __future__ import annotations

import argparse
import time

import kvgen.threads  # noqa: F401  (before torch: OpenMP's wait policy)
import torch

from kvgen.model.kernels.paged_decode import load_paged_decode


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1800, help="keys before the chunk's first row")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--calls", type=int, default=20)
    return parser.parse_args(argv)


def chunk_ms(kernel, q: torch.Tensor, pools: tuple[torch.Tensor, torch.Tensor], block_ids: torch.Tensor,
             mask: torch.Tensor, block_size: int, repeats: int, calls: int) -> float:
    call = kernel.for_group(block_ids, block_size, mask)
    call(q, *pools)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call(q, *pools)
        best = min(best, (time.perf_counter() - start) / calls * 1000)
    return best


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kernel, block_size = load_paged_decode(), 16
    blocks = (args.keys + max(args.rows)) // block_size + 1
    k = torch.randn(args.kv_heads, blocks * block_size, args.head_dim).to(torch.bfloat16)
    pools = (k, torch.randn_like(k))
    block_ids = torch.arange(blocks)[None]
    positions = torch.arange(blocks * block_size)
    one = None
    print(f"{args.keys} keys, {args.kv_heads} KV heads x {args.group}, head size {args.head_dim}, "
          f"{args.threads} threads")
    for rows in args.rows:
        q = torch.randn(rows, args.kv_heads * args.group, args.head_dim)
        mask = positions[None, :] <= args.keys + torch.arange(rows)[:, None]  # row r: keys up to its position
        ms = chunk_ms(kernel, q, pools, block_ids, mask, block_size, args.repeats, args.calls)
        one = ms if rows == 1 else one
        against = f", {ms / (rows * one):.2f}x {rows} decodes" if one else ""
        print(f"  {rows:3d} rows: {ms:.3f} ms{against}")


if __name__ == "__main__":
    main()
