"""`--model` as a Hugging Face repo id, offline, on a cache laid out the way huggingface_hub lays it out
(models--org--name/{refs/main, snapshots/<sha>/...}); HF_HUB_CACHE and HF_HUB_OFFLINE point at it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from kvgen.errors import ModelLoadError
from kvgen.loaders import load_model
from kvgen.loaders.hub import resolve_model
from tests.conftest import build_hf_model
from tests.loaders.gguf_builder import Dims, QType, gpt2_vocab, random_model, write_gguf
from tests.test_cli import assert_user_error, run

SHA = "0123456789abcdef0123456789abcdef01234567"
HF_REPO, GGUF_REPO = "kvgen-test/tiny-llama", "kvgen-test/tiny-llama-GGUF"
SMALL = Dims(hidden=256, inter=256, layers=1, heads=4, kv_heads=2)
GGUF_FILES = ("tiny-llama.Q4_K_M.gguf", "tiny-llama.Q8_0.gguf")


def _cached_repo(cache: Path, repo_id: str) -> Path:
    """An empty snapshot folder for repo_id in the cache, with refs/main pointing at it."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(SHA)
    snapshot = root / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("hf-cache")
    hf_dir, _ = build_hf_model("llama-gqa", tmp_path_factory.mktemp("hf-source"))
    shutil.copytree(hf_dir, _cached_repo(cache, HF_REPO), dirs_exist_ok=True)
    snapshot = _cached_repo(cache, GGUF_REPO)
    vocab = gpt2_vocab("gpt2")
    for name, qtype in zip(GGUF_FILES, (QType.Q4_K, QType.Q8_0)):
        write_gguf(snapshot / name, random_model(qtype, len(vocab.tokens), SMALL), vocab, SMALL)
    (snapshot / "README.md").write_text("tiny")
    return cache


@pytest.fixture
def offline(hub_cache, monkeypatch) -> Path:
    """huggingface_hub reads these at import; set them as the environment variables would have."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def test_hf_model_repo_resolves_to_the_cached_snapshot(offline):
    path = resolve_model(HF_REPO)
    assert path == offline / "models--kvgen-test--tiny-llama" / "snapshots" / SHA
    assert load_model(path).config.num_layers == 2


@pytest.mark.parametrize(("spec", "gguf_file", "name"), [
    (f"{GGUF_REPO}:Q4_K_M", None, GGUF_FILES[0]),
    (f"{GGUF_REPO}:q8_0", None, GGUF_FILES[1]),
    (GGUF_REPO, GGUF_FILES[1], GGUF_FILES[1]),
])
def test_gguf_repo_file_by_quant_or_name(offline, spec, gguf_file, name):
    path = resolve_model(spec, gguf_file)
    assert path.name == name and path.parent.name == SHA
    assert load_model(path).config.hidden_size == SMALL.hidden


def test_local_paths_win(tmp_path, offline):
    assert resolve_model(str(tmp_path)) == tmp_path
    assert resolve_model(str(tmp_path), "x.gguf") == tmp_path / "x.gguf"


@pytest.mark.parametrize(("spec", "gguf_file", "needles"), [
    ("kvgen-test/absent", None, ["not in the Hugging Face cache", "hf download kvgen-test/absent"]),
    (GGUF_REPO, None, ["is a GGUF repo", ":QUANT or --gguf-file", GGUF_FILES[0]]),
    (f"{GGUF_REPO}:Q2_K", None, ["no GGUF files match 'Q2_K'", GGUF_FILES[1]]),
    (f"{GGUF_REPO}:tiny", None, ["2 GGUF files match 'tiny'"]),
    (GGUF_REPO, "other.gguf", ["has no file 'other.gguf'"]),
])
def test_repo_errors_are_one_line(offline, spec, gguf_file, needles):
    with pytest.raises(ModelLoadError) as error:
        resolve_model(spec, gguf_file)
    assert "\n" not in str(error.value)
    for needle in needles:
        assert needle in str(error.value)


@pytest.mark.parametrize("argv", [["generate", "--model", "kvgen-test/absent"], ["serve", "kvgen-test/absent"]])
def test_missing_repo_through_the_cli(offline, capsys, argv):
    code, _, err = run(capsys, *argv)
    assert_user_error(code, err, "kvgen-test/absent", "hf download kvgen-test/absent")


def test_cli_reads_the_environment(hub_cache, tmp_path):
    """The real route: HF_HUB_CACHE and HF_HUB_OFFLINE=1 in the environment of a fresh `kvgen` process."""
    env = dict(os.environ, HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    argv = [sys.executable, "-c", "from kvgen.cli import main; raise SystemExit(main())", "generate",
            "--model", f"{GGUF_REPO}:Q8_0", "--prompt", "Hello", "--max-tokens", "4", "--json"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert '"finish_reason": "length"' in done.stdout
