"""Tolerances derived from fp32 rounding, so that they hold on any x86-64 (SSE, AVX2 or AVX-512, with
or without FMA, any BLAS blocking), instead of numbers tuned to one CPU.

Two fp32 evaluations of the same value that differ only in the order of their sums (another kernel,
another SIMD width, a GEMM instead of a GEMV) each lie within Higham's deterministic bound of the
exact value: a sum of n terms errs by at most gamma(n) * sum |term|, gamma(n) = n u / (1 - n u), with u
= 2**-24 the fp32 unit roundoff. So the two differ by at most 2 gamma(n) * sum |term|. A model's output
is a chain of such sums; to first order their errors add, so n is the sum of the reduction lengths
along one token's path, and `magnitude` stands for the size of the values compared.
"""

from kvgen.config import ModelConfig

FP32_UNIT_ROUNDOFF = 2.0**-24


def gamma(n: int) -> float:
    return n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF)


def fp32_gap(reduction_length: int, magnitude: float = 1.0) -> float:
    """The largest difference two fp32 evaluations that differ in summation order can show."""
    return 2 * gamma(reduction_length) * max(magnitude, 1.0)


def model_reduction_length(config: ModelConfig, context: int) -> int:
    """Sum of the reduction lengths one token's logprobs go through: per layer RMSNorm, the q/k/v
    projection, the scores (head_dim), softmax and P @ V (context), o_proj, RMSNorm, gate/up, down;
    then the final norm, the LM head and the log-softmax (vocab)."""
    hidden, heads_width = config.hidden_size, config.num_heads * config.head_dim
    per_layer = 2 * hidden + config.head_dim + 2 * context + heads_width + 2 * hidden + config.intermediate_size
    return config.num_layers * per_layer + 2 * hidden + config.vocab_size


def logprob_gap(config: ModelConfig, context: int, magnitude: float) -> float:
    """Tolerance for the logprobs of one model run two ways (kernels, batching, cache layouts)."""
    return fp32_gap(model_reduction_length(config, context), magnitude)


def assert_same_logprobs(a, b, config: ModelConfig, relative_floor: float = 0.0) -> None:
    """Two RequestOutputs of one request run two ways: the same chosen tokens, and log-probabilities
    within `logprob_gap` over the sequence's full context (or within `relative_floor` of their
    magnitude, at least 1, as logprob_gap scales, where a coarser rounding than fp32's can enter). The top tokens are the same, except
    that a near-tie at the edge of the top set may swap: a token only one run ranks in its top set
    must lie within the bound of that run's smallest top logprob."""
    for ca, cb in zip(a.outputs, b.outputs, strict=True):
        context = len(a.prompt_token_ids) + len(ca.token_ids)
        for la, lb in zip(ca.logprobs or [], cb.logprobs or [], strict=True):
            shared = la.top.keys() & lb.top.keys()
            pairs = [(la.token_logprob, lb.token_logprob)] + [(la.top[t], lb.top[t]) for t in shared]
            magnitude = max(max(abs(x), abs(y)) for x, y in pairs + list(zip(la.top.values(), lb.top.values())))
            bound = max(logprob_gap(config, context, magnitude), relative_floor * max(magnitude, 1.0))
            assert max(abs(x - y) for x, y in pairs) <= bound
            for mine, theirs in ((la.top, lb.top), (lb.top, la.top)):
                if extra := mine.keys() - shared:
                    assert theirs and all(mine[t] <= min(theirs.values()) + bound for t in extra)


# -- lossy K/V pools (kv_cache_dtype) ---------------------------------------------------------------
#
# A pool format rounds each K/V element once, to nearest, and reads widen exactly: the relative error
# it adds is its unit roundoff 2**-p for p significand bits (bf16 8, fp16 11, e4m3 4; fp32 24); an int8
# row errs by half a step of max/127, counted as one step, 2**-7, of the row's largest element (most
# elements are smaller). A bf16 model's two attention paths (the fp32 kernel rounding once, or bf16
# SDPA) also differ by bf16 rounding.
KV_ROUNDING = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11, "int8": 2.0**-7, "fp8": 2.0**-4}
# To first order a logprob then moves by that u times the model's gain from a relative K/V perturbation
# to the logprob. The gain has no a-priori bound short of the weights' norms, so it is declared: the
# largest measured, teacher-forced, was 19 (int8 pools of bf16 stories260K); bf16 / fp16 pools under
# fp32 gave 4-10 on stories260K and 6-9 on the SmolLM2 file dequantized to fp32, with u for each.
KV_GAIN = 32

# A greedy run's tokens and each step's top logprobs {token: logprob}.
Trace = tuple[list[int], list[dict[int, float]]]


def trace(output) -> Trace:
    """A CompletionOutput (logprobs requested) as a Trace: each step's top logprobs and its chosen token's
    (below the top ones where a grammar ruled those out)."""
    return output.token_ids, [step.top | {token: step.token_logprob}
                              for token, step in zip(output.token_ids, output.logprobs)]


def kv_bound(u: float, logprob: float) -> float:
    """How far a logprob may move when K/V are perturbed by a relative u (see KV_GAIN)."""
    return KV_GAIN * u * max(abs(logprob), 1.0)


def check_near_tie(step: int, got: Trace, want: Trace, bound) -> None:
    """Where `got` first picks another token than the reference `want`, the two picks must be a near-tie
    of the reference: the run's pick within twice the bound of the reference's own there (either may
    win). Where the reference does not report the run's pick, its logprob in the run, less the bound
    (the agreeing steps hold the two within it), stands in. Greedy picks are the top two; under a
    grammar they are the best tokens it allows, which need not be."""
    got_id, want_id = got[0][step], want[0][step]
    chosen = want[1][step][want_id]
    rival = want[1][step].get(got_id, got[1][step][got_id] - bound(chosen))
    assert chosen - rival <= 2 * bound(chosen), f"step {step}: not a near-tie, {want_id}: {chosen} vs {got_id}: {rival}"


def agreeing_prefix(got: Trace, want: Trace, u: float) -> int:
    """How many greedy tokens of `got` agree with the reference `want`; checks each agreeing step's top
    logprobs within kv_bound (the same context on both sides: teacher-forced), and that a divergence
    is a near-tie of the reference (its top two within twice the bound: either may win)."""
    (got_ids, got_tops), (want_ids, want_tops) = got, want
    for step, (g, w) in enumerate(zip(got_tops, want_tops, strict=True)):
        if got_ids[step] != want_ids[step]:
            check_near_tie(step, got, want, lambda logprob: kv_bound(u, logprob))
            return step
        for token in g.keys() & w.keys():
            assert abs(g[token] - w[token]) <= kv_bound(u, w[token]), f"step {step}: {g[token]} vs {w[token]}"
    return len(want_ids)


# -- lossy weights (dtype, quantization) ------------------------------------------------------------
#
# A model's weights rounded once more than the plain path's fp32 ones, as a relative u per element, on
# the same footing as KV_ROUNDING (KV_GAIN turns it into a logprob bound): a bf16 model rounds weights
# and activations to 8 significand bits; int8 packs groups of 32 at max/127 a step; int4 at max/7 (a
# GGUF's own 4-bit blocks, quantization "auto", taken as int4). Their quantized matmuls also round the
# activations to int8 per group, so two paths whose fp32 sums differ in the last bit (batching,
# chunking, another attention kernel) may land on neighbouring int8 steps: ACTIVATION_ROUNDING.
# Measured against the fp32 plain path, teacher-forced, worst |d logprob| / max(|logprob|, 1): bf16 0.07
# (stories260K) and 0.08 (SmolLM2), int8 0.05 and 0.16, int4 0.49 (stories260K): all within
# KV_GAIN * u.
WEIGHT_ROUNDING = {"bfloat16": 2.0**-8, "int8": 2.0**-7, "int4": 2.0**-3}
ACTIVATION_ROUNDING = 2.0**-7


def agreeing_prefix_within(got: Trace, want: Trace, bound) -> int:
    """agreeing_prefix with the tolerance a function of the reference logprob (kv_bound's, or
    logprob_gap's for fp32 paths); the two traces may end at different lengths only after they
    diverge (a grammar stops where its own tokens complete it)."""
    (got_ids, got_tops), (want_ids, want_tops) = got, want
    for step, (g, w) in enumerate(zip(got_tops, want_tops)):
        if got_ids[step] != want_ids[step]:
            check_near_tie(step, got, want, bound)
            return step
        for token in g.keys() & w.keys():
            assert abs(g[token] - w[token]) <= bound(w[token]), f"step {step}: {g[token]} vs {w[token]}"
    assert len(got_ids) == len(want_ids), f"the same tokens, but {len(got_ids)} of them against {len(want_ids)}"
    return len(want_ids)
