"""What every bench mode shares on the way out: statistics, the machine, tables, JSON, plots.

A mode returns a `Report`; `emit` prints its tables and notes, writes `<mode>.json` (every raw number
plus the machine) and draws `<mode>.png` when the mode has a figure (PLOTS). Plots are drawn from the
JSON data alone, so `kvgen bench plot` can redraw them without measuring again. matplotlib is the
`[bench]` extra, not a dependency of the engine: without it a mode still prints and writes its JSON,
and says which figure it did not draw.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import torch

from kvgen.errors import KVGenError
from kvgen.threads import foreign_environment

PERCENTILES = (50, 90, 99)
# The CPU features that decide which kernels run, kvgen's and the peers' (/proc/cpuinfo's names).
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512vbmi",
             "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")
# Environment variables that change what a bench measures (kernels, threads, the peers' builds).
ENV_PREFIXES = ("KVGEN_", "LLAMA_CPP_", "ONEDNN_", "DNNL_", "OMP_", "GOMP_", "OPENBLAS_", "MKL_")
PEER_PACKAGES = ("transformers", "llama-cpp-python", "ctranslate2")
REPO = Path(__file__).resolve().parents[2]


# -- timing and statistics ----------------------------------------------------------------------


def timed(fn: Callable[[], object], device: torch.device | None = None) -> float:
    """Seconds `fn()` takes, including GPU work it queued on `device`."""
    start = time.perf_counter()
    fn()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 of `values` (None for each when there are none)."""
    if not values:
        return {"mean": None} | {f"p{p}": None for p in PERCENTILES}
    return {"mean": float(np.mean(values))} | {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def loglog_slope(x: Sequence[float], y: Sequence[float]) -> float:
    """The exponent k of y ~ x^k, fitted by least squares on log-log axes."""
    return float(np.polyfit(np.log(x), np.log(y), 1)[0])


# -- the machine --------------------------------------------------------------------------------


def machine_info() -> dict:
    """What the numbers were measured on (goes into every JSON file)."""
    info = {
        "cpu": _cpu_model(), "logical_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": sys.version.split()[0], "platform": platform.platform(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "isa": _isa_flags(),
    }
    if hasattr(os, "sched_getaffinity"):
        info["usable_cores"] = len(os.sched_getaffinity(0))
    return info


def _isa_flags() -> list[str]:
    """ISA_FLAGS this CPU reports, in that order (empty where /proc/cpuinfo is not there)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())
    return [f for f in ISA_FLAGS if f in flags]


def run_info(argv: Sequence[str]) -> dict:
    """How the numbers were made (goes into every JSON file): the command as typed, the environment
    variables that change what it measures, kvgen's version and git commit, the peers' versions."""
    env = {k: v for k, v in sorted(foreign_environment().items()) if k.startswith(ENV_PREFIXES)}
    return {"argv": list(argv), "command": shlex.join(["kvgen", *argv]), "env": env,
            "kvgen": {"version": _version("kvgen"), **_git_commit()},
            "peers": {name: _version(name) for name in PEER_PACKAGES}}


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _git_commit() -> dict:
    """The commit kvgen runs from, and whether its tracked files differ from it; {} outside a checkout."""
    if not (REPO / ".git").exists():
        return {}
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        changes = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "dirty": bool(changes.strip())}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- tables -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    """One table row: the result key, its label with unit, and the factor from raw value to shown unit."""

    key: str
    label: str
    scale: float = 1.0


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]

    def render(self) -> str:
        """The title, then columns padded to fit: the first left-aligned, numbers right-aligned."""
        widths = [max(len(row[i]) for row in [self.header, *self.rows]) for i in range(len(self.header))]

        def line(cells: list[str]) -> str:
            return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

        return "\n".join([self.title, line(self.header), *map(line, self.rows)])


def fmt(value: float | int | None) -> str:
    """Four significant figures, thousands grouped; '-' for a missing value."""
    if value is None:
        return "-"
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def comparison_table(title: str, metrics: Sequence[Metric], results: dict[str, dict],
                     baseline: str = "kvgen") -> tuple[Table, dict[str, dict[str, float | None]]]:
    """Metrics down, systems across, then a `kvgen/<other>` column per other system (raw ratios, so
    above 1 means kvgen is higher: better for rates, worse for times). Returns the table and the ratios."""
    others = [name for name in results if name != baseline]
    ratios = {f"{baseline}/{o}": {m.key: ratio(results[baseline].get(m.key), results[o].get(m.key)) for m in metrics}
              for o in others}
    header = ["metric", *results, *ratios]
    rows = [[m.label, *(fmt(_scaled(r.get(m.key), m.scale)) for r in results.values()),
             *(_ratio_text(ratios[c][m.key]) for c in ratios)] for m in metrics]
    return Table(title, header, rows), ratios


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale


def _ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


# -- output -------------------------------------------------------------------------------------


@dataclass
class Report:
    """A mode's result: `data` is its JSON document, from which PLOTS[mode] (if any) draws its figure."""

    mode: str
    data: dict
    tables: list[Table]
    notes: list[str] = field(default_factory=list)


def emit(report: Report, output_dir: Path, argv: Sequence[str] = ()) -> list[Path]:
    """Prints the tables and notes, writes the JSON (and the PNG); returns the files written.
    `argv`: the command's arguments after `kvgen`, recorded so that `kvgen bench report` can print
    the exact command beside its figures."""
    for table in report.tables:
        print(table.render())
        print()
    for note in report.notes:
        print(note)
    output_dir.mkdir(parents=True, exist_ok=True)
    data = report.data | {"mode": report.mode, "machine": machine_info(), "run": run_info(argv),
                          "notes": report.notes}
    written = [output_dir / f"{report.mode}.json"]
    written[0].write_text(json.dumps(data, indent=2) + "\n")
    if report.mode in PLOTS:
        try:
            PLOTS[report.mode](data, output_dir / f"{report.mode}.png")
            written.append(output_dir / f"{report.mode}.png")
        except PlotsUnavailable as e:
            print(f"no {report.mode}.png: {e}", file=sys.stderr)
    print("wrote " + ", ".join(map(str, written)))
    return written


# -- plots (from the JSON data) -----------------------------------------------------------------


class PlotsUnavailable(KVGenError):
    """matplotlib is not installed (it is the `[bench]` extra)."""


def pyplot():
    """matplotlib's pyplot on a backend that needs no display; PlotsUnavailable without matplotlib."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        if e.name != "matplotlib":
            raise
        raise PlotsUnavailable("matplotlib is not installed (pip install 'kvgen[bench]')") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(data: dict, path: Path) -> None:
    """Output tokens/s per system: batched kvgen next to one-at-a-time kvgen and the peers."""
    plt = pyplot()
    names = list(data["results"])
    values = [data["results"][n]["output_tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.4 * len(names) + 1), 3.6))
    bars = ax.bar(names, values, color=["C0" if n == "kvgen" else "C7" for n in names])
    ax.bar_label(bars, labels=[fmt(v) for v in values])
    ax.margins(y=0.12)
    settings = data["settings"]
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{settings['model']}: {settings['num_requests']} requests, {settings['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_scaling(data: dict, path: Path) -> None:
    """Left: time of one decode step against position. Right: total time for n tokens, with fitted slopes."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, series) in enumerate(data["results"].items()):
        color = f"C{i}"
        left.loglog(series["positions"], series["step_s"], "o-", color=color,
                    label=f"{name} (slope {series['step_slope']:.2f})")
        right.loglog(series["n"], series["total_s"], "o-", color=color,
                     label=f"{name} (slope {series['total_slope']:.2f})")
    left.set(xlabel="position t", ylabel="seconds per decode step", title="one decode step at position t")
    right.set(xlabel="tokens generated n", ylabel="seconds", title="total time for n tokens")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{data['settings']['model']}, {data['settings']['dtype']}: KV cache vs recompute")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PLOTS = {"throughput": plot_throughput, "scaling": plot_scaling}
