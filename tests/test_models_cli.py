"""`kvgen ls` and `kvgen pull`: local model files, the Hugging Face cache, and a repo that cannot be had."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _kvgen(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-m", "kvgen", *args], capture_output=True, text=True, env=full, timeout=120)


def _fake_hub_cache(root: Path) -> None:
    """The layout huggingface_hub keeps: blobs, snapshots of symlinks to them, refs."""
    repo = root / "models--org--tiny-GGUF"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_bytes(b"GGUF" + b"\0" * 2044)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "tiny-Q4_K_M.gguf").symlink_to(repo / "blobs" / "abc123")


def test_ls_lists_files_directories_and_the_hub_cache(tmp_path):
    (tmp_path / "models" / "hf").mkdir(parents=True)
    (tmp_path / "models" / "hf" / "config.json").write_text("{}")
    (tmp_path / "models" / "hf" / "model.safetensors").write_bytes(b"\0" * 4096)
    (tmp_path / "models" / "a.gguf").write_bytes(b"\0" * 1024)
    _fake_hub_cache(tmp_path / "hub")
    out = _kvgen("ls", str(tmp_path / "models"), HF_HUB_CACHE=str(tmp_path / "hub"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.endswith(str(tmp_path / "models" / "a.gguf")) and "1.0 KB" in line for line in lines), lines
    assert any(line.endswith(str(tmp_path / "models" / "hf")) for line in lines), lines
    assert any("org/tiny-GGUF --gguf-file tiny-Q4_K_M.gguf  (Hugging Face cache)" in line for line in lines), lines


def test_pull_of_a_repo_out_of_reach_fails_in_one_line(tmp_path):
    out = _kvgen("pull", "org/none-GGUF:Q4_K_M", HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "org/none-GGUF" in out.stderr


def test_pull_of_a_cached_gguf_prints_its_path(tmp_path):
    _fake_hub_cache(tmp_path)
    out = _kvgen("pull", "org/tiny-GGUF", "--gguf-file", "tiny-Q4_K_M.gguf", HF_HUB_OFFLINE="1",
                 HF_HUB_CACHE=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).name == "tiny-Q4_K_M.gguf"
