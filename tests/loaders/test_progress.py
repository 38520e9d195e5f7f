"""Loading's progress bar and what loading leaves resident (kvgen.loaders.progress, .residency)."""

from __future__ import annotations

import io
import sys

from gguf import GGMLQuantizationType as QType

from kvgen.llm import LLM
from kvgen.loaders import progress
from kvgen.loaders.residency import peak_rss_bytes, rss_bytes
from tests.loaders.gguf_builder import Dims, llama_vocab, random_model, write_gguf


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_counts_every_byte_of_the_weights_on_a_terminal(tmp_path, stories_dir, monkeypatch):
    """Each tensor is counted once as it is converted (the tied embedding and head share one table),
    so the bar ends at the file's tensor bytes."""
    vocab = llama_vocab(stories_dir)
    model = random_model(QType.Q4_K, len(vocab.tokens), Dims())
    del model["lm_head.weight"]
    path = write_gguf(tmp_path / "m.gguf", model, vocab)
    total = sum(stored.nbytes for _, stored in model.values())
    counted = []
    monkeypatch.setattr(sys, "stderr", Terminal())
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)
    original = progress.advance
    monkeypatch.setattr("kvgen.model.linear_choice.advance", lambda n: (counted.append(n), original(n)))
    llm = LLM(path, kv_cache_memory=8 << 20)
    assert sum(counted) == total and "loading weights" in sys.stderr.getvalue()
    stats = llm.load_stats
    assert stats.file_bytes == path.stat().st_size and 0 < stats.rss_bytes <= stats.peak_rss_bytes
    assert stats.seconds > 0 and stats.summary().startswith(f"loaded {path} (")


def test_no_bar_off_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with progress.loading(100):
        progress.advance(100)
    progress.advance(5)  # outside a block: nothing to update
    assert sys.stderr.getvalue() == ""


def test_rss_is_read():
    assert 0 < rss_bytes() <= peak_rss_bytes()
