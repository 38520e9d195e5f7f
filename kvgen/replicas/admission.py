"""What the data-parallel front end checks a request against before it routes it.

The server's routes read `llm.engine` (tokenizer, encode_prompt, check_fits, compile_grammar,
max_model_len); with replicas that is an AdmissionEngine in the front end: the model's tokenizer and
config and a KV pool sized as each replica's, without weights or KV tensors, so a request is refused
(400) before it is routed exactly as one engine would refuse it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvgen.config import EngineConfig
from kvgen.engine.base import EngineStats
from kvgen.engine.llm_engine import LLMEngine
from kvgen.loaders import LoadedModel
from kvgen.sample.grammar import GrammarCompiler
from kvgen.sampling_params import SamplingParams
from kvgen.scheduling.sequence import RequestOutput


class AdmissionEngine(LLMEngine):
    """What the server's routes check a request against, in the front end: the tokenizer, the context,
    the vocabulary, grammars and a block pool sized as each replica's (bookkeeping only, never used),
    but no weights and no KV tensors. It never steps; `stats()` is the replicas' sum."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, stats: Callable[[], EngineStats]) -> None:
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        self.grammars = GrammarCompiler(self.tokenizer, loaded.config.vocab_size)
        self.requests = {}
        self.speculator = None
        self._build_kv_manager()
        self._stats = stats

    def check_speculative(self, params: SamplingParams) -> None:
        if self.config.speculative_method is None:
            super().check_speculative(params)
        # else the replica's speculator judges it when the request is added (a refusal is a 400 there)

    def stats(self) -> EngineStats:
        return self._stats()

    def step(self) -> list[RequestOutput]:
        raise RuntimeError("the admission engine does not run requests; the replicas do")
