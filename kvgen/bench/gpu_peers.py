"""transformers as a GPU peer (`kvgen bench latency|throughput --device cuda --compare hf-static|hf-cb`).

    hf-static  generate() with its static KV cache; on a GPU transformers compiles the decode forward
               itself (torch.compile, CompileConfig's reduce-overhead: CUDA graphs), the setting
               gpt-fast showed to be plain PyTorch's fastest batch-1 decode
    hf-cb      its continuous batching (the manager behind generate_batch), each request with its own
               max_new_tokens, as kvgen's engine runs them; batch 1 is plain generate() as `hf`

Both read the same files as kvgen (GGUF through gguf_file=, dequantized by transformers).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvgen.bench.peers import HFSystem
from kvgen.bench.system import BenchRequest


class HFStaticSystem(HFSystem):
    name = "hf-static"

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, streamer=None) -> None:
        self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                            streamer=streamer, cache_implementation="static")


class HFContinuousSystem(HFSystem):
    name = "hf-cb"

    @torch.inference_mode()
    def run_batch(self, requests: Sequence[BenchRequest]) -> None:
        generated = run_continuous(self.model, [r.prompt for r in requests], [r.output_len for r in requests])
        if generated != sum(r.output_len for r in requests):
            raise RuntimeError(f"transformers continuous batching gave {generated} tokens, "
                               f"not {sum(r.output_len for r in requests)}")

    def run_at(self, requests: Sequence[BenchRequest], size: int) -> None:
        self.run_batch(requests)  # the manager batches by itself: one size


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
