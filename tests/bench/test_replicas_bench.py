"""`kvgen bench replicas` on the default model: its three servers come up and serve every request,
and the shared prompts are served from the prefix cache more with prefix-aware routing than with
round-robin (each shared prompt computed on one replica instead of both)."""

from __future__ import annotations

import json

import pytest

from kvgen.bench.replicas import shared_prefix_requests
from kvgen.cli import main


@pytest.mark.slow  # three servers, ~25 s
def test_replicas_against_one_engine(tmp_path, capsys):
    argv = ["bench", "replicas", "--model", "stories260k", "--num-requests", "12", "--num-prefixes", "3",
            "--prefix-len", "48", "--suffix-len-range", "4", "8", "--output-len-range", "4", "8",
            "--num-kv-blocks", "128", "--rate", "20", "--output-dir", str(tmp_path)]
    # --rate 20: one after another (sent all at once, requests sharing a prompt are scheduled in the
    # same step, before any of them has cached it, and both routers hit as rarely)
    assert main(argv) == 0
    data = json.loads((tmp_path / "replicas.json").read_text())
    summary = data["summary"]
    assert list(summary) == ["N=1", "N=2 prefix", "N=2 round-robin"]
    assert all((s["completed"], s["failed"]) == (12, 0) and s["output_tokens_per_s"] > 0 for s in summary.values())
    assert summary["N=2 prefix"]["prefix_cache_hit_rate"] > summary["N=2 round-robin"]["prefix_cache_hit_rate"]
    assert "prefix-aware over round-robin routing" in capsys.readouterr().out


def test_shared_prefix_requests_share_their_prompts():
    class Args:
        seed, num_requests, num_prefixes, prefix_len = 0, 12, 3, 20
        suffix_len_range, output_len_range = (2, 5), (3, 4)

    requests = shared_prefix_requests(Args, vocab_size=100)
    prefixes = {tuple(r.prompt[:20]) for r in requests}
    assert len(requests) == 12 and len(prefixes) == 3
    assert sorted(sum(tuple(r.prompt[:20]) == p for r in requests) for p in prefixes) == [4, 4, 4]
    assert all(22 <= len(r.prompt) <= 25 and 3 <= r.output_len <= 4 for r in requests)
    assert requests == shared_prefix_requests(Args, vocab_size=100)  # seeded
    assert all(min(r.prompt) >= 3 for r in requests)
