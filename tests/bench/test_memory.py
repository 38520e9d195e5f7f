"""The memory report: how much reserved KV memory holds tokens, contiguous vs paged."""

from kvgen.bench.memory import measure
from kvgen.bench.workload import make_requests
from kvgen.config import EngineConfig
from kvgen.engine.llm_engine import LLMEngine
from kvgen.loaders import load_model


def test_paged_cache_uses_at_least_95_percent_of_its_slots(stories_bin):
    engine = LLMEngine(load_model(stories_bin), EngineConfig(block_size=16))
    workload = make_requests(100, (32, 256), (32, 256), engine.model_config.vocab_size, seed=0)
    report = measure(engine, workload)
    assert report["paged_utilization"] >= 0.95
    assert report["contiguous_utilization"] < 0.7  # max_model_len per sequence wastes most of it
    assert engine.kv.num_used_blocks == 0
