"""The tiers an engine config asks for, or the one line saying why this engine cannot have them."""

from __future__ import annotations

from kvgen.cache.sizing import KVPlan
from kvgen.cache.tiers.disk import DiskTier
from kvgen.cache.tiers.host import HostTier
from kvgen.cache.tiers.identity import model_identity
from kvgen.cache.tiers.manager import TieredKVManager, Tiers
from kvgen.config import EngineConfig


def tier_refusal(config: EngineConfig, plan: KVPlan) -> str | None:
    """Why the KV tiers cannot run with this engine (None: they can)."""
    if not config.enable_prefix_caching:
        return "KV tiers (--kv-offload-memory, --kv-cache-dir) keep cached prefixes: they need prefix caching"
    if plan.kinds:
        return ("KV tiers are not offered for hybrid (sliding-window) models yet: their window layers' blocks "
                "would have to follow the global ones; run without --kv-offload-memory / --kv-cache-dir")
    if config.tensor_parallel_size > 1:
        return "KV tiers need the pools in one process: not with --tensor-parallel-size > 1"
    if config.speculative_method == "draft":
        return "KV tiers do not restore a draft model's pools: not with --speculative-method draft"
    return None


def build_tiered_manager(config: EngineConfig, plan: KVPlan, model_config: object, weights: dict,
                         compute_dtype: str) -> TieredKVManager:
    """The manager over the plan's pool with the config's tiers; raises ValueError where refused."""
    refusal = tier_refusal(config, plan)
    if refusal is not None:
        raise ValueError(refusal)
    host = HostTier(config.kv_offload_memory) if config.kv_offload_memory else None
    disk = None
    if config.kv_cache_dir is not None:
        layout = {"kv_dtype": plan.kv_dtype, "block_size": plan.block_size, "num_layers": plan.num_layers,
                  "layer_bytes_per_token": plan.layer_bytes_per_token, "kinds": plan.kinds,
                  "compute_dtype": compute_dtype, "quantization": config.quantization}
        disk = DiskTier(config.kv_cache_dir, config.kv_cache_disk, model_identity(model_config, weights, layout))
    return TieredKVManager(plan.num_blocks, plan.block_size, Tiers(host, disk))
