"""`kvgen ls` (the models on this machine) and `kvgen pull REPO[:QUANT]` (fetch one through
huggingface_hub, with its progress bars), registered through kvgen.commands.

    kvgen ls [DIR ...]       GGUF files and Hugging Face model directories under each DIR (default: the
                             current directory, not descending past 3 levels), then the models in the
                             Hugging Face cache (HF_HUB_CACHE / HF_HOME), each with its size
    kvgen pull org/name-GGUF:Q4_K_M     one GGUF file of a repo (the same pick as --model)
    kvgen pull org/name                 a safetensors model's files

What `ls` prints is what `--model` takes: a path, or a repo id (`org/name`, `org/name:QUANT`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path

from kvgen.cache.sizing import format_bytes

MAX_DEPTH = 3


def register(subparsers: argparse._SubParsersAction) -> None:
    ls = subparsers.add_parser("ls", help="list the models on this machine (files and the Hugging Face cache)")
    ls.add_argument("dirs", nargs="*", metavar="DIR", help="where to look for model files (default: .)")
    ls.add_argument("--no-hub-cache", action="store_true", help="do not list the Hugging Face cache")
    ls.set_defaults(func=cmd_ls)
    pull = subparsers.add_parser("pull", help="fetch a model from the Hugging Face Hub: org/name or org/name:QUANT")
    pull.add_argument("spec", metavar="REPO[:QUANT]")
    pull.add_argument("--gguf-file", help="the file to fetch from a GGUF repo (instead of :QUANT)")
    pull.set_defaults(func=cmd_pull)


def local_models(root: Path) -> Iterator[tuple[Path, int]]:
    """(path, bytes) of each .gguf file and each directory with config.json + weights under root."""
    base = len(root.parts)
    for directory, subdirs, files in os.walk(root):
        here = Path(directory)
        subdirs[:] = [d for d in sorted(subdirs) if not d.startswith(".")] if len(here.parts) - base < MAX_DEPTH else []
        weights = [f for f in files if f.endswith(".safetensors")]
        if "config.json" in files and weights:
            yield here, sum((here / f).stat().st_size for f in weights)
        for name in sorted(files):
            if name.endswith(".gguf"):
                yield here / name, (here / name).stat().st_size


def hub_models() -> Iterator[tuple[str, int]]:
    """(what --model takes, bytes) for each model repo in the Hugging Face cache: org/name, or
    org/name:FILE.gguf for each GGUF file of a GGUF repo."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        return
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        files = {f.file_name: f.size_on_disk for rev in repo.revisions for f in rev.files}
        ggufs = sorted(name for name in files if name.endswith(".gguf"))
        if ggufs:
            for name in ggufs:
                yield f"{repo.repo_id} --gguf-file {name}", files[name]
        elif "config.json" in files:
            yield repo.repo_id, repo.size_on_disk


def cmd_ls(args: argparse.Namespace) -> int:
    found = 0
    for root in [Path(d) for d in args.dirs] or [Path(".")]:
        for path, size in local_models(root):
            print(f"{format_bytes(size):>10}  {path}")
            found += 1
    if not args.no_hub_cache:
        for spec, size in hub_models():
            print(f"{format_bytes(size):>10}  {spec}  (Hugging Face cache)")
            found += 1
    if not found:
        print("no models found (kvgen pull org/name-GGUF:Q4_K_M fetches one)")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from kvgen.loaders.hub import resolve_model

    path = resolve_model(args.spec, args.gguf_file)  # huggingface_hub shows its progress bars on a terminal
    if not path.exists():
        from kvgen.errors import KVGenError

        raise KVGenError(f"{args.spec} is neither a local path nor a Hugging Face repo id (org/name[:QUANT])")
    print(path)
    return 0
