"""llama.cpp's own tools, for making GGUF files the way llama.cpp users get them.

    converter_dir(cache)  `convert_hf_to_gguf.py` with its `conversion/` and `gguf-py/`, from the
                          llama-cpp-python sdist (which vendors llama.cpp): `pip download`ed and
                          unpacked once into `cache` (the test fixtures keep theirs in their own cache)
    convert(...)          runs it on a Hugging Face directory
    find_binary(program)  a llama.cpp binary (llama-quantize, llama-server): `$KVGEN_LLAMA_QUANTIZE` /
                          `$KVGEN_LLAMA_SERVER`, else beside the libraries llama-cpp-python loads
                          (`$LLAMA_CPP_LIB_PATH`, the same build), else on PATH
    quantize(...)         runs llama-quantize
    gguf_tokenizer_dir    transformers' reading of a GGUF's tokenizer, saved as tokenizer.json (a real
                          byte-level BPE the converter recognises), once

Each raises `ToolError` with the step, the command and its output when it fails.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp converts
QWEN2_VOCAB = "models/ggml-vocab-qwen2.gguf"  # llama.cpp's vocabulary-only test file, in the sdist (tests use it)
_UNPACKED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "LICENSE", QWEN2_VOCAB)


class ToolError(RuntimeError):
    """A llama.cpp tool could not be had or failed; the message says which step and why."""


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock file, so that two processes build a cached file once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fd:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


def converter_dir(cache: Path) -> Path:
    """`cache`/llama-cpp-convert-<version>, downloaded and unpacked on first use."""
    root = cache / f"llama-cpp-convert-{LLAMA_CPP_PYTHON}"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    with file_lock(cache / ".convert.lock"):
        if not (root / "convert_hf_to_gguf.py").is_file():
            _download_converter(cache, root)
    return root


def _download_converter(cache: Path, root: Path) -> None:
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp]
        print("downloading the llama-cpp-python sdist for llama.cpp's convert_hf_to_gguf.py", file=sys.stderr)
        r = subprocess.run(cmd, capture_output=True, text=True)
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not sdists:  # pip may fail after saving (preparing metadata); the file is what counts
            raise ToolError(f"cannot get llama.cpp's converter: `{' '.join(cmd)}` failed "
                            f"(rc {r.returncode}): {r.stderr.strip()[-2000:]}")
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        staged = Path(tmp) / "staged"
        with tarfile.open(sdists[0]) as tar:
            members = []
            for m in tar.getmembers():
                rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
                if rel and (m.isfile() or m.isdir()) and rel.startswith(_UNPACKED):
                    m.name = rel
                    members.append(m)
            tar.extractall(staged, members=members, filter="data")
        if not (staged / "convert_hf_to_gguf.py").is_file():
            raise ToolError(f"{sdists[0].name} holds no {prefix}convert_hf_to_gguf.py")
        staged.rename(root)


def convert(hf_dir: Path, out: Path, outtype: str, cache: Path, extra: tuple[str, ...] = ()) -> Path:
    """Runs convert_hf_to_gguf.py on `hf_dir` (`--outtype` f32, bf16, q8_0, ...), writing `out`; `extra`
    are more of its flags (`--no-mtp` for a Qwen3.5 directory saved by transformers, which has no MTP
    layers: the converter asserts it has some unless told)."""
    conv = converter_dir(cache)
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the script then prefers gguf-py
    env |= {"PYTHONPATH": os.pathsep.join([str(conv / "gguf-py"), str(conv)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(conv / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out),
           "--outtype", outtype, *extra]
    _run(cmd, out, f"convert_hf_to_gguf.py --outtype {outtype} {' '.join(extra)} on {hf_dir}".replace("  ", " "), env)
    return out


def gguf_tokenizer_dir(source: Path, out: Path) -> Path:
    """`out` holding the tokenizer of the GGUF `source` as transformers rebuilds and saves it
    (tokenizer.json + tokenizer_config.json, no chat template), built once."""
    if (out / "tokenizer.json").is_file():
        return out
    if not source.is_file():
        raise ToolError(f"{source} is missing: it is where the {out.name} tokenizer comes from")
    with file_lock(out.parent / f".{out.name}.lock"):
        if not (out / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
            tmp = Path(tempfile.mkdtemp(dir=out.parent))
            tok.save_pretrained(tmp)
            (tmp / "chat_template.jinja").unlink(missing_ok=True)
            tmp.rename(out)
    return out


def qwen2_tokenizer_dir(cache: Path) -> Path:
    """Qwen2's vocabulary (151936 tokens, from the converter's ggml-vocab-qwen2.gguf) as a tokenizer
    directory the converter recognises ('qwen2'), in `cache`/tokenizers/qwen2."""
    return gguf_tokenizer_dir(converter_dir(cache) / QWEN2_VOCAB, cache / "tokenizers" / "qwen2")


def find_binary(program: str) -> Path:
    """The llama.cpp binary `program` (see the module docstring); ToolError naming where it looked."""
    variable = f"KVGEN_{program.upper().replace('-', '_')}"
    candidates = [os.environ.get(variable)]
    if lib := os.environ.get("LLAMA_CPP_LIB_PATH"):
        candidates.append(str(Path(lib) / program))
    candidates.append(shutil.which(program))
    for candidate in filter(None, candidates):
        if Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    built_with = " with -DLLAMA_BUILD_SERVER=ON" if program == "llama-server" else ""
    raise ToolError(f"{program}: no binary (build llama.cpp{built_with} and set {variable}, or LLAMA_CPP_LIB_PATH "
                    f"to its bin directory, or PATH)")


def quantize(source: Path, out: Path, mix: str, threads: int | None = None, requantize: bool = False) -> Path:
    """`llama-quantize source out MIX` (a GGUF of F32/F16/BF16 tensors -> the mix, e.g. Q4_K_M). With
    `requantize`, the source may hold quantized tensors (`--allow-requantize`: they are dequantized
    first, so the result carries both roundings; the tests make real-weight files of other mixes so)."""
    flags = ["--allow-requantize"] if requantize else []
    cmd = [str(find_binary("llama-quantize")), *flags, str(source), str(out), mix,
           str(threads or os.cpu_count() or 1)]
    env = os.environ | {"LD_LIBRARY_PATH": f"{Path(cmd[0]).parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    _run(cmd, out, f"llama-quantize to {mix}", env)
    return out


def _run(cmd: list[str], out: Path, step: str, env: dict[str, str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0 or not out.is_file():
        raise ToolError(f"{step} failed (rc {r.returncode}): {' '.join(cmd)}\n{(r.stdout + r.stderr)[-4000:]}")
