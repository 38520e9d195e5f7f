/* A mixture-of-experts layer in one call: route, group the tokens by expert, and per active expert
 * gate/up, SwiGLU and down over its tokens, then each token's outputs weighted and summed.
 *
 * Built by kvgen/model/kernels/moe.py with the host's flags (build.py's FLAGS). No loop over experts
 * or tokens is left to Python, and each expert's weights are read once per call however many tokens
 * chose it; an expert no token chose is not read at all (batch-1 decode reads top_k of them).
 *
 * The experts' matrices are not read here: each projection's stack (every expert's [N, K], one after
 * the other at a fixed stride) is multiplied by the function it comes with, of the packed kernels'
 * signature: qmatmul.c's qmatmul_{u4,u8,e2m1}_g{group}_{f16,f32} on a packed stack of a GGUF file, or
 * kquant.c's kq_matmul_{q4_k,q5_k,q6_k} on a K-quant stack (`kquant`: its signature), or
 * moe_f32_matmul below for fp32 stacks. So packed experts run the same integer dot products as every
 * other packed layer.
 *
 * Routing, per token: p = softmax(logits) (fp32, max subtracted), the top_k largest p (the lower
 * expert index first among equal ones), renormalised to sum 1 where `norm_topk`. Then slots
 * (token t, choice k) are sorted by expert (a counting sort, tokens in order within an expert), each
 * expert's rows of x gathered into one block, and
 *     y[slot] = down_e( silu(gate_e(x_t)) * up_e(x_t) ),   out[t] = sum over k of w[t, k] * y[(t, k)]
 * (the sum in k's order, so a token's output does not depend on the tokens beside it, but for which
 * side of `many_rows` its experts' row counts are, as a dense packed layer's rows on its call's).
 *
 * gpt-oss's experts add a bias to each projection's rows (`gate_up_bias` [experts, 2 * inner],
 * `down_bias` [experts, hidden], NULL where there is none) and take the clamped SwiGLU in place of
 * silu (ACT_CLAMPED_SWIGLU): g = min(gate, limit), u = clamp(up, -limit, limit),
 * act = (u + 1) * g * sigmoid(alpha * g), in transformers' order of operations.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The packed kernels' signature (qmatmul.c): out [T, N] = x [T, K] @ W^T; nonzero when out of memory. */
typedef int (*matmul_fn)(const float *x, int64_t T, int64_t K, const uint8_t *codes, const void *scale,
                         const void *min, int32_t offset, int64_t N, float *out, int32_t parts, int32_t threads);

/* kquant.c's: out [T, N] (rows ldo apart) = x [T, K] @ W^T for K-quant panels at w. */
typedef int (*kquant_fn)(const float *x, int64_t T, int64_t K, const uint8_t *w, int64_t N, float *out, int64_t ldo,
                         int32_t parts, int32_t threads);

/* One projection of every expert: expert e's matrix [N, K] at codes + e * codes_stride (its scales
 * and mins likewise, where the format has them). `matmul` is a kquant_fn where `kquant`. */
struct expert_stack {
    void *matmul;
    const uint8_t *codes, *scale, *min;
    int64_t codes_stride, scale_stride, min_stride; /* bytes per expert */
    int32_t offset, parts;
    /* From this many rows an expert's x goes in one int8 part, as a dense packed layer's call does
     * from as many (kvgen.model.quant_linear.MANY_ROWS): the second part doubles the integer work
     * where the kernel is compute-bound (a prefill's experts), and costs nothing at decode's few rows,
     * which keep it. */
    int32_t many_rows;
    int64_t N, K;
    int32_t kquant;
};

enum { ACT_SILU = 0, ACT_CLAMPED_SWIGLU = 1 };

struct moe_args {
    const float *x;      /* [T, hidden] the branch's normed input */
    const float *logits; /* [T, experts] the router's */
    int64_t T, experts, top_k;
    int32_t norm_topk;
    struct expert_stack gate_up; /* N = 2 * inner: gate rows, then up rows */
    struct expert_stack down;    /* N = hidden, K = inner */
    float *out;                  /* [T, hidden] */
    int64_t *counts;             /* [experts] tokens routed to each, added to (router statistics) */
    int32_t num_threads;
    const float *gate_up_bias;   /* [experts, 2 * inner] or NULL */
    const float *down_bias;      /* [experts, hidden] or NULL */
    int32_t activation;          /* ACT_* */
    float alpha, limit;          /* the clamped SwiGLU's */
};

/* out [T, N] = x [T, K] @ W^T for W fp32 [N, K] at `codes`: the fp32 stacks' matmul, 16 lanes of
 * partial sums per dot product. */
int moe_f32_matmul(const float *x, int64_t T, int64_t K, const uint8_t *codes, const void *scale, const void *min,
                   int32_t offset, int64_t N, float *out, int32_t parts, int32_t threads) {
    (void)scale, (void)min, (void)offset, (void)parts;
    const float *w = (const float *)codes;
    const int use = threads > 1 && N * K * (T + 4) >= (1 << 16) ? threads : 1;
#pragma omp parallel for num_threads(use) schedule(static) if (use > 1)
    for (int64_t n = 0; n < N; n++) {
        const float *wn = w + n * K;
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * K;
            float acc[16] = {0};
            int64_t k = 0;
            for (; k + 16 <= K; k += 16)
                for (int j = 0; j < 16; j++)
                    acc[j] += xt[k + j] * wn[k + j];
            float sum = 0.0f;
            for (int j = 0; j < 16; j++)
                sum += acc[j];
            for (; k < K; k++)
                sum += xt[k] * wn[k];
            out[t * N + n] = sum;
        }
    }
    return 0;
}

/* Token t's experts (chosen[k]) and weights (weight[k]), from its logits. */
static void route(const float *logits, int64_t experts, int64_t top_k, int norm_topk, float *p, int32_t *chosen,
                  float *weight) {
    float max = logits[0], total = 0.0f;
    for (int64_t e = 1; e < experts; e++)
        max = logits[e] > max ? logits[e] : max;
    for (int64_t e = 0; e < experts; e++)
        total += p[e] = expf(logits[e] - max);
    for (int64_t e = 0; e < experts; e++)
        p[e] /= total;
    float picked = 0.0f;
    for (int64_t k = 0; k < top_k; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < experts; e++)
            if (p[e] >= 0.0f && (best < 0 || p[e] > p[best]))
                best = e;
        chosen[k] = (int32_t)best;
        picked += weight[k] = p[best];
        p[best] = -1.0f; /* taken */
    }
    if (norm_topk)
        for (int64_t k = 0; k < top_k; k++)
            weight[k] /= picked;
}

static inline const uint8_t *at(const uint8_t *base, int64_t stride, int64_t e) {
    return base ? base + e * stride : NULL;
}

/* rows [n, N] of x through expert e of `s`. */
static int expert_matmul(const struct expert_stack *s, int64_t e, const float *x, int64_t n, float *out,
                         int threads) {
    const int32_t parts = n >= s->many_rows ? 1 : s->parts;
    if (s->kquant)
        return ((kquant_fn)s->matmul)(x, n, s->K, at(s->codes, s->codes_stride, e), s->N, out, s->N, parts,
                                      threads);
    return ((matmul_fn)s->matmul)(x, n, s->K, at(s->codes, s->codes_stride, e), at(s->scale, s->scale_stride, e),
                                  at(s->min, s->min_stride, e), s->offset, s->N, out, parts, threads);
}

/* rows [n, width] += bias [width] (NULL: nothing). */
static void add_bias(float *rows, int64_t n, int64_t width, const float *bias) {
    if (!bias)
        return;
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < width; i++)
            rows[r * width + i] += bias[i];
}

/* act [n, inner] = act(gate) * up of gate_up rows [n, 2 * inner]: silu, or the clamped SwiGLU. */
static void swiglu(const struct moe_args *a, const float *gate_up, int64_t n, int64_t inner, float *act) {
    const float alpha = a->alpha, limit = a->limit;
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < inner; i++) {
            float g = gate_up[r * 2 * inner + i], u = gate_up[r * 2 * inner + inner + i];
            if (a->activation == ACT_SILU) {
                act[r * inner + i] = g / (1.0f + expf(-g)) * u;
                continue;
            }
            g = g < limit ? g : limit;
            u = u < -limit ? -limit : u > limit ? limit : u;
            act[r * inner + i] = (u + 1.0f) * (g * (1.0f / (1.0f + expf(-(g * alpha)))));
        }
}

/* Expert e over its rows r0 .. r0 + n - 1 of the gathered buffers: gate/up, activation, down. */
static int expert_pass(const struct moe_args *a, int64_t e, int64_t r0, int64_t n, const float *xs, float *gate_up,
                       float *act, float *ys, int threads) {
    const int64_t hidden = a->down.N, inner = a->down.K;
    if (expert_matmul(&a->gate_up, e, xs + r0 * hidden, n, gate_up + r0 * 2 * inner, threads))
        return 1;
    add_bias(gate_up + r0 * 2 * inner, n, 2 * inner, a->gate_up_bias ? a->gate_up_bias + e * 2 * inner : NULL);
    swiglu(a, gate_up + r0 * 2 * inner, n, inner, act + r0 * inner);
    if (expert_matmul(&a->down, e, act + r0 * inner, n, ys + r0 * hidden, threads))
        return 1;
    add_bias(ys + r0 * hidden, n, hidden, a->down_bias ? a->down_bias + e * hidden : NULL);
    return 0;
}

/* Every expert some token chose, over its rows (start: expert e's are start[e] .. start[e + 1] - 1;
 * `active`: room for the experts' indices).
 * With at least SHARE_FROM_EXPERTS per thread (decode chooses top_k, prefill most), the experts are
 * shared among the threads, each running its experts' matmuls on one thread: a step forks once, not
 * twice an expert, and each thread streams whole matrices. Otherwise each matmul is split. A row's
 * result is the same either way (the kernels' rows do not depend on their threads). */
#define SHARE_FROM_EXPERTS 2
static int run_experts(const struct moe_args *a, const int64_t *start, int64_t *active, const float *xs,
                       float *gate_up, float *act, float *ys) {
    int64_t count = 0;
    for (int64_t e = 0; e < a->experts; e++)
        if (start[e + 1] > start[e])
            active[count++] = e;
    int failed = 0;
    const int threads = a->num_threads;
    if (threads > 1 && count >= SHARE_FROM_EXPERTS * threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(| : failed)
        for (int64_t i = 0; i < count; i++) {
            const int64_t e = active[i];
            failed |= expert_pass(a, e, start[e], start[e + 1] - start[e], xs, gate_up, act, ys, 1);
        }
    } else {
        for (int64_t i = 0; i < count && !failed; i++) {
            const int64_t e = active[i];
            failed = expert_pass(a, e, start[e], start[e + 1] - start[e], xs, gate_up, act, ys, threads);
        }
    }
    return failed;
}

int moe_forward(const struct moe_args *a) {
    const int64_t T = a->T, E = a->experts, K = a->top_k, slots = T * K;
    const int64_t hidden = a->down.N, inner = a->down.K;
    int32_t *chosen = malloc(sizeof(int32_t) * slots);
    int64_t *row_of_slot = malloc(sizeof(int64_t) * slots), *start = calloc(E + 1, sizeof(int64_t));
    int64_t *fill = malloc(sizeof(int64_t) * E);
    float *weight = malloc(sizeof(float) * slots), *p = malloc(sizeof(float) * E);
    float *xs = malloc(sizeof(float) * slots * hidden), *ys = malloc(sizeof(float) * slots * hidden);
    float *gate_up = malloc(sizeof(float) * slots * 2 * inner), *act = malloc(sizeof(float) * slots * inner);
    int failed = !(chosen && row_of_slot && start && fill && weight && p && xs && ys && gate_up && act);
    if (!failed) {
        for (int64_t t = 0; t < T; t++)
            route(a->logits + t * E, E, K, a->norm_topk, p, chosen + t * K, weight + t * K);
        for (int64_t s = 0; s < slots; s++) /* a counting sort of the slots by expert */
            start[chosen[s] + 1]++;
        for (int64_t e = 0; e < E; e++) {
            a->counts[e] += start[e + 1];
            start[e + 1] += start[e];
        }
        memcpy(fill, start, sizeof(int64_t) * E);
        for (int64_t s = 0; s < slots; s++) { /* x's rows gathered, expert by expert */
            const int64_t row = fill[chosen[s]]++;
            row_of_slot[s] = row;
            memcpy(xs + row * hidden, a->x + (s / K) * hidden, sizeof(float) * hidden);
        }
    }
    failed = failed || run_experts(a, start, fill, xs, gate_up, act, ys); /* fill: free once gathered */
    if (!failed)
        for (int64_t t = 0; t < T; t++) {
            float *o = a->out + t * hidden;
            memset(o, 0, sizeof(float) * hidden);
            for (int64_t k = 0; k < K; k++) {
                const float w = weight[t * K + k], *y = ys + row_of_slot[t * K + k] * hidden;
                for (int64_t h = 0; h < hidden; h++)
                    o[h] += w * y[h];
            }
        }
    free(chosen), free(row_of_slot), free(start), free(fill), free(weight), free(p);
    free(xs), free(ys), free(gate_up), free(act);
    return failed;
}
