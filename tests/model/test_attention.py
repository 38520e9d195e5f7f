import torch

from kvgen.model.kv_storage import PagedKVCache


def test_gather_reads_whole_blocks_heads_first_whatever_came_before():
    """Gathers reuse one buffer; a smaller gather after a larger one must still see only its blocks."""
    cache = PagedKVCache(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=3, head_dim=5,
                         device=torch.device("cpu"), dtype=torch.float32)
    cache.k[0].copy_(torch.randn_like(cache.k[0]))
    cache.v[0].copy_(torch.randn_like(cache.v[0]))
    k_blocks, v_blocks = cache.blocks(0)  # [kv_heads, blocks, block_size, D]
    for block_ids in ([[2, 0], [1, 3]], [[3]], [[0, 1, 2]]):
        ids = torch.tensor(block_ids)
        keys, values = cache.gather(0, ids)
        expected_k = k_blocks[:, ids].flatten(2, 3).transpose(0, 1)  # [B, kv_heads, N * block_size, D]
        expected_v = v_blocks[:, ids].flatten(2, 3).transpose(0, 1)
        assert torch.equal(keys, expected_k) and torch.equal(values, expected_v)
