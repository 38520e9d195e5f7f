"""The subcommands that live with their subsystem, each as `register(subparsers)`.

kvgen.cli adds these after its own (generate, batch, kv-size). They build on kvgen.options, never on
kvgen.cli, so the imports run one way: cli -> commands -> subsystem cli -> options.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvgen.bench.cli import register as register_bench
from kvgen.chat.cli import register as register_chat
from kvgen.eval.cli import register as register_eval
from kvgen.models_cli import register as register_models
from kvgen.server.cli import register as register_serve



def register_cache(sub: argparse._SubParsersAction) -> None:
    """`kvgen cache ls|clear --kv-cache-dir DIR`: the disk tier's blocks (kvgen.cache.tiers.disk)."""
    cache = sub.add_parser("cache", help="list or clear the KV disk tier (--kv-cache-dir)")
    cache.add_argument("action", choices=("ls", "clear"))
    cache.add_argument("--kv-cache-dir", required=True, help="the disk tier's directory")
    cache.add_argument("--json", action="store_true")
    cache.set_defaults(func=cmd_cache)


def cmd_cache(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from kvgen.cache.sizing import format_bytes
    from kvgen.cache.tiers.disk import clear_blocks, list_blocks

    if not Path(args.kv_cache_dir).is_dir():
        raise ValueError(f"{args.kv_cache_dir} is not a directory")
    if args.action == "clear":
        print(f"removed {clear_blocks(args.kv_cache_dir)} block files from {args.kv_cache_dir}")
        return 0
    rows = list_blocks(args.kv_cache_dir)
    if args.json:
        print(json.dumps({identity.hex(): row for identity, row in rows.items()}))
        return 0
    print(f"{'model identity':<18} {'blocks':>8} {'tokens':>10} {'bytes':>12}")
    for identity, row in sorted(rows.items(), key=lambda r: -r[1]["bytes"]):
        print(f"{identity.hex()[:16]:<18} {row['blocks']:>8,} {row['tokens']:>10,} {format_bytes(row['bytes']):>12}")
    total = sum(r["bytes"] for r in rows.values())
    print(f"{len(rows)} model identities, {sum(r['blocks'] for r in rows.values()):,} blocks, {format_bytes(total)} "
          f"in {args.kv_cache_dir}")
    return 0


SUBSYSTEM_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    register_serve, register_chat, register_bench, register_eval, register_cache, register_models,
)
