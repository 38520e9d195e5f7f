"""The mixture-of-experts kernel (moe.c through kvgen.model.experts) against the experts computed in
float64 from the same (dequantized) weights, at 1, few and many tokens, fp32 and packed stacks.

The bound is derived from the kernel's roundings, step by step (`expert_bound`):
- each matmul: fp32 stacks gamma(K) sum |x||w|; packed stacks the activations' int8 step per span
  (max |x| / 127, half a step plus 4 * 127 ulps of rounding, tests/model/quant/bounds.py) times |w|,
  plus the fp32 accumulation over the weights' terms |s (q - o)| + |m|, (K / 8 + 25) u (the larger of
  qmatmul.c's K / 32 + 25 and kquant.c's 2 K / 16 + 4, tests/model/quant/test_kquant.py), plus an
  input already off by x_err, times |w|;
- SwiGLU: silu is 1.1-Lipschitz, so |silu(g') u' - silu(g) u| <= 1.1 e_g (|u| + e_u) + |silu(g)| e_u,
  plus 8 ulps of its own (expf, a division, two products);
- routing weights: softmax over E logits and the renormalisation, (E + 2K + 8) ulps relative;
- the weighted sum: gamma(K) over sum w |y|.
"""

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvgen.loaders.gguf_tensors import GGUFWeight
from kvgen.model.experts import Experts, expert_stack, moe_reference, route
from kvgen.model.formats.gguf_blocks import convert
from kvgen.model.kernels.moe import ExpertOptions, moe_kernel
from kvgen.model.formats.float_weights import quantize_int4
from kvgen.model.kernels.qmatmul import qmatmul_kernel
from kvgen.model.linear_choice import FLOAT_QUANTIZERS, gguf_values
from tests.model.quant.bounds import U, term_magnitudes
from tests.model.quant.raw_blocks import raw_matrix
from tests.model.quant.test_kquant import K_TYPES
from tests.model.quant.test_kquant import magnitudes as k_magnitudes
from tests.support.tolerances import gamma

pytestmark = pytest.mark.skipif(moe_kernel() is None, reason="no C compiler: the experts run in torch")


def random_experts(experts: int, hidden: int, inner: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(experts, inner, hidden, generator=g) / hidden ** 0.5,
            torch.randn(experts, inner, hidden, generator=g) / hidden ** 0.5,
            torch.randn(experts, hidden, inner, generator=g) / inner ** 0.5]


def gguf_experts(ggml_type: Q, experts: int, hidden: int, inner: int) -> list[GGUFWeight]:
    shapes = [(experts, inner, hidden), (experts, inner, hidden), (experts, hidden, inner)]
    return [GGUFWeight(f"w{i}", ggml_type, s, raw_matrix(ggml_type, s[0] * s[1], s[2], seed=i))
            for i, s in enumerate(shapes)]


def matmul_bound(x_abs: torch.Tensor, x_err: torch.Tensor, packed: bool, w_abs: torch.Tensor):
    """Bound on |kernel(x') - x W^T| for |x' - x| <= x_err, x_abs = |x| float64 [T, K], w_abs one
    expert's |w| (fp32) or term magnitudes (packed)."""
    k = x_abs.shape[1]
    upper = x_abs + x_err
    if not packed:
        return x_err @ w_abs.T + gamma(k) * upper @ w_abs.T
    span_max = upper.view(upper.shape[0], k // 32, 32).amax(-1).repeat_interleave(32, 1)
    step = span_max / 127 * (0.5 + 4 * 127 * U)
    return (x_err + step) @ w_abs.T + (k / 8 + 25) * U * (upper + step) @ w_abs.T


def expert_bound(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, layer: Experts,
                 terms: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """(float64 reference [T, hidden], bound on the kernel's distance to it); `terms`: the stacks'
    magnitudes (`magnitudes`)."""
    gate_up, down = layer.gate_up.dequantize().double(), layer.down.dequantize().double()
    experts, inner = down.shape[0], down.shape[2]
    gu_terms, down_terms = terms
    packed = not isinstance(layer.down.weight, torch.Tensor)
    x = x.double()
    ref, bound = torch.zeros_like(x), torch.zeros_like(x)
    top_k = chosen.shape[1]
    w_err = (experts + 2 * top_k + 8) * U * weights.double()
    for e in chosen.unique().tolist():
        tokens, k = torch.nonzero(chosen == e, as_tuple=True)
        xe = x[tokens]
        gu = xe @ gate_up[e].T
        gu_err = matmul_bound(xe.abs(), torch.zeros_like(xe), packed, gu_terms[e])
        g, u = gu.split(inner, dim=1)
        g_err, u_err = gu_err.split(inner, dim=1)
        a = torch.nn.functional.silu(g) * u
        a_err = 1.1 * g_err * (u.abs() + u_err) + torch.nn.functional.silu(g).abs() * u_err
        a_err = a_err + 8 * U * (a.abs() + a_err)
        y = a @ down[e].T
        y_err = matmul_bound(a.abs(), a_err, packed, down_terms[e])
        w = weights[tokens, k].double()[:, None]
        ref.index_add_(0, tokens, w * y)
        bound.index_add_(0, tokens, w * y_err + w_err[tokens, k][:, None] * (y.abs() + y_err)
                         + gamma(top_k) * w * (y.abs() + y_err))
    return ref, bound


def magnitudes(parts: list) -> torch.Tensor:
    """Per expert, the magnitudes a stack's fp32 sums run over, [experts, N, K] stacked as the kernel
    stacks `parts`: |w| of float parts, |s (q - o)| + |m| (|d sc (q - o)| + |dmin m|) of GGUF blocks."""
    def one(p):
        if isinstance(p, torch.Tensor):
            return p.double().abs()
        experts, n, k = p.shape
        if p.ggml_type in K_TYPES:
            return k_magnitudes(p.ggml_type, p.raw, (experts * n, k)).view(experts, n, k)
        return term_magnitudes(convert(p.ggml_type, p.raw, (experts * n, k))).view(experts, n, k)

    return torch.cat([one(p) for p in parts], dim=1)


def check(parts: list, top_k: int, norm: bool, tokens: int, seed: int = 0, quantization: str = "none") -> Experts:
    """Builds the experts of `parts` (gate, up, down), packed again as `quantization` asks, and checks
    one call of `tokens` random rows."""
    terms = (magnitudes(parts[:2]), magnitudes(parts[2:])) if quantization == "none" else None
    layer = Experts(*parts, top_k=top_k, norm_topk=norm, activations="int8", quantization=quantization)
    if terms is None:  # the terms of the packed copy the layer made
        terms = tuple(term_magnitudes(stack.weight).view(stack.experts, stack.args.N, stack.args.K)
                      for stack in (layer.gate_up, layer.down))
    g = torch.Generator().manual_seed(seed)
    hidden = layer.down.args.N
    x = torch.randn(tokens, hidden, generator=g)
    logits = 3 * torch.randn(tokens, layer.num_experts, generator=g)
    chosen, weights = route(logits.double(), layer.top_k, layer.norm_topk)
    out = layer(x, logits)
    ref, bound = expert_bound(x, chosen, weights, layer, terms)
    assert torch.equal(layer.counts, torch.bincount(chosen.flatten(), minlength=layer.num_experts))
    assert ((out.double() - ref).abs() <= bound).all(), ((out.double() - ref).abs() / bound).max()
    return layer


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("top_k,norm", [(2, True), (4, False)])
def test_fp32_experts_match_float64(tokens, top_k, norm):
    assert check(random_experts(8, 64, 32), top_k, norm, tokens).gate_up.kernel == "moe f32"


@pytest.mark.skipif(qmatmul_kernel() is None, reason="no packed kernel on this CPU")
@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("ggml_type,hidden,inner,kernel", [
    (Q.Q8_0, 64, 32, "moe packed u8 g32"), (Q.Q4_0, 64, 32, "moe packed u4 g32"),
    (Q.MXFP4, 64, 32, "moe packed e2m1 g32"), (Q.Q4_K, 256, 256, "moe q4_k"), (Q.Q6_K, 256, 256, "moe q6_k")], ids=lambda v: getattr(v, "name", None))
def test_packed_experts_match_float64(tokens, ggml_type, hidden, inner, kernel):
    layer = check(gguf_experts(ggml_type, 4, hidden, inner), 2, True, tokens)
    assert layer.gate_up.kernel == layer.down.kernel == kernel


@pytest.mark.skipif(qmatmul_kernel() is None, reason="no packed kernel on this CPU")
@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("quantization,kernel", [("int8", "moe packed u8 g32"), ("int4", "moe packed u4 g32")])
def test_float_experts_packed_as_quantization_asks(tokens, quantization, kernel):
    """`--quantization int8 / int4` packs a float checkpoint's experts as it packs its dense matrices:
    each stack holds the bits quantize_int8 / quantize_int4 give its experts' rows."""
    parts = random_experts(4, 64, 32)
    layer = check(parts, 2, True, tokens, quantization=quantization)
    assert layer.gate_up.kernel == layer.down.kernel == kernel
    want = FLOAT_QUANTIZERS[quantization](torch.cat(parts[:2], dim=1).reshape(4 * 64, 64))
    assert torch.equal(layer.gate_up.weight.codes, want.codes) and torch.equal(layer.gate_up.weight.scale, want.scale)


@pytest.mark.skipif(qmatmul_kernel() is None, reason="no packed kernel on this CPU")
def test_gguf_experts_packed_again_only_where_that_narrows_them():
    """At int4, Q8_0 experts are packed again from their values (as a Q8_0 dense matrix is), Q4_0
    experts (4.5 bits a weight against int4's 5) stay as the file has them; at int8, Q8_0 stays."""
    q8 = gguf_experts(Q.Q8_0, 4, 64, 32)
    layer = Experts(*q8, top_k=2, norm_topk=True, activations="int8", quantization="int4")
    values = torch.cat([gguf_values(p) for p in q8[:2]], dim=1).reshape(4 * 64, 64)
    assert layer.gate_up.kernel == "moe packed u4 g32"
    assert torch.equal(layer.gate_up.weight.codes, quantize_int4(values).codes)
    assert Experts(*q8, top_k=2, norm_topk=True, activations="int8", quantization="int8").gate_up.kernel == \
        "moe packed u8 g32"
    q4 = gguf_experts(Q.Q4_0, 4, 64, 32)
    kept, auto = (Experts(*q4, top_k=2, norm_topk=True, activations="int8", quantization=q) for q in ("int4", "auto"))
    assert kept.down.kernel == "moe packed u4 g32" and torch.equal(kept.down.dequantize(), auto.down.dequantize())


def test_a_token_reads_only_its_experts():
    """Experts no token chose are never read: NaN weights there leave the output finite and exact."""
    gate, up, down = random_experts(8, 64, 32)
    x, logits = torch.randn(1, 64), torch.full((1, 8), -10.0)
    logits[0, 2], logits[0, 5] = 1.0, 0.5
    for w in (gate, up, down):
        w[[0, 1, 3, 4, 6, 7]] = float("nan")
    layer = Experts(gate, up, down, top_k=2, norm_topk=True, activations="int8")
    out = layer(x, logits)
    chosen, weights = route(logits, 2, True)
    want = moe_reference(x, chosen, weights, torch.cat((gate, up), dim=1), down)
    assert torch.isfinite(out).all() and set(chosen.flatten().tolist()) == {2, 5}
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)


def test_rows_do_not_depend_on_their_neighbours():
    """A token's output is the same alone or in a batch (its sum runs in its own top-k order)."""
    layer = Experts(*random_experts(8, 64, 32), top_k=2, norm_topk=True, activations="int8")
    x, logits = torch.randn(9, 64), torch.randn(9, 8)
    batch = layer(x, logits)
    alone = torch.cat([layer(x[i:i + 1], logits[i:i + 1]) for i in range(9)])
    assert torch.equal(batch, alone)


@pytest.mark.skipif(qmatmul_kernel() is None, reason="no packed kernel on this CPU")
@pytest.mark.parametrize("ggml_type", [Q.Q4_K, Q.Q8_0], ids=lambda t: t.name)
def test_an_expert_with_many_rows_takes_x_in_one_int8_part(ggml_type):
    """Two int8 parts (the engine's default) below 16 rows an expert, one from 16 on, as a dense
    packed layer's call: 16 tokens through every expert give the one-part layer's bits, 15 do not."""
    parts = gguf_experts(ggml_type, 4, 256, 256)
    two, one = (Experts(*parts, top_k=4, norm_topk=True, activations=a) for a in ("int8x2", "int8"))
    g = torch.Generator().manual_seed(4)
    x, logits = torch.randn(16, 256, generator=g), torch.randn(16, 4, generator=g)
    assert torch.equal(two(x, logits), one(x, logits))
    assert not torch.equal(two(x[:15], logits[:15]), one(x[:15], logits[:15]))


@pytest.mark.skipif(qmatmul_kernel() is None, reason="no packed kernel on this CPU")
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (1, 4), (6, 4)])
def test_experts_shared_among_threads_give_the_same_bits(tokens, top_k):
    """Two threads sharing the experts (at least two active experts a thread) or splitting each matmul
    (fewer) give one thread's bits: a row's sums never depend on which thread ran them."""
    layer = Experts(*gguf_experts(Q.Q4_K, 8, 256, 256), top_k=top_k, norm_topk=True, activations="int8")
    g = torch.Generator().manual_seed(3)
    x, logits = torch.randn(tokens, 256, generator=g), torch.randn(tokens, 8, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = layer(x, logits)
        torch.set_num_threads(1)
        one = layer(x, logits)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(two, one)


def test_mixed_types_stay_float():
    """A stack whose parts differ in type (gate Q8_0, up Q4_0) cannot be one packed stack: fp32."""
    gate, up, _ = gguf_experts(Q.Q8_0, 2, 64, 32)
    up = gguf_experts(Q.Q4_0, 2, 64, 32)[1]
    assert expert_stack([gate, up], "int8").kernel == "moe f32"


def gpt_oss_reference(gate, up, down, options, x, logits, top_k):
    """transformers' GptOssExperts and router order (top-k logits, softmax among them) on the same weights,
    put in its layout: gate_up_proj [experts, hidden, 2 * inner], gate and up columns interleaved."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts, inner, hidden = gate.shape
    module = GptOssExperts(GptOssConfig(hidden_size=hidden, intermediate_size=inner, num_local_experts=experts))
    gate_bias, up_bias = options.gate_up_bias.split(inner, dim=1)
    with torch.no_grad():
        module.gate_up_proj[:, :, ::2], module.gate_up_proj[:, :, 1::2] = gate.transpose(1, 2), up.transpose(1, 2)
        module.gate_up_proj_bias[:, ::2], module.gate_up_proj_bias[:, 1::2] = gate_bias, up_bias
        module.down_proj.copy_(down.transpose(1, 2)), module.down_proj_bias.copy_(options.down_bias)
        top, chosen = torch.topk(logits, top_k, dim=-1)
        return module(x, chosen, top.softmax(dim=1))


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_gpt_oss_experts_match_transformers(tokens):
    """Biases on every projection and the clamped SwiGLU, gate and up values past the limit included:
    the kernel and the torch reference against transformers' experts."""
    gate, up, down = (w * 6 for w in random_experts(8, 64, 32))  # |gate|, |up| past 7 for some rows
    g = torch.Generator().manual_seed(1)
    options = ExpertOptions(torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g), "clamped_swiglu")
    x, logits = torch.randn(tokens, 64, generator=g), 3 * torch.randn(tokens, 8, generator=g)
    assert (x @ gate.flatten(0, 1).T).abs().max() > 2 * options.limit
    want = gpt_oss_reference(gate, up, down, options, x, logits, 4)
    layer = Experts(gate, up, down, top_k=4, norm_topk=True, activations="int8", options=options)
    assert torch.allclose(layer(x, logits), want, rtol=1e-5, atol=1e-4)
    chosen, weights = route(logits, 4, True)
    reference = moe_reference(x, chosen, weights, torch.cat((gate, up), dim=1), down, options)
    assert torch.allclose(reference, want, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(moe_reference(x, chosen, weights, torch.cat((gate, up), dim=1), down), want, atol=1)


@pytest.mark.skipif(qmatmul_kernel() is None, reason="no packed kernel on this CPU")
@pytest.mark.parametrize("ggml_type", [Q.MXFP4, Q.Q8_0], ids=lambda v: v.name)
def test_packed_gpt_oss_experts_add_their_biases(ggml_type):
    """Packed stacks take the same biases and clamped SwiGLU: within 3% of the torch reference on their
    values (the int8 activations' error, ~1%; a bias dropped is of the output's own size)."""
    parts = gguf_experts(ggml_type, 8, 64, 32)
    gate, up, down = (p.dequantize() for p in parts)
    g = torch.Generator().manual_seed(2)
    options = ExpertOptions(torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g), "clamped_swiglu")
    layer = Experts(*parts, top_k=4, norm_topk=True, activations="int8", options=options)
    x, logits = torch.randn(5, 64, generator=g), torch.randn(5, 8, generator=g)
    chosen, weights = route(logits, 4, True)
    want = moe_reference(x, chosen, weights, torch.cat((gate, up), dim=1), down, options)
    assert layer.gate_up.kernel == ("moe packed e2m1 g32" if ggml_type == Q.MXFP4 else "moe packed u8 g32")
    assert (layer(x, logits) - want).abs().max() < 0.03 * want.abs().max()
