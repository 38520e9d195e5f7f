"""Files the tests fetch or convert once and keep in the test-model cache ($KVGEN_TEST_MODELS, default
~/.cache/kvgen-test-models): real GGUFs that shared/models/*/fetch.sh assembles, and transformers' and
gguf's readings of GGUFs. Each is made under a lock of its own, so two processes (a run and tests/prebuild.py
beside it) make it once: the second waits, then finds it there."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
from pathlib import Path

from benchmarks.llama_tools import file_lock
from tests.loaders.arch_fixtures import cache_root


class FetchError(RuntimeError):
    """A model could not be fetched; the message says why."""


def fetch_model(fetch: Path, name: str) -> Path:
    """The file `fetch` (a fetch.sh) assembles into the cache, fetched at most once at a time."""
    if not fetch.is_file():
        raise FetchError(f"{fetch} is missing")
    with file_lock(cache_root() / f".fetch-{fetch.parent.name}.lock"):  # fetch.sh writes one temporary name
        done = subprocess.run(["bash", str(fetch)], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise FetchError(f"fetching {name} failed: {done.stderr.strip()[-500:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def transformers_saved(gguf: Path) -> Path:
    """transformers' reading of `gguf` (dequantized to float32), saved in its own format.

    Reading a GGUF takes transformers 15-65 s (its vocabulary and tensors converted in Python), so the
    first reading is saved under the cache, keyed by the file's size and time and by transformers'
    version; later runs load that in a few seconds."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stat = gguf.stat()
    saved = cache_root() / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}-transformers-{transformers.__version__}"
    with file_lock(cache_root() / f".{saved.name}.lock"):
        if not (saved / "config.json").is_file():
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            model.hf_quantizer = None  # the values are plain float32 by now; saved as such
            model.config.__dict__.pop("quantization_config", None)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            partial = saved.with_name(saved.name + f".partial-{os.getpid()}")
            model.save_pretrained(partial)
            tokenizer.save_pretrained(partial)
            try:
                partial.rename(saved)
            except OSError:  # saved meanwhile by a run that took no lock
                shutil.rmtree(partial, ignore_errors=True)
    return saved


def gguf_reading(path: Path) -> dict:
    """gguf's `GGUFReader` reading of `path`: {"metadata": key -> contents(), "tensors": [[name, shape,
    type, data offset, bytes], ...]}. Parsing Gemma 3's 262,144-token vocabulary takes that reader ~15 s,
    so the first reading is saved as JSON under the cache, keyed by the file's size and time and by
    gguf's version (JSON keeps Python's int, float, bool and str apart, which the comparison checks)."""
    import gguf

    stat = path.stat()
    version = importlib.metadata.version("gguf")
    saved = cache_root() / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-gguf-{version}.json"
    with file_lock(cache_root() / f".{saved.name}.lock"):
        if not saved.is_file():
            reader = gguf.GGUFReader(path)
            reading = {"metadata": {key: field.contents() for key, field in reader.fields.items()},
                       "tensors": [[t.name, [int(d) for d in t.shape], int(t.tensor_type), int(t.data_offset),
                                    int(t.n_bytes)] for t in reader.tensors]}
            partial = saved.with_name(saved.name + f".partial-{os.getpid()}")
            partial.write_text(json.dumps(reading))
            partial.rename(saved)
    return json.loads(saved.read_text())
