/* A K-quant sub-block (32 columns of a panel) against rows of x, for kquant.c's panel (see its
 * header): included by kquant.c after its constants (XPASS, UNROLL), qvec.h and its helpers. Both
 * builds make the same fp32 operations in the same order (the same bits); integer sums are exact in
 * any order. Per row r, with dot the sub-block's (Q6_K: each 16 columns') integer sums:
 *     Q4_K/Q5_K  y[r] = fma(mn, xsum, fma(dot * sx, sc, y[r]))
 *     Q6_K       y[r] = fma((dot - 32 sum q_x) * sx, sc, y[r])  per 16 columns
 */

/* A span's int8 values as 8 groups of 4 bytes. */
ALWAYS_INLINE const int32_t *words(const struct xspan *xs) { return (const int32_t *)xs->q; }

#ifdef __AVX512F__
/* `init` + the sum over g in [g0, g0 + n) of codes c[g] by x's 4 bytes g (xr[g]), in two independent
 * chains of vpdpbusd. */
ALWAYS_INLINE vi row_dots(const vi *c, const int32_t *xr, const int g0, const int n, int32_t init) {
    vi a = vi_set1_i32(init), b = vi_set1_i32(0);
    UNROLL for (int g = g0; g < g0 + n; g += 2) {
        a = dot4(a, c[g], vi_set1_i32(xr[g]), 4);
        b = dot4(b, c[g + 1], vi_set1_i32(xr[g + 1]), 4);
    }
    return vi_add(a, b);
}

/* y[r] += sub-block `s` (codes c, scales from meta) times row r0 + r of x, for r < R. One row at a
 * time: its 8 vpdpbusd in two independent chains (per Q6_K half), then its fp32 epilogue, so that
 * only the code vectors and the rows' outputs stay live across rows. Holding every row's sums and
 * scales for a pass, as the AVX2 build does, spilled code vectors to the stack: on an AMD EPYC
 * (Zen 5, 2 threads) 512 rows of x through the llama-1b shape's 32 MLP matrices took 579-632 ms
 * rather than 780-841 (Q6_K) and 549-610 rather than 635-698 (Q5_K_M's mix), with the same bits. */
ALWAYS_INLINE void sub_block(const vi *c, const uint8_t *lo, const uint8_t *meta, vf d, vf neg_dmin, int s,
                             const struct kx *x, int64_t r0, const int R, int64_t span, vf *y,
                             const int kind) {
    (void)lo;
    const struct xspan *xs = x_span(x, r0, span);
    if (kind == 6) { /* per 16 columns */
        const vf sc[2] = {vf_mul(d, i8x16(meta + 32 * s)), vf_mul(d, i8x16(meta + 32 * s + 16))};
        UNROLL for (int r = 0; r < R; r++) {
            const int32_t *xr = words(&xs[r]);
            const vf sx = vf_set1(xs[r].sx);
            UNROLL for (int half = 0; half < 2; half++)
                y[r] = vf_fmadd(vf_mul(vi_to_vf(row_dots(c, xr, 4 * half, 4, xs[r].init[half])), sx),
                                sc[half], y[r]);
        }
        return;
    }
    const vf sc = vf_mul(d, u8x16(meta + 16 * s)), mn = vf_mul(neg_dmin, u8x16(meta + 128 + 16 * s));
    UNROLL for (int r = 0; r < R; r++) {
        const vi dot = row_dots(c, words(&xs[r]), 0, 8, 0);
        y[r] = vf_fmadd(vf_mul(vi_to_vf(dot), vf_set1(xs[r].sx)), sc, y[r]);
        y[r] = vf_fmadd(mn, vf_set1(xs[r].xsum), y[r]);
    }
}
#else
/* How many codes vectors dot4_rows takes at a time (qvec.h): AVX2 adds their products in int16, so
 * 2 * (largest code) * 127 * RUN <= 32,767. */
#define RUN(kind) ((kind) == 4 ? 8 : (kind) == 5 ? 4 : 2)

/* a[r] += sum over g in [g0, g1) of codes c[g] by row r's 4 bytes g of x. */
ALWAYS_INLINE void dots(const vi *c, const int32_t *const *xq, const int g0, const int g1, const int R, vi *a,
                        const int kind) {
    UNROLL for (int g = g0; g < g1; g += RUN(kind)) {
        const int32_t *x[XPASS];
        UNROLL for (int r = 0; r < R; r++)
            x[r] = xq[r] + g;
        UNROLL for (int r = 0; r < R; r += DOT4_ROWS)
            dot4_rows(a + r, c + g, x + r, RUN(kind), R - r < DOT4_ROWS ? R - r : DOT4_ROWS);
    }
}

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

/* y[r] += sub-block `s` (codes c, low nibbles lo, scales from meta) times row r0 + r of x, for r < R:
 * every row's integer sums first, then their fp32 epilogues. */
ALWAYS_INLINE void sub_block(const vi *c, const uint8_t *lo, const uint8_t *meta, vf d, vf neg_dmin, int s,
                             const struct kx *x, int64_t r0, const int R, int64_t span, vf *y,
                             const int kind) {
    const struct xspan *xs = x_span(x, r0, span);
    const int32_t *xq[XPASS];
    vi a[XPASS];
    UNROLL for (int r = 0; r < R; r++)
        xq[r] = words(&xs[r]);
    if (kind == 6) { /* per 16 columns: dot - 32 sum q_x, scaled by d*sc */
        for (int half = 0; half < 2; half++) {
            const vf sc = vf_mul(d, i8x16(meta + 32 * s + 16 * half));
            UNROLL for (int r = 0; r < R; r++)
                a[r] = vi_set1_i32(xs[r].init[half]);
            dots(c, xq, 4 * half, 4 * half + 4, R, a, kind);
            UNROLL for (int r = 0; r < R; r++)
                y[r] = vf_fmadd(vf_mul(vi_to_vf(a[r]), vf_set1(xs[r].sx)), sc, y[r]);
        }
        return;
    }
    const vf sc = vf_mul(d, u8x16(meta + 16 * s)), mn = vf_mul(neg_dmin, u8x16(meta + 128 + 16 * s));
    if (kind == 4 && R >= 4) { /* below 4 rows the sub-block's 8 code vectors fit beside the sums */
        UNROLL for (int r = 0; r < R; r += 4)
            q4k_dots(lo, xq + r, R - r < 4 ? R - r : 4, a + r);
    } else {
        UNROLL for (int r = 0; r < R; r++)
            a[r] = vi_set1_i32(0);
        dots(c, xq, 0, 8, R, a, kind);
    }
    UNROLL for (int r = 0; r < R; r++) {
        y[r] = vf_fmadd(vf_mul(vi_to_vf(a[r]), vf_set1(xs[r].sx)), sc, y[r]);
        y[r] = vf_fmadd(mn, vf_set1(xs[r].xsum), y[r]);
    }
}
#endif
