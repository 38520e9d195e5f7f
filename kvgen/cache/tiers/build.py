"""The tiers an engine config asks for, or the one line saying why this engine cannot have them."""

from __future__ import annotations

from kvgen.cache.sizing import QUANTIZED_KV, KVPlan
from kvgen.cache.tiers.disk import DiskTier
from kvgen.cache.tiers.host import HostTier
from kvgen.cache.tiers.hybrid import TieredHybridKVManager, kind_root
from kvgen.cache.tiers.identity import model_identity
from kvgen.cache.tiers.manager import TieredKVManager, Tiers
from kvgen.cache.tiers.pool_io import Int8PoolIO, PoolIO
from kvgen.config import EngineConfig


def tier_refusal(config: EngineConfig, plan: KVPlan) -> str | None:
    """Why the KV tiers cannot run with this engine (None: they can)."""
    if not config.enable_prefix_caching:
        return "KV tiers (--kv-offload-memory, --kv-cache-dir) keep cached prefixes: they need prefix caching"
    if config.tensor_parallel_size > 1:
        return "KV tiers need the pools in one process: not with --tensor-parallel-size > 1"
    if config.speculative_method == "draft":
        return "KV tiers do not restore a draft model's pools: not with --speculative-method draft"
    if config.kv_offload_dtype == "int8" and plan.kv_dtype in QUANTIZED_KV:
        return (f"--kv-offload-dtype int8 is for float KV pools: a {plan.kv_dtype} pool's blocks go to the tiers "
                "as they are (leave it auto)")
    return None


def build_tiered_manager(config: EngineConfig, plan: KVPlan, model_config: object, weights: dict,
                         compute_dtype: str) -> TieredKVManager | TieredHybridKVManager:
    """The manager over the plan's pool with the config's tiers; raises ValueError where refused."""
    refusal = tier_refusal(config, plan)
    if refusal is not None:
        raise ValueError(refusal)
    host = HostTier(config.kv_offload_memory) if config.kv_offload_memory else None
    disk = None
    if config.kv_cache_dir is not None:
        layout = {"kv_dtype": plan.kv_dtype, "block_size": plan.block_size, "num_layers": plan.num_layers,
                  "layer_bytes_per_token": plan.layer_bytes_per_token, "kinds": plan.kinds,
                  "compute_dtype": compute_dtype, "quantization": config.quantization,
                  "offload_dtype": config.kv_offload_dtype}
        disk = DiskTier(config.kv_cache_dir, config.kv_cache_disk, model_identity(model_config, weights, layout))
    tiers = Tiers(host, disk)
    if not plan.kinds:
        return TieredKVManager(plan.num_blocks, plan.block_size, tiers)
    kinds = [TieredKVManager(n, plan.block_size, tiers, kind_root(i)) for i, n in enumerate(plan.blocks)]
    return TieredHybridKVManager(kinds, list(plan.kinds), config.max_num_batched_tokens)


def attach_pools(manager: TieredKVManager | TieredHybridKVManager, caches: list[object], offload_dtype: str) -> None:
    """Gives each kind's manager the bytes of its pools (a runner's `kinds`' caches, the global kind first),
    as the tiers store them (`offload_dtype`: the pool's own bytes, or int8)."""
    io = Int8PoolIO if offload_dtype == "int8" else PoolIO
    for kind, cache in zip(getattr(manager, "kinds", [manager]), caches):
        kind.attach(io(cache))
