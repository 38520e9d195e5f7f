"""kvgen: an LLM inference engine that shows what its KV cache is doing."""

import kvgen.threads  # noqa: F401  (first: thread settings must precede loading torch and numpy)

from kvgen.errors import InvalidRequestError, KVGenError, ModelLoadError
from kvgen.llm import LLM
from kvgen.sampling_params import SamplingParams
from kvgen.scheduling.sequence import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "KVGenError", "ModelLoadError",
           "InvalidRequestError"]
