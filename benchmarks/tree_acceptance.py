"""Would a tree verify pay? Greedy acceptance of a draft chain and of two small token trees, simulated on
a real draft/target pair, and what the step would cost, so that the choice rests on a measurement:

    python benchmarks/tree_acceptance.py TARGET.gguf DRAFT.gguf --task free copy --gen-len 128

The target generates greedily from the bench's prompts (kvgen.bench.tasks); the draft, packed as the
proposer packs it (int4, x in one int8 part), is teacher-forced over prompt + output, which gives its
top tokens at every position of the target's path. Greedy speculation accepts a draft token where the
target's is among the tree's candidates at that depth, so a step's accepted tokens follow from those
top tokens alone:

    chain   K tokens, each the draft's top one                                         K + 1 verify rows
    fork    the draft's top two first tokens, each followed by its top K - 1            2K + 1 rows
    spare   the chain, plus at each depth the second choice followed by top ones     K(K+3)/2 + 1 rows

(`fork`'s second branch and `spare`'s branches also cost the draft a row per step each.) The costs are
a forward pass of that many rows through each model without a cache (the layers' kernels at that row
count; attention over a few hundred cached tokens is left out), best of --repeats. A step's tokens per
second are its accepted tokens + 1 over K draft passes and one verify.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import kvgen.threads  # noqa: F401  (before torch: OpenMP's wait policy)
import numpy as np
import torch

from kvgen import LLM, SamplingParams
from kvgen.bench.tasks import task_prompts
from kvgen.engine.speculative.draft import DRAFT_ACTIVATIONS
from kvgen.loaders import load_model
from kvgen.model.attention import NoCacheAttention
from kvgen.model.decoder import DecoderModel


@dataclass(frozen=True)
class Tree:
    """A token tree by the candidates it keeps: `seconds` second choices on a path at most, the second
    choice allowed at depths `second_at` (1-based); its verify rows and the draft rows of each pass."""

    name: str
    seconds: int
    second_at: tuple[int, ...]
    verify_rows: int
    draft_rows: tuple[int, ...]


def trees(k: int) -> list[Tree]:
    spare_rows = tuple(1 + d for d in range(k))  # pass d drafts the chain and the d paths that left it
    return [Tree("chain", 0, (), k + 1, (1,) * k),
            Tree("fork", 1, (1,), 2 * k + 1, (1,) + (2,) * (k - 1)),
            Tree("spare", 1, tuple(range(1, k + 1)), k * (k + 3) // 2 + 1, spare_rows)]


def accepted(ranks: np.ndarray, start: int, k: int, tree: Tree) -> int:
    """Draft tokens a greedy verify keeps from position `start`: ranks[i] is where the target's token i
    stands in the draft's order there (0: its top token)."""
    kept, seconds = 0, 0
    for depth in range(1, k + 1):
        i = start + depth - 1
        if i >= len(ranks):
            break
        if ranks[i] == 0:
            kept += 1
        elif ranks[i] == 1 and seconds < tree.seconds and depth in tree.second_at:
            kept, seconds = kept + 1, seconds + 1
        else:
            break
    return kept


def steps(ranks: np.ndarray, k: int, tree: Tree) -> int:
    """Speculative steps to produce every position of `ranks` with `tree`."""
    position, count = 0, 0
    while position < len(ranks):
        position += accepted(ranks, position, k, tree) + 1
        count += 1
    return count


def draft_ranks(draft: DecoderModel, ids: list[int], prompt_len: int) -> np.ndarray:
    """For each output token, its rank among the draft's logits at the position before it (0, 1, or 2
    for anything lower)."""
    windows = [draft.config.window(i) for i in range(draft.config.num_layers)]
    with torch.no_grad():
        hidden = draft.forward(torch.tensor(ids), torch.arange(len(ids)), NoCacheAttention(windows))
        logits = draft.logits(hidden[prompt_len - 1:-1]).float()
    top2 = logits.topk(2, dim=-1).indices
    target = torch.tensor(ids[prompt_len:])[:, None]
    return np.where((top2 == target).numpy(), np.arange(2), 2).min(axis=1)


def forward_ms(model: DecoderModel, rows: int, repeats: int) -> float:
    """Best ms of a forward pass of `rows` tokens plus their logits, without a cache."""
    windows = [model.config.window(i) for i in range(model.config.num_layers)]
    ids, positions = torch.arange(100, 100 + rows), torch.arange(rows)
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            model.logits(model.forward(ids, positions, NoCacheAttention(windows)))
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--task", nargs="+", default=["free", "copy"], choices=["free", "copy", "edit", "random"])
    parser.add_argument("--count", type=int, default=2, help="prompts per task")
    parser.add_argument("--prompt-len", type=int, default=512, help="the random task's (the others' are their own)")
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--activations", default="int8x2", help="the target's (the draft's: int8)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, dict[str, tuple[float, float]]]:
    """Prints a line per task and tree; returns {task: {tree: (tokens a step, simulated tokens/s)}}."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    k = args.num_speculative_tokens
    llm = LLM(args.target, activations=args.activations, max_num_seqs=args.count)
    loaded = load_model(args.draft, keep_quantized=True)
    draft = DecoderModel(loaded.config, {**loaded.weights, **loaded.quantized}, quantization="int4",
                         activations=DRAFT_ACTIVATIONS)
    shapes = trees(k)
    verify = {t.verify_rows: forward_ms(llm.engine.model, t.verify_rows, args.repeats) for t in shapes}
    plain = forward_ms(llm.engine.model, 1, args.repeats)
    drafted = {r: forward_ms(draft, r, args.repeats) for t in shapes for r in set(t.draft_rows)}
    print(f"forward ms: target {plain:.1f} at 1 row, "
          + ", ".join(f"{verify[r]:.1f} at {r}" for r in sorted(verify))
          + "; draft " + ", ".join(f"{drafted[r]:.1f} at {r}" for r in sorted(drafted)))
    results: dict[str, dict[str, tuple[float, float]]] = {}
    rng = np.random.default_rng(0)
    for task in args.task:
        prompts = task_prompts(task, llm.tokenizer, llm.engine.model.config.vocab_size, args.count,
                               args.prompt_len, rng)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=args.gen_len, temperature=0.0))
        ranks = [draft_ranks(draft, p + o.token_ids, len(p)) for p, o in zip(prompts, outputs)]
        top1 = np.mean(np.concatenate(ranks) == 0)
        top2 = np.mean(np.concatenate(ranks) <= 1)
        results[task] = {}
        tokens = sum(len(r) for r in ranks)
        for tree in shapes:
            count = sum(steps(r, k, tree) for r in ranks)
            step_ms = sum(drafted[r] for r in tree.draft_rows) + verify[tree.verify_rows]
            rate = tokens / (count * step_ms / 1e3)
            results[task][tree.name] = (tokens / count, rate)
            print(f"{task}: draft top-1 {top1:.0%}, top-2 {top2:.0%}; {tree.name:5} {tree.verify_rows:2} rows: "
                  f"{tokens / count:.2f} tokens a step of {step_ms:.1f} ms = {rate:.1f} tok/s "
                  f"({rate * plain / 1e3:.2f}x plain)")
    return results


if __name__ == "__main__":
    main()
