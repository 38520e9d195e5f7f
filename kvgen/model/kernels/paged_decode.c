/* Paged decode attention on the CPU: one query per sequence (or a speculative verify chunk's few),
 * its keys and values read in place from the block pool, so no gathered copy of K/V is ever
 * written (the store of a step's K/V rows into the pool is paged_store.c's).
 * A verify chunk's `queries` rows per sequence share its block table; each row has its own mask
 * row (causal: keys up to its own position) and is attended exactly as the decode of its token
 * would be, through the same spans in the same order: the same bits, so speculating changes no
 * attention output. Only the mask says which keys a row reads.
 * Built by kvgen/model/kernels/build.py with the system's C compiler (-O3 -march=native -fopenmp)
 * and called through ctypes. One work item is one (sequence, KV head, span of SPLIT_KEYS key
 * positions): the `group` query heads of each of the sequence's query rows that share the KV head,
 * over the span's keys,
 *
 *     scores_j = scale * q . k_j     for each key j the row's mask allows     (one pass over K)
 *     m = max_j scores_j,  l = sum_j e^(scores_j - m),  acc = sum_j e^(scores_j - m) v_j
 *
 * then each query head's spans are merged (flash-decoding's split softmax): with M the largest m,
 * out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s (+ e^(sink - M), M >= sink, with `sinks`).
 * Spans let two threads share a sequence's few KV heads (SmolLM2 has 3: on whole heads one thread did
 * two thirds of the work). They are cut by position alone, never by the thread count or the batch,
 * so a result has the same bits however it is run; with one span the merge is exact (acc / l).
 * Masked keys are skipped without being read (padding, sliding windows). Pools are fp32, bf16 or
 * fp16 (widened to fp32 on load, exactly), or int8 or fp8 (e4m3) with fp32 scales: `key_groups` per
 * key (KV head, slot), each over head_dim / key_groups consecutive dimensions (a multiple of 16, or
 * the whole row), and one per value (KV head, slot). A key's scales multiply the partial dot
 * products of their groups, a value's scale its weight once, so quantized rows are dequantized in
 * registers. Queries, scores and outputs are fp32. With AVX-512 and a head size of 64, 128, 256 (Gemma 3)
 * or 512 (Gemma 4's global layers), `attend_avx512` runs instead of the portable `attend`: an item's
 * keys are scored 16 at a time for all its head-rows (score_keys: each key widened once, and 16 dot
 * products summed across lanes at once by lane_sums16 in _mm512_reduce_add_ps's own order), then
 * the values summed in tiles of up to 8 heads that read and widen each value row once for the tile
 * (attend_heads), the softmax's maxima and exponentials 16 at a time (exp16); 2.2x faster than the
 * portable loops at 192 keys, 2.1x at 2,048 (BENCHMARKS.md), and the tiles 1.5x (head size 256) to
 * 2.2x (512) faster than one head at a time with Gemma 4's 8 heads per KV head. A verify chunk's
 * rows share the item, so each key is widened once for the chunk: 16 rows at SmolLM2's shape (3 KV
 * heads x 3, head size 64, 1,800 keys, bf16) take 0.37x the time of 16 decodes, the same bits
 * (docs/performance-notes.md). */
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#ifdef __AVX512F__
#include "exp16.h"
#include "widen16.h"
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_bits.h"

struct paged_decode_args {
    const float *q;           /* [batch, kv_heads * group, head_dim], q_stride apart */
    const void *k_pool;       /* [kv_heads, num_slots, head_dim], fp32, bf16, fp16, int8 or fp8 */
    const void *v_pool;       /* same */
    const float *k_scale;     /* [kv_heads, num_slots, key_groups] for int8 / fp8 pools, else NULL */
    const float *v_scale;     /* [kv_heads, num_slots] for int8 / fp8 pools, else NULL */
    const int64_t *block_ids; /* [batch / queries, blocks_per_seq]: pool block of each of a sequence's blocks */
    const uint8_t *mask;      /* [batch, blocks_per_seq * block_size]: 1 where the query attends */
    float *out;               /* [batch, kv_heads * group, head_dim] */
    int64_t batch;            /* query rows: `queries` per sequence, a sequence's rows one after another */
    int64_t queries;          /* 1 for decodes; a verify chunk's K + 1 */
    int64_t q_stride;         /* elements from one query row to the next (heads contiguous) */
    int64_t kv_heads, group, head_dim, num_slots, blocks_per_seq, block_size;
    int64_t key_groups;       /* scales per key row of a quantized pool (1 for float pools) */
    float scale;
    int32_t num_threads;
    const float *sinks;       /* [kv_heads * group] a logit per query head in each softmax's denominator, or NULL */
};

enum element { F32, BF16, F16, INT8, FP8 };

static float fp8_values[256]; /* e4m3fn byte -> its value, filled before the first FP8 call */

static void fill_fp8_values(void) {
    for (int byte = 0; byte < 256; byte++) {
        const int sign = byte >> 7, exponent = (byte >> 3) & 15, mantissa = byte & 7;
        float value = exponent ? ldexpf(1.f + mantissa / 8.f, exponent - 7) : ldexpf(mantissa / 8.f, -6);
        if (exponent == 15 && mantissa == 7)
            value = NAN; /* e4m3fn has no infinities; S.1111.111 is NaN */
        fp8_values[byte] = sign ? -value : value;
    }
}

/* An IEEE half as fp32 (exact: every half is an fp32). Without F16C: its exponent and mantissa
 * shifted into an fp32's and rebiased by a multiply by 2**112, which also scales subnormals right;
 * infinities and NaNs (exponent 31) keep theirs. */
static inline __attribute__((always_inline)) float from_f16(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t magnitude = (uint32_t)(h & 0x7fffu) << 13;
    float value;
    memcpy(&value, &magnitude, sizeof value);
    value *= 0x1p112f;
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((h & 0x7c00u) == 0x7c00u)
        bits = magnitude | 0x7f800000u;
    bits |= (uint32_t)(h & 0x8000u) << 16;
    memcpy(&value, &bits, sizeof value);
    return value;
#endif
}

static inline __attribute__((always_inline)) float load(const void *pool, int64_t i, const enum element kind) {
    if (kind == F32)
        return ((const float *)pool)[i];
    if (kind == INT8)
        return (float)((const int8_t *)pool)[i];
    if (kind == FP8)
        return fp8_values[((const uint8_t *)pool)[i]];
    if (kind == F16)
        return from_f16(((const uint16_t *)pool)[i]);
    return from_bf16(((const uint16_t *)pool)[i]); /* bf16 is the high half of an fp32 */
}

/* The scale of the pool row starting at element `row` (1 for unscaled pools). */
static inline __attribute__((always_inline)) float row_scale(const float *scales, int64_t row, int64_t dim,
                                                             const enum element kind) {
    return kind == INT8 || kind == FP8 ? scales[row / dim] : 1.f;
}

/* Key positions per work item (see the top of the file). */
#ifndef SPLIT_KEYS
#define SPLIT_KEYS 256
#endif

/* One work item: sequence `seq` (its `queries` rows), KV head h, key positions [first, last). */
struct span {
    int64_t seq, h, first, last;
};

static inline __attribute__((always_inline)) struct span span_of(const struct paged_decode_args *a, int64_t item,
                                                                 int64_t spans) {
    const int64_t length = a->blocks_per_seq * a->block_size, s = item % spans, bh = item / spans;
    const int64_t last = (s + 1) * SPLIT_KEYS < length ? (s + 1) * SPLIT_KEYS : length;
    return (struct span){bh / a->kv_heads, bh % a->kv_heads, s * SPLIT_KEYS, last};
}

/* Where each key of the span that query row b's mask allows starts in the pool (element index), in
 * order; how many. */
static inline __attribute__((always_inline)) int64_t allowed_rows(const struct paged_decode_args *a, struct span w,
                                                                  int64_t b, int64_t dim, int64_t *restrict rows) {
    const int64_t block_size = a->block_size, head_first_slot = w.h * a->num_slots;
    const int64_t *restrict blocks = a->block_ids + w.seq * a->blocks_per_seq;
    const uint8_t *restrict mask = a->mask + b * a->blocks_per_seq * block_size;
    int64_t count = 0;
    for (int64_t n = w.first / block_size, p = w.first; p < w.last; n++) {
        const int64_t block_first_row = head_first_slot + blocks[n] * block_size - n * block_size;
        for (const int64_t end = (n + 1) * block_size < w.last ? (n + 1) * block_size : w.last; p < end; p++)
            if (mask[p])
                rows[count++] = (block_first_row + p) * dim;
    }
    return count;
}

/* Attends the query heads of query row b of a work item into `partial` [group, 2 + dim]: per head m, l, acc.
 * `scratch` holds SPLIT_KEYS pool rows then group * SPLIT_KEYS floats. Every field, and each
 * key's row, is read into a local first: stores through the float pointers could otherwise alias
 * them and force a reload in the inner loops (twice as slow). */
static inline __attribute__((always_inline)) void attend(const struct paged_decode_args *a, struct span w,
                                                         int64_t b, void *scratch, float *restrict partial,
                                                         const enum element kind, const int64_t dim) {
    const int64_t group = a->group;
    const float scale = a->scale;
    const void *k_pool = a->k_pool, *v_pool = a->v_pool;
    const float *restrict q = a->q + b * a->q_stride + w.h * group * dim;
    int64_t *restrict rows = scratch;                      /* [count]: where each allowed key's row starts */
    float *restrict weights = (float *)(rows + SPLIT_KEYS); /* [group, count] */
    float max_score[group], total[group];

    const int64_t count = allowed_rows(a, w, b, dim, rows);
    for (int64_t g = 0; g < group; g++)
        max_score[g] = -INFINITY, total[g] = 0.f;
    const int64_t key_groups = kind == INT8 || kind == FP8 ? a->key_groups : 1, per_scale = dim / key_groups;
    for (int64_t i = 0; i < count; i++) {
        const int64_t row = rows[i];
        const float *key_scales = kind == INT8 || kind == FP8 ? a->k_scale + row / dim * key_groups : NULL;
        for (int64_t g = 0; g < group; g++) {
            float dot = 0.f;
            for (int64_t s = 0; s < key_groups; s++) {
                float part = 0.f;
#pragma omp simd reduction(+ : part)
                for (int64_t d = s * per_scale; d < (s + 1) * per_scale; d++)
                    part += q[g * dim + d] * load(k_pool, row + d, kind);
                dot += key_scales ? part * key_scales[s] : part;
            }
            const float score = dot * scale;
            weights[g * count + i] = score;
            max_score[g] = score > max_score[g] ? score : max_score[g];
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t i = 0; i < count; i++) {
            const float e = expf(weights[g * count + i] - max_score[g]);
            weights[g * count + i] = e;
            total[g] += e;
        }
    memset(partial, 0, sizeof(float) * group * (2 + dim));
    for (int64_t i = 0; i < count; i++) {
        const int64_t row = rows[i];
        const float value_scale = row_scale(a->v_scale, row, dim, kind);
        for (int64_t g = 0; g < group; g++) {
            const float e = weights[g * count + i] * value_scale;
            float *restrict acc = partial + g * (2 + dim) + 2;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++)
                acc[d] += e * load(v_pool, row + d, kind);
        }
    }
    for (int64_t g = 0; g < group; g++)
        partial[g * (2 + dim)] = max_score[g], partial[g * (2 + dim) + 1] = total[g];
}

/* A work item row by row into `partial` [queries, group, 2 + dim] (`attend`). */
static inline __attribute__((always_inline)) void attend_item(const struct paged_decode_args *a, struct span w,
                                                              void *scratch, float *restrict partial,
                                                              const enum element kind, const int64_t dim) {
    for (int64_t r = 0; r < a->queries; r++)
        attend(a, w, w.seq * a->queries + r, scratch, partial + r * a->group * (2 + dim), kind, dim);
}

#ifdef __AVX512F__
#include "paged_decode_avx512.h"
#define ATTEND_FIXED attend_avx512
#else
#define ATTEND_FIXED attend_item
#endif

/* out for query head x (h * group + g) of query row b, from its spans' partials: item (sequence, h,
 * span) holds [queries, group, 2 + dim]. */
static void merge(const struct paged_decode_args *a, const float *partials, int64_t spans, int64_t b, int64_t x) {
    const int64_t group = a->group, dim = a->head_dim, queries = a->queries, stride = queries * group * (2 + dim);
    const int64_t item = (b / queries * a->kv_heads + x / group) * spans;
    const float *first = partials + item * stride + (b % queries * group + x % group) * (2 + dim);
    float *restrict out = a->out + (b * a->kv_heads * group + x) * dim;
    const float sink = a->sinks ? a->sinks[x] : -INFINITY; /* weight to no value */
    float top = sink, total = 0.f;
    for (int64_t s = 0; s < spans; s++)
        top = first[s * stride] > top ? first[s * stride] : top;
    memset(out, 0, sizeof(float) * dim);
    for (int64_t s = 0; s < spans; s++) {
        const float *p = first + s * stride;
        if (p[1] == 0.f) /* no key allowed in the span */
            continue;
        const float c = expf(p[0] - top); /* 1 exactly for the span holding the top score */
        total += c * p[1];
        for (int64_t d = 0; d < dim; d++)
            out[d] += c * p[2 + d];
    }
    const float inverse = total > 0.f || a->sinks ? 1.f / (total + expf(sink - top)) : 0.f; /* no key: zeros */
    for (int64_t d = 0; d < dim; d++)
        out[d] *= inverse;
}

/* Below this many multiply-adds of scores (queries x keys x head_dim), one thread. OpenMP's workers
 * spin a while after each call (kvgen/threads.py), so in a decode step the second thread is awake:
 * two threads already read a layer's K/V from memory faster at 192 keys (44 against 58 us). */
#ifndef PARALLEL_WORK
#define PARALLEL_WORK (1 << 16)
#endif

/* Returns 0, or 1 if scratch space could not be allocated (then `out` is incomplete). */
static int paged_decode(const struct paged_decode_args *a, const enum element kind) {
    const int64_t length = a->blocks_per_seq * a->block_size, spans = length > 0 ? (length - 1) / SPLIT_KEYS + 1 : 1;
    const int64_t heads = a->batch * a->kv_heads, items = a->batch / a->queries * a->kv_heads * spans;
    const int64_t item_floats = a->queries * a->group * (2 + a->head_dim);
    const int threads = heads * a->group * length * a->head_dim >= PARALLEL_WORK ? a->num_threads : 1;
    float *partials = malloc(sizeof(float) * items * item_floats);
    int failed = !partials;
    if (kind == FP8 && fp8_values[1] == 0.f) /* the smallest subnormal is nonzero once filled */
        fill_fp8_values();
#pragma omp parallel num_threads(threads) if (partials)
    {
        /* key rows, 16 widened keys and the scores of an item's head-rows (attend_avx512), or of a row's (attend) */
        const size_t bytes = SPLIT_KEYS * sizeof(int64_t) + sizeof(float) * (16 * a->head_dim + item_floats / (2 + a->head_dim) * SPLIT_KEYS);
        void *scratch = partials ? aligned_alloc(64, (bytes + 63) / 64 * 64) : NULL;
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        /* One loop per element type, so that each inlined `attend` sees its type as a constant, and
         * the common head sizes as constants too (the loops over a row then unroll: ~25% faster at
         * 64 than a runtime size; with AVX-512 those sizes take attend_avx512).
         * Every thread reaches the loops, as OpenMP requires; one without memory skips its items. */
#define ATTEND_ALL(KIND)                                                                                  \
    _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < items; item++) if (scratch) {   \
        const struct span w = span_of(a, item, spans);                                                    \
        float *partial = partials + item * item_floats;                                                   \
        switch (a->head_dim) {                                                                            \
        case 64: ATTEND_FIXED(a, w, scratch, partial, KIND, 64); break;                                   \
        case 128: ATTEND_FIXED(a, w, scratch, partial, KIND, 128); break;                                 \
        case 256: ATTEND_FIXED(a, w, scratch, partial, KIND, 256); break;                                 \
        case 512: ATTEND_FIXED(a, w, scratch, partial, KIND, 512); break;                                 \
        default: attend_item(a, w, scratch, partial, KIND, a->head_dim); break;                           \
        }                                                                                                 \
    }
        switch (kind) {
        case F32: ATTEND_ALL(F32) break;
        case BF16: ATTEND_ALL(BF16) break;
        case F16: ATTEND_ALL(F16) break;
        case INT8: ATTEND_ALL(INT8) break;
        case FP8: ATTEND_ALL(FP8) break;
        }
#undef ATTEND_ALL
        free(scratch);
        if (!failed) {
#pragma omp for
            for (int64_t x = 0; x < heads * a->group; x++)
                merge(a, partials, spans, x / (a->kv_heads * a->group), x % (a->kv_heads * a->group));
        }
    }
    free(partials);
    return failed;
}

int paged_decode_f32(const struct paged_decode_args *a) { return paged_decode(a, F32); }
int paged_decode_bf16(const struct paged_decode_args *a) { return paged_decode(a, BF16); }
int paged_decode_f16(const struct paged_decode_args *a) { return paged_decode(a, F16); }
int paged_decode_int8(const struct paged_decode_args *a) { return paged_decode(a, INT8); }
int paged_decode_fp8(const struct paged_decode_args *a) { return paged_decode(a, FP8); }
