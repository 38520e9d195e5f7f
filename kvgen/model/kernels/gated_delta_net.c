/* Gated DeltaNet in C: the delta rule and the causal conv of any number of sequences, each with its own
 * tokens (one for a decode step, a prompt chunk for a prefill), reading and updating each sequence's
 * recurrent state and conv window in place in a pool of slots (kvgen/cache/state_pool.py), fp32. The
 * math is kvgen/model/gated_delta_net.py's (delta_rule_recurrent, causal_conv1d); see there for the rule.
 *
 * gdn_rule: one task per (sequence, value head). Its state S [Dk, Dv] is independent column by column
 * (token t touches column v only through p[v], u[v] and o[v] below), so the task takes COLS columns
 * at a time into a contiguous block (Dk x 32 fp32, 16 KB at Dk 128: it stays in L1) and runs all of
 * the sequence's tokens on it before the next block; the pool is read once and written once however
 * many tokens there are. Per token, with q, k unit vectors (q also scaled by Dk^-1/2) and d = exp(g):
 *
 *     pass 1   p = k^T S,  r = q^T S                          (one read of the block)
 *              u = beta (x - d p)                             (the delta rule's write)
 *              o = d r + (q.k) u                              (= S_new^T q)
 *     pass 2   S = d S + k u^T                                (one read and write of the block)
 *
 * q and k are L2-normalized per head (x / sqrt(sum x^2 + 1e-6)) once per token, before the blocks.
 * Value head h reads key head h / r ("grouped", Hugging Face's order) or h mod Hk ("tiled", a GGUF's).
 * With `kept`, the state after every token is written out too (a speculative verify's checkpoints).
 * Sums run in another order than torch's (and o is formed from S before its update), so results differ
 * from torch's by rounding: tests/model/test_gated_delta_net_kernel.py holds them to a derived bound.
 *
 * gdn_conv: the causal depthwise convolution (kernel K) and SiLU; one task per (sequence, 256
 * channels), its taps and the old window transposed to rows so that the channel loops vectorize; each
 * sequence's window [C, K - 1] becomes its last K - 1 inputs.
 *
 * Tasks are shared among `num_threads` OpenMP threads (torch's count, passed in), dynamically: a
 * ragged batch's sequences differ in length.
 *
 * Measured (benchmarks/delta_net_prefill.py; a Qwen3.5-0.8B-shaped layer, 16 + 16 heads of 128, a
 * 512-token prompt, conv + gates + rule + gated norm, on a 2-core machine under a load of ~6, so the
 * ratios hold better than the times): torch's chunked form 221 ms/layer -> C 62 (3.6x) on one thread,
 * 369 -> 63 (5.8x) on two. Decode (tests/model/test_gated_delta_net_kernel.py -m slow) runs as fast as
 * the two-pass step this replaced: one token runs on the pool in place, without the block copies.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512F__
#include "exp16.h"
#endif

#define MAX_DIM 1024   /* Dk, Dv up to this (Qwen3.5: 128); gdn_rule returns 1 beyond it */
#define LANES 16       /* floats in one vector below (AVX-512's; the compiler splits it where narrower) */
#define COLS 32        /* state columns a task keeps in L1 across a sequence's tokens */
#define VECS (COLS / LANES)
#define CONV_GROUP 256 /* channels per conv task */
#define MAX_KERNEL 8   /* conv kernel sizes up to this (Qwen3.5: 4); gdn_conv returns 1 beyond it */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float unaligned_vec __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

/* Sequence n's rows: starts[n] .. starts[n + 1] - 1, or row n alone where there are no starts (decode). */
static void sequence_rows(const int64_t *starts, int64_t n, int64_t *first, int64_t *count) {
    *first = starts ? starts[n] : n;
    *count = starts ? starts[n + 1] - starts[n] : 1;
}

static int64_t longest_sequence(const int64_t *starts, int64_t sequences) {
    int64_t longest = sequences > 0 ? 1 : 0;
    for (int64_t n = 0; starts && n < sequences; n++)
        if (starts[n + 1] - starts[n] > longest) longest = starts[n + 1] - starts[n];
    return longest;
}

struct gdn_rule_args {
    const float *q, *k;    /* [rows, Hk, Dk], rows qk_stride floats apart (q and k share it) */
    const float *v;        /* [rows, Hv, Dv], rows v_stride floats apart */
    const float *g, *beta; /* [rows, Hv] contiguous: log decay (<= 0) and rate */
    float *states;         /* the pool: [num_slots, Hv, Dk, Dv] */
    const int64_t *slots;  /* [sequences]: each sequence's slot in the pool */
    const int64_t *starts; /* [sequences + 1]: sequence n's rows, or NULL: one row per sequence */
    float *out;            /* [rows, Hv, Dv] contiguous */
    float *kept;           /* NULL, or [rows, Hv, Dk, Dv] contiguous: the state after each row */
    int64_t sequences, k_heads, v_heads, k_dim, v_dim, qk_stride, v_stride;
    int32_t tiled, normalize, num_threads;
};

static void unit(const float *restrict x, int64_t n, float scale, int normalize, float *restrict y) {
    float squares = 0.f;
    if (normalize) {
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < n; i++) squares += x[i] * x[i];
    }
    const float r = normalize ? 1.f / sqrtf(squares + 1e-6f) : 1.f;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * scale;
}

/* One token on COLS columns of a state: rows B + i * stride, i < Dk (columns past the head's Dv are
 * zeros, as are x's there, and stay zeros); x, o [COLS]. Even and odd rows sum apart in pass 1, two
 * chains of FMAs. */
static void rule_token(float *restrict B, int64_t stride, int64_t Dk, const float *restrict q, const float *restrict k,
                       float qk, const vec *restrict x, float decay, float beta, vec *restrict o) {
#define ROW(i, c) (*(unaligned_vec *)(B + (i) * stride + (c) * LANES))
    vec p0[VECS] = {0}, p1[VECS] = {0}, r0[VECS] = {0}, r1[VECS] = {0}, u[VECS];
    int64_t i = 0;
    for (; i + 2 <= Dk; i += 2)
        for (int c = 0; c < VECS; c++) {
            const vec s0 = ROW(i, c), s1 = ROW(i + 1, c);
            p0[c] += k[i] * s0, r0[c] += q[i] * s0;
            p1[c] += k[i + 1] * s1, r1[c] += q[i + 1] * s1;
        }
    for (; i < Dk; i++)
        for (int c = 0; c < VECS; c++) p0[c] += k[i] * ROW(i, c), r0[c] += q[i] * ROW(i, c);
    for (int c = 0; c < VECS; c++) {
        u[c] = beta * (x[c] - decay * (p0[c] + p1[c]));
        o[c] = decay * (r0[c] + r1[c]) + qk * u[c];
    }
    for (i = 0; i < Dk; i++)
        for (int c = 0; c < VECS; c++) ROW(i, c) = decay * ROW(i, c) + k[i] * u[c];
#undef ROW
}

/* A block [Dk, COLS] from columns j0 .. j0 + width - 1 of a state [Dk, Dv] (zeros past width), and back. */
static void block_load(float *restrict B, const float *restrict S, int64_t Dk, int64_t Dv, int64_t j0, int64_t width) {
    for (int64_t i = 0; i < Dk; i++) {
        const float *restrict row = S + i * Dv + j0;
        if (width == COLS)
            for (int c = 0; c < VECS; c++) *(vec *)(B + i * COLS + c * LANES) = *(const unaligned_vec *)(row + c * LANES);
        else
            for (int64_t j = 0; j < COLS; j++) B[i * COLS + j] = j < width ? row[j] : 0.f;
    }
}

static void block_store(const float *restrict B, float *restrict S, int64_t Dk, int64_t Dv, int64_t j0, int64_t width) {
    for (int64_t i = 0; i < Dk; i++) {
        float *restrict row = S + i * Dv + j0;
        if (width == COLS)
            for (int c = 0; c < VECS; c++) *(unaligned_vec *)(row + c * LANES) = *(const vec *)(B + i * COLS + c * LANES);
        else
            for (int64_t j = 0; j < width; j++) row[j] = B[i * COLS + j];
    }
}

/* Per thread: a state block [Dk, COLS], then the unit q and k [T, Dk] and q.k [T] of a task's tokens. */
static size_t rule_scratch_floats(const struct gdn_rule_args *a, int64_t longest) {
    return (size_t)a->k_dim * COLS + (size_t)longest * (2 * a->k_dim + 1);
}

static void rule_task(const struct gdn_rule_args *a, int64_t n, int64_t h, float *scratch) {
    const int64_t Dk = a->k_dim, Dv = a->v_dim, Hv = a->v_heads, Hk = a->k_heads;
    const int64_t kh = a->tiled ? h % Hk : h / (Hv / Hk);
    int64_t first, T;
    sequence_rows(a->starts, n, &first, &T);
    float *block = scratch;
    float *qs = scratch + Dk * COLS, *ks = qs + T * Dk, *qk = ks + T * Dk;
    for (int64_t t = 0; t < T; t++) {
        const int64_t row = (first + t) * a->qk_stride + kh * Dk;
        unit(a->q + row, Dk, 1.f / sqrtf((float)Dk), a->normalize, qs + t * Dk);
        unit(a->k + row, Dk, 1.f, a->normalize, ks + t * Dk);
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < Dk; i++) dot += qs[t * Dk + i] * ks[t * Dk + i];
        qk[t] = dot;
    }
    float *S = a->states + (a->slots[n] * Hv + h) * Dk * Dv;
    for (int64_t j0 = 0; j0 < Dv; j0 += COLS) {
        const int64_t width = Dv - j0 < COLS ? Dv - j0 : COLS;
        /* one token (decode) reads the block once either way: it runs in place, without the copies */
        const int in_place = T == 1 && width == COLS && !a->kept;
        float *B = in_place ? S + j0 : block;
        if (!in_place) block_load(block, S, Dk, Dv, j0, width);
        for (int64_t t = 0; t < T; t++) {
            const int64_t row = first + t;
            vec x[VECS] = {0}, o[VECS];
            memcpy(x, a->v + row * a->v_stride + h * Dv + j0, width * sizeof(float));
            rule_token(B, in_place ? Dv : COLS, Dk, qs + t * Dk, ks + t * Dk, qk[t], x, expf(a->g[row * Hv + h]),
                       a->beta[row * Hv + h], o);
            memcpy(a->out + (row * Hv + h) * Dv + j0, o, width * sizeof(float));
            if (a->kept) block_store(block, a->kept + (row * Hv + h) * Dk * Dv, Dk, Dv, j0, width);
        }
        if (!in_place) block_store(block, S, Dk, Dv, j0, width);
    }
}

int gdn_rule(const struct gdn_rule_args *a) {
    if (a->k_dim > MAX_DIM || a->v_dim > MAX_DIM) return 1;
    const size_t floats = rule_scratch_floats(a, longest_sequence(a->starts, a->sequences));
    int failed = 0;
#pragma omp parallel num_threads(a->num_threads)
    {
        float *scratch = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < a->sequences * a->v_heads; task++)
            if (scratch) rule_task(a, task / a->v_heads, task % a->v_heads, scratch);
        free(scratch);
    }
    return failed ? 2 : 0;
}

struct gdn_conv_args {
    const float *x;        /* [rows, C], rows x_stride floats apart */
    const float *weight;   /* [C, K] */
    float *windows;        /* the pool: [num_slots, C, K - 1] */
    const int64_t *slots;  /* [sequences] */
    const int64_t *starts; /* [sequences + 1], or NULL: one row per sequence */
    float *out;            /* [rows, C] contiguous */
    int64_t sequences, channels, kernel, x_stride;
    int32_t num_threads;
};

/* y[c] = silu(y[c]) for c < n, e^x from exp16.h on AVX-512 (within an fp32 ulp of expf), else expf. */
static void silu_in_place(float *restrict y, int64_t n) {
    int64_t c = 0;
#ifdef __AVX512F__
    for (; c + 16 <= n; c += 16) {
        const __m512 x = _mm512_loadu_ps(y + c);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_storeu_ps(y + c, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    }
#endif
    for (; c < n; c++) y[c] = y[c] / (1.f + expf(-y[c]));
}

/* Channels c0.. (up to CONV_GROUP) of sequence n. Input s of the sequence (s < 0: the window's). */
static void conv_task(const struct gdn_conv_args *a, int64_t n, int64_t c0) {
    const int64_t C = a->channels, K = a->kernel, W = K - 1, width = C - c0 < CONV_GROUP ? C - c0 : CONV_GROUP;
    float taps[MAX_KERNEL][CONV_GROUP], past[MAX_KERNEL][CONV_GROUP]; /* [K, width], [W, width] */
    float *window = a->windows + a->slots[n] * C * W + c0 * W;
    for (int64_t j = 0; j < width; j++) {
        for (int64_t i = 0; i < K; i++) taps[i][j] = a->weight[(c0 + j) * K + i];
        for (int64_t i = 0; i < W; i++) past[i][j] = window[j * W + i];
    }
    int64_t first, T;
    sequence_rows(a->starts, n, &first, &T);
#define INPUT(s) ((s) >= 0 ? a->x + (first + (s)) * a->x_stride + c0 : past[W + (s)])
    for (int64_t t = 0; t < T; t++) {
        float *restrict y = a->out + (first + t) * C + c0;
        for (int64_t j = 0; j < width; j++) y[j] = 0.f;
        for (int64_t i = 0; i < K; i++) {
            const float *restrict in = INPUT(t - W + i);
#pragma omp simd
            for (int64_t j = 0; j < width; j++) y[j] += taps[i][j] * in[j];
        }
        silu_in_place(y, width);
    }
    for (int64_t i = 0; i < W; i++) {
        const float *in = INPUT(T - W + i);
        for (int64_t j = 0; j < width; j++) window[j * W + i] = in[j];
    }
#undef INPUT
}

int gdn_conv(const struct gdn_conv_args *a) {
    if (a->kernel < 1 || a->kernel > MAX_KERNEL) return 1;
    const int64_t groups = (a->channels + CONV_GROUP - 1) / CONV_GROUP;
#pragma omp parallel for num_threads(a->num_threads) schedule(dynamic)
    for (int64_t task = 0; task < a->sequences * groups; task++)
        conv_task(a, task / groups, task % groups * CONV_GROUP);
    return 0;
}
