/* paged_decode.c's work items with AVX-512 (see its header): included by it after its span helpers
 * (struct span, allowed_rows, row_scale, SPLIT_KEYS), under __AVX512F__. */

/* Whether each query row of the item allows, within the span, a first part of the keys its last row
 * allows (a causal verify chunk: row r's keys are the last row's up to r's own position); then
 * counts[r] is how many. Sliding windows drop keys at the front, and such rows go one at a time.
 * The mask's bytes (0 or 1) 64 at a time, as bits. */
static inline __attribute__((always_inline)) int nested_counts(const struct paged_decode_args *a, struct span w,
                                                               int64_t *restrict counts) {
    const int64_t row_bytes = a->blocks_per_seq * a->block_size, first_row = w.seq * a->queries;
    const uint8_t *restrict last = a->mask + (first_row + a->queries - 1) * row_bytes;
    for (int64_t r = 0; r < a->queries; r++) {
        const uint8_t *restrict mask = a->mask + (first_row + r) * row_bytes;
        int64_t count = 0;
        int ended = 0; /* a key the last row allows and this row does not has been passed */
        for (int64_t p = w.first; p < w.last; p += 64) {
            const __mmask64 lanes = w.last - p >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (w.last - p)) - 1;
            const uint64_t mine = _mm512_test_epi8_mask(_mm512_maskz_loadu_epi8(lanes, mask + p), _mm512_set1_epi8(1));
            const uint64_t theirs = _mm512_test_epi8_mask(_mm512_maskz_loadu_epi8(lanes, last + p), _mm512_set1_epi8(1));
            const uint64_t missing = theirs & ~mine;
            if ((mine & ~theirs) || (ended && mine) || (missing && (mine & -(missing & -missing))))
                return 0;
            ended |= missing != 0;
            count += __builtin_popcountll(mine);
        }
        counts[r] = count;
    }
    return 1;
}

/* 16 consecutive elements of a pool row from element i, widened to fp32. */
static inline __attribute__((always_inline)) __m512 load16(const void *pool, int64_t i, const enum element kind) {
    if (kind == F32)
        return _mm512_loadu_ps((const float *)pool + i);
    if (kind == BF16)
        return widen_bf16x16((const uint16_t *)pool + i);
    if (kind == F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)pool + i)));
    const __m128i bytes = _mm_loadu_si128((const __m128i *)((const uint8_t *)pool + i));
    if (kind == INT8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(bytes), fp8_values, 4);
}

/* The lane sums of 16 vectors, in key order: out lane j = the sum of d[j]'s lanes, added in
 * _mm512_reduce_add_ps's pairs (lane i with i + 8, then i + 4, i + 2 and i + 1), so each is that
 * function's result bit for bit, for 47 operations where 16 of it take ~130. Each level adds two
 * vectors' halves (quarters, pairs, lanes) side by side. */
static inline __attribute__((always_inline)) __m512 lane_sums16(const __m512 *d) {
    __m512 eighths[8], quarters[4], pairs[2];
    for (int m = 0; m < 8; m++) /* [d0 lanes i + (i + 8) | d1's]: keys 2m, 2m + 1 */
        eighths[m] = _mm512_add_ps(_mm512_shuffle_f32x4(d[2 * m], d[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(d[2 * m], d[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int m = 0; m < 4; m++) /* quarter k: key 4m + k, lanes j + (j + 4) */
        quarters[m] = _mm512_add_ps(_mm512_shuffle_f32x4(eighths[2 * m], eighths[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(eighths[2 * m], eighths[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int m = 0; m < 2; m++) /* quarter k: keys 8m + k (lanes 0, 1) and 8m + 4 + k (lanes 2, 3) */
        pairs[m] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * m], quarters[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(quarters[2 * m], quarters[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane 4k + l holds key 4l + k */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

/* weights[x, i] = scale * q_x . k_i for the `heads` query heads at queries[x] and the first `count`
 * keys of `rows` (head sizes a multiple of 32, compile-time, at most 512). Sixteen keys at a time are
 * widened once into `keys` [16, dim] (fp32) for all the heads; per head, the query is pre-scaled, a
 * key's dot product is summed over its 16-lane vectors in order (each times the key scale that
 * covers it, for quantized pools), then across lanes in lane_sums16: every score is the one a head
 * alone gets, whatever the heads or keys beside it. */
static inline __attribute__((always_inline)) void score_keys(const struct paged_decode_args *a, const int64_t *rows,
                                                            int64_t count, const float *const *queries,
                                                            int64_t heads, float *restrict weights,
                                                            float *restrict keys, const enum element kind,
                                                            const int64_t dim) {
    const int64_t vectors = dim / 16;
    /* scales per key row, and 16-lane vectors per scale (the caller keeps dim / key_groups a multiple of 16) */
    const int64_t key_groups = kind == INT8 || kind == FP8 ? a->key_groups : 1, per_scale = vectors / key_groups;
    const int quantized = kind == INT8 || kind == FP8;
    for (int64_t i0 = 0; i0 < count; i0 += 16) {
        const int n = count - i0 < 16 ? (int)(count - i0) : 16;
        const float *key_scales[16];
        for (int j = 0; j < 16; j++) {
            key_scales[j] = quantized && j < n ? a->k_scale + rows[i0 + j] / dim * key_groups : NULL;
            for (int64_t c = 0; c < vectors; c++)
                _mm512_store_ps(keys + j * dim + 16 * c,
                                j < n ? load16(a->k_pool, rows[i0 + j] + 16 * c, kind) : _mm512_setzero_ps());
        }
        for (int64_t x = 0; x < heads; x++) {
            __m512 dot[16], query = _mm512_mul_ps(_mm512_loadu_ps(queries[x]), _mm512_set1_ps(a->scale));
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++)
                dot[j] = _mm512_mul_ps(quantized && j < n ? _mm512_mul_ps(query, _mm512_set1_ps(key_scales[j][0])) : query,
                                       _mm512_load_ps(keys + j * dim));
            for (int64_t c = 1; c < vectors; c++) {
                query = _mm512_mul_ps(_mm512_loadu_ps(queries[x] + 16 * c), _mm512_set1_ps(a->scale));
#pragma GCC unroll 16
                for (int j = 0; j < 16; j++) {
                    const __m512 q = quantized && j < n
                                         ? _mm512_mul_ps(query, _mm512_set1_ps(key_scales[j][c / per_scale]))
                                         : query;
                    dot[j] = _mm512_fmadd_ps(q, _mm512_load_ps(keys + j * dim + 16 * c), dot[j]);
                }
            }
            _mm512_mask_storeu_ps(weights + x * count + i0, (__mmask16)((1u << n) - 1), lane_sums16(dot));
        }
    }
}

/* Softmax and values for T head-rows (a compile-time 1, 2, 4 or 8) scored into `weights` [T, count]
 * (count: the most keys any of them attends), head t attending the first counts[t] keys of `rows`,
 * into `partial` [T, 2 + dim]. Each value row is read and widened once per 32 dimensions for the T
 * heads, whose sums run side by side in registers; per head each value dimension is summed over its
 * keys in order, and the keys a head does not attend are never weighed or summed (masked
 * multiply-adds), so a head's result depends neither on T nor on the heads beside it. */
static inline __attribute__((always_inline)) void attend_heads(const struct paged_decode_args *a, const int64_t *rows,
                                                              const int64_t *counts, int64_t count,
                                                              float *restrict weights, const int T,
                                                              float *restrict partial, const enum element kind,
                                                              const int64_t dim) {
    const int64_t vectors = dim / 16;
    const void *v_pool = a->v_pool;
    int64_t shortest = count; /* the fewest keys a head attends */
    for (int g = 0; g < T; g++)
        shortest = counts[g] < shortest ? counts[g] : shortest;
    for (int g = 0; g < T; g++) { /* exponentials 16 at a time, then each value's scale folded in */
        float *restrict w = weights + g * count;
        const int64_t n = counts[g];
        __m512 tops = _mm512_set1_ps(-INFINITY);
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 lanes = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
            tops = _mm512_mask_max_ps(tops, lanes, tops, _mm512_maskz_loadu_ps(lanes, w + i));
        }
        const float top = _mm512_reduce_max_ps(tops);
        const __m512 shift = _mm512_set1_ps(top);
        __m512 totals = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 lanes = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, w + i), shift));
            _mm512_mask_storeu_ps(w + i, lanes, e);
            totals = _mm512_add_ps(totals, _mm512_maskz_mov_ps(lanes, e));
        }
        if (kind == INT8 || kind == FP8)
            for (int64_t i = 0; i < n; i++)
                w[i] *= row_scale(a->v_scale, rows[i], dim, kind);
        partial[g * (2 + dim)] = top, partial[g * (2 + dim) + 1] = _mm512_reduce_add_ps(totals);
    }
    for (int64_t c = 0; c < vectors; c += 2) { /* 32 dimensions (a 64-byte line of bf16) at a time */
        __m512 low[T], high[T];
#pragma GCC unroll 8
        for (int g = 0; g < T; g++)
            low[g] = high[g] = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i < shortest; i++) {
            const __m512 v0 = load16(v_pool, rows[i] + 16 * c, kind), v1 = load16(v_pool, rows[i] + 16 * c + 16, kind);
#pragma GCC unroll 8
            for (int g = 0; g < T; g++) {
                const __m512 e = _mm512_set1_ps(weights[g * count + i]);
                low[g] = _mm512_fmadd_ps(e, v0, low[g]);
                high[g] = _mm512_fmadd_ps(e, v1, high[g]);
            }
        }
        for (; i < count; i++) { /* keys only some of the heads attend (a verify chunk's own) */
            const __m512 v0 = load16(v_pool, rows[i] + 16 * c, kind), v1 = load16(v_pool, rows[i] + 16 * c + 16, kind);
#pragma GCC unroll 8
            for (int g = 0; g < T; g++) {
                const __m512 e = _mm512_set1_ps(weights[g * count + i]);
                const __mmask16 attends = i < counts[g] ? 0xffff : 0;
                low[g] = _mm512_mask3_fmadd_ps(e, v0, low[g], attends);
                high[g] = _mm512_mask3_fmadd_ps(e, v1, high[g], attends);
            }
        }
#pragma GCC unroll 8
        for (int g = 0; g < T; g++) {
            _mm512_storeu_ps(partial + g * (2 + dim) + 2 + 16 * c, low[g]);
            _mm512_storeu_ps(partial + g * (2 + dim) + 18 + 16 * c, high[g]);
        }
    }
}

/* The `heads` head-rows x = r * group + g (query row b0 + r, query head g of the item's KV head),
 * row r attending the first row_counts[r] keys of `rows`, into `partial` [heads, 2 + dim]: all
 * scored at once (score_keys), then softmax and values in tiles of 8, 4, 2 and 1 (attend_heads).
 * `scratch`: keys [16, dim], then weights [heads, SPLIT_KEYS]. */
static inline __attribute__((always_inline)) void attend_tiles(const struct paged_decode_args *a, struct span w,
                                                              const int64_t *rows, int64_t heads, int64_t b0,
                                                              const int64_t *row_counts, float *restrict scratch,
                                                              float *restrict partial, const enum element kind,
                                                              const int64_t dim) {
    const int64_t group = a->group;
    float *restrict keys = scratch, *restrict weights = scratch + 16 * dim;
    const float *queries[heads];
    int64_t count = 0; /* the most keys a row attends */
    for (int64_t x = 0; x < heads; x++) {
        queries[x] = a->q + (b0 + x / group) * a->q_stride + (w.h * group + x % group) * dim;
        count = row_counts[x / group] > count ? row_counts[x / group] : count;
    }
    score_keys(a, rows, count, queries, heads, weights, keys, kind, dim);
    for (int64_t x0 = 0; x0 < heads;) {
        const int64_t left = heads - x0;
        const int T = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        int64_t counts[8];
        for (int t = 0; t < T; t++)
            counts[t] = row_counts[(x0 + t) / group];
        float *tile = partial + x0 * (2 + dim), *tile_weights = weights + x0 * count;
        if (T == 8)
            attend_heads(a, rows, counts, count, tile_weights, 8, tile, kind, dim);
        else if (T == 4)
            attend_heads(a, rows, counts, count, tile_weights, 4, tile, kind, dim);
        else if (T == 2)
            attend_heads(a, rows, counts, count, tile_weights, 2, tile, kind, dim);
        else
            attend_heads(a, rows, counts, count, tile_weights, 1, tile, kind, dim);
        x0 += T;
    }
}

/* A work item for head sizes a multiple of 32 (compile-time, at most 512) into `partial`
 * [queries, group, 2 + dim]. The query heads of all its rows are scored and summed together when
 * the rows' keys nest (a verify chunk of K + 1 rows then widens each key once, not once per row);
 * else row by row. `scratch`: rows [SPLIT_KEYS], then attend_tiles'. */
static inline __attribute__((always_inline)) void attend_avx512(const struct paged_decode_args *a, struct span w,
                                                               void *scratch, float *restrict partial,
                                                               const enum element kind, const int64_t dim) {
    const int64_t group = a->group, queries = a->queries, b0 = w.seq * queries;
    int64_t *restrict rows = scratch; /* [count] */
    float *restrict rest = (float *)(rows + SPLIT_KEYS);
    int64_t counts[queries];
    if (queries == 1 || nested_counts(a, w, counts)) {
        counts[queries - 1] = allowed_rows(a, w, b0 + queries - 1, dim, rows);
        attend_tiles(a, w, rows, queries * group, b0, counts, rest, partial, kind, dim);
        return;
    }
    for (int64_t r = 0; r < queries; r++) {
        const int64_t count = allowed_rows(a, w, b0 + r, dim, rows);
        attend_tiles(a, w, rows, group, b0 + r, &count, rest, partial + r * group * (2 + dim), kind, dim);
    }
}
