"""lm-evaluation-harness against the server: one loglikelihood (multiple-choice) task and one
generate_until task, defined locally (YAML + JSONL written here, nothing from the hub), run through
lm-eval's `local-completions` backend against a real server and through its own `hf` backend on the
same model as a Hugging Face directory. Both must give the same accuracy, the same generations, and
per-item log-likelihoods within fp32 rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvgen import LLM
from kvgen.server.app import create_app
from tests.server.harness import running
from tests.support.tolerances import logprob_gap

MODEL = "stories260K"
MAX_LENGTH = 512  # the model's context

# (context, choices, index of the right one): what a TinyStories model should know.
CHOICE_ITEMS = [
    ("Once upon a time, there was a little", [" girl", " car", " spoon"], 0),
    ("Lily went to the park with her", [" mom", " shoe", " rain"], 0),
    ("The sun was shining and the sky was", [" blue", " angry", " fork"], 0),
    ("Tom had a red ball. He liked to play with his", [" ball", " house", " sad"], 0),
    ("The cat was hungry, so it ate some", [" food", " sky", " jump"], 0),
    ("She was very happy and gave her mom a big", [" hug", " car", " sleep"], 0),
    ("One day, a little boy named Tim found a", [" box", " went", " very"], 0),
    ("The dog barked and ran to the", [" door", " blue", " happy"], 1),
]
# (context, target): three are the model's greedy continuations up to the first ".", one is not.
GENERATE_ITEMS = [
    ("Once upon a time", ", there was a little girl named Lily"),
    ("Tom and Sue went to the park", ""),
    ("The little bird", " was very happy"),
    ("One day, Lily saw a big", " box with a big box"),
]


def write_tasks(root: Path) -> Path:
    """Two lm-eval tasks over local JSONL files; returns the folder to pass as include_path."""
    choices = root / "choice.jsonl"
    choices.write_text("".join(json.dumps({"context": c, "choices": ch, "label": y}) + "\n"
                               for c, ch, y in CHOICE_ITEMS))
    continues = root / "continue.jsonl"
    continues.write_text("".join(json.dumps({"context": c, "target": t}) + "\n" for c, t in GENERATE_ITEMS))
    (root / "kvgen_choice.yaml").write_text(f"""
task: kvgen_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {choices}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (root / "kvgen_continue.yaml").write_text(f"""
task: kvgen_continue
dataset_path: json
dataset_kwargs:
  data_files:
    test: {continues}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["."]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    regexes_to_ignore: ["^ "]
""")
    return root


def evaluate(model: str, model_args: str, tasks_dir: Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=["kvgen_choice", "kvgen_continue"],
                           task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True,
                           batch_size=8, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                           fewshot_random_seed=0)


def per_item(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.fixture
def offline_hub(monkeypatch):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")


def test_lm_eval_local_completions_matches_hf_backend(stories_hf_dir, tmp_path, offline_hub, monkeypatch):
    tasks_dir = write_tasks(tmp_path)
    common = f"tokenizer={stories_hf_dir},add_bos_token=True,max_length={MAX_LENGTH}"
    llm = LLM(stories_hf_dir, num_kv_blocks=256, max_num_seqs=16)
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    with running(create_app(llm.engine, model_name=MODEL)) as url:
        served = evaluate("local-completions", f"model={MODEL},base_url={url}/v1/completions,"
                          f"tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=4,max_retries=1,"
                          f"{common}", tasks_dir)
    reference = evaluate("hf", f"pretrained={stories_hf_dir},dtype=float32,device=cpu,{common}", tasks_dir)

    for task, metric in (("kvgen_choice", "acc,none"), ("kvgen_continue", "exact_match,none")):
        assert served["results"][task][metric] == reference["results"][task][metric]
    assert served["results"]["kvgen_choice"]["acc,none"] >= 0.5  # the model's real quality comes through

    # Per item: the same generations, and each continuation's log-likelihood, a sum over its tokens,
    # within that many times one token's fp32 bound over the item's whole length.
    # The hf backend decodes a generation's tokens alone, and SentencePiece drops the first one's
    # space (" box" -> "box"); the server decodes them after the prompt, as vLLM does. Hence the
    # metric's regexes_to_ignore, and the comparison past leading spaces.
    assert served["results"]["kvgen_continue"]["exact_match,none"] == 0.75
    assert [[[g.lstrip(" ")] for [g] in item] for item in per_item(served, "kvgen_continue")] \
        == [[[g.lstrip(" ")] for [g] in item] for item in per_item(reference, "kvgen_continue")]
    tokenizer = AutoTokenizer.from_pretrained(stories_hf_dir)
    config = llm.engine.model_config
    served_items = sorted(served["samples"]["kvgen_choice"], key=lambda s: s["doc_id"])
    reference_items = sorted(reference["samples"]["kvgen_choice"], key=lambda s: s["doc_id"])
    for got, want in zip(served_items, reference_items, strict=True):
        for (context, continuation), [(ll_got, greedy_got)], [(ll_want, greedy_want)] in zip(
                got["arguments"], got["resps"], want["resps"], strict=True):
            length = len(tokenizer(context + continuation).input_ids)
            num_scored = length - len(tokenizer(context).input_ids)
            assert abs(ll_got - ll_want) <= num_scored * logprob_gap(config, length, abs(ll_want))
            assert greedy_got == greedy_want
