/* The store of a step's K/V rows into the paged float pools (`paged_store`, below), a call of its own
 * in a fused decode step's list (kvgen/model/kernels/step.c). Built by kvgen/model/kernels/build.py
 * like paged_decode.c and loaded beside it (kvgen/model/kernels/paged_decode.py). */
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16_bits.h"

/* fp32 -> IEEE half, rounded to nearest even, overflowing to infinity: torch's conversion
 * (c10's fp16_ieee_from_fp32_value, the same arithmetic) or F16C's, bit for bit. */
static inline uint16_t to_f16(float f) {
#ifdef __F16C__
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    float base = (fabsf(f) * 0x1p112f) * 0x1p-110f; /* rounds away the bits a half cannot hold */
    uint32_t w, bias, bits;
    memcpy(&w, &f, sizeof w);
    const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
    bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u)
        bias = 0x71000000u;
    bias = (bias >> 1) + 0x07800000u;
    float bias_value;
    memcpy(&bias_value, &bias, sizeof bias_value);
    base += bias_value;
    memcpy(&bits, &base, sizeof bits);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}

/* What a store reads and writes: element types of the model's K/V rows and of the pools. */
enum store_element { STORE_F32, STORE_BF16, STORE_F16 };

static inline float store_load(const void *row, int64_t d, const enum store_element kind) {
    return kind == STORE_F32 ? ((const float *)row)[d] : from_bf16(((const uint16_t *)row)[d]);
}

/* One row of `dim` elements from `source` (fp32 or bf16) into `pool` (fp32, bf16 or fp16): copied
 * where the types are one, else widened exactly or rounded to nearest even, as torch's .to() does. */
static inline void store_row(void *pool, const void *source, int64_t dim, const enum store_element from,
                             const enum store_element to) {
    if (from == to) {
        memcpy(pool, source, (size_t)dim * (to == STORE_F32 ? 4 : 2));
        return;
    }
    for (int64_t d = 0; d < dim; d++) {
        const float x = store_load(source, d, from);
        if (to == STORE_F32)
            ((float *)pool)[d] = x;
        else if (to == STORE_BF16)
            ((uint16_t *)pool)[d] = to_bf16(x);
        else
            ((uint16_t *)pool)[d] = to_f16(x);
    }
}

/* Stores a step's K/V into pools [kv_heads, num_slots, dim] at slots [T]: k and v [T, kv_heads, dim]
 * with `k_stride` / `v_stride` elements from one token to the next (views into the q/k/v
 * projection's rows). What PagedKVCache.write does (torch's index_copy_, after .to() into a pool of
 * another float type), without its ~5 us a call. */
void paged_store(const void *k, const void *v, int64_t k_stride, int64_t v_stride, const int64_t *slots, int64_t T,
                 int64_t kv_heads, int64_t dim, int64_t num_slots, int64_t source_kind, int64_t pool_kind,
                 void *k_pool, void *v_pool) {
    const enum store_element from = (enum store_element)source_kind, to = (enum store_element)pool_kind;
    const int64_t in_size = from == STORE_F32 ? 4 : 2, out_size = to == STORE_F32 ? 4 : 2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t at = (h * num_slots + slots[t]) * dim * out_size;
            store_row((char *)k_pool + at, (const char *)k + (t * k_stride + h * dim) * in_size, dim, from, to);
            store_row((char *)v_pool + at, (const char *)v + (t * v_stride + h * dim) * in_size, dim, from, to);
        }
}

/* paged_store's arguments as one struct, for a call list (kvgen/model/kernels/step.c). */
struct paged_store_args {
    const void *k, *v;
    int64_t k_stride, v_stride;
    const int64_t *slots;
    int64_t T, kv_heads, dim, num_slots, source_kind, pool_kind;
    void *k_pool, *v_pool;
};

int paged_store_call(const struct paged_store_args *a) {
    paged_store(a->k, a->v, a->k_stride, a->v_stride, a->slots, a->T, a->kv_heads, a->dim, a->num_slots,
                a->source_kind, a->pool_kind, a->k_pool, a->v_pool);
    return 0;
}
