/* The integer dot products of a K-quant sub-block's unpacked codes with rows of x, for kquant.c's
 * panel (see its header): included by kquant.c after its constants (XPASS, UNROLL) and qvec.h.
 */
/* How many codes vectors dot4_rows takes at a time (qvec.h): AVX2 adds their products in int16, so
 * 2 * (largest code) * 127 * RUN <= 32,767; vpdpbusd needs no such runs. */
#ifdef __AVX512F__
#define RUN(kind) 1
#else
#define RUN(kind) ((kind) == 4 ? 8 : (kind) == 5 ? 4 : 2)
#endif

/* a[r] += sum over g in [g0, g1) of codes c[g] by row r's 4 bytes g of x. With AVX-512 the rows'
 * chains of dependent vpdpbusd are interleaved to hide its latency (at R <= 2, two chains a row).
 * Integer sums: the same whatever the order. */
ALWAYS_INLINE void dots(const vi *c, const int32_t *const *xq, const int g0, const int g1, const int R, vi *a,
                        const int kind) {
#ifdef __AVX512F__
    if (R <= 2) {
        vi b[2];
        UNROLL for (int r = 0; r < R; r++)
            b[r] = vi_set1_i32(0);
        UNROLL for (int g = g0; g < g1; g += 2)
            UNROLL for (int r = 0; r < R; r++) {
                a[r] = dot4(a[r], c[g], vi_set1_i32(xq[r][g]), 4);
                b[r] = dot4(b[r], c[g + 1], vi_set1_i32(xq[r][g + 1]), 4);
            }
        UNROLL for (int r = 0; r < R; r++)
            a[r] = vi_add(a[r], b[r]);
        return;
    }
#endif
    UNROLL for (int g = g0; g < g1; g += RUN(kind)) {
        const int32_t *x[XPASS];
        UNROLL for (int r = 0; r < R; r++)
            x[r] = xq[r] + g;
        UNROLL for (int r = 0; r < R; r += DOT4_ROWS)
            dot4_rows(a + r, c + g, x + r, RUN(kind), R - r < DOT4_ROWS ? R - r : DOT4_ROWS);
    }
}

#ifndef __AVX512F__
/* AVX2's dots for a Q4_K sub-block (lo: its 4 vectors of low nibbles, in L1 once a pass has read
 * them): a[r] = sum over its 8 code vectors of codes by row r's x, for R <= 4 rows. The 8 products
 * of a row stay below 32,768 in int16 (codes below 16), so 4 rows' int16 sums, a code vector and x
 * fill the 16 ymm; each code vector is unpacked again for each 4 rows of a pass. Holding the
 * sub-block's 8 vectors (16 ymm) for a pass's 8 rows, as `dots` does, spilled them and the sums to
 * the stack: 16 rows of x through an 8,960 x 1,536 matrix on one core of an AMD EPYC without
 * AVX-512 ran at 137 GOP/s, and run so at 162. Q5_K's and Q6_K's shorter runs need int32 sums beside
 * the int16 ones, and unpacking their high bits for every 4 rows cost more than it saved (Q6_K 100 ->
 * 57 GOP/s). */
ALWAYS_INLINE void q4k_dots(const uint8_t *lo, const int32_t *const *xq, const int R, vi *a) {
    const vi nibble = vi_set1_i8(0x0F);
    __m256i s_lo[4], s_hi[4];
    UNROLL for (int r = 0; r < R; r++)
        s_lo[r] = s_hi[r] = _mm256_setzero_si256();
    UNROLL for (int g = 0; g < 8; g++) {
        const vi bytes = vi_loadu(lo + 64 * (g >> 1));
        const vi c = vi_and(g & 1 ? vi_srli16(bytes, 4) : bytes, nibble);
        UNROLL for (int r = 0; r < R; r++) {
            const __m256i xi = _mm256_set1_epi32(xq[r][g]);
            s_lo[r] = _mm256_add_epi16(s_lo[r], _mm256_maddubs_epi16(c.lo, xi));
            s_hi[r] = _mm256_add_epi16(s_hi[r], _mm256_maddubs_epi16(c.hi, xi));
            __asm__("" : "+x"(s_lo[r]), "+x"(s_hi[r])); /* one chain a row, not a tree of spilled products */
        }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    UNROLL for (int r = 0; r < R; r++)
        a[r] = (vi){_mm256_madd_epi16(s_lo[r], ones), _mm256_madd_epi16(s_hi[r], ones)};
}
#endif
