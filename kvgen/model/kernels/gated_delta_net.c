/* Gated DeltaNet decode: one token of B sequences, each reading and updating its own state in place in
 * a pool of states (kvgen/cache/state_pool.py), fp32. The math is kvgen/model/gated_delta_net.py's
 * delta_rule_step and conv1d_step; see there for the rule.
 *
 * Why C: torch's step makes five passes over each state [Hv, Dk, Dv] (decay, k^T S, the outer-product
 * add with its temporary, S^T q) and runs ~200 us for a Qwen3.5-0.8B layer at batch 1 (1 MB of state),
 * 3.5-9.6 ms at batch 8, where the state need be read once and written once. Here each (sequence, value
 * head) is one task of two passes over its Dk x Dv block (64 KB at 128 x 128, so the second pass reads
 * from L2):
 *
 *     pass 1   p[v] = sum_i k[i] S[i][v]                     (k^T S, before the decay)
 *              u[v] = beta * (x[v] - exp(g) p[v])             (the delta rule's write)
 *     pass 2   S[i][v] = exp(g) S[i][v] + k[i] u[v];  o[v] += q[i] S[i][v]
 *
 * q and k are L2-normalized per head (x / sqrt(sum x^2 + 1e-6)) and q scaled by Dk^-1/2 in the task;
 * value head h reads key head h / r ("grouped", Hugging Face's order) or h mod Hk ("tiled", a GGUF's).
 * Sums run in another order than torch's (and exp(g) multiplies k^T S instead of S first), so results
 * differ from torch's by rounding: tests/model/test_gated_delta_net_kernel.py holds them to a derived bound.
 *
 * conv_step: the causal depthwise convolution (kernel K) and SiLU of one token per sequence, shifting
 * each sequence's window [C, K - 1] (in its pool slot) by one.
 *
 * Tasks are shared among `num_threads` OpenMP threads (torch's count, passed in).
 *
 * Measured (tests/model/test_gated_delta_net_kernel.py -m slow, one thread, a 2-core machine shared with
 * other jobs, so +-50%): a Qwen3.5-0.8B-shaped layer, 16 key heads x 128,
 *     value heads  batch   delta step torch -> C     conv step torch -> C
 *     16           1       198-424 us -> 53-98        72-154 us -> 14
 *     32           1       633-1069 us -> 184-203     89-176 us -> 18
 *     16           8       3505-5360 us -> 515-524    489 us -> 54
 *     32           8       7709-13878 us -> 1222-2225 710-1553 us -> 138
 * (4-10x; ~12 us of each C figure is the Python wrapper's checks and the ctypes call).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef __AVX512F__
#include "exp16.h"
#endif

#define MAX_DIM 1024 /* Dk, Dv up to this (Qwen3.5: 128); gdn_step returns 1 beyond it */

struct gdn_step_args {
    const float *q, *k;   /* [B, Hk, Dk], rows qk_stride floats apart (q and k of one sequence share it) */
    const float *v;       /* [B, Hv, Dv], rows v_stride floats apart */
    const float *g, *beta; /* [B, Hv] contiguous: log decay (<= 0) and rate */
    float *states;        /* the pool: [num_slots, Hv, Dk, Dv] */
    const int64_t *slots; /* [B]: each sequence's slot in the pool */
    float *out;           /* [B, Hv, Dv] contiguous */
    int64_t batch, k_heads, v_heads, k_dim, v_dim, qk_stride, v_stride;
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

int gdn_step(const struct gdn_step_args *a) {
    if (a->k_dim > MAX_DIM || a->v_dim > MAX_DIM) return 1;
    const int64_t Dk = a->k_dim, Dv = a->v_dim, Hv = a->v_heads, Hk = a->k_heads, ratio = Hv / Hk;
    const float q_scale = 1.f / sqrtf((float)Dk);
#pragma omp parallel for num_threads(a->num_threads) schedule(static)
    for (int64_t task = 0; task < a->batch * Hv; task++) {
        const int64_t b = task / Hv, h = task % Hv, kh = a->tiled ? h % Hk : h / ratio;
        float q[MAX_DIM], k[MAX_DIM], u[MAX_DIM], o[MAX_DIM];
        unit(a->q + b * a->qk_stride + kh * Dk, Dk, q_scale, a->normalize, q);
        unit(a->k + b * a->qk_stride + kh * Dk, Dk, 1.f, a->normalize, k);
        float *restrict S = a->states + (a->slots[b] * Hv + h) * Dk * Dv;
        const float *restrict x = a->v + b * a->v_stride + h * Dv;
        const float decay = expf(a->g[b * Hv + h]), beta = a->beta[b * Hv + h];
        for (int64_t j = 0; j < Dv; j++) u[j] = 0.f, o[j] = 0.f;
        for (int64_t i = 0; i < Dk; i++) {
            const float ki = k[i];
            const float *restrict row = S + i * Dv;
#pragma omp simd
            for (int64_t j = 0; j < Dv; j++) u[j] += ki * row[j];
        }
#pragma omp simd
        for (int64_t j = 0; j < Dv; j++) u[j] = beta * (x[j] - decay * u[j]);
        for (int64_t i = 0; i < Dk; i++) {
            const float ki = k[i], qi = q[i];
            float *restrict row = S + i * Dv;
#pragma omp simd
            for (int64_t j = 0; j < Dv; j++) {
                const float s = decay * row[j] + ki * u[j];
                row[j] = s;
                o[j] += qi * s;
            }
        }
        float *restrict y = a->out + (b * Hv + h) * Dv;
        for (int64_t j = 0; j < Dv; j++) y[j] = o[j];
    }
    return 0;
}

struct conv_step_args {
    const float *x;       /* [B, C], rows x_stride floats apart */
    const float *weight;  /* [C, K] */
    float *windows;       /* the pool: [num_slots, C, K - 1] */
    const int64_t *slots; /* [B] */
    float *out;           /* [B, C] contiguous */
    int64_t batch, channels, kernel, x_stride;
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

int conv_step(const struct conv_step_args *a) {
    const int64_t C = a->channels, K = a->kernel, W = K - 1;
#pragma omp parallel for num_threads(a->num_threads) schedule(static)
    for (int64_t b = 0; b < a->batch; b++) {
        const float *restrict x = a->x + b * a->x_stride;
        float *restrict window = a->windows + a->slots[b] * C * W;
        const float *restrict f = a->weight;
        float *restrict y = a->out + b * C;
        if (K == 4) { /* Qwen3.5's kernel: unrolled, so that the channel loop vectorizes */
#pragma omp simd
            for (int64_t c = 0; c < C; c++) {
                float *w = window + c * 3;
                const float w0 = w[0], w1 = w[1], w2 = w[2], xc = x[c];
                y[c] = w0 * f[c * 4] + w1 * f[c * 4 + 1] + w2 * f[c * 4 + 2] + xc * f[c * 4 + 3];
                w[0] = w1, w[1] = w2, w[2] = xc;
            }
        } else {
            for (int64_t c = 0; c < C; c++) {
                float *restrict w = window + c * W;
                float sum = 0.f;
                for (int64_t i = 0; i < W; i++) sum += w[i] * f[c * K + i];
                y[c] = sum + x[c] * f[c * K + W];
                for (int64_t i = 0; i + 1 < W; i++) w[i] = w[i + 1];
                if (W > 0) w[W - 1] = x[c];
            }
        }
        silu_in_place(y, C);
    }
    return 0;
}
