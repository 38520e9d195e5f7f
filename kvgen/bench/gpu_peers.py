"""transformers' continuous batching, driven request by request (each with its own max_new_tokens, EOS
off), as the `hf-cb` peer (benchmarks.peers; `kvgen bench throughput --device cuda --compare hf-cb`) and
benchmarks/gpu_check.py run it. generate_batch gives every request one length; its manager takes one
per request.
"""

from __future__ import annotations

import time


def run_continuous(model, prompts: list[list[int]], outputs: list[int], timeout: float = 600) -> int:
    """Every prompt through transformers' continuous-batching manager with its own max_new_tokens
    (EOS off); returns the tokens generated."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(outputs), do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=output)
        done: set[str] = set()
        generated = 0
        deadline = time.monotonic() + timeout
        while len(done) < len(prompts):
            if time.monotonic() > deadline:
                raise TimeoutError("transformers continuous batching did not finish")
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished() and result.request_id not in done:
                done.add(result.request_id)
                generated += len(result.generated_tokens)
        return generated
    finally:
        manager.stop(block=True)
