"""KV tiers below the pool (kvgen.cache.tiers): evicted prefix blocks come back from RAM or disk as
prefix hits, and greedy tokens equal the plain cache's; faults on disk end in a recompute and one warning."""

import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

from kvgen import LLM, SamplingParams
from kvgen.cache.tiers.disk import SUFFIX

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
DOC = "Once upon a time there was a little girl named Lily. She loved to play in the park with her ball. " * 6
OTHERS = ["Tom had a big red dog " * 16, "The sun was hot and the sky " * 16]


def run(prompts, **kw):
    """Each prompt alone, in order, through a fresh engine; (token ids per prompt, prompt tokens computed, llm).
    The disk tier's background writes are finished before it returns."""
    kw = {"num_kv_blocks": 14, "block_size": 16, "max_num_seqs": 1, **kw}
    llm = LLM(**kw)
    outs = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    if getattr(llm.engine.kv, "tiers", None) is not None and llm.engine.kv.tiers.disk is not None:
        llm.engine.kv.tiers.disk.flush()
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.num_used_blocks == 0
    stats = llm.engine.stats()
    return outs, stats.prefix_cache_queries - stats.prefix_cache_hits, llm


def doc_blocks(llm) -> int:
    return (len(llm.engine.tokenizer.encode(DOC + " Q1")) - 1) // 16


def tier_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name.startswith("kvgen.cache.tiers")]


PROMPTS = [DOC + " Q1", *OTHERS, DOC + " Q2"]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8", "bfloat16"])
def test_a_host_tier_serves_an_evicted_prefix_with_the_plain_caches_tokens(kv_cache_dtype):
    plain, computed_plain, _ = run(PROMPTS, kv_cache_dtype=kv_cache_dtype)
    tiered, computed, llm = run(PROMPTS, kv_cache_dtype=kv_cache_dtype, kv_offload_memory=64 << 20)
    assert tiered == plain
    saved = doc_blocks(llm) * 16
    assert computed == computed_plain - saved  # the document's blocks came back from RAM, not recomputed
    host = llm.engine.kv.tiers.counters["host"]
    assert host.hits == doc_blocks(llm) and host.bytes_out == host.hits * llm.engine.kv.io.block_bytes


def test_a_host_tier_smaller_than_the_prefix_keeps_what_fits_and_stays_correct():
    plain, computed_plain, _ = run(PROMPTS)
    tiered, computed, llm = run(PROMPTS, kv_offload_memory=3 * 20480)  # 3 blocks of stories260K's 20 KiB
    assert tiered == plain
    assert llm.engine.kv.tiers.host.nbytes <= 3 * 20480
    assert computed <= computed_plain


def test_a_restarted_engine_serves_the_prefix_from_disk(tmp_path):
    plain, _, _ = run([DOC + " Q1"], num_kv_blocks=40)
    first, computed_first, _ = run([DOC + " Q1"], num_kv_blocks=40, kv_cache_dir=str(tmp_path))
    again, computed_again, llm = run([DOC + " Q1"], num_kv_blocks=40, kv_cache_dir=str(tmp_path))
    assert first == again == plain
    assert computed_again == computed_first - doc_blocks(llm) * 16
    assert llm.engine.kv.tiers.counters["disk"].hits == doc_blocks(llm)
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == doc_blocks(llm)


def test_host_and_disk_together(tmp_path):
    plain, computed_plain, _ = run(PROMPTS)
    tiered, computed, llm = run(PROMPTS, kv_offload_memory=2 * 20480, kv_cache_dir=str(tmp_path))
    assert tiered == plain
    assert computed == computed_plain - doc_blocks(llm) * 16  # two blocks from RAM, the rest from disk
    counters = llm.engine.kv.tiers.counters
    assert counters["host"].hits + counters["disk"].hits == doc_blocks(llm) and counters["disk"].hits > 0


def test_the_disk_budget_holds_under_load(tmp_path):
    budget = 4 * 21000  # four block files
    plain, _, _ = run(PROMPTS)
    tiered, _, _ = run(PROMPTS, kv_cache_dir=str(tmp_path), kv_cache_disk=budget)
    assert tiered == plain
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= budget


def _fill(tmp_path):
    """The document's blocks on disk, and the plain run's tokens for a second question on it."""
    run([DOC + " Q1"], num_kv_blocks=40, kv_cache_dir=str(tmp_path))
    plain, computed_plain, _ = run([DOC + " Q2"], num_kv_blocks=40)
    return sorted(tmp_path.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime), plain, computed_plain


def test_flipped_bytes_in_a_block_file_are_recomputed_with_one_warning(tmp_path, caplog):
    files, plain, computed_plain = _fill(tmp_path)
    for path in files[3:4]:
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0xFF
        path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        out, computed, llm = run([DOC + " Q2"], num_kv_blocks=40, kv_cache_dir=str(tmp_path))
    assert out == plain
    assert computed == computed_plain - 3 * 16  # the three blocks before the corrupt one were used
    assert len(tier_warnings(caplog)) == 1 and "checksum" in tier_warnings(caplog)[0]
    caplog.clear()  # the recomputed blocks were written again: a third engine reads them all, and warns of nothing
    with caplog.at_level(logging.WARNING):
        again, computed_again, _ = run([DOC + " Q2"], num_kv_blocks=40, kv_cache_dir=str(tmp_path))
    assert again == plain and computed_again == computed_plain - doc_blocks(llm) * 16
    assert not tier_warnings(caplog)


def test_a_truncated_block_file_is_removed_with_one_warning(tmp_path, caplog):
    files, plain, computed_plain = _fill(tmp_path)
    with open(files[2], "r+b") as f:
        f.truncate(files[2].stat().st_size // 2)
    with caplog.at_level(logging.WARNING):
        out, computed, _ = run([DOC + " Q2"], num_kv_blocks=40, kv_cache_dir=str(tmp_path))
    assert out == plain and computed == computed_plain - 2 * 16
    assert len(tier_warnings(caplog)) == 1 and "truncated" in tier_warnings(caplog)[0]


def test_another_model_or_kv_layout_never_reads_the_blocks(tmp_path, caplog, hf_model):
    _fill(tmp_path)
    plain, computed_plain, _ = run([DOC + " Q2"], num_kv_blocks=40, kv_cache_dtype="bfloat16")
    with caplog.at_level(logging.WARNING):
        out, computed, llm = run([DOC + " Q2"], num_kv_blocks=40, kv_cache_dtype="bfloat16",
                                 kv_cache_dir=str(tmp_path))
    assert out == plain and computed == computed_plain
    assert len(tier_warnings(caplog)) == 1 and "another model" in tier_warnings(caplog)[0]
    assert llm.engine.kv.tiers.counters["disk"].hits == 0


def test_a_full_disk_turns_the_disk_tier_off_with_one_warning(tmp_path, caplog, monkeypatch):
    import errno

    import kvgen.cache.tiers.disk as disk

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    plain, _, _ = run(PROMPTS)
    monkeypatch.setattr(disk.os, "replace", full)
    with caplog.at_level(logging.WARNING):
        out, _, llm = run(PROMPTS, kv_cache_dir=str(tmp_path))
    assert out == plain
    assert len(tier_warnings(caplog)) == 1 and "disk is full" in tier_warnings(caplog)[0]
    assert not llm.engine.kv.tiers.disk.enabled and not list(tmp_path.iterdir())


KILLED_WRITER = textwrap.dedent("""
    import os, sys, time
    import kvgen.cache.tiers.disk as disk
    def stall(*args):
        print("writing", flush=True)
        time.sleep(600)
    disk.os.replace = stall
    from kvgen import LLM, SamplingParams
    llm = LLM(num_kv_blocks=40, block_size=16, max_num_seqs=1, kv_cache_dir=sys.argv[1])
    llm.generate([sys.argv[2]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
""")


def test_a_server_killed_mid_write_leaves_nothing_that_is_read(tmp_path, caplog):
    """A process SIGKILLed between writing a block's temporary file and renaming it into place."""
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path), DOC + " Q1"],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert child.stdout.readline().strip() == "writing"
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob("*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    assert list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(f"*{SUFFIX}"))
    plain, computed_plain, _ = run([DOC + " Q2"], num_kv_blocks=40)
    with caplog.at_level(logging.WARNING):
        out, computed, _ = run([DOC + " Q2"], num_kv_blocks=40, kv_cache_dir=str(tmp_path))
    assert out == plain and computed == computed_plain
    assert len(tier_warnings(caplog)) == 1 and "unfinished write" in tier_warnings(caplog)[0]
    assert not list(tmp_path.glob("*.tmp"))


# int8 offload's layout and identity are the fast suite's on stories260K (below); on the real file: slow.
@pytest.mark.parametrize("offload_dtype", ["auto", pytest.param("int8", marks=pytest.mark.slow)])
def test_smollm2_real_file_host_tier_equals_the_plain_cache(smollm_gguf, offload_dtype):
    doc = ("The quick brown fox jumps over the lazy dog while the farmer watches from the porch and "
           "thinks about the harvest, the weather and the price of wheat at the market in town. ") * 4
    prompts = [doc + "Who watches?", "Write a haiku about the sea. " * 6, "List three colors. " * 8,
               doc + "What does the farmer think about?"]
    kw = dict(model=smollm_gguf, quantization="none", dtype="float32", num_kv_blocks=12, block_size=16,
              max_num_seqs=1)
    plain, computed_plain, _ = run(prompts, **kw)
    tiered, computed, llm = run(prompts, **kw, kv_offload_memory=256 << 20, kv_offload_dtype=offload_dtype)
    assert tiered == plain
    assert llm.engine.kv.tiers.counters["host"].hits > 0 and computed < computed_plain
    fp32_block = 16 * llm.engine.bytes_per_token
    assert llm.engine.kv.io.block_bytes == (fp32_block if offload_dtype == "auto" else fp32_block * (64 + 4) // 256)


def test_int8_offload_blocks_are_another_layout_on_disk(tmp_path, caplog):
    """The offload dtype is part of the disk identity: an int8 tier never reads the pool-dtype tier's files."""
    _fill(tmp_path)
    plain, computed_plain, _ = run([DOC + " Q2"], num_kv_blocks=40)
    with caplog.at_level(logging.WARNING):
        out, computed, llm = run([DOC + " Q2"], num_kv_blocks=40, kv_cache_dir=str(tmp_path), kv_offload_dtype="int8")
    assert computed == computed_plain and llm.engine.kv.tiers.counters["disk"].hits == 0
    assert len(tier_warnings(caplog)) == 1 and "another model" in tier_warnings(caplog)[0]
    again, computed_again, llm = run([DOC + " Q2"], num_kv_blocks=40, kv_cache_dir=str(tmp_path),
                                     kv_offload_dtype="int8")
    assert llm.engine.kv.tiers.counters["disk"].hits == doc_blocks(llm) and computed_again < computed
    assert out == plain and again == plain  # stories260K: int8 blocks give the same greedy tokens here


def test_int8_offload_of_a_quantized_pool_is_refused_in_one_line():
    with pytest.raises(ValueError, match="for float KV pools") as refused:
        LLM(kv_cache_dtype="int8", kv_offload_memory=1 << 20, kv_offload_dtype="int8")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("options, params", [
    ({"max_num_batched_tokens": 16}, {}),  # chunked prefill around restored blocks
    ({"speculative_method": "ngram", "num_speculative_tokens": 3, "adaptive_speculation": False}, {}),
    ({}, {"kv_policy": "window:32"}),  # blocks hashed under the window's key: their own chain
    ({}, {"n": 2}),
    ({"max_num_seqs": 4}, {}),  # the prompts in one batch
])
def test_tiers_with_other_engine_features_keep_the_tokens(options, params):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **params)

    def outs(**kw):
        llm = LLM(**{"num_kv_blocks": 14, "block_size": 16, "max_num_seqs": 1, **options, **kw})
        got = [[c.token_ids for c in llm.generate([p], sp)[0].outputs] for p in PROMPTS]
        got += [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[::-1], sp)]
        llm.engine.kv.check_invariants()
        assert llm.engine.kv.num_used_blocks == 0
        return got, llm

    plain, _ = outs()
    tiered, llm = outs(kv_offload_memory=64 << 20)
    assert tiered == plain


def test_tiers_need_the_paged_cache():
    with pytest.raises(ValueError, match="paged"):
        LLM(kv_cache="contiguous", kv_offload_memory=1 << 20)


def test_a_second_model_on_the_same_directory_never_reads_the_firsts_blocks(tmp_path, caplog, smollm_gguf):
    _fill(tmp_path)  # stories260K's blocks
    kw = dict(model=smollm_gguf, num_kv_blocks=40)  # packed: what is checked is whose blocks are read
    plain, computed_plain, _ = run([DOC + " Q2"], **kw)
    with caplog.at_level(logging.WARNING):
        out, computed, llm = run([DOC + " Q2"], **kw, kv_cache_dir=str(tmp_path))
    assert out == plain and computed == computed_plain
    assert len(tier_warnings(caplog)) == 1 and "another model" in tier_warnings(caplog)[0]
    assert llm.engine.kv.tiers.counters["disk"].hits == 0
