"""A plain script, without an `if __name__ == "__main__":` guard, that asks for two tensor-parallel
ranks: its workers must not run the script again (kvgen.distributed.process), so it gives the tokens
of one process, here through a real subprocess on the default model. The same script over bf16 K/V
pools checks that every rank rounds into and widens out of its own pools."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvgen import LLM, SamplingParams
from tests.support.tolerances import KV_ROUNDING, Trace, agreeing_prefix, trace

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["Once upon a time", "Lily had a red ball", "Tom"]
SCRIPT = f'''import json, sys
from kvgen import LLM, SamplingParams

llm = LLM(tensor_parallel_size=2, kv_cache_dtype=sys.argv[1])
params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
outputs = [o.outputs[0] for o in llm.generate({PROMPTS!r}, params)]
print(json.dumps([[o.token_ids, [x.top for x in o.logprobs]] for o in outputs]))
'''


def run_script(tmp_path: Path, kv_dtype: str) -> list[Trace]:
    script = tmp_path / "plain.py"
    script.write_text(SCRIPT)
    started = time.monotonic()
    run = subprocess.run([sys.executable, str(script), kv_dtype], env=os.environ | {"PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "bootstrapping phase" not in run.stderr and "did not meet" not in run.stderr
    assert time.monotonic() - started < 60  # no rendezvous timeout waited out
    return [(ids, [{int(t): v for t, v in top.items()} for top in tops])  # JSON keys are strings
            for ids, tops in json.loads(run.stdout.strip().splitlines()[-1])]


def one_process(kv_dtype: str) -> list[Trace]:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    return [trace(o.outputs[0]) for o in LLM(kv_cache_dtype=kv_dtype).generate(PROMPTS, params)]


def test_a_script_without_a_main_guard_runs_on_two_ranks(tmp_path):
    got = run_script(tmp_path, "auto")
    assert [ids for ids, _ in got] == [ids for ids, _ in one_process("auto")]


@pytest.mark.parametrize("kv_dtype", ["bfloat16"])
def test_two_ranks_over_bf16_pools_agree_with_one(tmp_path, kv_dtype):
    """The ranks' partial sums reorder fp32 rounding, which can move a K/V value across a bf16
    rounding boundary: the same bound as one process's bf16 pools against fp32 ones."""
    got = run_script(tmp_path, kv_dtype)
    for ranks, one in zip(got, one_process(kv_dtype), strict=True):
        assert agreeing_prefix(ranks, one, KV_ROUNDING[kv_dtype]) >= len(one[0]) // 2
