/* Gated DeltaNet in C: the delta rule and the causal conv of any number of sequences, each with its own
 * tokens (one for a decode step, a prompt chunk for a prefill), reading and updating each sequence's
 * recurrent state and conv window in place in a pool of slots (kvgen/cache/state_pool.py), fp32. The
 * math is kvgen/model/gated_delta_net.py's (delta_rule_recurrent, causal_conv1d); see there for the rule.
 *
 * gdn_rule: one task per (sequence, value head). Its state S [Dk, Dv] is independent column by column
 * (token t touches column v only through p[v], u[v] and o[v] below), so the task takes COLS columns
 * at a time into a contiguous block (Dk x 32 fp32 with AVX-512, x 16 with AVX2: 16 / 8 KB at Dk 128,
 * in L1) and runs all of the sequence's tokens on it before the next block; the pool is read once and
 * written once however many tokens there are. Per token, with q, k unit vectors (q also scaled by
 * Dk^-1/2) and d = exp(g):
 *
 *     pass 1   p = k^T S,  r = q^T S                          (one read of the block)
 *              u = beta (x - d p)                             (the delta rule's write)
 *              o = d r + (q.k) u                              (= S_new^T q)
 *     pass 2   S = d S + k u^T                                (one read and write of the block)
 *
 * GROUP (4) tokens share each pass (rule_group): pass 1 makes all their p and r from the same S, each
 * token's prediction then adds the earlier tokens' writes through the dots k_a.k_b and q_a.k_b, and pass
 * 2 writes the group's updates at once, one decay for all. The state's work per token and column falls
 * from 4 vector operations (2 FMAs in pass 1, a multiply and an FMA in pass 2) to 3.25, the floor being
 * 3; on the Zen 4 host, whose AVX-512 issues one 512-bit FMA a cycle, the rule is FMA-bound: CPU time of
 * a 512-token Qwen3.5-0.8B layer's rule, one thread, 15.5 ms one token at a time, 15.5 with 2 at a
 * time, 12.3 with 4, 12.9 with 6; 16 columns with 4 or 8 tokens, 14.3 / 15.5; 48 with 4, 13.5. A group
 * is a chunk of the chunked form (kvgen/model/gated_delta_net.py) of 4 tokens: its rounding is held to
 * that form's bound with C = 4. A sequence's last T mod 4 tokens, decode's one, and every token where
 * the states after each are kept go one at a time.
 *
 * q and k are L2-normalized per head (x / sqrt(sum x^2 + 1e-6)) once per token, before the blocks.
 * Value head h reads key head h / r ("grouped", Hugging Face's order) or h mod Hk ("tiled", a GGUF's).
 * With `kept`, the state after every token is written out too (a speculative verify's checkpoints);
 * with `z`, the task ends with the layer's gated norm of its head's o, w * rmsnorm(o) * silu(z).
 * Sums run in another order than torch's (and o is formed from S before its update), so results differ
 * from torch's by rounding: tests/model/test_gated_delta_net_prefill.py holds them to a derived bound.
 *
 * gdn_conv: the causal depthwise convolution (kernel K) and SiLU; one task per (sequence, 256
 * channels); each sequence's window [C, K - 1] becomes its last K - 1 inputs.
 *
 * gdn_gates: each row's gates from in_proj's a and b columns (kvgen.model.gated_delta_net.gates), in C
 * so that a fused decode step (kvgen/model/kernels/step.c's call lists) makes them with the bits of
 * the layer-by-layer step, which calls it too.
 *
 * Tasks are shared among `num_threads` OpenMP threads (torch's count, passed in), dynamically: a
 * ragged batch's sequences differ in length.
 *
 * Measured (benchmarks/delta_net_prefill.py: a Qwen3.5-0.8B-shaped layer, 16 + 16 heads of 128,
 * conv + gates + rule + gated norm of a 512-token prompt; one thread, CPU time, the 2-core host under a
 * load of ~8, where wall times mostly measure the other jobs): torch's chunked form 77.7 ms/layer -> C
 * 19.6 (4.0x); 4 prompts of 128 in one batch 68.7 -> 17.5 (3.9x). Of C's, the rule ~12, the conv ~3.3
 * (bound by streaming the 12.6 MB of conv input and output). Decode, against the two-pass step kernel
 * this replaced (CPU time, one thread): the rule 5-25% faster, the conv within 5%; one token runs on
 * the pool in place, without the block copies.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512F__
#include "exp16.h"
#endif

#define MAX_DIM 1024   /* Dk, Dv up to this (Qwen3.5: 128); gdn_rule returns 1 beyond it */
/* Floats in one vector below: a register's. Wider generic vectors than the hardware's are not split
 * into registers but moved through the stack: with 16 on an AVX2-only AMD EPYC, a 512-token
 * Qwen3.5-0.8B layer took 196 ms against torch's 49. */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
/* State columns a task keeps in L1 across a sequence's tokens: 2 vectors (AVX2 with 4 took 23.7-24.3
 * ms a layer above, alternated with 2: 20.9-21.0). */
#define COLS (2 * LANES)
#define VECS (COLS / LANES)
#define GROUP 4        /* tokens per pass over a block (rule_group) */
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
    float *out;            /* [rows, Hv, Dv] contiguous: o, or with z the gated norm of o */
    float *kept;           /* NULL, or [rows, Hv, Dk, Dv] contiguous: the state after each row */
    const float *z;        /* NULL, or the gate [rows, Hv * Dv], rows z_stride floats apart */
    const float *norm_weight; /* [Dv], with z */
    int64_t sequences, k_heads, v_heads, k_dim, v_dim, qk_stride, v_stride, z_stride;
    float eps;             /* the gated norm's */
    int32_t tiled, normalize, num_threads;
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

/* n tokens (n <= GROUP, a constant where it is called) on COLS columns of a state: rows B + i * stride,
 * i < Dk (columns past the head's Dv are zeros, as are x's there, and stay zeros). q, k [n, Dk] unit
 * vectors; qk, kk [n, GROUP]: qk[a][b] = q_a.k_b (b <= a), kk[a][b] = k_a.k_b (b < a); x, o [n, VECS].
 * Pass 1 reads the block once for all n tokens; token a then predicts from those sums and the earlier
 * tokens' writes u_b (k_a^T S_a = decays * k_a^T S + sum_b decay(b -> a) (k_a.k_b) u_b); pass 2 writes
 * all n updates at once: S = decays * S + sum_b decay(after b) k_b u_b^T. */
static inline __attribute__((always_inline)) void rule_group(
    float *restrict B, int64_t stride, int64_t Dk, const int n, const float *restrict q, const float *restrict k,
    const float *restrict qk, const float *restrict kk, const vec *restrict x, const float *restrict g,
    const float *restrict beta, vec *restrict o) {
#define ROW(i, c) (*(unaligned_vec *)(B + (i) * stride + (c) * LANES))
    vec p[GROUP][VECS], r[GROUP][VECS], u[GROUP][VECS];
    for (int a = 0; a < n; a++)
        for (int c = 0; c < VECS; c++) p[a][c] = r[a][c] = (vec){0};
    for (int64_t i = 0; i < Dk; i++)
        for (int c = 0; c < VECS; c++) {
            const vec s = ROW(i, c);
            for (int a = 0; a < n; a++) p[a][c] += k[a * Dk + i] * s, r[a][c] += q[a * Dk + i] * s;
        }
    float decay[GROUP], through[GROUP + 1] = {1.f}; /* through[a]: the product of the first a decays */
    for (int a = 0; a < n; a++) decay[a] = expf(g[a]), through[a + 1] = through[a] * decay[a];
    for (int a = 0; a < n; a++)
        for (int c = 0; c < VECS; c++) {
            vec predicted = through[a + 1] * p[a][c], out = through[a + 1] * r[a][c];
            float span = decay[a]; /* the decays of tokens b + 1 .. a */
            for (int b = a - 1; b >= 0; b--) {
                predicted += span * kk[a * GROUP + b] * u[b][c], out += span * qk[a * GROUP + b] * u[b][c];
                span *= decay[b];
            }
            u[a][c] = beta[a] * (x[a * VECS + c] - predicted);
            o[a * VECS + c] = out + qk[a * GROUP + a] * u[a][c];
        }
    float span = 1.f; /* the decays after token a */
    for (int a = n - 1; a >= 0; a--) {
        for (int c = 0; c < VECS; c++) u[a][c] *= span;
        span *= decay[a];
    }
    for (int64_t i = 0; i < Dk; i++)
        for (int c = 0; c < VECS; c++) {
            vec s = through[n] * ROW(i, c);
            for (int a = 0; a < n; a++) s += k[a * Dk + i] * u[a][c];
            ROW(i, c) = s;
        }
#undef ROW
}

/* A block [Dk, COLS] from columns j0 .. j0 + width - 1 of a state [Dk, Dv] (zeros past width), and back. */
static void block_load(float *restrict B, const float *restrict S, int64_t Dk, int64_t Dv, int64_t j0, int64_t width) {
    for (int64_t i = 0; i < Dk; i++) {
        const float *restrict row = S + i * Dv + j0;
        if (width == COLS)
            for (int c = 0; c < VECS; c++)
                *(vec *)(B + i * COLS + c * LANES) = *(const unaligned_vec *)(row + c * LANES);
        else
            for (int64_t j = 0; j < COLS; j++) B[i * COLS + j] = j < width ? row[j] : 0.f;
    }
}

static void block_store(const float *restrict B, float *restrict S, int64_t Dk, int64_t Dv, int64_t j0, int64_t width) {
    for (int64_t i = 0; i < Dk; i++) {
        float *restrict row = S + i * Dv + j0;
        if (width == COLS)
            for (int c = 0; c < VECS; c++)
                *(unaligned_vec *)(row + c * LANES) = *(const vec *)(B + i * COLS + c * LANES);
        else
            for (int64_t j = 0; j < width; j++) row[j] = B[i * COLS + j];
    }
}

/* Per thread: a state block [Dk, COLS], then a task's unit q and k [T, Dk] and their dots qk, kk [T, GROUP]. */
static size_t rule_scratch_floats(const struct gdn_rule_args *a, int64_t longest) {
    return (size_t)a->k_dim * COLS + (size_t)longest * 2 * (a->k_dim + GROUP);
}

static float dot(const float *restrict x, const float *restrict y, int64_t n) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += x[i] * y[i];
    return sum;
}

/* The unit q and k of a task's T tokens and the dots rule_group reads: tokens run in groups of GROUP
 * from the first, the last T mod GROUP (and all with `kept`: it needs every token's state) one at a
 * time -> how many run in groups. */
static int64_t rule_prepare(const struct gdn_rule_args *a, int64_t first, int64_t T, int64_t kh, float *qs,
                            float *ks, float *qk, float *kk) {
    const int64_t Dk = a->k_dim, grouped = a->kept ? 0 : T - T % GROUP;
    for (int64_t t = 0; t < T; t++) {
        const int64_t row = (first + t) * a->qk_stride + kh * Dk, at = t < grouped ? t % GROUP : 0;
        unit(a->q + row, Dk, 1.f / sqrtf((float)Dk), a->normalize, qs + t * Dk);
        unit(a->k + row, Dk, 1.f, a->normalize, ks + t * Dk);
        for (int64_t b = 0; b <= at; b++) {
            const float *earlier = ks + (t - at + b) * Dk;
            qk[t * GROUP + b] = dot(qs + t * Dk, earlier, Dk);
            if (b < at) kk[t * GROUP + b] = dot(ks + t * Dk, earlier, Dk);
        }
    }
    return grouped;
}

/* out's row of each of a task's tokens <- w * rmsnorm(o) * silu(z), Qwen3.5's gated norm (as
 * kvgen.model.gated_delta_net.gated_rms_norm in fp32), while the head's o is still in cache. */
static void gated_norm(const struct gdn_rule_args *a, int64_t first, int64_t T, int64_t h) {
    const int64_t Dv = a->v_dim;
    float gate[MAX_DIM];
    for (int64_t t = 0; t < T; t++) {
        float *restrict o = a->out + ((first + t) * a->v_heads + h) * Dv;
        memcpy(gate, a->z + (first + t) * a->z_stride + h * Dv, Dv * sizeof(float));
        silu_in_place(gate, Dv);
        const float r = 1.f / sqrtf(dot(o, o, Dv) / (float)Dv + a->eps);
#pragma omp simd
        for (int64_t j = 0; j < Dv; j++) o[j] = a->norm_weight[j] * (o[j] * r) * gate[j];
    }
}

static void rule_task(const struct gdn_rule_args *a, int64_t n, int64_t h, float *scratch) {
    const int64_t Dk = a->k_dim, Dv = a->v_dim, Hv = a->v_heads, Hk = a->k_heads;
    int64_t first, T;
    sequence_rows(a->starts, n, &first, &T);
    float *block = scratch, *qs = scratch + Dk * COLS, *ks = qs + T * Dk, *qk = ks + T * Dk, *kk = qk + T * GROUP;
    const int64_t grouped = rule_prepare(a, first, T, a->tiled ? h % Hk : h / (Hv / Hk), qs, ks, qk, kk);
    float *S = a->states + (a->slots[n] * Hv + h) * Dk * Dv;
    for (int64_t j0 = 0; j0 < Dv; j0 += COLS) {
        const int64_t width = Dv - j0 < COLS ? Dv - j0 : COLS;
        /* one token (decode) reads the block once either way: it runs in place, without the copies */
        const int in_place = T == 1 && width == COLS && !a->kept;
        float *B = in_place ? S + j0 : block;
        const int64_t stride = in_place ? Dv : COLS;
        if (!in_place) block_load(block, S, Dk, Dv, j0, width);
        for (int64_t t = 0; t < T;) {
            const int tokens = t < grouped ? GROUP : 1;
            float g[GROUP], beta[GROUP];
            vec x[GROUP][VECS] = {0}, o[GROUP][VECS];
            for (int s = 0; s < tokens; s++) {
                const int64_t row = first + t + s;
                g[s] = a->g[row * Hv + h], beta[s] = a->beta[row * Hv + h];
                memcpy(x[s], a->v + row * a->v_stride + h * Dv + j0, width * sizeof(float));
            }
            const float *qt = qs + t * Dk, *kt = ks + t * Dk, *qkt = qk + t * GROUP, *kkt = kk + t * GROUP;
            if (tokens == GROUP)
                rule_group(B, stride, Dk, GROUP, qt, kt, qkt, kkt, x[0], g, beta, o[0]);
            else
                rule_group(B, stride, Dk, 1, qt, kt, qkt, kkt, x[0], g, beta, o[0]);
            for (int s = 0; s < tokens; s++) {
                const int64_t row = first + t + s;
                memcpy(a->out + (row * Hv + h) * Dv + j0, o[s], width * sizeof(float));
                if (a->kept) block_store(block, a->kept + (row * Hv + h) * Dk * Dv, Dk, Dv, j0, width);
            }
            t += tokens;
        }
        if (!in_place) block_store(block, S, Dk, Dv, j0, width);
    }
    if (a->z) gated_norm(a, first, T, h);
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


/* y[j] = sum_i f[j][i] in[i][j] for j < width: taps f [width, K] as the weight holds them. */
static void conv_row(float *restrict y, const float *restrict f, const float *const *in, int64_t K, int64_t width) {
    if (K == 4) { /* Qwen3.5's kernel: unrolled, so that the channel loop vectorizes */
        const float *restrict x0 = in[0], *restrict x1 = in[1], *restrict x2 = in[2], *restrict x3 = in[3];
#pragma omp simd
        for (int64_t j = 0; j < width; j++)
            y[j] = x0[j] * f[j * 4] + x1[j] * f[j * 4 + 1] + x2[j] * f[j * 4 + 2] + x3[j] * f[j * 4 + 3];
        return;
    }
    for (int64_t j = 0; j < width; j++) {
        float sum = 0.f;
        for (int64_t i = 0; i < K; i++) sum += in[i][j] * f[j * K + i];
        y[j] = sum;
    }
}

/* A window's channels [width, W] (as the pool holds them) to rows [W, width], and rows back; W = 3
 * (Qwen3.5's) unrolled, so that the channel loops vectorize. */
static void window_to_rows(float rows[][CONV_GROUP], const float *restrict window, int64_t W, int64_t width) {
    if (W == 3) {
#pragma omp simd
        for (int64_t j = 0; j < width; j++)
            rows[0][j] = window[j * 3], rows[1][j] = window[j * 3 + 1], rows[2][j] = window[j * 3 + 2];
        return;
    }
    for (int64_t j = 0; j < width; j++)
        for (int64_t i = 0; i < W; i++) rows[i][j] = window[j * W + i];
}

static void rows_to_window(float *restrict window, const float *const *rows, int64_t W, int64_t width) {
    if (W == 3) {
        const float *restrict r0 = rows[0], *restrict r1 = rows[1], *restrict r2 = rows[2];
#pragma omp simd
        for (int64_t j = 0; j < width; j++) window[j * 3] = r0[j], window[j * 3 + 1] = r1[j], window[j * 3 + 2] = r2[j];
        return;
    }
    for (int64_t j = 0; j < width; j++)
        for (int64_t i = 0; i < W; i++) window[j * W + i] = rows[i][j];
}

/* in[i] <- input t - W + i of a sequence whose rows start at `first`: a row of x, or before the
 * sequence's first token one of its old window's (past [W, width]). */
static void conv_inputs(const struct gdn_conv_args *a, int64_t first, int64_t t, int64_t c0,
                        float past[][CONV_GROUP], const float **in) {
    const int64_t W = a->kernel - 1;
    for (int64_t i = 0; i < a->kernel; i++) {
        const int64_t s = t - W + i;
        in[i] = s >= 0 ? a->x + (first + s) * a->x_stride + c0 : past[W + s];
    }
}

/* Channels c0.. (up to CONV_GROUP) of sequence n: the old window copied to rows first (past), so that
 * every input is a row, and the new window can be written in place. */
static void conv_task(const struct gdn_conv_args *a, int64_t n, int64_t c0) {
    const int64_t C = a->channels, K = a->kernel, W = K - 1, width = C - c0 < CONV_GROUP ? C - c0 : CONV_GROUP;
    float past[MAX_KERNEL][CONV_GROUP]; /* [W, width] */
    float *window = a->windows + a->slots[n] * C * W + c0 * W;
    window_to_rows(past, window, W, width);
    int64_t first, T;
    sequence_rows(a->starts, n, &first, &T);
    const float *in[MAX_KERNEL];
    for (int64_t t = 0; t < T; t++) {
        conv_inputs(a, first, t, c0, past, in);
        float *restrict y = a->out + (first + t) * C + c0;
        conv_row(y, a->weight + c0 * K, in, K, width);
        silu_in_place(y, width);
    }
    conv_inputs(a, first, T, c0, past, in); /* inputs T - W .. T - 1: the new window */
    rows_to_window(window, in, W, width);
}

int gdn_conv(const struct gdn_conv_args *a) {
    if (a->kernel < 1 || a->kernel > MAX_KERNEL) return 1;
    const int64_t groups = (a->channels + CONV_GROUP - 1) / CONV_GROUP;
#pragma omp parallel for num_threads(a->num_threads) schedule(dynamic)
    for (int64_t task = 0; task < a->sequences * groups; task++)
        conv_task(a, task / groups, task % groups * CONV_GROUP);
    return 0;
}

/* -- the gates -------------------------------------------------------------------------------------- */

/* Per row and value head: g = decay_rate * softplus(a + dt_bias), softplus(x) = x above torch's
 * threshold 20, else log1p(e^x); beta = sigmoid(b) = 1 / (1 + e^-b). */
struct gdn_gates_args {
    const float *a, *b;                /* [rows, heads], rows a_stride / b_stride floats apart */
    const float *dt_bias, *decay_rate; /* [heads] */
    float *g, *beta;                   /* [rows, heads] contiguous */
    int64_t rows, heads, a_stride, b_stride;
};

int gdn_gates(const struct gdn_gates_args *p) {
    for (int64_t r = 0; r < p->rows; r++) {
        const float *restrict a = p->a + r * p->a_stride, *restrict b = p->b + r * p->b_stride;
        float *restrict g = p->g + r * p->heads, *restrict beta = p->beta + r * p->heads;
        for (int64_t h = 0; h < p->heads; h++) {
            const float x = a[h] + p->dt_bias[h];
            g[h] = p->decay_rate[h] * (x > 20.f ? x : log1pf(expf(x)));
            beta[h] = 1.f / (1.f + expf(-b[h]));
        }
    }
    return 0;
}
