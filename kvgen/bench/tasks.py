"""What `kvgen bench latency --task` asks of a model (prompts as token ids, the same for every system):

    random   uniformly random token ids of --prompt-len (the default: no text, nothing to look up)
    repeat   a chat request to repeat a passage of at least max(--prompt-len, 300) tokens word for word:
             an input-grounded task, where prompt lookup finds most of the output in the prompt
    free     the same passage as context, then a request for a new story: free generation

Passages are runs of sentences of kvgen/eval/data/tinystory.txt; each prompt starts at another
sentence, so no two share a prefix beyond the instruction (the prefix cache cannot serve them).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from kvgen.bench.workload import random_prompt
from kvgen.tokenizer import Tokenizer

TASKS = ("random", "repeat", "free")
MIN_PASSAGE_TOKENS = 300
STORY = Path(__file__).resolve().parents[1] / "eval" / "data" / "tinystory.txt"
INSTRUCTIONS = {
    "repeat": "Repeat the following passage exactly, word for word, and write nothing else.\n\n{passage}",
    "free": "Here is a story.\n\n{passage}\n\nNow write a different, new story about a boy and his cat.",
}


def task_prompts(task: str, tokenizer: Tokenizer, vocab_size: int, count: int, prompt_len: int,
                 rng: np.random.Generator) -> list[list[int]]:
    """`count` prompts of the task (token ids; chat-templated for the text tasks)."""
    if task == "random":
        return [random_prompt(rng, vocab_size, prompt_len) for _ in range(count)]
    from kvgen.server.chat import ChatTemplate  # the server's template rendering, also for models without one
    from kvgen.server.protocol import ChatMessage

    template = ChatTemplate(tokenizer)
    sentences = re.split(r"(?<=[.!?\"])\s+", STORY.read_text().strip())
    wanted = max(prompt_len, MIN_PASSAGE_TOKENS)
    prompts = []
    for i in range(count):
        passage = _passage(sentences, i % len(sentences), wanted, tokenizer)
        message = ChatMessage(role="user", content=INSTRUCTIONS[task].format(passage=passage))
        prompts.append(template.prompt_ids([message]))
    return prompts


def _passage(sentences: list[str], first: int, num_tokens: int, tokenizer: Tokenizer) -> str:
    """Sentences from `first` on (wrapping around) until they hold `num_tokens` tokens."""
    taken: list[str] = []
    while len(tokenizer.encode(" ".join(taken), add_special_tokens=False)) < num_tokens:
        taken.append(sentences[(first + len(taken)) % len(sentences)])
    return " ".join(taken)
