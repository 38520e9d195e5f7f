"""What the data-parallel front end checks a request against before it routes it.

The server's routes read `llm.engine` (tokenizer, admission, max_model_len, stats); with replicas that
is an AdmissionView in the front end: the model's tokenizer and config and the admission a replica's
engine would have (kvgen.engine.admission: its context, and block tables sized as each replica's
pools, bookkeeping only), without weights or KV tensors. So a request is refused (400) before it is
routed exactly as one engine would refuse it, and the replica takes it as admitted.
"""

from __future__ import annotations

from collections.abc import Callable

from kvgen.cache.sizing import plan_kv
from kvgen.config import EngineConfig
from kvgen.engine.admission import Admission, KVLimits, max_model_len_of
from kvgen.engine.base import EngineStats
from kvgen.loaders import LoadedModel


class AdmissionView:
    """The engine as the server's routes see it in the front end: the tokenizer, the context, the
    admission of each replica's engine; `stats()` is the replicas' sum. It never runs a request."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, stats: Callable[[], EngineStats]) -> None:
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.max_model_len = max_model_len_of(loaded.config, config)
        self.kv_plan = plan_kv(loaded.config, config, self.max_model_len)
        tables = self.kv_plan.manager(config.enable_prefix_caching, config.max_num_batched_tokens)
        self.admission = Admission(self.tokenizer, loaded.config, self.max_model_len,
                                   KVLimits(tables, self.kv_plan.capacity_tokens, config.max_num_batched_tokens),
                                   speculative=config.speculative_method is not None)
        self._stats = stats

    def capacity_report(self) -> str:
        return self.kv_plan.report()

    def stats(self) -> EngineStats:
        return self._stats()
