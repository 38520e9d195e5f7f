"""The K-quant kernel (kvgen/model/kernels/kquant.c) alone on a GGUF's K-quant matrices: ms for all of
them at each number of rows of x, in one and two int8 parts, so that a decode (1 row), a verify
(K + 1 rows in two parts) or a batched step (rows in one part) can be costed without the model
around it.

    python benchmarks/kquant_rows.py MODEL.gguf --suffix ffn_gate.weight ffn_down.weight \
        --rows 1 5 16 --parts 1 2 --threads 2

Each matrix is packed as kvgen loads it; a figure is the best of --repeats passes over every matrix
after one warm-up, the matrices taken in turn so that each pass streams them from memory (a model's
matrices together exceed the last-level cache; a few small ones may not).

`--baseline DIR` times another kquant.c of the same packed layout against this one, the two builds
taking turns in every repeat, and says whether their outputs are the same bits; for a revision:

    git archive REV kvgen/model/kernels | tar -x -C /tmp/rev
    python benchmarks/kquant_rows.py MODEL.gguf --suffix .weight --rows 1 3 5 7 --parts 1 \
        --baseline /tmp/rev/kvgen/model/kernels
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import kvgen.threads  # noqa: F401  (before torch: OpenMP's wait policy)
import numpy as np
import torch
from gguf import GGUFReader

from kvgen.model.formats.kquant import KINDS
from kvgen.model.kernels.kquant import kquant_build, kquant_kernel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--suffix", nargs="+", default=["ffn_gate.weight", "ffn_down.weight"],
                        help="tensor names ending so (default: the MLP's gate and down matrices)")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 5, 16])
    parser.add_argument("--parts", nargs="+", type=int, default=[1, 2], choices=[1, 2])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="a directory with another kquant.c and its headers, "
                        "timed against this build (see above)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[tuple[int, int, float, float | None]]:
    """Prints a line per (parts, rows) and returns them as (parts, rows, ms, the baseline's ms or None)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    kernel = kquant_kernel()
    if kernel is None:
        raise SystemExit("kquant_rows: this CPU lacks the K-quant kernel's AVX-512 VNNI")
    builds = {"kvgen": kernel}
    if args.baseline is not None:
        baseline = kquant_build(kernel.isa, args.baseline / "kquant.c")
        if baseline is None:
            raise SystemExit(f"kquant_rows: {args.baseline / 'kquant.c'} did not build")
        builds["baseline"] = baseline
    tensors = [t for t in GGUFReader(args.model).tensors
               if t.tensor_type in KINDS and t.name.endswith(tuple(args.suffix))]
    if not tensors:
        raise SystemExit(f"kquant_rows: no K-quant tensor of {args.model} ends with {' or '.join(args.suffix)}")
    weights = [kernel.pack(t.tensor_type, [np.asarray(t.data)]) for t in tensors]
    generator = torch.Generator().manual_seed(0)
    results = []
    for parts in args.parts:
        for rows in args.rows:
            xs = [torch.randn(rows, w.shape[1], generator=generator) for w in weights]
            calls = {name: [(build.bind(w, parts), x) for w, x in zip(weights, xs)] for name, build in builds.items()}
            outputs = {name: [bound.run(x) for bound, x in pairs] for name, pairs in calls.items()}  # warm-up
            best = dict.fromkeys(calls, float("inf"))
            for _ in range(args.repeats):
                for name, pairs in calls.items():
                    start = time.perf_counter()
                    for bound, x in pairs:
                        bound.run(x)
                    best[name] = min(best[name], time.perf_counter() - start)
            line = f"{len(weights)} matrices, x in {parts} part(s), {rows} row(s): {best['kvgen'] * 1e3:.2f} ms"
            if "baseline" in best:
                same = all(torch.equal(a, b) for a, b in zip(outputs["kvgen"], outputs["baseline"]))
                line += (f" (baseline {best['baseline'] * 1e3:.2f} ms, {best['baseline'] / best['kvgen']:.2f}x; "
                         f"{'the same bits' if same else 'different bits'})")
            results.append((parts, rows, best["kvgen"] * 1e3, best["baseline"] * 1e3 if "baseline" in best else None))
            print(line)
    return results


if __name__ == "__main__":
    main()
