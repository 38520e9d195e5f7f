"""What `kvgen bench latency --task` asks of a model (prompts as token ids, the same for every system):

    random   uniformly random token ids of --prompt-len (the default: no text, nothing to look up)
    repeat   a chat request to repeat a passage of at least max(--prompt-len, 300) tokens word for word:
             an input-grounded task, where prompt lookup finds most of the output in the prompt
    free     the same passage as context, then a request for a new story: free generation
    copy     a chat request to copy a Python file (kvgen/bench/data/inventory.py.txt) exactly
    edit     a replayed multi-turn code-editing conversation over that file: each earlier turn's user
             request and the assistant's whole edited file (stored, not generated), then the next edit
             to make; prompt i asks for edit i + 1 (cycling), so later prompts share earlier ones' turns

Passages are runs of sentences of kvgen/eval/data/tinystory.txt; each prompt starts at another
sentence, so no two share a prefix beyond the instruction (the prefix cache cannot serve them).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from kvgen.bench.workload import random_prompt
from kvgen.tokenizer import Tokenizer

TASKS = ("random", "repeat", "free", "copy", "edit")
MIN_PASSAGE_TOKENS = 300
CODE_TASK_TOKENS = 2048  # the longest prompt of the copy and edit tasks, with room (the last edit: ~1,800)
STORY = Path(__file__).resolve().parents[1] / "eval" / "data" / "tinystory.txt"
CODE = Path(__file__).resolve().parent / "data" / "inventory.py.txt"
COPY = "Copy the following Python file exactly, character for character, and write nothing else.\n\n```python\n{code}```"
# The edit conversation's turns: (request, old, new): each reply is the whole file with old -> new.
EDITS = (
    ("Add type hints to Item.value and Inventory.total_value. Reply with the whole file.",
     [("def value(self):", "def value(self) -> float:"), ("def total_value(self):", "def total_value(self) -> float:")]),
    ("Rename the method cheapest to lowest_price. Reply with the whole file.",
     [("def cheapest(self):", "def lowest_price(self):")]),
    ("Make remove raise KeyError with a clear message when the item is missing. Reply with the whole file.",
     [("        item = self.items[name]\n        if item.quantity < quantity:",
       "        if name not in self.items:\n            raise KeyError(f\"no {name} in the inventory\")\n"
       "        item = self.items[name]\n        if item.quantity < quantity:")]),
    ("Add a method count that returns the number of units of all items. Reply with the whole file.",
     [("    def cheapest(self):", "    def count(self) -> int:\n        return sum(item.quantity for item in "
       "self.items.values())\n\n    def cheapest(self):")]),
)
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
    if task in ("copy", "edit"):
        return [template.prompt_ids(code_messages(task, i)) for i in range(count)]
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


def code_messages(task: str, index: int) -> list:
    """The chat of the copy task, or of the edit task's prompt `index`: the file, then each earlier
    edit's request and the stored reply (the whole file after it), then the next request."""
    from kvgen.server.protocol import ChatMessage

    code = CODE.read_text()
    if task == "copy":
        return [ChatMessage(role="user", content=COPY.format(code=code))]
    turn = index % len(EDITS)
    messages = [ChatMessage(role="user", content=f"Here is my file inventory.py:\n\n```python\n{code}```\n\n"
                                                 + EDITS[0][0])]
    for done in range(turn):  # edit `done` was asked for and answered: its reply is the file after it
        code = _apply(code, EDITS[done][1])
        messages += [ChatMessage(role="assistant", content=f"```python\n{code}```"),
                     ChatMessage(role="user", content=EDITS[done + 1][0])]
    return messages


def _apply(code: str, changes: list[tuple[str, str]]) -> str:
    for old, new in changes:
        if old not in code:
            raise ValueError(f"edit task: {old!r} is not in the file")
        code = code.replace(old, new, 1)
    return code
