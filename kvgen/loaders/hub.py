"""`--model` as a Hugging Face repo id: `org/name` (a HF model repo), `org/name:Q4_K_M` or `--gguf-file NAME`
(one file of a GGUF repo).

Everything goes through `huggingface_hub`, so its cache (`HF_HUB_CACHE`, `HF_HOME`) and offline mode
(`HF_HUB_OFFLINE=1`) apply as for any Hugging Face tool. A local path always wins over a repo id.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from kvgen.errors import ModelLoadError

_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")
# What a HF model directory needs; a repo's other files (other formats, images, ...) are not fetched.
HF_MODEL_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]


def resolve_model(spec: str, gguf_file: str | None = None) -> Path:
    """A local path (`gguf_file` inside it, if given), else the downloaded or cached files of a repo id.

    Raises ModelLoadError, one line, when the repo, or the file asked for, cannot be had.
    """
    path = Path(spec)
    repo_id, _, quant = spec.partition(":")
    if path.exists() or not _REPO_ID.fullmatch(repo_id):
        return path / gguf_file if gguf_file else path
    from huggingface_hub import hf_hub_download, snapshot_download  # here: importing it takes 0.1-0.2 s

    files = _repo_files(repo_id)
    if gguf_file or quant:
        name = gguf_file or _pick_gguf(repo_id, quant, files)
        if name not in files:
            raise ModelLoadError(repo_id, f"has no file {name!r} (GGUF files: {_listing(_ggufs(files))})")
        return Path(_hub(repo_id, lambda: hf_hub_download(repo_id, name), f"{repo_id} {name}"))
    if "config.json" in files:
        return Path(_hub(repo_id, lambda: snapshot_download(repo_id, allow_patterns=HF_MODEL_FILES)))
    if _ggufs(files):
        raise ModelLoadError(repo_id, f"is a GGUF repo: pick a file with {repo_id}:QUANT or --gguf-file NAME "
                                      f"(GGUF files: {_listing(_ggufs(files))})")
    raise ModelLoadError(repo_id, "has neither config.json nor a .gguf file")


def _repo_files(repo_id: str) -> list[str]:
    """The repo's file names: from the Hub, or, offline or without a network, from the cached snapshot."""
    from huggingface_hub import HfApi, constants, errors, snapshot_download

    if not constants.is_offline_mode():
        try:
            return HfApi().list_repo_files(repo_id)
        except errors.RepositoryNotFoundError:
            raise ModelLoadError(repo_id, "no such Hugging Face repo (or a private one: hf auth login)") from None
        except Exception:  # noqa: BLE001 -- no network; the HTTP client's errors are not huggingface_hub's API
            pass
    root = Path(_hub(repo_id, lambda: snapshot_download(repo_id, local_files_only=True)))
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _pick_gguf(repo_id: str, quant: str, files: list[str]) -> str:
    """The one .gguf file whose name contains `quant` (any case)."""
    matches = [f for f in _ggufs(files) if quant.lower() in Path(f).name.lower()]
    if len(matches) != 1:
        found = "no" if not matches else f"{len(matches)}"
        raise ModelLoadError(f"{repo_id}:{quant}", f"{found} GGUF files match {quant!r} "
                                                   f"(GGUF files: {_listing(_ggufs(files))}); use --gguf-file NAME")
    return matches[0]


def _hub(repo_id: str, call: Callable[[], str], what: str | None = None) -> str:
    """Runs a huggingface_hub download; a file missing from the cache while offline becomes a one-line
    ModelLoadError saying how to download it (`what`: the `hf download` arguments)."""
    from huggingface_hub import constants, errors

    try:
        return call()
    except errors.LocalEntryNotFoundError:
        raise ModelLoadError(repo_id, f"not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the Hub "
                                      f"is out of reach; download it first: hf download {what or repo_id}") from None
    except errors.HfHubHTTPError as e:
        raise ModelLoadError(repo_id, f"Hugging Face Hub: {str(e).splitlines()[0]}") from None


def _ggufs(files: list[str]) -> list[str]:
    return [f for f in files if f.endswith(".gguf")]


def _listing(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return (", ".join(names[:limit]) or "none") + more
