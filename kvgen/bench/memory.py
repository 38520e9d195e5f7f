"""`kvgen bench memory`: how much of the KV memory a workload reserves actually holds tokens.

A contiguous cache reserves `max_model_len` slots per running sequence; a paged cache holds whole
blocks, so each sequence wastes at most one partly filled block. The engine runs the workload (all
requests at once, continuous batching) and after every step counts the tokens whose K/V are stored
against the slots each layout would have reserved for the same running sequences.
"""

from __future__ import annotations

import argparse

from kvgen.bench.report import Report, Table, fmt
from kvgen.bench.system import BenchRequest
from kvgen.bench.workload import make_requests
from kvgen.engine.llm_engine import LLMEngine
from kvgen.sampling_params import SamplingParams


def measure(engine: LLMEngine, requests: list[BenchRequest]) -> dict:
    """Runs the requests together; returns token, slot and utilization totals over all steps."""
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(f"mem-{i}", r.prompt, params)
    stored = paged = contiguous = steps = peak_blocks = 0
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        stored += sum(seq.num_computed_tokens for seq in running)
        paged += engine.kv.num_used_blocks * engine.kv.block_size
        contiguous += len(running) * engine.max_model_len
        peak_blocks = max(peak_blocks, engine.kv.num_used_blocks)
        steps += 1
    return {"steps": steps, "token_slot_steps": stored, "paged_slot_steps": paged,
            "contiguous_slot_steps": contiguous, "paged_utilization": stored / paged,
            "contiguous_utilization": stored / contiguous, "peak_paged_blocks": peak_blocks,
            "block_size": engine.kv.block_size, "max_model_len": engine.max_model_len}


def run(args: argparse.Namespace, engine: LLMEngine, settings: dict) -> Report:
    workload = make_requests(args.num_requests, args.prompt_len_range, args.output_len_range,
                             engine.model_config.vocab_size, args.seed)
    result = measure(engine, workload)
    title = (f"KV memory: {settings['model']}, {args.num_requests} requests, prompts {args.prompt_len_range[0]}-"
             f"{args.prompt_len_range[1]}, outputs {args.output_len_range[0]}-{args.output_len_range[1]} tokens")
    rows = [["contiguous (max_model_len per sequence)", fmt(result["contiguous_utilization"] * 100)],
            [f"paged (blocks of {result['block_size']})", fmt(result["paged_utilization"] * 100)]]
    table = Table(title, ["layout", "% of reserved slots holding a token"], rows)
    workload_settings = {"num_requests": args.num_requests, "prompt_len_range": args.prompt_len_range,
                         "output_len_range": args.output_len_range}
    return Report("memory", {"settings": settings | workload_settings, "results": result}, [table])
