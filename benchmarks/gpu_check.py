"""The checks benchmarks/gpu_check.sh runs on a GPU machine, one per invocation (each in its own process,
under its own `timeout`). Every check prints one `PASS <check>: ...` or `FAIL <check>: ...` line and
writes <out>/<check>.json.

    bandwidth          a device-to-device copy of 1 GiB: the memory bandwidth the others are measured against
    build-model        a random-weight HF directory of a config's exact shape (benchmarks/configs/*.json), bf16
    tokens             greedy tokens of kvgen against transformers, both on the device in bf16, 4 prompts:
                       transformers runs once over each prompt + kvgen's tokens (teacher forcing) and its
                       argmax must equal kvgen's next token; the first divergence and its logit gap (HF's
                       top logit minus HF's logit for kvgen's token) are reported, and judged by transformers
                       in fp32 on the same prefix (`judge_divergence`: a bf16 near-tie passes, a larger
                       fp32 margin fails)
    latency-kvgen      batch-1 decode tok/s and the share of the copy bandwidth its bytes a step reach
    latency-hf         the same for transformers' static cache + torch.compile (eager static cache first,
                       so a compile that runs out of time still leaves a figure)
    throughput-kvgen   N requests (prompt and output lengths drawn in ranges, random ids) through LLM.generate
    throughput-hf      the same requests through transformers' continuous batching (per-request
                       max_new_tokens through its manager; generate_batch's single length as a fallback, said so)

`--device cpu --tiny` runs every check on small shapes on the CPU (the dry run that proves the
script before it reaches a GPU); there kvgen runs its Triton backend under Triton's interpreter when
KVGEN_TRITON_ON_CPU=1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

if os.environ.get("KVGEN_TRITON_ON_CPU") == "1":  # before triton is imported: its kernels are built interpreted
    os.environ["TRITON_INTERPRET"] = "1"

REPO = Path(__file__).resolve().parent.parent
SIZES = {  # per check: (full, tiny)
    "prompts": (4, 2), "tokens": (64, 8), "latency_prompt": (128, 16), "latency_tokens": (256, 16),
    "requests": (256, 6), "prompt_range": ((128, 512), (16, 32)), "output_range": ((128, 512), (4, 12)),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Once upon a time, in a small village,", "List three uses of a paged KV cache:"]


def size(args, name):
    return SIZES[name][1 if args.tiny else 0]


def report(args, check: str, ok: bool, line: str, data: dict) -> int:
    data = {"check": check, "pass": ok, "summary": line, "device": args.device, "tiny": args.tiny, **data}
    if torch.cuda.is_available() and args.device.startswith("cuda"):
        data["gpu"] = torch.cuda.get_device_name()
    (Path(args.out) / f"{check}.json").write_text(json.dumps(data, indent=1, default=str))
    print(f"{'PASS' if ok else 'FAIL'} {check}: {line}", flush=True)
    return 0 if ok else 1


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- bandwidth ---------------------------------------------------------------------------------------


def check_bandwidth(args) -> int:
    nbytes = (64 << 20) if args.tiny else (1 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(args.device)
    reps = 5 if args.tiny else 20
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(args.device)
    seconds = (time.perf_counter() - start) / reps
    bandwidth = 2 * nbytes / seconds  # each copy reads and writes every byte
    return report(args, "bandwidth", True, f"{bandwidth / 1e9:.0f} GB/s (copy of {nbytes >> 20} MiB, read + write)",
                  {"bytes_per_s": bandwidth})


def measured_bandwidth(args) -> float | None:
    path = Path(args.out) / "bandwidth.json"
    return json.loads(path.read_text())["bytes_per_s"] if path.exists() else None


# -- a random-weight model of a config's shape -------------------------------------------------------


def check_build_model(args) -> int:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.random_models import save_placeholder_tokenizer

    spec = json.loads(Path(args.config).read_text())
    spec = {k: v for k, v in spec.items() if not k.startswith("_")}
    out = Path(args.model_dir)
    done = out / "config.json"
    if done.exists():
        return report(args, "build-model", True, f"{out} already built", {"path": str(out)})
    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(**spec)
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    gen = torch.Generator(device=args.device).manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1 and name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:  # transformers' init: N(0, initializer_range); biases too, so they matter
            t = torch.randn(shape, generator=gen, device=args.device, dtype=torch.float32)
            tensors[name] = t.mul_(config.initializer_range).to(torch.bfloat16).cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    nbytes = sum(t.numel() * 2 for t in tensors.values())
    del tensors
    config.dtype = torch.bfloat16
    config.save_pretrained(out)
    save_placeholder_tokenizer(config.vocab_size, out)
    return report(args, "build-model", True, f"{out}: {nbytes / 1e9:.2f} GB bf16, random weights of {args.config}",
                  {"path": str(out), "bytes": nbytes})


# -- kvgen and transformers --------------------------------------------------------------------------


def kvgen_llm(args, **options):
    from kvgen import LLM

    llm = LLM(args.model, device=args.device, dtype="bfloat16", quantization="none", **options)
    if os.environ.get("KVGEN_TRITON_ON_CPU") == "1" and not args.device.startswith("cuda"):
        from kvgen.gpu.backend import TritonPagedAttention

        llm.engine.runner.attention_type = TritonPagedAttention
    return llm


def hf_model(args, dtype: torch.dtype = torch.bfloat16):
    from transformers import AutoModelForCausalLM

    path = Path(args.model)
    if path.suffix == ".gguf" and not _has_accelerate():
        print("accelerate missing (transformers needs it for gguf_file=): transformers reads an HF directory "
              "of the GGUF's weights as kvgen's loader dequantizes them", flush=True)
        path = _hf_dir_from_gguf(path, Path(os.environ.get("KVGEN_CHECK_WORK", "/tmp/kvgen-gpu")) / "hf-from-gguf")
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(args.device).eval()


def _has_accelerate() -> bool:
    if os.environ.get("KVGEN_CHECK_NO_ACCELERATE") == "1":
        return False
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


def _hf_dir_from_gguf(path: Path, out: Path) -> Path:
    """A llama GGUF as an HF directory (bf16 safetensors + LlamaConfig), from kvgen's loader's
    dequantized weights (HF names; kvgen's suite checks that loader against transformers' own)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from kvgen.loaders import load_model

    loaded = load_model(path, dtype=torch.bfloat16)
    c = loaded.config
    if c.architecture != "llama":
        raise ValueError(f"no HF directory for architecture {c.architecture}")
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in loaded.weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                         num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                         max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                         rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
                         bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids))
    config.rope_parameters = {"rope_type": "default", "rope_theta": c.rope_theta}
    config.dtype = torch.bfloat16
    config.save_pretrained(out)
    return out


def prompt_ids(args, llm) -> list[list[int]]:
    n = size(args, "prompts")
    if args.random_ids:
        rng = random.Random(1)
        vocab = 500 if args.tiny else 30000
        return [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 40))] for _ in range(n)]
    return [llm.tokenizer.encode(p) for p in PROMPTS[:n]]


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 numbers at |x| (8 significant bits: 2^(floor(log2 |x|) - 7))."""
    import math

    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0 ** -126))) - 7)


def judge_divergence(l16: torch.Tensor, l32: torch.Tensor, hf_token: int, kvgen_token: int) -> dict:
    """A first divergence judged by the fp32 model (transformers in fp32, same weights, same prefix).

    Both engines end in a bf16 LM head, so each logit carries bf16 error: its rounding (half an ulp
    of its magnitude, an ulp on the difference of two logits) and what bf16 activations accumulate
    upstream. The fp32 gap g = l32[hf] - l32[kvgen] is the margin kvgen's bf16 error had to overcome
    to pick its token. It is a legitimate bf16 near-tie when g <= bound, with
        bound = max(2 ulp_bf16(max(|l32[hf]|, |l32[kvgen]|)), |(l16[hf] - l16[kvgen]) - g|):
    two ulps of the logits' own rounding, or transformers' own bf16 error on this very gap (kvgen
    may err as much as the reference does). g <= 0 means fp32 prefers kvgen's token: transformers'
    bf16 flipped it, kvgen did not. A larger g is a kvgen error bigger than bf16 explains: FAIL."""
    g = (l32[hf_token] - l32[kvgen_token]).item()
    bf16_gap = (l16[hf_token] - l16[kvgen_token]).item()
    ulp = bf16_ulp(max(abs(l32[hf_token].item()), abs(l32[kvgen_token].item())))
    hf_error = abs(bf16_gap - g)
    bound = max(2 * ulp, hf_error)
    verdict = "fp32 prefers kvgen's token" if g <= 0 else ("bf16 near-tie" if g <= bound else "kvgen error")
    return {"fp32_gap": g, "fp32_prefers": "kvgen" if g < 0 else ("tie" if g == 0 else "transformers"),
            "fp32_argmax": int(l32.argmax().item()), "fp32_top2_gap": float((lambda v: v[0] - v[1])(l32.topk(2).values)),
            "bf16_ulp_at_logits": ulp, "hf_bf16_error_on_gap": hf_error, "fp32_bound": bound,
            "verdict": verdict, "ok": g <= bound}


def check_tokens(args) -> int:
    """kvgen's greedy tokens against transformers bf16 (teacher-forced), each first divergence judged
    by transformers in fp32 (`judge_divergence`); and over every position, how often each bf16 engine's
    token is the fp32 model's argmax on the same prefix (kvgen's rate should match transformers')."""
    from kvgen import SamplingParams

    llm = kvgen_llm(args, max_model_len=1024)
    prompts = prompt_ids(args, llm)
    n = size(args, "tokens")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    generated = [list(o.outputs[0].token_ids) for o in outs]
    if any(len(g) != n for g in generated):
        return report(args, f"tokens-{args.label}", False, f"kvgen generated {[len(g) for g in generated]} tokens, "
                      f"not {n} each ({[o.outputs[0].finish_reason for o in outs]})", {})
    llm.close()
    del llm
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    def teacher_forced(model) -> list[torch.Tensor]:
        rows = []
        with torch.inference_mode():
            for p, gen in zip(prompts, generated):
                ids = torch.tensor([p + gen], device=args.device)
                rows.append(model(ids).logits[0, len(p) - 1 : len(p) - 1 + len(gen)].float())  # row i predicts gen[i]
        return rows

    model = hf_model(args)
    bf16 = teacher_forced(model)
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    model32 = hf_model(args, torch.float32)
    fp32 = teacher_forced(model32)
    del model32
    rows, agree_all, worst_ok = [], True, True
    for p, gen, logits, l32 in zip(prompts, generated, bf16, fp32):
        top = logits.argmax(-1).tolist()
        top32 = l32.argmax(-1).tolist()
        first = next((i for i, (a, b) in enumerate(zip(top, gen)) if a != b), None)
        row = {"prompt_tokens": len(p), "agree": first is None, "kvgen": gen,
               "kvgen_is_fp32_argmax": sum(a == b for a, b in zip(gen, top32)) / len(gen),
               "hf_bf16_is_fp32_argmax": sum(a == b for a, b in zip(top, top32)) / len(gen)}
        if first is not None:
            agree_all = False
            gap = (logits[first, top[first]] - logits[first, gen[first]]).item()
            tie = 2 * 2.0 ** -8 * logits[first].abs().max().item()
            judged = judge_divergence(logits[first], l32[first], top[first], gen[first])
            row |= {"first_divergence": first, "hf_token": top[first], "kvgen_token": gen[first],
                    "logit_gap": gap, "near_tie_bound": tie, "near_tie": gap <= tie, "fp32": judged}
            worst_ok &= judged["ok"]
        rows.append(row)
    name = f"tokens-{args.label}"
    rates = (f"; tokens equal to fp32's argmax: kvgen {sum(r['kvgen_is_fp32_argmax'] for r in rows) / len(rows):.1%}, "
             f"transformers bf16 {sum(r['hf_bf16_is_fp32_argmax'] for r in rows) / len(rows):.1%}")
    if agree_all:
        line = f"{len(prompts)} prompts x {n} tokens identical to transformers" + rates
    else:
        parts = [f"prompt {i}: first divergence at token {r['first_divergence']}, bf16 gap {r['logit_gap']:.4f}, "
                 f"fp32 gap {r['fp32']['fp32_gap']:.4f} (bound {r['fp32']['fp32_bound']:.4f}): {r['fp32']['verdict']}"
                 for i, r in enumerate(rows) if not r["agree"]]
        line = "; ".join(parts) + rates
    return report(args, name, agree_all or worst_ok, line, {"model": args.model, "prompts": rows})


def decode_bytes(model_config, params_bytes: int, embed_bytes: int, context: int) -> int:
    """Bytes a batch-1 decode step reads: every weight but the embedding table (one row), and the KV
    cache of `context` tokens in bf16."""
    kv = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * 2 * context
    return params_bytes - embed_bytes + kv


def check_latency_kvgen(args) -> int:
    from kvgen import SamplingParams

    llm = kvgen_llm(args, max_model_len=2048, max_num_seqs=8, enforce_eager=args.eager)
    rng = random.Random(2)
    prompt = [rng.randrange(3, 30000 if not args.tiny else 500) for _ in range(size(args, "latency_prompt"))]
    n = size(args, "latency_tokens")
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up: kernels compiled, graph captured
    best = None
    for _ in range(3):
        out = llm.generate([prompt], params)[0]
        times = out.metrics.token_times
        if len(out.outputs[0].token_ids) != n or len(times) < 2:
            return report(args, "latency-kvgen", False, f"generated {len(out.outputs[0].token_ids)} of {n} tokens "
                          f"({out.outputs[0].finish_reason})", {})
        rate = (len(times) - 1) / (times[-1] - times[0])
        best = rate if best is None else max(best, rate)
    model = llm.engine.model
    params_bytes, embed = _weight_bytes(Path(args.model))
    step_bytes = decode_bytes(model.config, params_bytes, embed, len(prompt) + n // 2)
    bandwidth = measured_bandwidth(args)
    share = step_bytes * best / bandwidth if bandwidth else None
    graphs = getattr(llm.engine.runner, "graphs", None)
    line = (f"{best:.1f} tok/s batch-1 decode, {step_bytes / 1e9:.2f} GB a step"
            + (f", {share:.0%} of the measured {bandwidth / 1e9:.0f} GB/s" if share else "")
            + (f" (CUDA graphs: {graphs.replays} steps replayed)" if graphs else " (eager)"))
    return report(args, "latency-kvgen", True, line,
                  {"tok_s": best, "step_bytes": step_bytes, "bandwidth_share": share, "bandwidth": bandwidth,
                   "graph_replays": graphs.replays if graphs else 0, "prompt": len(prompt), "tokens": n})


def _weight_bytes(model_dir: Path) -> tuple[int, int]:
    """bf16 bytes of every tensor of an HF directory's safetensors, and of its embedding table."""
    from safetensors import safe_open

    total = embed = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                nbytes = 2 * int(torch.tensor(shape).prod().item()) if shape else 2
                total += nbytes
                embed += nbytes if "embed_tokens" in key else 0
    return total, embed


def check_latency_hf(args) -> int:
    """transformers' batch-1 decode with its static cache: eager (`disable_compile`), then as generate()
    runs it by default on a GPU, its forward through torch.compile (CompileConfig: reduce-overhead, CUDA
    graphs). Tokens are timed by a streamer, so one generation length serves (no recompile)."""
    from transformers import GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    class Timer(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    model = hf_model(args)
    rng = random.Random(2)
    prompt = torch.tensor([[rng.randrange(3, 30000 if not args.tiny else 500)
                            for _ in range(size(args, "latency_prompt"))]], device=args.device)
    n = size(args, "latency_tokens")
    result_path = Path(args.out) / "latency-hf.json"
    data: dict = {"prompt": prompt.shape[1], "tokens": n}

    def rate(label: str, compile_: bool, runs: int) -> float:
        gc = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                              eos_token_id=None, pad_token_id=0, disable_compile=not compile_)
        best = 0.0
        for _ in range(runs):  # the first run compiles (when compiling) and is a warm-up either way
            timer = Timer()
            model.generate(prompt, generation_config=gc, streamer=timer)
            decode = timer.times[2:]  # put #0 is the prompt, #1 the prefill's token
            best = max(best, (len(decode) - 1) / (decode[-1] - decode[0]))
        data[label] = best
        result_path.write_text(json.dumps({"check": "latency-hf", "partial": True, **data}))
        print(f"{label}: {best:.1f} tok/s", flush=True)
        return best

    eager = rate("static_eager_tok_s", False, 2)
    compiled = None
    if args.device.startswith("cuda"):
        try:
            compiled = rate("static_compiled_tok_s", True, 3)
        except Exception as e:  # no compiler for inductor, a dynamo error: the eager figure stands, said so
            print(f"transformers' compiled decode failed: {e!r}", flush=True)
            data["compile_error"] = repr(e)[:500]
    best = max(eager, compiled or 0.0)
    kvgen_path = Path(args.out) / "latency-kvgen.json"
    kvgen = json.loads(kvgen_path.read_text()).get("tok_s") if kvgen_path.exists() else None
    ratio = kvgen / best if kvgen else None
    line = (f"transformers static cache {eager:.1f} tok/s eager"
            + (f", {compiled:.1f} tok/s torch.compile" if compiled else " (no compile off CUDA)")
            + (f"; kvgen / transformers' best = {ratio:.2f}x" if ratio else ""))
    return report(args, "latency-hf", True, line, {**data, "kvgen_over_hf": ratio})


def workload(args) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(3)
    lo_p, hi_p = size(args, "prompt_range")
    lo_o, hi_o = size(args, "output_range")
    vocab = 30000 if not args.tiny else 500
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(lo_p, hi_p))] for _ in range(size(args, "requests"))]
    outputs = [rng.randint(lo_o, hi_o) for _ in prompts]
    if args.requests:  # a scaled run: the first N requests of the same workload (the names say so)
        prompts, outputs = prompts[: args.requests], outputs[: args.requests]
    return prompts, outputs


def throughput_name(args, engine: str) -> str:
    """throughput-kvgen / throughput-hf on the full workload; -N suffixed when scaled to N requests."""
    return f"throughput-{engine}" + (f"-{args.requests}" if args.requests else "")


def check_throughput_kvgen(args) -> int:
    from kvgen import SamplingParams

    prompts, outputs = workload(args)
    llm = kvgen_llm(args, max_model_len=2048, max_num_seqs=len(prompts), max_num_batched_tokens=8192,
                    kv_cache_memory=(24 << 30) if not args.tiny else (64 << 20), enforce_eager=args.eager)
    llm.generate(prompts[:4], [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 4)  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outputs]
    sync(args.device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(args.device)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    ok = generated == sum(outputs)
    line = (f"{len(prompts)} requests, {generated} tokens out in {seconds:.1f} s: {generated / seconds:.0f} tok/s "
            f"({(generated + sum(map(len, prompts))) / seconds:.0f} tok/s with prompts)")
    return report(args, throughput_name(args, "kvgen"), ok, line,
                  {"seconds": seconds, "generated": generated, "tok_s": generated / seconds,
                   "requests": len(prompts), "scaled_from": size(args, "requests") if args.requests else None})


def check_throughput_hf(args) -> int:
    from transformers import GenerationConfig

    prompts, outputs = workload(args)
    model = hf_model(args)
    gc = GenerationConfig(max_new_tokens=max(outputs), do_sample=False, eos_token_id=None, pad_token_id=0)
    mode = "manager, per-request max_new_tokens"
    sync(args.device)
    start = time.perf_counter()
    from kvgen.bench.gpu_peers import PartialRun, run_continuous

    def progress(done: int, made: int, seconds: float) -> None:
        print(f"transformers: {done}/{len(prompts)} requests done, {made} tokens, {seconds:.0f} s", flush=True)

    try:
        generated = run_continuous(model, prompts, outputs, timeout=args.peer_timeout, progress=progress)
    except PartialRun as e:  # the rate of what finished says more than a bare timeout
        rate = e.generated / e.seconds if e.seconds else 0.0
        rc = report(args, throughput_name(args, "hf"), False, f"{e} ({rate:.0f} tok/s over finished requests)",
                    {"partial": True, "done": e.done, "generated": e.generated, "seconds": e.seconds,
                     "requests": len(prompts), "tok_s_finished": rate})
        sys.stdout.flush()
        os._exit(rc)  # the manager's thread may still be alive, and Python would wait for it at exit
    except Exception as e:  # an API this transformers lacks: generate_batch, one length for all (said so)
        print(f"transformers continuous-batching manager failed ({e!r}); generate_batch instead", flush=True)
        mode = f"generate_batch, max_new_tokens={max(outputs)} for every request"
        start = time.perf_counter()
        results = model.generate_batch(inputs=prompts, generation_config=gc)
        generated = sum(len(r.generated_tokens) for r in results.values())
    sync(args.device)
    seconds = time.perf_counter() - start
    kvgen_path = Path(args.out) / f"{throughput_name(args, 'kvgen')}.json"  # kvgen on the same requests only
    ratio = (json.loads(kvgen_path.read_text())["tok_s"] / (generated / seconds)) if kvgen_path.exists() else None
    scaled = (f" (scaled: the first {len(prompts)} of the {size(args, 'requests')} requests, kvgen ran the same)"
              if args.requests else "")
    line = (f"{len(prompts)} requests, {generated} tokens out in {seconds:.1f} s: {generated / seconds:.0f} tok/s ({mode})"
            + (f"; kvgen / transformers = {ratio:.2f}x" if ratio else "") + scaled)
    return report(args, throughput_name(args, "hf"), True, line,
                  {"seconds": seconds, "generated": generated, "mode": mode, "tok_s": generated / seconds,
                   "kvgen_over_hf": ratio, "requests": len(prompts),
                   "scaled_from": size(args, "requests") if args.requests else None})


# -- where a batch-1 decode step's time goes ---------------------------------------------------------


class _Timed:
    """Wraps a callable, adding its wall time (and, with `sync_after`, its device time up to a
    synchronize) to `totals[name]`."""

    def __init__(self, fn, name: str, totals: dict, device: str, sync_after: bool = False) -> None:
        self.fn, self.name, self.totals, self.device, self.sync_after = fn, name, totals, device, sync_after

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            if self.sync_after:
                sync(self.device)
            self.totals[self.name] = self.totals.get(self.name, 0.0) + time.perf_counter() - t0


def _device_ms(args, fn, reps: int) -> float:
    """ms a call of `fn` takes on the device (CUDA events around `reps` calls; wall time on the CPU)."""
    fn()
    sync(args.device)
    if args.device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1000 / reps


def _profile_table(args, fn, reps: int, sorts: list[tuple[str, list[str]]], row_limit: int = 15) -> tuple[str, dict]:
    """torch.profiler over `reps` calls of fn: a table per (title, sort keys to try), and the kernel
    count a call (device events)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for _ in range(reps):
            fn()
        sync(args.device)
    averages = prof.key_averages()
    text = []
    for title, keys in sorts:
        for key in keys:
            try:
                table = averages.table(sort_by=key, row_limit=row_limit, max_name_column_width=70)
                break
            except Exception as e:  # a sort key this torch does not know: the next one
                table = f"(no table sorted by {keys}: {e!r})"
        text.append(f"### {title} ({reps} calls)\n{table}\n")
    info = {}
    try:
        kernels = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
        info["device_events_per_call"] = len(kernels) / reps
        info["device_us_per_call"] = sum(e.time_range.elapsed_us() for e in kernels) / reps
        by_kernel: dict = {}  # the paged attention kernels' own time (Triton names them after the function)
        for e in kernels:
            if "_decode" in e.name or "_prefill_kernel" in e.name or "_store_kv" in e.name:
                by_kernel[e.name] = by_kernel.get(e.name, 0.0) + e.time_range.elapsed_us() / reps
        info["attention_kernels_us_per_call"] = by_kernel
    except Exception as e:
        info["events_error"] = repr(e)[:200]
    return "\n".join(text), info


def check_profile(args) -> int:
    """Where a batch-1 decode step goes, on the 1.5B shape (docs/gpu.md, "The profile run"):
    (a) the captured graph's replay alone (CUDA events, 100 replays) and the same forward run eagerly;
    (b) the engine step's wall time, through engine.step() and through LLM.generate's token times,
        with a breakdown by phase (schedule, prepare, the runner with a sync after it: launch +
        device time, sampling and bookkeeping);
    (c) torch.profiler tables: engine steps (by CPU time and by CUDA time), graph replays alone (by
        CUDA time: which kernels the graph spends its time in), to <out>/profile.txt;
    (d) host syncs a step: torch.cuda.set_sync_debug_mode("warn") over 20 steps, warnings counted
        by the line that raised them."""
    import warnings

    from kvgen import SamplingParams
    from kvgen.gpu.graph_ladder import padded_size

    llm = kvgen_llm(args, max_model_len=2048, max_num_seqs=8)
    engine, runner = llm.engine, llm.engine.runner
    if not args.device.startswith("cuda") and os.environ.get("KVGEN_TRITON_ON_CPU") == "1":
        from kvgen.gpu.graphs import GraphDecoder  # the dry run: the graph bookkeeping, replayed eagerly

        runner.graphs = GraphDecoder(runner, 8, 2048, capture=False)
        runner.run = runner.graphs.run
    graphs = getattr(runner, "graphs", None)
    rng = random.Random(2)
    vocab = 30000 if not args.tiny else 500
    prompt = [rng.randrange(3, vocab) for _ in range(size(args, "latency_prompt"))]
    reps = 10 if args.tiny else 100
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # compile, capture
    data: dict = {"prompt": len(prompt)}
    out_path = Path(args.out) / "profile.json"

    def save():
        out_path.write_text(json.dumps({"check": "profile", "partial": True, **data}, indent=1, default=str))

    # (b) through LLM.generate, as latency-kvgen measures
    n = 64 if not args.tiny else 16
    o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
    t = o.metrics.token_times
    data["generate_ms_per_token"] = 1000 * (t[-1] - t[0]) / (len(t) - 1)
    # (b) engine.step() by hand, one long request
    engine.add_request("profile", prompt, SamplingParams(temperature=0, max_tokens=1024, ignore_eos=True))
    for _ in range(4):
        engine.step()  # the prompt, then a few decodes
    replays0 = graphs.replays if graphs else 0
    steps = []
    for _ in range(reps):
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    steps.sort()
    data["step_ms_median"] = 1000 * steps[len(steps) // 2]
    data["step_ms_mean"] = 1000 * sum(steps) / len(steps)
    data["step_ms_min"] = 1000 * steps[0]
    data["graph_replays_in_steps"] = (graphs.replays - replays0) if graphs else 0
    save()
    # the breakdown: wrap the phases (the runner with a sync after it, so its device time is its own)
    totals: dict = {}
    sched, execute, sample, record, mark = (engine.scheduler.schedule, runner.execute, engine.sample_and_record,
                                            engine.record, engine._mark_computed)
    prepare = runner.prepare
    engine.scheduler.schedule = _Timed(sched, "schedule", totals, args.device)
    runner.execute = _Timed(execute, "runner.execute (+ sync: launch and device time)", totals, args.device, True)
    runner.prepare = _Timed(prepare, "  of which runner.prepare (step tensors, masks)", totals, args.device)
    if graphs:
        fill, grun = graphs._fill, graphs.run
        graphs._fill = _Timed(fill, "  of which graphs._fill (key ranges, static buffers)", totals, args.device)
    engine.sample_and_record = _Timed(sample, "sample_and_record (finite check, sampler, record)", totals, args.device)
    engine.record = _Timed(record, "  of which record (append, detokenize, outputs)", totals, args.device)
    engine._mark_computed = _Timed(mark, "_mark_computed (prefix cache, slide)", totals, args.device)
    k = reps // 2
    t0 = time.perf_counter()
    for _ in range(k):
        engine.step()
    wall = time.perf_counter() - t0
    engine.scheduler.schedule, runner.execute, runner.prepare = sched, execute, prepare
    engine.sample_and_record, engine.record, engine._mark_computed = sample, record, mark
    if graphs:
        graphs._fill = fill
    data["breakdown_ms_per_step"] = {name: 1000 * v / k for name, v in totals.items()}
    data["breakdown_ms_per_step"]["step (wall, with the sync after the runner)"] = 1000 * wall / k
    save()
    # (a) the graph alone, and the same forward eagerly
    if graphs:
        rung = padded_size(1, graphs.sizes)
        graph = graphs.graphs.get(rung)
        if graph is not None:
            data["graph_replay_ms"] = _device_ms(args, graph.replay, reps)
            data["eager_forward_ms"] = _device_ms(args, lambda: graphs._forward(rung), max(reps // 5, 2))
    save()
    try:  # profiler: an error here must not lose the figures above
        # (c) profiler tables
        text = [f"# kvgen decode profile, batch 1, prompt {len(prompt)} ({args.model})\n"]
        table, info = _profile_table(args, engine.step, 20 if not args.tiny else 4, [
            ("engine.step by CPU total", ["cpu_time_total"]),
            ("engine.step by self CPU", ["self_cpu_time_total"]),
            ("engine.step by CUDA total", ["device_time_total", "cuda_time_total"])])
        text.append(table)
        data["profile_engine_step"] = info
        if graphs and graphs.graphs.get(padded_size(1, graphs.sizes)) is not None:
            graph = graphs.graphs[padded_size(1, graphs.sizes)]
            table, info = _profile_table(args, graph.replay, 20 if not args.tiny else 4, [
                ("graph replay alone by self CUDA (kernels)", ["self_device_time_total", "self_cuda_time_total"])], 25)
            text.append(table)
            data["profile_graph_replay"] = info
            rung = padded_size(1, graphs.sizes)
            table, info = _profile_table(args, lambda: graphs._forward(rung), 5 if not args.tiny else 2, [
                ("the same forward eagerly by CUDA total (ops)", ["device_time_total", "cuda_time_total"]),
                ("the same forward eagerly by CPU total (ops)", ["cpu_time_total"])], 25)
            text.append(table)
            data["profile_eager_forward"] = info
        import cProfile  # the Python side of a step, by function (what the aten tables do not show)
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20 if not args.tiny else 4):
            engine.step()
        prof.disable()
        for order in ("cumulative", "tottime"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(30)
            text.append(f"### cProfile of engine.step by {order} ({20 if not args.tiny else 4} calls)\n{buf.getvalue()}")
        (Path(args.out) / "profile.txt").write_text("\n".join(text))
        save()
    except Exception as e:
        data['profiler_error'] = repr(e)[:500]
        print(f'profiler failed: {e!r}', flush=True)
    try:  # syncs: an error here must not lose the figures above
        # (d) host syncs a step
        if args.device.startswith("cuda"):
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(20):
                    engine.step()
            torch.cuda.set_sync_debug_mode(0)
            where: dict = {}
            for w in caught:
                key = f"{Path(w.filename).name}:{w.lineno} {str(w.message)[:60]}"
                where[key] = where.get(key, 0) + 1
            data["syncs_per_step"] = len(caught) / 20
            data["syncs_by_line"] = {k: v / 20 for k, v in sorted(where.items(), key=lambda kv: -kv[1])}
        else:
            data["syncs_per_step"] = None  # sync debug mode is CUDA's
    except Exception as e:
        data['syncs_error'] = repr(e)[:500]
        print(f'syncs failed: {e!r}', flush=True)
    engine.abort("profile")
    model = engine.model
    params_bytes, embed = _weight_bytes(Path(args.model))
    step_bytes = decode_bytes(model.config, params_bytes, embed, len(prompt) + 150)
    bandwidth = measured_bandwidth(args)
    data["step_bytes"] = step_bytes
    data["bandwidth"] = bandwidth
    if bandwidth:
        data["bytes_floor_ms"] = 1000 * step_bytes / bandwidth
    replay = data.get("graph_replay_ms")
    graph_kernels = data.get("profile_graph_replay", {}).get("attention_kernels_us_per_call", {})
    decode_us = sum(v for name, v in graph_kernels.items() if "_decode" in name)  # split and reduce kernels
    if decode_us:
        data["decode_attention_us_per_layer"] = decode_us / model.config.num_layers
    line = (f"step {data['step_ms_median']:.2f} ms median ({1000 / data['step_ms_median']:.0f} tok/s; "
            f"generate {data['generate_ms_per_token']:.2f} ms/token)"
            + (f", graph replay alone {replay:.2f} ms" if replay else "")
            + (f", eager forward {data['eager_forward_ms']:.2f} ms" if data.get("eager_forward_ms") else "")
            + (f", bytes floor {data['bytes_floor_ms']:.2f} ms" if bandwidth else "")
            + (f", decode attention {data['decode_attention_us_per_layer']:.1f} us/layer"
               if data.get("decode_attention_us_per_layer") else "")
            + (f", {data['syncs_per_step']:.1f} host syncs a step" if data.get("syncs_per_step") is not None else ""))
    data.pop("partial", None)
    return report(args, "profile", True, line, data)


CHECKS = {"bandwidth": check_bandwidth, "build-model": check_build_model, "tokens": check_tokens,
          "latency-kvgen": check_latency_kvgen, "latency-hf": check_latency_hf,
          "throughput-kvgen": check_throughput_kvgen, "throughput-hf": check_throughput_hf,
          "profile": check_profile}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small shapes (the CPU dry run)")
    parser.add_argument("--model", help="a GGUF file or an HF directory")
    parser.add_argument("--label", default="model", help="names the tokens check's result (tokens-LABEL)")
    parser.add_argument("--random-ids", action="store_true", help="prompts of random token ids (random models)")
    parser.add_argument("--config", help="build-model: the architecture JSON")
    parser.add_argument("--model-dir", help="build-model: where to write it")
    parser.add_argument("--eager", action="store_true", help="kvgen with --enforce-eager")
    parser.add_argument("--peer-timeout", type=float, default=600, help="throughput-hf: seconds before it "
                        "reports what transformers finished (set below the step's limit)")
    parser.add_argument("--requests", type=int, default=0,
                        help="throughput: the first N requests of the workload (a scaled run, named -N)")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    return CHECKS[args.check](args)


if __name__ == "__main__":
    sys.exit(main())
