"""The tiers' parts on their own (kvgen.cache.tiers): the host tier's LRU and pins, block files on disk
and the faults they survive, the chain digest and the model identity, the pools' bytes round trip."""

import json
import logging
import os
import threading

import pytest
import torch

from kvgen.cache.tiers.disk import HEADER_BYTES, SUFFIX, DiskTier, clear_blocks, list_blocks
from kvgen.cache.tiers.host import HostTier
from kvgen.cache.tiers.identity import model_identity
from kvgen.cache.tiers.manager import chain_digest
from kvgen.cache.tiers.pool_io import Int8PoolIO, PoolIO
from kvgen.cache.tiers.sizing import tier_tokens

TOKENS = tuple(range(16))


def payload(seed: int, size: int = 1000) -> torch.Tensor:
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_the_host_tier_pushes_out_the_least_recently_used_and_keeps_pins():
    host = HostTier(3000)
    for i in range(3):
        assert host.put(bytes([i]) * 16, TOKENS, payload(i)) == []
    assert host.get(b"\0" * 16, TOKENS) is not None  # block 0 is now the most recent
    pushed = host.put(b"\3" * 16, TOKENS, payload(3))
    assert [d for d, _, _ in pushed] == [b"\1" * 16] and host.nbytes == 3000
    pushed = host.put(b"\4" * 16, TOKENS, payload(4), pinned={b"\2" * 16})
    assert [d for d, _, _ in pushed] == [b"\0" * 16]  # the pinned block 2 stays though older
    assert host.get(b"\2" * 16, (1,) * 16) is None  # other tokens: never served


def test_chain_digests_name_the_whole_prefix():
    a = chain_digest(None, TOKENS)
    assert chain_digest(None, TOKENS) == a and len(a) == 16
    assert chain_digest(a, TOKENS) != chain_digest(chain_digest(None, (5,) * 16), TOKENS)
    assert chain_digest(None, TOKENS, "window:8") != a


def test_the_identity_changes_with_the_weights_and_the_kv_layout():
    weights = {"w": torch.ones(4, 4)}
    base = model_identity("cfg", weights, {"kv_dtype": "float32", "block_size": 16})
    assert base == model_identity("cfg", {"w": torch.ones(4, 4)}, {"kv_dtype": "float32", "block_size": 16})
    assert base != model_identity("cfg", {"w": torch.full((4, 4), 2.0)}, {"kv_dtype": "float32", "block_size": 16})
    assert base != model_identity("cfg", weights, {"kv_dtype": "int8", "block_size": 16})
    assert base != model_identity("cfg", weights, {"kv_dtype": "float32", "block_size": 32})
    assert base != model_identity("cfg2", weights, {"kv_dtype": "float32", "block_size": 16})


def test_block_files_round_trip_across_a_restart_within_the_budget(tmp_path):
    disk = DiskTier(tmp_path, 3 * (HEADER_BYTES + 64 + 1000), b"A" * 32)
    for i in range(5):
        disk.put(bytes([i]) * 16, TOKENS, payload(i))
    disk.flush()
    assert len(disk) == 3 and sum(p.stat().st_size for p in tmp_path.iterdir()) <= disk.capacity
    again = DiskTier(tmp_path, disk.capacity, b"A" * 32)
    assert len(again) == 3 and torch.equal(again.get(b"\4" * 16, TOKENS), payload(4))
    assert b"\0" * 16 not in again


@pytest.fixture()
def held_writes(monkeypatch):
    """The disk tier's writer held before it renames a block into place, until the event is set."""
    import kvgen.cache.tiers.disk as disk_module

    release, replace = threading.Event(), os.replace

    def held(src, dst):
        assert release.wait(30)
        replace(src, dst)

    monkeypatch.setattr(disk_module.os, "replace", held)
    yield release
    release.set()


def test_a_block_whose_write_is_pending_is_served_from_memory(tmp_path, held_writes):
    disk = DiskTier(tmp_path, 1 << 20, b"A" * 32)
    disk.put(b"\0" * 16, TOKENS, payload(0))
    assert b"\0" * 16 in disk and not list(tmp_path.glob(f"*{SUFFIX}"))  # taken, not written yet
    assert torch.equal(disk.get(b"\0" * 16, TOKENS), payload(0))
    assert disk.get(b"\0" * 16, (1,) * 16) is None  # other tokens: never served
    held_writes.set()
    disk.flush()
    assert [p.name for p in tmp_path.iterdir()] == [f"{'00' * 16}{SUFFIX}"]
    assert torch.equal(DiskTier(tmp_path, 1 << 20, b"A" * 32).get(b"\0" * 16, TOKENS), payload(0))


def test_a_block_dropped_for_the_budget_while_being_written_leaves_no_file(tmp_path, held_writes):
    disk = DiskTier(tmp_path, HEADER_BYTES + 64 + 1000, b"A" * 32)  # one block
    disk.put(b"\0" * 16, TOKENS, payload(0))
    disk.put(b"\1" * 16, TOKENS, payload(1))  # block 0 is dropped while its write waits
    assert b"\0" * 16 not in disk and len(disk) == 1
    held_writes.set()
    disk.flush()
    assert [p.name for p in tmp_path.iterdir()] == [f"{'01' * 16}{SUFFIX}"] and disk.nbytes == disk.capacity
    assert list_blocks(tmp_path) == {b"A" * 32: {"blocks": 1, "tokens": 16, "bytes": disk.capacity}}


def test_a_foreign_directory_is_never_read_and_warns_once(tmp_path, caplog):
    disk = DiskTier(tmp_path, 1 << 20, b"A" * 32)
    for i in range(3):
        disk.put(bytes([i]) * 16, TOKENS, payload(i))
    with caplog.at_level(logging.WARNING):
        other = DiskTier(tmp_path, 1 << 20, b"B" * 32)
    assert len(other) == 0 and other.get(b"\0" * 16, TOKENS) is None
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 3  # another model's blocks are left alone


def test_a_stale_temporary_file_and_junk_are_removed_with_one_warning_each(tmp_path, caplog):
    (tmp_path / f"{'ab' * 16}{SUFFIX}.999999999.tmp").write_bytes(b"half a block")
    (tmp_path / f"{'cd' * 16}{SUFFIX}").write_bytes(b"not a block")
    with caplog.at_level(logging.WARNING):
        disk = DiskTier(tmp_path, 1 << 20, b"A" * 32)
    assert len(disk) == 0 and not list(tmp_path.iterdir())
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_cache_ls_and_clear(tmp_path, capsys):
    from kvgen.cli import main

    disk = DiskTier(tmp_path, 1 << 20, b"A" * 32)
    for i in range(3):
        disk.put(bytes([i]) * 16, TOKENS, payload(i))
    assert list_blocks(tmp_path) == {b"A" * 32: {"blocks": 3, "tokens": 48, "bytes": 3 * (HEADER_BYTES + 64 + 1000)}}
    assert main(["cache", "ls", "--kv-cache-dir", str(tmp_path)]) == 0
    assert "41414141" in capsys.readouterr().out
    assert main(["cache", "clear", "--kv-cache-dir", str(tmp_path)]) == 0
    assert clear_blocks(tmp_path) == 0 and not os.listdir(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_block_round_trips_through_the_pools_bytes(dtype):
    class Pools:  # the duck type PoolIO reads: per layer [kv_heads, num_slots, D] (+ scales)
        quantized = dtype == torch.int8
        block_size = 4

        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.k = [torch.randn(2, 12, 8, generator=g).to(dtype) for _ in range(3)]
            self.v = [torch.randn(2, 12, 8, generator=g).to(dtype) for _ in range(3)]
            self.k_scale = [torch.rand(2, 12, 2, generator=g) for _ in range(3)]
            self.v_scale = [torch.rand(2, 12, generator=g) for _ in range(3)]

    pools = Pools()
    io = PoolIO(pools)
    data = io.read(1)
    io.write(2, data)
    for tensors in (pools.k, pools.v) + ((pools.k_scale, pools.v_scale) if pools.quantized else ()):
        for t in tensors:
            assert torch.equal(t[:, 4:8], t[:, 8:12])
    assert not torch.equal(pools.k[0][:, 0:4], pools.k[0][:, 4:8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_offload_restores_each_row_within_its_scale(dtype):
    class Pools:
        block_size = 4

        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.k = [(torch.randn(2, 12, 8, generator=g) * 10 ** torch.randn(2, 12, 1, generator=g)).to(dtype)
                      for _ in range(3)]
            self.v = [torch.randn(2, 12, 8, generator=g).to(dtype) for _ in range(3)]

    pools = Pools()
    io = Int8PoolIO(pools)
    assert io.block_bytes == 3 * 2 * (2 * 4 * 8 + 4 * 2 * 4)  # layers x K, V x (int8 rows + a float32 scale each)
    payload = io.read(1)
    io.write_many([2, 0], [payload, payload])
    for t in pools.k + pools.v:
        want, got = t[:, 4:8].float(), t[:, 8:12].float()
        bound = want.abs().amax(-1, keepdim=True) / 254 + want.abs() * (2 ** -8 if dtype == torch.bfloat16 else 0)
        assert ((got - want).abs() <= bound * 1.0001 + 1e-12).all()
        assert torch.equal(t[:, 0:4], t[:, 8:12]) and not torch.equal(got, want)


def test_tier_tokens():
    assert tier_tokens(1000, 16, 16000 * 10, None) == {"host": {"bytes": 160000, "blocks": 10, "tokens": 160}}


def test_kv_size_prints_what_an_int8_host_tier_holds(capsys):
    """stories260K: 5 layers, 4 KV heads of 8 dims; an fp32 token takes 1280 bytes, an int8 one 480."""
    from kvgen.cli import main

    for dtype, per_token in (("auto", 1280), ("int8", 480)):
        assert main(["kv-size", "--dtype", "float32", "--json", "--kv-offload-memory", "1MiB",
                     "--kv-offload-dtype", dtype]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["tiers"]["host"]["blocks"] == (1 << 20) // (16 * per_token)
