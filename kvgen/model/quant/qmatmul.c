/* y = x @ W^T for weights kept quantized: integer dot products (AVX-512 VNNI, or AVX2), as ggml does.
 *
 * Built by kvgen/model/quant/kernel.py with explicit flags (AVX-512 F/BW/VL/VNNI, FMA, F16C; or AVX2,
 * FMA, F16C; never -march=native, never AMX) and called through ctypes, only on CPUs that report
 * those features. qvec.h holds the two builds' vectors; the code below is written once for both.
 *
 * Weights [N, K] (layout in kvgen/model/quant/formats.py): unsigned codes u, an integer offset o,
 * and per group of G (32, or 16 for 8-bit) a scale s and an optional min m: w = s * (u - o) + m.
 * Rows come in tiles of 4, stored span (32 columns) by span, so one 64-byte vector holds elements
 * 0-15 of a span for the 4 rows (A) and another elements 16-31 (B): the low and high nibbles of one
 * load for 4-bit codes, two loads for 8-bit.
 *
 * Each row of x is quantized once per call to int8 per span (as ggml's q8_0 activations):
 * sx = max|x| / 127, qx = round(x / sx), so x^ = sx * qx. With the span's 16-byte halves of qx
 * broadcast to the 4 rows, exactly in int32,
 *     dot = sum (u - o) * qx = vpdpbusd(A, qx[0:16]) + vpdpbusd(B, qx[16:32]) - o * sum qx
 * (4 int32 lanes per row), then y = sum_g s_g * sx_g * dot_g + m_g * sx_g * sum_g qx in fp32. The
 * result is the exact dot product of the dequantized W with x^, up to fp32 rounding of the scale
 * products and the sums. With parts = 2, x's rounding error r = x - x^ is quantized the same way as
 * a second row of x (its step is ~1/254 of the first's) and the two rows' results are added: one
 * more tile row per token of work, the weights still read once.
 *
 * Work: OpenMP over blocks of weight tiles, one contiguous range of the weights per thread; inside
 * a block, x's rows go four at a time over each tile (then two, then one). Every output goes through the same operations
 * whatever the number of rows, so a row's result does not depend on the rows beside it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qvec.h"

#define TILE 4            /* weight rows per tile */
#define XTILE 4           /* rows of x per pass over a tile */
#define TILES_PER_ITEM 16 /* weight tiles per OpenMP work item */
/* The tunables below were chosen by A/B microbenchmarks (BENCHMARKS.md); -D overrides them. */
/* Software prefetch distance along a thread's stream of codes, at one or two rows of x: the
 * hardware prefetchers stop at each 4 KiB page, and a layer's weights are a few hundred KiB read
 * once per step. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T0
#endif
/* Below this many bytes of weights (plus a share for each row of x), one thread: waking the second
 * costs more than it saves. Since OpenMP's workers spin briefly after each call (kvgen/threads.py),
 * a decode step's calls find the second thread awake: from 64 KiB on two threads read SmolLM2's
 * 200-550 KiB layers 1.3-1.7x faster than one, and a Q4_1 decode step's forward went from 8.6-8.9
 * to 7.9-8.5 ms (the threshold was 512 KiB, set when the workers slept at once). */
#ifndef PARALLEL_BYTES
#define PARALLEL_BYTES (64 << 10)
#endif

/* x after quantization (rows = parts * T). Per span: q (32 bytes), init (2 x 4 int32: vpdpbusd's start values,
 * -o * sums of 4 consecutive q: for G=32 both halves in init[0]; for G=16 half A in init[0] and B
 * in init[1]), scale; per weight group: sum = scale * sum of q. */
struct xq {
    int8_t *q;       /* [T, spans, 32] */
    __m128i *init;   /* [T, spans, 2] */
    float *scale;    /* [T, spans] */
    float *sum;      /* [T, K / G] */
};

/* The sum of 4 int32 lanes. */
static inline int lane_total(__m128i v) {
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1))));
}

static void quantize_span(const float *x, int32_t offset, int group, int8_t *q, __m128i *init, float *scale,
                          float *sum) {
    float amax = abs_max32(x);
    float s = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m128i qa = vf_to_i8x16(vf_mul(vf_loadu(x), vf_set1(inv)));
    __m128i qb = vf_to_i8x16(vf_mul(vf_loadu(x + 16), vf_set1(inv)));
    _mm_storeu_si128((__m128i *)q, qa);
    _mm_storeu_si128((__m128i *)(q + 16), qb);
    *scale = s;
    const __m128i minus_offset = _mm_set1_epi32(-offset);
    __m128i sums_a = sums_of_4(qa), sums_b = sums_of_4(qb);
    int total_a = lane_total(sums_a), total_b = lane_total(sums_b);
    if (group == 32) {
        init[0] = _mm_mullo_epi32(_mm_add_epi32(sums_a, sums_b), minus_offset);
        init[1] = _mm_setzero_si128();
        sum[0] = s * (float)(total_a + total_b);
    } else {
        init[0] = _mm_mullo_epi32(sums_a, minus_offset);
        init[1] = _mm_mullo_epi32(sums_b, minus_offset);
        sum[0] = s * (float)total_a;
        sum[1] = s * (float)total_b;
    }
}

/* out[t0 .. t0+RX-1, 4w .. 4w+3]: RX rows of x by weight tile w. Groups go four at a time: their
 * 16 products s_w * s_x (lane 4q+i: group q, row i) are one vector multiply per row of x, and each
 * span picks its own out of them with a permute. */
static inline __attribute__((always_inline)) void tile(const struct xq *x, int64_t t0, const int RX, int64_t w,
                                                       int64_t K, const uint8_t *codes, const void *scale,
                                                       const void *min, int64_t N, float *out, const int bits,
                                                       const int group, const int f16, const int prefetch) {
    const int64_t spans = K / 32, groups = K / group;
    const int per_span = 32 / group, span_bytes = 16 * bits; /* 64 (4-bit) or 128 (8-bit) per tile */
    const uint8_t *wc = codes + w * spans * span_bytes;
    const int64_t wv = w * groups * TILE; /* first scale/min of the tile */
    /* Sized by XTILE, not RX: arrays sized by a parameter are variable-length to GCC even when
     * inlining makes it a constant, and then live on the stack, not in registers. */
    vf acc[XTILE], macc[XTILE], prod[XTILE];
    for (int r = 0; r < RX; r++)
        acc[r] = macc[r] = vf_zero();
    for (int64_t c0 = 0; c0 < groups; c0 += 4) {
        const int count = groups - c0 >= 4 ? 4 : (int)(groups - c0); /* groups in this chunk */
        const int64_t span0 = c0 / per_span;
        if (PREFETCH_BYTES && prefetch) { /* scales and mins: 1/16 (4-bit fp16) .. 1/4 of the codes' bytes */
            _mm_prefetch((const char *)scale + (wv + c0 * TILE) * (f16 ? 2 : 4) + PREFETCH_BYTES / 4, PREFETCH_HINT);
            if (min)
                _mm_prefetch((const char *)min + (wv + c0 * TILE) * (f16 ? 2 : 4) + PREFETCH_BYTES / 4, PREFETCH_HINT);
        }
        vf sw = load_values(scale, wv + c0 * TILE, count * TILE, f16);
        vf mw = min ? load_values(min, wv + c0 * TILE, count * TILE, f16) : vf_zero();
        for (int r = 0; r < RX; r++) {
            vf sx = load_values(x->scale, (t0 + r) * spans + span0, count / per_span, 0);
            prod[r] = vf_mul(sw, spread(sx, 0, 4 * per_span));
            if (min)
                macc[r] = vf_fmadd(mw, spread(load_values(x->sum, (t0 + r) * groups + c0, count, 0), 0, 4), macc[r]);
        }
        for (int j = 0; j < count / per_span; j++) {
            const uint8_t *p = wc + (span0 + j) * span_bytes;
            if (PREFETCH_BYTES && prefetch) {
                _mm_prefetch((const char *)p + PREFETCH_BYTES, PREFETCH_HINT);
                if (bits == 8)
                    _mm_prefetch((const char *)p + PREFETCH_BYTES + 64, PREFETCH_HINT);
            }
            vi a, b;
            load_codes(p, bits, &a, &b);
            for (int r = 0; r < RX; r++) {
                const int64_t span = (t0 + r) * spans + span0 + j;
                vi xa = bcast16(x->q + 32 * span), xb = bcast16(x->q + 32 * span + 16);
                if (group == 32) {
                    vi dot = dot4(bcast_i32x4(x->init[2 * span]), a, xa, bits);
                    dot = dot4(dot, b, xb, bits);
                    acc[r] = vf_fmadd(vi_to_vf(dot), spread(prod[r], 4 * j, 4), acc[r]);
                } else {
                    vi da = dot4(bcast_i32x4(x->init[2 * span]), a, xa, bits);
                    vi db = dot4(bcast_i32x4(x->init[2 * span + 1]), b, xb, bits);
                    acc[r] = vf_fmadd(vi_to_vf(da), spread(prod[r], 8 * j, 4), acc[r]);
                    acc[r] = vf_fmadd(vi_to_vf(db), spread(prod[r], 8 * j + 4, 4), acc[r]);
                }
            }
        }
    }
    const int rows = N - TILE * w >= TILE ? TILE : (int)(N - TILE * w); /* the last tile may be padding */
    for (int r = 0; r < RX; r++) {
        __m128 y = row_sums(acc[r]);
        if (min)
            y = _mm_add_ps(y, quarter_sums(macc[r]));
        store_rows(out + (t0 + r) * N + TILE * w, y, rows);
    }
}

/* Weight tiles w0 .. w1-1 against rows t0 .. t0+RX-1 of x; `prefetch`: this pass is the first over
 * these tiles, which streams them from memory (later passes find them in L1/L2). */
static inline __attribute__((always_inline)) void pass(const struct xq *x, int64_t t0, const int RX, int64_t K,
                                                       const uint8_t *codes, const void *scale, const void *min,
                                                       int64_t w0, int64_t w1, int64_t N, float *out, const int bits,
                                                       const int group, const int f16, const int prefetch) {
    for (int64_t w = w0; w < w1; w++)
        tile(x, t0, RX, w, K, codes, scale, min, N, out, bits, group, f16, prefetch);
}

/* Weight tiles w0 .. w1-1 against every row of x, XTILE rows of x at a time, then 2, then 1. Only the
 * first pass prefetches: at a verify chunk's 2-16 rows of x (4-32 with two parts) it is the pass that
 * reads the weights from memory, and without it (it used to prefetch only at one or two rows) the
 * first 4-row pass waited on the hardware prefetchers at every 4 KiB page. */
static inline __attribute__((always_inline)) void tiles(const struct xq *x, int64_t T, int64_t K,
                                                        const uint8_t *codes, const void *scale, const void *min,
                                                        int64_t w0, int64_t w1, int64_t N, float *out,
                                                        const int bits, const int group, const int f16) {
    int64_t t = T >= XTILE ? XTILE : T >= 2 ? 2 : T;
    if (t == XTILE)
        pass(x, 0, XTILE, K, codes, scale, min, w0, w1, N, out, bits, group, f16, 1);
    else if (t == 2) /* a token's two parts, at one row of x */
        pass(x, 0, 2, K, codes, scale, min, w0, w1, N, out, bits, group, f16, 1);
    else if (t == 1)
        pass(x, 0, 1, K, codes, scale, min, w0, w1, N, out, bits, group, f16, 1);
    for (; t + XTILE <= T; t += XTILE)
        pass(x, t, XTILE, K, codes, scale, min, w0, w1, N, out, bits, group, f16, 0);
    for (; t + 2 <= T; t += 2)
        pass(x, t, 2, K, codes, scale, min, w0, w1, N, out, bits, group, f16, 0);
    for (; t < T; t++)
        pass(x, t, 1, K, codes, scale, min, w0, w1, N, out, bits, group, f16, 0);
}

/* Work item `item`: TILES_PER_ITEM weight tiles (fewer at the end) against every row of x. */
static inline __attribute__((always_inline)) void work_item(const struct xq *x, int64_t T, int64_t K,
                                                            const uint8_t *codes, const void *scale, const void *min,
                                                            int64_t item, int64_t num_tiles, int64_t N, float *out,
                                                            const int bits, const int group, const int f16) {
    int64_t w0 = item * TILES_PER_ITEM, w1 = w0 + TILES_PER_ITEM < num_tiles ? w0 + TILES_PER_ITEM : num_tiles;
    tiles(x, T, K, codes, scale, min, w0, w1, N, out, bits, group, f16);
}

/* r = x - s * q over one span: the rounding error of the first part, for the second. */
static void residual(const float *x, const int8_t *q, float s, float *r) {
    for (int h = 0; h < 32; h += 16) {
        vf q_h = i8x16_to_vf(_mm_loadu_si128((const __m128i *)(q + h)));
        vf_storeu(r + h, vf_sub(vf_loadu(x + h), vf_mul(vf_set1(s), q_h)));
    }
}

/* Row t of x as `parts` rows of quantized x (rows parts*t ..): the first quantizes x, the second
 * (parts = 2) x's rounding error after the first, so that x is within half the second's much finer
 * step. In scratch space from aligned_alloc (the caller frees xq->init); 1 if out of memory. */
static int quantize_x(const float *x, int64_t T, int64_t K, int32_t offset, int group, int parts, int threads,
                      struct xq *xq) {
    const int64_t spans = K / 32, rows = parts * T;
    /* per span: init (32 bytes), q (32), scale (4), sum (4, or 8 for groups of 16) */
    size_t bytes = (size_t)(rows * spans * (32 + 32 + 4 + 8));
    char *scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!scratch)
        return 1;
    xq->init = (__m128i *)scratch;
    xq->q = (int8_t *)(xq->init + 2 * rows * spans);
    xq->scale = (float *)(xq->q + rows * K);
    xq->sum = xq->scale + rows * spans;
    const int per_span = 32 / group;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && T >= 16)
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < spans; g++) {
            float r[32];
            const float *values = x + t * K + 32 * g;
            for (int part = 0; part < parts; part++) {
                int64_t span = (parts * t + part) * spans + g;
                if (part) {
                    residual(values, xq->q + 32 * (span - spans), xq->scale[span - spans], r);
                    values = r;
                }
                quantize_span(values, offset, group, xq->q + 32 * span, xq->init + 2 * span, xq->scale + span,
                              xq->sum + span * per_span);
            }
        }
    return 0;
}

/* out[t] = parts[2t] + parts[2t+1] for rows of N. */
static void add_parts(const float *parts, int64_t T, int64_t N, float *out) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < N; n++)
            out[t * N + n] = parts[2 * t * N + n] + parts[(2 * t + 1) * N + n];
}

/* One exported kernel per format. The parallel loop is written out in each, so that OpenMP's
 * outlined body is specialised for the format's constants (inside a shared inline function it is
 * outlined once, with bits/group/f16 as run-time values, and runs about three times slower).
 * Returns 0, or 1 when the scratch space for x cannot be allocated. */
#define KERNEL(name, bits, group, f16)                                                                        \
    int name(const float *x, int64_t T, int64_t K, const uint8_t *codes, const void *scale, const void *min,  \
             int32_t offset, int64_t N, float *out, int32_t parts, int32_t num_threads) {                     \
        const int64_t num_tiles = (N + TILE - 1) / TILE, items = (num_tiles + TILES_PER_ITEM - 1) / TILES_PER_ITEM; \
        const int64_t rows = parts * T, work = num_tiles * TILE * K * bits / 8 * (1 + rows / 4);              \
        const int threads = num_threads > 1 && work >= PARALLEL_BYTES ? num_threads : 1;                      \
        struct xq xq;                                                                                         \
        if (quantize_x(x, T, K, offset - CODE_BIAS(bits), group, parts, threads, &xq))                                          \
            return 1;                                                                                         \
        float *y = parts == 1 ? out : malloc(sizeof(float) * rows * N);                                       \
        if (!y) {                                                                                             \
            free(xq.init);                                                                                    \
            return 1;                                                                                         \
        }                                                                                                     \
        if (threads == 1) { /* no parallel region at all: entering even a serial one costs time */           \
            for (int64_t item = 0; item < items; item++)                                                      \
                work_item(&xq, rows, K, codes, scale, min, item, num_tiles, N, y, bits, group, f16);          \
        } else {                                                                                              \
            _Pragma("omp parallel for num_threads(threads) schedule(static)")                                 \
            for (int64_t item = 0; item < items; item++)                                                      \
                work_item(&xq, rows, K, codes, scale, min, item, num_tiles, N, y, bits, group, f16);          \
        }                                                                                                     \
        if (parts == 2) {                                                                                     \
            add_parts(y, T, N, out);                                                                          \
            free(y);                                                                                          \
        }                                                                                                     \
        free(xq.init);                                                                                        \
        return 0;                                                                                             \
    }

/* One call's arguments as a struct, for a call list (kvgen/model/kernels/step.c): `name`_call. */
struct qmatmul_args {
    const float *x;
    int64_t T, K;
    const uint8_t *codes;
    const void *scale, *min;
    int32_t offset;
    int64_t N;
    float *out;
    int32_t parts, num_threads;
};

#define KERNELS(name, bits, group, f16)                                                                       \
    KERNEL(name, bits, group, f16)                                                                            \
    int name##_call(const struct qmatmul_args *a) {                                                           \
        return name(a->x, a->T, a->K, a->codes, a->scale, a->min, a->offset, a->N, a->out, a->parts,          \
                    a->num_threads);                                                                          \
    }

KERNELS(qmatmul_u4_g32_f16, 4, 32, 1)
KERNELS(qmatmul_u4_g32_f32, 4, 32, 0)
KERNELS(qmatmul_u8_g32_f16, 8, 32, 1)
KERNELS(qmatmul_u8_g32_f32, 8, 32, 0)
KERNELS(qmatmul_u8_g16_f32, 8, 16, 0)

/* -- dequantizing to bf16, for many rows of x ------------------------------------------------------
 * At prefill's hundreds of rows the integer kernel is compute-bound, and two parts of x cost it twice
 * the work. There W^ is dequantized once per call into bf16_matmul.c's layout (tiles of 4 rows, span
 * by span: the same tiling as the codes, so tile w span j goes to out[(w * spans + j) * 128]) and x
 * runs in bf16 through AVX-512 BF16 dot products (kvgen/model/quant/linear.py). Values are rounded to
 * the nearest bf16 (ties to even) from w = s * (u - o) + m in fp32. */

static inline __attribute__((always_inline)) float value_at(const void *p, int64_t at, const int f16) {
    return f16 ? _cvtsh_ss(((const uint16_t *)p)[at]) : ((const float *)p)[at];
}

/* 16 codes (bytes) of one row -> 16 bf16 values s * (u - o) + m. */
static inline __attribute__((always_inline)) __m256i dequantize16(__m128i codes, int32_t offset, float s, float m) {
    return bf16_of(vf_fmadd(vf_set1(s), u8x16_minus_to_vf(codes, offset), vf_set1(m)));
}

#define DEQUANTIZE_ROW(i)                                                                                     \
    {                                                                                                         \
        const int64_t ga = first_group * TILE + i, gb = (first_group + (group == 32 ? 0 : 1)) * TILE + i;      \
        const float sa = value_at(scale, ga, f16), sb = value_at(scale, gb, f16);                             \
        const float ma = min ? value_at(min, ga, f16) : 0.0f, mb = min ? value_at(min, gb, f16) : 0.0f;       \
        _mm256_storeu_si256((__m256i *)(o + 32 * i), dequantize16(row_codes(a, i), offset, sa, ma)); \
        _mm256_storeu_si256((__m256i *)(o + 32 * i + 16), dequantize16(row_codes(b, i), offset, sb, mb)); \
    }

/* Tile w of W^ (every span) into `out`, the bf16 layout's tile w. */
static inline __attribute__((always_inline)) void dequantize_tile(const uint8_t *codes, const void *scale,
                                                                  const void *min, int32_t offset, int64_t w,
                                                                  int64_t K, uint16_t *out, const int bits,
                                                                  const int group, const int f16) {
    const int64_t spans = K / 32, groups = K / group, span_bytes = 16 * bits;
    for (int64_t j = 0; j < spans; j++) {
        const uint8_t *p = codes + (w * spans + j) * span_bytes;
        const int64_t first_group = w * groups + j * (32 / group);
        uint16_t *o = out + (w * spans + j) * TILE * 32;
        vi a, b;
        load_codes(p, bits, &a, &b);
        DEQUANTIZE_ROW(0) DEQUANTIZE_ROW(1) DEQUANTIZE_ROW(2) DEQUANTIZE_ROW(3)
    }
}

/* One exported function per format, as for the kernels (OpenMP's outlined body per format). */
#define DEQUANTIZE(name, bits, group, f16)                                                                    \
    void name(const uint8_t *codes, const void *scale, const void *min, int32_t offset, int64_t N, int64_t K,  \
              uint16_t *out, int32_t num_threads) {                                                           \
        const int64_t num_tiles = (N + TILE - 1) / TILE;                                                      \
        const int threads = num_threads > 1 && num_tiles * TILE * K * bits / 8 >= PARALLEL_BYTES ? num_threads : 1; \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")                    \
        for (int64_t w = 0; w < num_tiles; w++)                                                               \
            dequantize_tile(codes, scale, min, offset, w, K, out, bits, group, f16);                          \
    }

DEQUANTIZE(qmatmul_u4_g32_f16_bf16, 4, 32, 1)
DEQUANTIZE(qmatmul_u4_g32_f32_bf16, 4, 32, 0)
DEQUANTIZE(qmatmul_u8_g32_f16_bf16, 8, 32, 1)
DEQUANTIZE(qmatmul_u8_g32_f32_bf16, 8, 32, 0)
DEQUANTIZE(qmatmul_u8_g16_f32_bf16, 8, 16, 0)

/* -- dequantizing to fp32 panels, for many rows of x on CPUs whose fp32 multiply-adds outrun their
 * bf16 dot products (kvgen/model/quant/linear.py) -------------------------------------------------
 * W^ in f32_matmul.c's panels [ceil(N / 32), K, 32], zeros past N: panel p holds rows 32p .. 32p + 31
 * (8 tiles of codes) as columns. w = s * (u - o) + m, one fused multiply-add. */

#define PANEL_ROWS 32

/* Span j (32 columns) of panel p: its 8 tiles dequantized row by row, then written column by column. */
static inline __attribute__((always_inline)) void dequantize_panel_span(const uint8_t *codes, const void *scale,
                                                                        const void *min, int32_t offset, int64_t p,
                                                                        int64_t j, int64_t N, int64_t K, float *out,
                                                                        const int bits, const int group,
                                                                        const int f16) {
    float rows[PANEL_ROWS][32];
    const int64_t spans = K / 32, groups = K / group, span_bytes = 16 * bits;
    for (int t = 0; t < PANEL_ROWS / TILE; t++) {
        const int64_t w = p * (PANEL_ROWS / TILE) + t;
        if (w * TILE >= N) { /* past the last tile: zeros */
            memset(rows[TILE * t], 0, sizeof(float) * 32 * TILE);
            continue;
        }
        vi a, b;
        load_codes(codes + (w * spans + j) * span_bytes, bits, &a, &b);
        const int64_t first_group = w * groups + j * (32 / group);
        for (int i = 0; i < TILE; i++) {
            const int64_t ga = first_group * TILE + i, gb = (first_group + (group == 32 ? 0 : 1)) * TILE + i;
            const float sa = value_at(scale, ga, f16), sb = value_at(scale, gb, f16);
            const float ma = min ? value_at(min, ga, f16) : 0.0f, mb = min ? value_at(min, gb, f16) : 0.0f;
            vf_storeu(rows[TILE * t + i], vf_fmadd(vf_set1(sa), u8x16_minus_to_vf(row_codes(a, i), offset), vf_set1(ma)));
            vf_storeu(rows[TILE * t + i] + 16,
                      vf_fmadd(vf_set1(sb), u8x16_minus_to_vf(row_codes(b, i), offset), vf_set1(mb)));
        }
    }
    float *panel = out + (p * K + 32 * j) * PANEL_ROWS;
    for (int c = 0; c < 32; c++)
        for (int r = 0; r < PANEL_ROWS; r++)
            panel[c * PANEL_ROWS + r] = PANEL_ROWS * p + r < N ? rows[r][c] : 0.0f;
}

#define DEQUANTIZE_F32(name, bits, group, f16)                                                                \
    void name(const uint8_t *codes, const void *scale, const void *min, int32_t offset, int64_t N, int64_t K,  \
              float *out, int32_t num_threads) {                                                              \
        const int64_t panels = (N + PANEL_ROWS - 1) / PANEL_ROWS;                                             \
        const int threads = num_threads > 1 && N * K * bits / 8 >= PARALLEL_BYTES ? num_threads : 1;          \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")                    \
        for (int64_t p = 0; p < panels; p++)                                                                  \
            for (int64_t j = 0; j < K / 32; j++)                                                              \
                dequantize_panel_span(codes, scale, min, offset, p, j, N, K, out, bits, group, f16);          \
    }

DEQUANTIZE_F32(qmatmul_u4_g32_f16_f32, 4, 32, 1)
DEQUANTIZE_F32(qmatmul_u4_g32_f32_f32, 4, 32, 0)
DEQUANTIZE_F32(qmatmul_u8_g32_f16_f32, 8, 32, 1)
DEQUANTIZE_F32(qmatmul_u8_g32_f32_f32, 8, 32, 0)
DEQUANTIZE_F32(qmatmul_u8_g16_f32_f32, 8, 16, 0)

/* x as the kernels quantize it, `parts` rows per row of x: x^ = sum over parts of scale * q (tests). */
int quantize_activations(const float *x, int64_t T, int64_t K, int32_t parts, int8_t *q, float *scale) {
    struct xq xq;
    if (quantize_x(x, T, K, 0, 32, parts, 1, &xq))
        return 1;
    for (int64_t i = 0; i < parts * T * K; i++)
        q[i] = xq.q[i];
    for (int64_t i = 0; i < parts * T * (K / 32); i++)
        scale[i] = xq.scale[i];
    free(xq.init);
    return 0;
}
