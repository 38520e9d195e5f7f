"""How long the model's collectives take: `python -m kvgen.distributed.allreduce --world 2`.

Each decoder layer all-reduces its o_proj and down_proj outputs, [tokens, hidden] each, so a step
pays 2 x layers all-reduces (plus one for the embedding and a gather of the logits). This times one
all-reduce of that shape on N spawned ranks over the backend the engine would use, and prints the
per-op latency and what it adds to one forward pass of a model with `--layers` layers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvgen.distributed.group import (
    Rendezvous,
    TensorParallelGroup,
    default_backend,
    free_port,
)


def _time_all_reduce(group: TensorParallelGroup, shape: tuple[int, int], dtype: torch.dtype, repeats: int) -> float:
    """Median seconds of one all-reduce of `shape` (after a warm-up), as rank 0 sees it."""
    x = torch.ones(shape, dtype=dtype, device=group.device)
    times = []
    for i in range(repeats + 3):
        dist.barrier(group=group.control)
        if group.device.type == "cuda":
            torch.cuda.synchronize(group.device)
        started = time.perf_counter()
        group.all_reduce(x)
        if group.device.type == "cuda":
            torch.cuda.synchronize(group.device)
        if i >= 3:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else args.device)
    backend = args.backend or default_backend(args.device)
    group = TensorParallelGroup(Rendezvous(rank, args.world, backend, f"tcp://127.0.0.1:{port}"), device)
    dtype = getattr(torch, args.dtype)
    for tokens in args.tokens:
        seconds = _time_all_reduce(group, (tokens, args.hidden), dtype, args.repeats)
        if rank == 0:
            nbytes = tokens * args.hidden * dtype.itemsize
            print(f"{args.world} ranks, {backend}, [{tokens}, {args.hidden}] {args.dtype} ({nbytes} bytes): "
                  f"{seconds * 1e6:.1f} us per all-reduce, {2 * args.layers * seconds * 1e3:.2f} ms per forward "
                  f"of {args.layers} layers")
    group.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=576, help="hidden size (default: SmolLM2-135M's)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 512])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", help="gloo or nccl (default: the engine's choice for the device)")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    mp.spawn(_rank, args=(args, free_port()), nprocs=args.world)


if __name__ == "__main__":
    main()
