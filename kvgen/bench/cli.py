"""`kvgen bench MODE`: latency, throughput, scaling, serve, replicas (and plot, to redraw figures from JSON; report,
to write BENCHMARKS.md from it: benchmarks.page, in the peer harness of a checkout, as are the peers).

Every mode prints a table, writes `<output-dir>/<mode>.json` and, where it has a figure, `<mode>.png`.
Engine options are the same as for `generate` / `serve`; peers (`--compare hf|llama.cpp|ct2`) run on
the same files, dtype and requests in the same invocation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

from kvgen.bench import latency, memory, scaling, throughput
from kvgen.bench.bench_model import BenchModel, resolve
from kvgen.bench.harness import available, harness
from kvgen.bench.report import PLOTS, Report, emit
from kvgen.bench.system import KvgenSystem, PeerUnavailable, System
from kvgen.bench.tasks import CODE_TASK_TOKENS, MIN_PASSAGE_TOKENS, TASKS
from kvgen.cache.sizing import parse_bytes
from kvgen.config import DTYPES
from kvgen.engine.speculative.hybrid import SuffixFirst
from kvgen.llm import open_engine
from kvgen.loaders.residency import freeze_live_objects
from kvgen.options import add_engine_options, config_only, engine_config

DEFAULT_BENCH_MODEL = "smollm2-135m"


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: kvgen beside its peers, tables + JSON + plots")
    modes = bench.add_subparsers(dest="mode", required=True, metavar="MODE")

    p = _mode(modes, "latency", "batch-1 TTFT, prefill and decode speed, bytes/s vs memory bandwidth", engine=True)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up (median reported)")
    p.add_argument("--bandwidth-size", type=parse_bytes, default="1GiB",
                   help="bytes copied to measure memory bandwidth (default: 1GiB)")
    p.add_argument("--task", choices=TASKS, default="random",
                   help="random prompt ids (default); repeat: repeat a 300+ token passage (input-grounded); "
                        "free: a new story after the passage; copy: copy a Python file; edit: a replayed multi-turn "
                        "code-editing conversation over that file (kvgen/bench/tasks.py)")
    _add_compare(p)

    p = _mode(modes, "throughput", "many requests at once: requests/s and tokens/s", engine=True)
    _add_workload(p)
    p.add_argument("--sequential", action="store_true",
                   help="also run the same requests one at a time through the same engine")
    p.add_argument("--rounds", type=int, default=1,
                   help="kvgen and its variants (--compare-speculation) take turns over this many rounds of "
                        "fresh requests, so that the machine's drift falls on both (default: 1)")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 16, 32, 64],
                   help="static batch sizes peers try, fastest kept (default: 1,8,16,32,64)")
    _add_compare(p)

    p = _mode(modes, "scaling", "decode step time vs position: no cache vs contiguous vs paged", engine=True)
    p.add_argument("--max-len", type=int, help="largest position (default: min(2048, model context))")
    p.add_argument("--points", type=int, default=10, help="positions sampled, geometrically spaced")
    p.add_argument("--steps", type=int, default=3, help="decode steps timed at each position (median)")

    p = _mode(modes, "memory", "share of reserved KV slots that hold a token: contiguous vs paged", engine=True)
    _add_workload(p)

    p = _mode(modes, "serve", "load generator against a running `kvgen serve` (loopback only)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (default: inf)")
    p.add_argument("--api-key", help="Bearer key, if the server wants one")
    p.add_argument("--model", help="the served model's file, for its vocabulary (default: the default model)")
    _add_workload(p)

    p = _mode(modes, "replicas", "two data-parallel replicas vs one engine on requests sharing system prompts: "
                                 "throughput, and the prefix cache's hit rate by router (starts its own servers)")
    p.add_argument("--model", default=DEFAULT_BENCH_MODEL, help=f"model file (default: {DEFAULT_BENCH_MODEL})")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=8, help="shared system prompts (default: 8)")
    p.add_argument("--prefix-len", type=int, default=256, help="tokens in each shared prompt (default: 256)")
    p.add_argument("--suffix-len-range", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"),
                   help="tokens each request adds after its shared prompt (default: 16 64)")
    p.add_argument("--output-len-range", type=int, nargs=2, default=[32, 64], metavar=("MIN", "MAX"))
    p.add_argument("--rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (default: inf)")
    p.add_argument("--threads-per-replica", type=int, default=1, help="cores per replica (default: 1)")
    p.add_argument("--num-kv-blocks", type=int, default=1024, help="KV blocks per engine (default: 1024)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step (default: 64)")
    p.add_argument("--rounds", type=int, default=1, help="rounds the configurations take turns over (default: 1)")
    p.add_argument("--ray-address", help="also run the prefix configuration as Ray actors on this cluster "
                                         "('local': a private one)")

    p = modes.add_parser("plot", help="redraw the PNG figures from the JSON files in --output-dir")
    p.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    p.set_defaults(func=cmd_plot)

    p = modes.add_parser("report", help="BENCHMARKS.md from latency / throughput JSON files: kvgen against each "
                                        "peer, with the machine, date and command of each run")
    p.add_argument("paths", type=Path, nargs="+", metavar="JSON", help="latency.json / throughput.json files")
    p.add_argument("--output", type=Path, help="write the page here (default: print it)")
    p.add_argument("--plots-dir", type=Path, help="also draw the ratios into PLOTS_DIR/benchmark-ratios.png, linked "
                                                  "from the page")
    p.set_defaults(func=cmd_report)


def _mode(modes: argparse._SubParsersAction, name: str, help: str, engine: bool = False) -> argparse.ArgumentParser:
    parser = modes.add_parser(name, help=help, description=help)
    parser.add_argument("--output-dir", type=Path, default=Path("bench-results"), help="JSON and PNG go here")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts and lengths")
    if engine:
        parser.add_argument("--threads", type=int, help="torch threads, also given to peers (default: torch's)")
        add_engine_options(parser)
        parser.set_defaults(model=DEFAULT_BENCH_MODEL)
        parser.epilog = (f"--model also takes {DEFAULT_BENCH_MODEL} (the default: SmolLM2-135M's shape, seeded "
                         "random weights, built once) and stories260k")
    parser.set_defaults(func=cmd_bench)
    return parser


def _add_workload(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len-range", type=int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len-range", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))


def _add_compare(parser: argparse.ArgumentParser) -> None:
    peers = harness("peers", "--compare").PEERS if available() else None  # None: --compare says why when given
    parser.add_argument("--compare", action="append", default=[], choices=peers,
                        help="also run this peer on the same model and requests (repeatable)")
    parser.add_argument("--compare-speculation", action="store_true",
                        help="with --speculative-method: also run kvgen without speculation (kvgen-plain)")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return values


# -- commands -----------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    _check_args(args)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    runners = {"latency": _latency, "throughput": _throughput, "scaling": _scaling, "memory": _memory,
               "serve": _serve, "replicas": _replicas}
    emit(runners[args.mode](args), args.output_dir, args.argv)
    return 0


def _latency(args: argparse.Namespace) -> Report:
    model, kvgen, settings = _setup(args)
    plain = _plain_kvgen(args)
    longest = max(args.prompt_len, {"random": 0, "copy": CODE_TASK_TOKENS, "edit": CODE_TASK_TOKENS}.get(
        args.task, MIN_PASSAGE_TOKENS + 128)) + args.gen_len
    peers, unavailable = _peers(args, model, settings["dtype"], longest)
    weights = kvgen.engine.model.step_weight_bytes()
    report = latency.run(args, kvgen.engine.model_config, [kvgen, *plain, *peers], settings, weights,
                         kvgen.engine.tokenizer)
    return _with_speculation(_noting(report, unavailable), kvgen)


def _throughput(args: argparse.Namespace) -> Report:
    model, kvgen, settings = _setup(args)
    plain = _plain_kvgen(args)
    longest = args.prompt_len_range[1] + args.output_len_range[1]
    peers, unavailable = _peers(args, model, settings["dtype"], longest)
    vocab_size = kvgen.engine.model_config.vocab_size
    report = throughput.run(args, vocab_size, kvgen, peers, settings, variants=plain)
    return _with_speculation(_noting(report, unavailable), kvgen)


def _plain_kvgen(args: argparse.Namespace) -> list[KvgenSystem]:
    """kvgen without speculative decoding, for --compare-speculation (its ratio: kvgen/kvgen-plain)."""
    if not args.compare_speculation:
        return []
    if args.speculative_method is None:
        raise ValueError("--compare-speculation compares against --speculative-method, which is not given")
    _, plain, _ = _setup(args, speculative_method=None, draft_model=None)
    plain.name = "kvgen-plain"
    return [plain]


def _with_speculation(report: Report, kvgen: KvgenSystem) -> Report:
    """kvgen's speculative counters (proposed, accepted, mean accepted length) in the notes and JSON."""
    speculator = getattr(kvgen.engine, "speculator", None)
    if speculator is None:
        return report
    counters = speculator.counters.as_dict()
    report.data["speculative"] = counters | {"adaptive": speculator.switch.table() if speculator.switch else None}
    paired = ""
    if isinstance(speculator.proposer, SuffixFirst):
        report.data["speculative"]["from_suffix"] = speculator.proposer.from_suffix
        paired = f"; the suffix tree proposed at {speculator.proposer.from_suffix} of those steps"
    report.notes.append(f"kvgen speculative ({kvgen.engine.config.speculative_method}, K = {speculator.k}): "
                        f"{counters['proposed']} proposed, {counters['accepted']} accepted "
                        f"({counters['acceptance_rate']:.0%}), mean accepted length "
                        f"{counters['mean_accepted_length']:.2f} tokens per verifying step{paired}")
    return report


def _scaling(args: argparse.Namespace) -> Report:
    # The engine runs paged whatever --kv-cache says: none and contiguous are timed through kvgen.phases.
    _, kvgen, settings = _setup(args, kv_cache="paged")
    max_len = min(args.max_len or 2048, kvgen.engine.max_model_len)
    return scaling.run(args, kvgen, max_len, settings)


def _memory(args: argparse.Namespace) -> Report:
    _, kvgen, settings = _setup(args, kv_cache="paged")
    return memory.run(args, kvgen.engine, settings)


def _serve(args: argparse.Namespace) -> Report:
    from kvgen.bench import serve  # here: it needs httpx, which kvgen itself does not

    model = resolve(args.model)
    settings = {"model": model.name, "url": args.url, "rate": str(args.rate), "seed": args.seed,
                "num_requests": args.num_requests, "prompt_len_range": args.prompt_len_range,
                "output_len_range": args.output_len_range}
    return serve.run(args, config_only(model.path).vocab_size, settings)


def _replicas(args: argparse.Namespace) -> Report:
    from kvgen.bench import replicas  # here: it needs httpx, which kvgen itself does not

    model = resolve(args.model)
    keys = ("seed", "num_requests", "num_prefixes", "prefix_len", "suffix_len_range", "output_len_range",
            "threads_per_replica", "num_kv_blocks", "max_num_seqs", "rounds", "ray_address")
    settings = {"model": model.name, "model_path": str(model.path), "rate": str(args.rate)} | {
        key: getattr(args, key) for key in keys}
    return replicas.run(args, str(model.path), config_only(model.path).vocab_size, settings)


def _setup(args: argparse.Namespace, **overrides) -> tuple[BenchModel, KvgenSystem, dict]:
    """The model, kvgen's engine on it (engine options + `overrides`), and the settings every JSON records."""
    model = resolve(args.model)
    config = dataclasses.replace(engine_config(args), **overrides)
    engine, stats = open_engine(model.path, config, args.tokenizer, args.gguf_file)
    freeze_live_objects()
    print(stats.summary(), file=sys.stderr)
    if hasattr(engine, "capacity_report"):
        print(engine.capacity_report(), file=sys.stderr)
    settings = {"model": model.name, "model_path": str(model.path), "dtype": DTYPES[config.dtype],
                "kv_cache": config.kv_cache, "seed": args.seed,
                "engine": dataclasses.asdict(getattr(engine, "config", config)),  # "auto" KV dtype resolved
                "kvgen_load": dataclasses.asdict(stats) | {"kv_cache_bytes": kv_cache_bytes(engine)}}
    system = KvgenSystem(engine)
    system.load_s = stats.seconds
    return model, system, settings


def kv_cache_bytes(engine) -> int | None:
    """The bytes the engine's KV pools reserve (the paged engine's; None for the others)."""
    if not hasattr(engine, "capacity_tokens"):
        return None
    return engine.capacity_tokens * engine.bytes_per_token


def _noting(report: Report, unavailable: list[str]) -> Report:
    """Adds the peers that could not run to the printed notes and the JSON."""
    report.notes += unavailable
    report.data["unavailable"] = unavailable
    return report


def _peers(args: argparse.Namespace, model: BenchModel, dtype: str, max_len: int) -> tuple[list[System], list[str]]:
    """The peers of --compare that load, and one line for each that does not."""
    peers, unavailable = [], []
    peers_module = harness("peers", "--compare") if args.compare else None
    draft = peers_module.Draft(Path(args.draft_model), args.num_speculative_tokens) \
        if args.compare and getattr(args, "draft_model", None) else None
    for name in dict.fromkeys(args.compare):
        try:
            started = time.perf_counter()
            peers.append(peers_module.load_peer(name, model, dtype, max_len, args.device, draft=draft))
            peers[-1].load_s = time.perf_counter() - started
        except PeerUnavailable as e:
            unavailable.append(str(e))
    return peers, unavailable


def _check_args(args: argparse.Namespace) -> None:
    """Rejects values no mode can run with (one line, exit 2, like the rest of the CLI)."""
    for name in ("prompt_len", "repeats", "num_requests", "steps", "max_len", "bandwidth_size", "threads", "rate",
                 "rounds", "num_prefixes", "prefix_len", "threads_per_replica", "num_kv_blocks"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("prompt_len_range", "output_len_range", "suffix_len_range"):
        low, high = getattr(args, name, (1, 1))
        if not 1 <= low <= high:
            raise ValueError(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {low} {high}")
    if getattr(args, "gen_len", 2) < 2:
        raise ValueError("--gen-len must be at least 2 (decode speed is measured after the first token)")
    if getattr(args, "points", 2) < 2:
        raise ValueError("--points must be at least 2 (slopes are fitted through them)")


def cmd_report(args: argparse.Namespace) -> int:
    page = harness("page", "kvgen bench report").write_page(args.paths, args.output, args.plots_dir)
    if args.output is None:
        print(page, end="")
    else:
        print(f"wrote {args.output} ({len(page.splitlines())} lines) from {len(args.paths)} JSON files")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    drawn = []
    for mode, plot in PLOTS.items():
        source = args.output_dir / f"{mode}.json"
        if source.is_file():
            plot(json.loads(source.read_text()), args.output_dir / f"{mode}.png")
            drawn.append(str(args.output_dir / f"{mode}.png"))
    if not drawn:
        raise ValueError(f"no {' or '.join(f'{m}.json' for m in PLOTS)} in {args.output_dir}")
    print("wrote " + ", ".join(drawn))
    return 0
