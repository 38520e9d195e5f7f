"""What the tiers hold in tokens: a host tier stores a block's K/V bytes as the pool does; a disk tier's
block file adds a header and the block's token ids."""

from __future__ import annotations

from kvgen.cache.tiers.disk import HEADER_BYTES


def int8_tier_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """A token's bytes in the tiers with --kv-offload-dtype int8: K and V rows of int8, a float32 scale each."""
    return num_layers * num_kv_heads * 2 * (head_dim + 4)


def tier_tokens(bytes_per_token: int, block_size: int, host_bytes: int | None, disk_bytes: int | None) -> dict:
    """{tier: {bytes, blocks, tokens}} for the tiers given (sizes in bytes)."""
    out = {}
    block = bytes_per_token * block_size
    for tier, budget, per_block in (("host", host_bytes, block), ("disk", disk_bytes, block + HEADER_BYTES + 4 * block_size)):
        if budget:
            blocks = budget // per_block
            out[tier] = {"bytes": budget, "blocks": blocks, "tokens": blocks * block_size}
    return out
