"""Two "machines" on this one: two torchrun agents (--nnodes 2, one process each) meeting at
127.0.0.1, the multi-machine recipe of docs/tensor_parallel.md, give the same tokens as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvgen import LLM, SamplingParams
from kvgen.distributed.group import free_port

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Once upon a time"


def test_two_nodes_under_torchrun_match_one_process():
    port = str(free_port())
    nodes = []
    for rank in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", port,
                   "-m", "kvgen", "generate", "--tensor-parallel-size", "2", "--prompt", PROMPT,
                   "--max-tokens", "40", "--json"]
        nodes.append(subprocess.Popen(command, env=os.environ | {"PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        outputs = [node.communicate(timeout=120) for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.kill()
        tails = [node.communicate()[1][-2000:] for node in nodes]  # what each agent said before the hang
        raise AssertionError(f"the two torchrun agents did not finish within 120 s: {tails}") from None
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    expected = LLM().generate(PROMPT, SamplingParams(temperature=0, max_tokens=40))[0]
    assert json.loads(outputs[0][0])["token_ids"] == expected.token_ids
    assert outputs[1][0] == ""  # only rank 0 answers
