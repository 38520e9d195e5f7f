"""Tensor parallelism behind an executor: rank 0 runs the one engine, which hands each step to the
group's driver (kvgen.distributed.executor), and admits each request once, on rank 0."""

from __future__ import annotations

import pytest

from kvgen import LLM, SamplingParams
from kvgen.distributed.executor import TensorParallelExecutor
from kvgen.engine.executor import Executor
from kvgen.engine.llm_engine import LLMEngine
from kvgen.errors import InvalidRequestError
from tests.conftest import ADMISSION_RULES


def test_the_engine_is_one_and_admits_each_request_once(stories_bin, admissions):
    one = LLM(stories_bin, num_kv_blocks=128)
    with LLM(stories_bin, num_kv_blocks=128, tensor_parallel_size=2) as many:
        assert type(many.engine) is LLMEngine and isinstance(many.engine.executor, TensorParallelExecutor)
        assert type(one.engine.executor) is Executor
        assert set(many.engine.workers.workers) == {1}  # the executor's, read through the engine
        params = SamplingParams(temperature=0, max_tokens=8, n=2, kv_policy="sinks:4,60")
        admissions.clear()
        outs = many.generate(["Once upon a time", "Tom"], params)
        assert admissions["admit"] == 2
        assert {rule: admissions[rule] for rule in ADMISSION_RULES} == {rule: 2 for rule in ADMISSION_RULES}
        assert admissions["parse"] == 0
        assert [c.token_ids for o in outs for c in o.outputs] == \
            [c.token_ids for o in one.generate(["Once upon a time", "Tom"], params) for c in o.outputs]
        with pytest.raises(InvalidRequestError, match="h2o is not supported with tensor parallelism"):
            many.generate("Tom", SamplingParams(kv_policy="h2o:4,60"))
