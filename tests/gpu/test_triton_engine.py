"""The engine on the Triton backend (interpreted on the CPU) gives the torch path's greedy tokens on the
bundled stories260K, over ragged decode batches, chunked prefill, a window policy (ranges) and sinks
(the torch fallback); and a CPU run never imports triton or kvgen.gpu."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import torch  # noqa: E402

CUDA = os.environ.get("KVGEN_TEST_CUDA") == "1" and torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from kvgen import LLM, SamplingParams  # noqa: E402
from kvgen.gpu.backend import TritonPagedAttention  # noqa: E402

PROMPTS = ["Once upon a time", "Tom and Lily went to the park and saw a big dog", "The sun", "A little bird"]


def _tokens(triton: bool, policy: str = "full", eager: bool = False) -> list[list[int]]:
    """On the CPU: the torch path, or its runner switched to the (interpreted) Triton backend. On CUDA:
    `--attention-backend sdpa` (torch) against the engine's own CUDA choice (Triton, decode graphs)."""
    options = dict(max_num_batched_tokens=8, block_size=4)  # chunked prefill, many blocks
    if CUDA:
        llm = LLM(device="cuda", attention_backend="auto" if triton else "sdpa", enforce_eager=eager, **options)
        assert (llm.engine.runner.attention_type is TritonPagedAttention) == triton
    else:
        llm = LLM(attention_backend="sdpa", **options)
        if triton:
            llm.engine.runner.attention_type = TritonPagedAttention
    params = SamplingParams(temperature=0, max_tokens=8, kv_policy=policy, ignore_eos=True)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    assert all(len(t) == 8 for t in tokens), tokens  # an engine error would leave requests short
    return tokens


# The window and sinks policies through the whole engine are slow under the interpreter (~10-20 s a case);
# the kernel tests cross windows at every split edge, and test_triton_attention checks that sinks fall back
# to the torch path: slow here.
WINDOW = pytest.param("window:8", marks=pytest.mark.slow)
SINKS = pytest.param("sinks:2,8", marks=pytest.mark.slow)


@pytest.mark.parametrize("policy", ["full", WINDOW, SINKS])
def test_triton_backend_gives_the_torch_paths_tokens(policy):
    assert _tokens(True, policy) == _tokens(False, policy)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_decode_graphs_replay_and_give_the_eager_tokens():
    assert _tokens(True, eager=False) == _tokens(True, eager=True) == _tokens(False)


def test_a_cpu_run_imports_no_triton_and_no_gpu_module():
    code = ("import sys; from kvgen import LLM, SamplingParams; "
            "LLM().generate(['Once'], SamplingParams(temperature=0, max_tokens=4)); "
            "bad = [m for m in sys.modules if m == 'triton' or m.startswith(('triton.', 'kvgen.gpu'))]; "
            "assert not bad, bad")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


@pytest.mark.skipif(CUDA, reason="the CPU stand-in for graphs; on CUDA the real graphs are tested above")
@pytest.mark.parametrize("policy", ["full", WINDOW])
def test_graph_bookkeeping_without_capture_gives_the_torch_paths_tokens(policy):
    """GraphDecoder's static buffers, padding to the ladder and key ranges, replayed without a graph."""
    from kvgen.gpu.graphs import GraphDecoder

    llm = LLM(attention_backend="sdpa", max_num_batched_tokens=8, block_size=4, max_num_seqs=8)
    runner = llm.engine.runner
    runner.attention_type = TritonPagedAttention
    decoder = GraphDecoder(runner, max_batch=4, max_model_len=256, capture=False)  # rungs 1, 2, 4
    runner.run = decoder.run
    # ending at different steps: 3, 2, 1 sequences decode after the first ends (rung 4 pads a row)
    params = [SamplingParams(temperature=0, max_tokens=n, kv_policy=policy, ignore_eos=True) for n in (14, 10, 7, 4)]
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    assert decoder.replays >= 8 and {1, 2, 4} <= set(decoder.graphs)
    reference = LLM(attention_backend="sdpa", max_num_batched_tokens=8, block_size=4, max_num_seqs=8)
    assert tokens == [list(o.outputs[0].token_ids) for o in reference.generate(PROMPTS, params)]
