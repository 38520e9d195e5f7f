/* GGUF K-quant rows (Q4_K, Q5_K, Q6_K) -> kquant.c's layout, at load: one pass over the file's bytes
 * (read in place from the memory map) into the final buffer, no intermediate copy.
 *
 * Built by kvgen/model/kernels/kquant.py with kquant.c's flags. The layout is kquant.c's (see its
 * header): rows in panels of 16, each panel super-block by super-block, a block = meta (320 bytes) +
 * low nibbles (2048) + high-bit planes (Q5_K 512, Q6_K 1024).
 *
 * The caller names each output row's file row by a pointer (NULL: a zero row, the last panel's
 * padding), so a stack of matrices (q/k/v, gate/up) and a permutation of rows (llama.cpp's q/k
 * order) cost nothing extra. Per row and super-block the file's block is decoded to its 256 codes
 * (0..15, 0..31, 0..63) and integer scales, then scattered into the row's lane of the panel's block.
 * The values are the file's bit for bit: codes and 6-bit scales as integers, d and dmin as their
 * fp16 bits. Panels are independent, split among the threads.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PANEL 16
#define QK 256
#define META 320
#define LOW 2048
#define BLOCK_BYTES(kind) ((kind) == 4 ? META + LOW : (kind) == 5 ? META + LOW + 512 : META + LOW + 1024)
#define FILE_BYTES(kind) ((kind) == 4 ? 144 : (kind) == 5 ? 176 : 210)

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE __m256i load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
ALWAYS_INLINE void store32(uint8_t *p, __m256i v) { _mm256_storeu_si256((__m256i *)p, v); }

/* Bits 4.. of byte lanes: (v >> s) & mask, per byte (16-bit shifts, then the mask). */
ALWAYS_INLINE __m256i bits(__m256i v, int s, int mask) {
    return _mm256_and_si256(_mm256_srli_epi16(v, s), _mm256_set1_epi8((char)mask));
}

/* One file block -> codes q[256], and scales: Q4_K/Q5_K sc[8], m[8]; Q6_K sc[16] (int8 bits). */
ALWAYS_INLINE void decode(const uint8_t *b, uint8_t *q, uint8_t *sc, uint8_t *m, const int kind) {
    if (kind == 6) { /* ql 0..127, qh 128..191, sc 192..207: per half h, ql's 64 bytes give codes
                        0-63 (low nibbles) and 64-127 (high); qh's 32 give 2 high bits to l, 32+l, 64+l, 96+l */
        for (int h = 0; h < 2; h++) {
            const __m256i qh = load32(b + 128 + 32 * h);
            for (int k = 0; k < 4; k++) {
                const __m256i ql = load32(b + 64 * h + 32 * (k & 1));
                const __m256i low = k < 2 ? bits(ql, 0, 0x0F) : bits(ql, 4, 0x0F);
                const __m256i high = _mm256_slli_epi16(bits(qh, 2 * k, 0x03), 4);
                store32(q + 128 * h + 32 * k, _mm256_or_si256(low, high));
            }
        }
        memcpy(sc, b + 192, 16);
        return;
    }
    /* 12 bytes of scales at 4: sc 0-3 / m 0-3 the low 6 bits of bytes 0-3 / 4-7; sc and m 4-7 their
     * low 4 bits from bytes 8-11 and their high 2 from the top of bytes 0-3 / 4-7 */
    const uint8_t *p = b + 4;
    for (int j = 0; j < 4; j++) {
        sc[j] = p[j] & 0x3F;
        m[j] = p[4 + j] & 0x3F;
        sc[4 + j] = (uint8_t)((p[8 + j] & 0x0F) | ((p[j] >> 6) << 4));
        m[4 + j] = (uint8_t)((p[8 + j] >> 4) | ((p[4 + j] >> 6) << 4));
    }
    const uint8_t *qs = b + (kind == 4 ? 16 : 48); /* each 32 bytes: sub-blocks 2i (low nibbles), 2i+1 (high) */
    const __m256i qh = kind == 5 ? load32(b + 16) : _mm256_setzero_si256(); /* sub-block s: bit s of qh[0..31] */
    for (int s = 0; s < 8; s++) {
        __m256i c = bits(load32(qs + 32 * (s >> 1)), 4 * (s & 1), 0x0F);
        if (kind == 5)
            c = _mm256_or_si256(c, _mm256_slli_epi16(bits(qh, s, 0x01), 4));
        store32(q + 32 * s, c);
    }
}

/* 32 codes -> 16 bytes: byte 4v+b = code[8v+b] | code[8v+4+b] << 4, low 4 bits each (the layout's low
 * vectors, v = 0..3). */
ALWAYS_INLINE __m128i nibbles(const uint8_t *q) {
    const __m128 a = _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)q));
    const __m128 b = _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)(q + 16)));
    const __m128i lo = _mm_castps_si128(_mm_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))); /* dwords 0, 2 of a, b */
    const __m128i hi = _mm_castps_si128(_mm_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m128i nib = _mm_set1_epi8(0x0F);
    return _mm_or_si128(_mm_and_si128(lo, nib), _mm_slli_epi16(_mm_and_si128(hi, nib), 4)); /* stays in its byte */
}

/* The 16 bits of x at the even positions 0, 2, .., 30. */
ALWAYS_INLINE uint32_t spread(uint32_t x) {
    x = (x | x << 8) & 0x00FF00FFu;
    x = (x | x << 4) & 0x0F0F0F0Fu;
    x = (x | x << 2) & 0x33333333u;
    return (x | x << 1) & 0x55555555u;
}

/* Row `lane`'s block of codes q / scales into the panel's block `out` (see kquant.c's layout). */
ALWAYS_INLINE void scatter(const uint8_t *q, const uint8_t *sc, const uint8_t *m, const uint8_t *file, int lane,
                           uint8_t *out, const int kind) {
    uint8_t *low = out + META, *high = out + META + LOW;
    for (int s = 0; s < 8; s++) {
        uint32_t v[4];
        _mm_storeu_si128((__m128i *)v, nibbles(q + 32 * s));
        for (int i = 0; i < 4; i++)
            memcpy(low + 256 * s + 64 * i + 4 * lane, &v[i], 4);
    }
    /* Byte 4b+j of each 16 <- code 4j+b: the transposes that put a code's high bits at bit 8b+g. */
    const __m256i by_b = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                          0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    if (kind == 5) /* word s, bit 8b+g = bit 4 of code[32s+4g+b] */
        for (int s = 0; s < 8; s++) {
            __m256i t = _mm256_shuffle_epi8(load32(q + 32 * s), by_b);          /* half g/4: byte 4b + g%4 */
            t = _mm256_permutevar8x32_epi32(t, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* byte 8b + g */
            const uint32_t word = (uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(t, 3));
            memcpy(high + 64 * s + 4 * lane, &word, 4);
        }
    if (kind == 6) /* word (s, k), bits 8b+2j, 8b+2j+1 = bits 4, 5 of code[32s+4(4k+j)+b] */
        for (int s = 0; s < 8; s++) {
            const __m256i t = _mm256_shuffle_epi8(load32(q + 32 * s), by_b);    /* half k: byte 4b + j */
            const uint32_t b4 = (uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(t, 3));
            const uint32_t b5 = (uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(t, 2));
            for (int k = 0; k < 2; k++) {
                const uint32_t word = spread((b4 >> 16 * k) & 0xFFFF) | spread((b5 >> 16 * k) & 0xFFFF) << 1;
                memcpy(high + 128 * s + 64 * k + 4 * lane, &word, 4);
            }
        }
    if (kind == 6) {
        for (int j = 0; j < 16; j++)
            out[16 * j + lane] = sc[j];
        memcpy(out + 256 + 2 * lane, file + 208, 2);           /* d */
        memset(out + 288 + 2 * lane, 0, 2);
    } else {
        for (int j = 0; j < 8; j++) {
            out[16 * j + lane] = sc[j];
            out[128 + 16 * j + lane] = m[j];
        }
        memcpy(out + 256 + 2 * lane, file, 2);                 /* d */
        memcpy(out + 288 + 2 * lane, file + 2, 2);             /* dmin */
    }
}

/* Panel p: its 16 rows (rows[16p..], NULL for zeros) block by block. */
ALWAYS_INLINE void pack_panel(const uint8_t *const *rows, int64_t N, int64_t K, int64_t p, uint8_t *out,
                              const int kind) {
    static const uint8_t zeros[FILE_BYTES(6)];
    const int64_t blocks = K / QK;
    uint8_t *panel = out + p * blocks * BLOCK_BYTES(kind);
    for (int64_t b = 0; b < blocks; b++) {
        uint8_t *block = panel + b * BLOCK_BYTES(kind);
        for (int lane = 0; lane < PANEL; lane++) {
            const int64_t n = PANEL * p + lane;
            const uint8_t *file = n < N && rows[n] ? rows[n] + b * FILE_BYTES(kind) : zeros;
            uint8_t q[QK] __attribute__((aligned(32))), sc[16], m[8];
            decode(file, q, sc, m, kind);
            scatter(q, sc, m, file, lane, block, kind);
        }
    }
}

/* rows: N pointers to the file's rows (K / 256 blocks each) -> out, ceil(N / 16) panels. */
#define PACK(name, kind)                                                                                      \
    void name(const uint8_t *const *rows, int64_t N, int64_t K, uint8_t *out, int32_t num_threads) {          \
        const int64_t panels = (N + PANEL - 1) / PANEL;                                                       \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)")           \
        for (int64_t p = 0; p < panels; p++)                                                                  \
            pack_panel(rows, N, K, p, out, kind);                                                             \
    }

PACK(kq_pack_q4_k, 4)
PACK(kq_pack_q5_k, 5)
PACK(kq_pack_q6_k, 6)
