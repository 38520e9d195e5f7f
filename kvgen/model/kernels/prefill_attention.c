/* Causal attention for one sequence's prompt chunk on the CPU (AVX-512): Q queries at positions
 * first .. first + Q - 1 over the sequence's L = first + Q keys, flash attention's way (Dao et al.
 * 2022): blocks of 16 keys, an online softmax per query, no [Q, L] score matrix in memory.
 *
 * Built by kvgen/model/kernels/prefill.py with the system's C compiler (-O3 -march=native, never
 * AMX, -fopenmp) and called through ctypes. Why not torch's SDPA: its CPU flash kernel ran
 * SmolLM2's 9 heads of 64 over a 512-token prompt at ~60 GFLOP/s here (5-6 ms a layer, a quarter of
 * a bf16 prefill's time), its GQA and small head sizes far from the FMA units' peak.
 *
 * One work item is one (query head, tile of 16 queries). Keys are first laid out per KV head as
 * blocks of 16 transposed ([D][16], fp32), once per call, so a block's scores for the tile are
 * 16 x D fused multiply-adds of a key row-vector by a broadcast query element (scores in lanes, no
 * horizontal sums); values are widened to fp32 once too. Per block and query i, with m the running
 * maximum and l the running sum:
 *
 *     s = q_i K_block^T * scale,  m' = max(m, max s),  p = e^(s - m'),  c = e^(m - m')
 *     l = c l + sum p,            o_i = c o_i + p V_block,              m = m'
 *
 * and o_i / l at the end; with `sinks` (gpt-oss: a logit per head, no value), o_i / (l + e^(sink - m))
 * taken over max(m, sink). Keys after a query's position are masked in the blocks that cross the
 * diagonal; blocks wholly after the tile's last query are never read. Scores, softmax and sums are
 * fp32; K and V may be fp32 or bf16 (widened). Queries are fp32, rows q_stride apart, heads
 * contiguous; the output is fp32 [Q, heads, D]. Head sizes: multiples of 16 up to 128.
 */
#include <stdint.h>

#ifdef __AVX512F__
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "exp16.h"
#include "widen16.h"
#endif

struct prefill_attention_args {
    const float *q;    /* [queries, heads, head_dim], q_stride apart */
    const void *k, *v; /* [kv_heads, key_stride, head_dim], fp32 or bf16 (bf16 set): the first `keys` rows */
    float *out;        /* [queries, heads, head_dim] contiguous */
    int64_t queries, q_stride; /* query i sits at position first + i */
    int64_t keys, key_stride, first; /* keys = first + queries; key_stride rows from one KV head to the next */
    int64_t heads, kv_heads, head_dim;
    float scale;
    int32_t bf16, num_threads;
    const float *sinks; /* [heads] a logit per head in each softmax's denominator, or NULL */
};

#ifdef __AVX512F__
#define TILE 16 /* queries per work item, keys per block */
#define MAX_DIM 128

/* 16 consecutive elements from element i, as fp32. */
static inline __m512 load16(const void *p, int64_t i, int bf16) {
    return bf16 ? widen_bf16x16((const uint16_t *)p + i) : _mm512_loadu_ps((const float *)p + i);
}

/* keys [kv_heads, L, D] -> kt [kv_heads, blocks, D, 16] fp32 (zeros past L); values -> vf
 * [kv_heads, blocks * 16, D] fp32 (zeros past L). */
static void lay_out(const struct prefill_attention_args *a, int64_t blocks, float *kt, float *vf) {
    const int64_t dim = a->head_dim, keys = a->keys;
#pragma omp for schedule(static)
    for (int64_t hb = 0; hb < a->kv_heads * blocks; hb++) {
        const int64_t h = hb / blocks, b = hb % blocks;
        float *block = kt + hb * dim * TILE, *values = vf + hb * TILE * dim;
        float row[MAX_DIM];
        for (int64_t j = 0; j < TILE; j++) {
            const int64_t key = b * TILE + j, at = (h * a->key_stride + key) * dim;
            for (int64_t d = 0; d < dim; d += 16) {
                const int real = key < keys;
                _mm512_storeu_ps(row + d, real ? load16(a->k, at + d, a->bf16) : _mm512_setzero_ps());
                _mm512_storeu_ps(values + j * dim + d, real ? load16(a->v, at + d, a->bf16) : _mm512_setzero_ps());
            }
            for (int64_t d = 0; d < dim; d++)
                block[d * TILE + j] = row[d];
        }
    }
}

/* Query tile `tile` of head h: out rows for its (up to) 16 queries. */
static inline __attribute__((always_inline)) void attend_tile(const struct prefill_attention_args *a, int64_t h,
                                                              int64_t tile, int64_t blocks, const float *kt,
                                                              const float *vf, const int64_t dim) {
    const int64_t group = a->heads / a->kv_heads, kvh = h / group, q0 = tile * TILE;
    const int64_t count = a->queries - q0 < TILE ? a->queries - q0 : TILE;
    float query[TILE][MAX_DIM], acc[TILE][MAX_DIM], top[TILE], total[TILE];
    float p[TILE][TILE];
    for (int64_t i = 0; i < TILE; i++) {
        const float *row = a->q + (q0 + (i < count ? i : count - 1)) * a->q_stride + h * dim;
        for (int64_t d = 0; d < dim; d++)
            query[i][d] = row[d] * a->scale;
        memset(acc[i], 0, sizeof(float) * dim);
        top[i] = -INFINITY, total[i] = 0.f;
    }
    const int64_t last = a->first + q0 + count - 1; /* the tile's last query's position */
    for (int64_t b = 0; b * TILE <= last && b < blocks; b++) {
        const float *block = kt + (kvh * blocks + b) * dim * TILE;
        const float *values = vf + (kvh * blocks + b) * TILE * dim;
        __m512 s[TILE];
        for (int64_t i = 0; i < TILE; i++)
            s[i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d++) {
            const __m512 k = _mm512_loadu_ps(block + d * TILE);
            for (int64_t i = 0; i < TILE; i++)
                s[i] = _mm512_fmadd_ps(_mm512_set1_ps(query[i][d]), k, s[i]);
        }
        float c[TILE];
        for (int64_t i = 0; i < TILE; i++) {
            const int64_t allowed = i < count ? a->first + q0 + i - b * TILE + 1 : 0; /* keys query i sees */
            if (allowed <= 0) { /* none in this block (or a padding row): nothing changes */
                _mm512_storeu_ps(p[i], _mm512_setzero_ps());
                c[i] = 1.f;
                continue;
            }
            const __mmask16 lanes = allowed >= TILE ? 0xffff : (__mmask16)((1u << allowed) - 1);
            const float block_top = _mm512_mask_reduce_max_ps(lanes, s[i]);
            const float m = block_top > top[i] ? block_top : top[i];
            const __m512 e = _mm512_maskz_mov_ps(lanes, exp16(_mm512_sub_ps(s[i], _mm512_set1_ps(m))));
            c[i] = top[i] == -INFINITY ? 0.f : expf(top[i] - m);
            total[i] = total[i] * c[i] + _mm512_reduce_add_ps(e);
            top[i] = m;
            _mm512_storeu_ps(p[i], e);
        }
        /* o_i = c_i o_i + p_i V, four queries at a time: each value row is loaded once for the four. */
        for (int64_t i0 = 0; i0 < TILE; i0 += 4)
            for (int64_t d0 = 0; d0 < dim; d0 += 64) {
                const int64_t width = dim - d0 < 64 ? (dim - d0) / 16 : 4;
                __m512 o[4][4];
                for (int64_t i = 0; i < 4; i++)
                    for (int64_t w = 0; w < width; w++)
                        o[i][w] = _mm512_mul_ps(_mm512_loadu_ps(acc[i0 + i] + d0 + 16 * w), _mm512_set1_ps(c[i0 + i]));
                for (int64_t j = 0; j < TILE; j++) {
                    __m512 value[4];
                    for (int64_t w = 0; w < width; w++)
                        value[w] = _mm512_loadu_ps(values + j * dim + d0 + 16 * w);
                    for (int64_t i = 0; i < 4; i++) {
                        const __m512 weight = _mm512_set1_ps(p[i0 + i][j]);
                        for (int64_t w = 0; w < width; w++)
                            o[i][w] = _mm512_fmadd_ps(weight, value[w], o[i][w]);
                    }
                }
                for (int64_t i = 0; i < 4; i++)
                    for (int64_t w = 0; w < width; w++)
                        _mm512_storeu_ps(acc[i0 + i] + d0 + 16 * w, o[i][w]);
            }
    }
    for (int64_t i = 0; i < count; i++) {
        float *row = a->out + ((q0 + i) * a->heads + h) * dim;
        float inverse = 1.f / total[i]; /* key 0 is always allowed: total > 0 */
        if (a->sinks) { /* both rescaled to the larger of the running maximum and the sink */
            const float m = a->sinks[h] > top[i] ? a->sinks[h] : top[i], c = expf(top[i] - m);
            inverse = c / (total[i] * c + expf(a->sinks[h] - m));
        }
        for (int64_t d = 0; d < dim; d++)
            row[d] = acc[i][d] * inverse;
    }
}

/* Returns 0; 1 if scratch space could not be allocated, 2 for a head size it does not serve. */
int prefill_attention(const struct prefill_attention_args *a) {
    const int64_t dim = a->head_dim, blocks = (a->keys + TILE - 1) / TILE;
    if (dim % 16 || dim > MAX_DIM || a->heads % a->kv_heads || a->keys != a->first + a->queries
        || a->key_stride < a->keys)
        return 2;
    float *kt = malloc(sizeof(float) * a->kv_heads * blocks * TILE * dim);
    float *vf = malloc(sizeof(float) * a->kv_heads * blocks * TILE * dim);
    const int failed = !kt || !vf;
    if (!failed) {
        const int64_t tiles = (a->queries + TILE - 1) / TILE;
#pragma omp parallel num_threads(a->num_threads)
        {
            lay_out(a, blocks, kt, vf);
            /* Later tiles see more keys: the last ones first, handed out one at a time. */
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = a->heads * tiles - 1; item >= 0; item--) {
                const int64_t h = item % a->heads, tile = item / a->heads;
                switch (dim) {
                case 64: attend_tile(a, h, tile, blocks, kt, vf, 64); break;
                case 128: attend_tile(a, h, tile, blocks, kt, vf, 128); break;
                default: attend_tile(a, h, tile, blocks, kt, vf, dim); break;
                }
            }
        }
    }
    free(kt);
    free(vf);
    return failed;
}
#else
int prefill_attention(const struct prefill_attention_args *a) {
    (void)a;
    return 2; /* no AVX-512: the caller runs SDPA */
}
#endif
