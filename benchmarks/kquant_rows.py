"""The K-quant kernel (kvgen/model/kernels/kquant.c) alone on a GGUF's K-quant matrices: ms for all of
them at each number of rows of x, in one and two int8 parts, so that a decode (1 row), a verify
(K + 1 rows in two parts) or a batched step (rows in one part) can be costed without the model
around it.

    python benchmarks/kquant_rows.py MODEL.gguf --suffix ffn_gate.weight ffn_down.weight \
        --rows 1 5 16 --parts 1 2 --threads 2

Each matrix is packed as kvgen loads it; a figure is the best of --repeats passes over every matrix
after one warm-up, the matrices taken in turn so that each pass streams them from memory (a model's
matrices together exceed the last-level cache; a few small ones may not).
"""

from __future__ import annotations

import argparse
import time

import kvgen.threads  # noqa: F401  (before torch: OpenMP's wait policy)
import numpy as np
import torch
from gguf import GGUFReader

from kvgen.model.formats.kquant import KINDS
from kvgen.model.kernels.kquant import kquant_kernel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--suffix", nargs="+", default=["ffn_gate.weight", "ffn_down.weight"],
                        help="tensor names ending so (default: the MLP's gate and down matrices)")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 5, 16])
    parser.add_argument("--parts", nargs="+", type=int, default=[1, 2], choices=[1, 2])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[tuple[int, int, float]]:
    """Prints a line per (parts, rows) and returns them as (parts, rows, ms)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    kernel = kquant_kernel()
    if kernel is None:
        raise SystemExit("kquant_rows: this CPU lacks the K-quant kernel's AVX-512 VNNI")
    tensors = [t for t in GGUFReader(args.model).tensors
               if t.tensor_type in KINDS and t.name.endswith(tuple(args.suffix))]
    if not tensors:
        raise SystemExit(f"kquant_rows: no K-quant tensor of {args.model} ends with {' or '.join(args.suffix)}")
    weights = [kernel.pack(t.tensor_type, [np.asarray(t.data)]) for t in tensors]
    generator = torch.Generator().manual_seed(0)
    results = []
    for parts in args.parts:
        for rows in args.rows:
            calls = [(kernel.bind(w, parts), torch.randn(rows, w.shape[1], generator=generator)) for w in weights]
            for bound, x in calls:
                bound.run(x)
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                for bound, x in calls:
                    bound.run(x)
                best = min(best, time.perf_counter() - start)
            results.append((parts, rows, best * 1e3))
            print(f"{len(weights)} matrices, x in {parts} part(s), {rows} row(s): {best * 1e3:.2f} ms")
    return results


if __name__ == "__main__":
    main()
