/* GGUF Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, MXFP4 rows -> kvgen/model/formats/packed.py's packed layout, at load: one
 * pass over the file's bytes (read in place from the memory map) into the final buffers, no copy.
 *
 * Built by kvgen/model/kernels/block_pack.py, plain C (no ISA flags: the layout is packed wherever a
 * C compiler runs, whichever kernel then reads it). The layout (formats.py's header): rows in panels
 * of 16, each panel span by span (32 weights of a row); per (panel, span)
 *     4-bit codes (Q4_0, Q4_1, MXFP4): 4 vectors v of 16 rows x 4 bytes, byte b of row n's lane =
 *                               code 8v + b (low nibble) | code 8v + 4 + b << 4: 256 bytes;
 *     8-bit codes (the rest):   8 vectors g of 16 rows x 4 bytes, byte b = code 4g + b: 512 bytes;
 * and per (panel, span) the 16 rows' fp16 scales (and mins), the file's fp16 bits as they are, or
 * MXFP4's e8m0 exponent e as 2^(e - 128) (ggml's halved scale) in fp16 where every one of the matrix's
 * is one (e in 104..143), else in fp32.
 * Codes are the file's unsigned: Q4_0/Q4_1 q (0..15, offset 8 / 0), Q8_0 int8 q + 128, Q5_0
 * q - 16 + 128, Q5_1 q + 128 (offset 128), MXFP4 the e2m1 code (its codebook's index, offset 12).
 * The last panel's padding rows are zero (codes, scales, mins).
 *
 * The caller names each output row's file row by a pointer, so a stack of matrices (q/k/v, gate/up)
 * and a permutation of rows (llama.cpp's q/k order) cost nothing extra. Panels are independent, split
 * among the threads.
 */
#include <stdint.h>
#include <string.h>

#define PANEL 16
#define SPAN 32

enum kind { Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, MXFP4 };

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Per kind: a block's bytes, where its codes start, its 5th bits (qh, 4 bytes) and its min (fp16). */
ALWAYS_INLINE int block_bytes(const int kind) {
    return kind == Q4_0 ? 18 : kind == Q4_1 ? 20 : kind == Q8_0 ? 34 : kind == Q5_0 ? 22 : kind == Q5_1 ? 24 : 17;
}
ALWAYS_INLINE int codes_at(const int kind) {
    return kind == Q4_0 ? 2 : kind == Q4_1 ? 4 : kind == Q8_0 ? 2 : kind == Q5_0 ? 6 : kind == Q5_1 ? 8 : 1;
}
ALWAYS_INLINE int bits(const int kind) { return kind == Q4_0 || kind == Q4_1 || kind == MXFP4 ? 4 : 8; }
ALWAYS_INLINE int has_min(const int kind) { return kind == Q4_1 || kind == Q5_1; }

/* One file block -> its 32 unsigned codes (see the header). 4- and 5-bit blocks keep weights 0-15 in
 * the low nibbles of their 16 bytes and 16-31 in the high ones; weight i's 5th bit is bit i of qh
 * (little-endian). */
ALWAYS_INLINE void decode(const uint8_t *block, uint8_t *q, const int kind) {
    const uint8_t *qs = block + codes_at(kind);
    if (kind == Q8_0) {
        for (int i = 0; i < SPAN; i++)
            q[i] = qs[i] ^ 0x80;
        return;
    }
    uint32_t qh = 0;
    if (kind == Q5_0 || kind == Q5_1)
        memcpy(&qh, block + codes_at(kind) - 4, 4);
    const uint8_t add = kind == Q5_0 ? 112 : kind == Q5_1 ? 128 : 0;
    for (int i = 0; i < SPAN / 2; i++) {
        q[i] = (uint8_t)((qs[i] & 0x0F) + add);
        q[i + 16] = (uint8_t)((qs[i] >> 4) + add);
    }
    if (kind == Q5_0 || kind == Q5_1)
        for (int i = 0; i < SPAN; i++)
            q[i] = (uint8_t)(q[i] + (((qh >> i) & 1) << 4)); /* q + add <= 159: no wrap */
}

/* Row `lane`'s 32 codes into the (panel, span)'s codes. */
ALWAYS_INLINE void scatter(const uint8_t *q, int lane, uint8_t *codes, const int kind) {
    if (bits(kind) == 4)
        for (int v = 0; v < 4; v++)
            for (int b = 0; b < 4; b++)
                codes[64 * v + 4 * lane + b] = (uint8_t)(q[8 * v + b] | q[8 * v + 4 + b] << 4);
    else
        for (int g = 0; g < 8; g++)
            memcpy(codes + 64 * g + 4 * lane, q + 4 * g, 4);
}

/* A block's scale into entry i of `scale`: the file's fp16 bits, or MXFP4's 2^(e - 128) as fp16 bits
 * (e in 104..143; `wide` 0) or fp32 bits (subnormal below e = 2, as ggml_e8m0_to_fp32_half). */
ALWAYS_INLINE void put_scale(const uint8_t *block, void *scale, int64_t i, const int kind, const int wide) {
    if (kind != MXFP4) {
        memcpy((uint16_t *)scale + i, block, 2);
        return;
    }
    const int e = block[0], k = e - 128;
    if (wide)
        ((uint32_t *)scale)[i] = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    else
        ((uint16_t *)scale)[i] = (uint16_t)(k >= -14 ? (k + 15) << 10 : 1 << (k + 24));
}

/* Panel p: its 16 rows (rows[16p..], past N zeros) span by span. */
ALWAYS_INLINE void pack_panel(const uint8_t *const *rows, int64_t N, int64_t K, int64_t p, uint8_t *codes,
                              void *scale, uint16_t *min, const int kind, const int wide) {
    const int64_t spans = K / SPAN, span_bytes = SPAN * PANEL * bits(kind) / 8;
    uint8_t *panel = codes + p * spans * span_bytes;
    for (int64_t s = 0; s < spans; s++) {
        uint8_t *out = panel + s * span_bytes;
        const int64_t d = (p * spans + s) * PANEL;
        uint16_t *m = has_min(kind) ? min + d : NULL;
        for (int lane = 0; lane < PANEL; lane++) {
            const int64_t n = PANEL * p + lane;
            uint8_t q[SPAN];
            if (n < N) {
                const uint8_t *block = rows[n] + s * block_bytes(kind);
                decode(block, q, kind);
                put_scale(block, scale, d + lane, kind, wide);
                if (has_min(kind))
                    memcpy(m + lane, block + 2, 2);
            } else {
                memset(q, 0, SPAN);
                memset((uint8_t *)scale + (d + lane) * (wide ? 4 : 2), 0, wide ? 4 : 2);
                if (has_min(kind))
                    m[lane] = 0;
            }
            scatter(q, lane, out, kind);
        }
    }
}

/* rows: N pointers to the file's rows (K / 32 blocks each) -> codes, scale (and min), ceil(N / 16)
 * panels each. */
#define PACK(name, kind, wide)                                                                                \
    void name(const uint8_t *const *rows, int64_t N, int64_t K, uint8_t *codes, void *scale, uint16_t *min,    \
              int32_t num_threads) {                                                                          \
        const int64_t panels = (N + PANEL - 1) / PANEL;                                                       \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)")           \
        for (int64_t p = 0; p < panels; p++)                                                                  \
            pack_panel(rows, N, K, p, codes, scale, min, kind, wide);                                         \
    }

PACK(bp_pack_q4_0, Q4_0, 0)
PACK(bp_pack_q4_1, Q4_1, 0)
PACK(bp_pack_q8_0, Q8_0, 0)
PACK(bp_pack_q5_0, Q5_0, 0)
PACK(bp_pack_q5_1, Q5_1, 0)
PACK(bp_pack_mxfp4, MXFP4, 0)
PACK(bp_pack_mxfp4_f32, MXFP4, 1)
