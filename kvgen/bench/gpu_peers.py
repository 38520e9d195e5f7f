"""transformers' continuous batching, driven request by request (each with its own max_new_tokens, EOS
off), as the `hf-cb` peer (benchmarks.peers; `kvgen bench throughput --device cuda --compare hf-cb`) and
benchmarks/gpu_check.py run it. generate_batch gives every request one length; its manager takes one
per request.
"""

from __future__ import annotations

import time


class PartialRun(TimeoutError):
    """The manager did not finish in time (or stopped): what it had done by then."""

    def __init__(self, message: str, done: int, generated: int, seconds: float) -> None:
        super().__init__(message)
        self.done, self.generated, self.seconds = done, generated, seconds


def run_continuous(model, prompts: list[list[int]], outputs: list[int], timeout: float = 600,
                   progress=None) -> int:
    """Every prompt through transformers' continuous-batching manager with its own max_new_tokens
    (EOS off); returns the tokens generated. Raises PartialRun (finished requests and their tokens so
    far) past `timeout` or when the manager's thread has stopped; `progress(done, generated, seconds)`
    is called about every 5 s."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(outputs), do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    start = time.monotonic()
    try:
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=output)
        done: set[str] = set()
        generated = 0
        deadline, told = start + timeout, start
        while len(done) < len(prompts):
            now = time.monotonic()
            if now > deadline or not getattr(manager, "is_running", lambda: True)():
                why = "did not finish in time" if now > deadline else "stopped (its thread ended)"
                raise PartialRun(f"transformers continuous batching {why}: {len(done)} of {len(prompts)} requests, "
                                 f"{generated} tokens in {now - start:.1f} s", len(done), generated, now - start)
            if progress is not None and now - told >= 5:
                progress(len(done), generated, now - start)
                told = now
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished() and result.request_id not in done:
                done.add(result.request_id)
                generated += len(result.generated_tokens)
        return generated
    finally:  # bounded: a manager whose thread never got going would hold the process forever
        try:
            manager.stop(block=True, timeout=10, hard_stop=True)
        except TypeError:  # a transformers without these arguments
            manager.stop(block=True)
