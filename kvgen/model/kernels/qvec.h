/* The vectors qmatmul.c and kquant.c compute on: 16 fp32 lanes (vf) and 64 bytes / 16 int32 lanes
 * (vi), as one zmm register with AVX-512 VNNI, or as two ymm registers (lo: lanes 0-7, hi: 8-15)
 * with AVX2.
 *
 * Both give the kernel the same bits: the integer dot products are exact either way, and every
 * fp32 operation is per lane, so it runs in the same order in both. AVX2
 * has no vpdpbusd: its u8 x s8 products go through vpmaddubsw, whose int16 pair sums saturate past
 * 32,767. 4-bit codes (at most 15) times int8 x (|x| <= 127) never get there; 8-bit codes are made
 * signed first (u - 128, CODE_BIAS) and multiplied as |u - 128| by x with u - 128's sign, as ggml
 * does, so a pair is at most 2 * 128 * 127 = 32,512.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Qword i of v (row i's 4 bf16 values) to o + i * stride (16-bit elements). */
ALWAYS_INLINE void store_quads(uint16_t *o, __m256i v, int64_t stride) {
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    _mm_storel_epi64((__m128i *)o, lo);
    _mm_storeh_pd((double *)(o + stride), _mm_castsi128_pd(lo));
    _mm_storel_epi64((__m128i *)(o + 2 * stride), hi);
    _mm_storeh_pd((double *)(o + 3 * stride), _mm_castsi128_pd(hi));
}

/* A codebook of 4-bit codes (`book` 1): MXFP4's e2m1 values doubled (0, 1, 2, 3, 4, 6, 8, 12 and their
 * negatives), plus 12 so that they are unsigned, by code; the format's offset 12 takes the 12 back. */
static const uint8_t E2M1_CODES[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

#ifdef __AVX512F__

typedef __m512 vf;
typedef __m512i vi;
#define CODE_BIAS(bits) 0 /* vpdpbusd takes the unsigned codes as they are */

ALWAYS_INLINE vf vf_zero(void) { return _mm512_setzero_ps(); }
ALWAYS_INLINE vf vf_set1(float s) { return _mm512_set1_ps(s); }
ALWAYS_INLINE vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
ALWAYS_INLINE vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
ALWAYS_INLINE vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
ALWAYS_INLINE vf vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
ALWAYS_INLINE void vf_storeu(float *p, vf v) { _mm512_storeu_ps(p, v); }
ALWAYS_INLINE vf vi_to_vf(vi v) { return _mm512_cvtepi32_ps(v); }

/* 16 int8 as fp32. */
ALWAYS_INLINE vf i8x16_to_vf(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }

/* max |v| over 32 fp32 values at p. */
ALWAYS_INLINE float abs_max32(const float *p) {
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(p)), _mm512_abs_ps(_mm512_loadu_ps(p + 16))));
}

/* round(v) (to nearest even) as 16 int8, for |round(v)| <= 127. */
ALWAYS_INLINE __m128i vf_to_i8x16(vf v) { return _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)); }

/* Sums of 4 consecutive int8 (4 int32 lanes). */
ALWAYS_INLINE __m128i sums_of_4(__m128i q) { return _mm_dpbusd_epi32(_mm_setzero_si128(), _mm_set1_epi8(1), q); }

/* `count` (<= 16) consecutive fp16 or fp32 values as fp32, zeros after them. */
ALWAYS_INLINE vf load_values(const void *p, int64_t at, int count, const int f16) {
    __mmask16 m = (__mmask16)((1u << count) - 1);
    if (f16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + at));
    return _mm512_maskz_loadu_ps(m, (const float *)p + at);
}

/* Lane l of the result is lane base + l / width of v (base a multiple of 4, width 4 or 8). */
ALWAYS_INLINE vf spread(vf v, int base, int width) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(base), _mm512_srli_epi32(lanes, width == 4 ? 2 : 3));
    return _mm512_permutexvar_ps(idx, v);
}

/* The first `n` (1-16) lanes of v to p. */
ALWAYS_INLINE void vf_store_first(float *p, vf v, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v); }

ALWAYS_INLINE vi vi_set1_i32(int32_t v) { return _mm512_set1_epi32(v); }
ALWAYS_INLINE vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
ALWAYS_INLINE vi vi_loadu(const void *p) { return _mm512_loadu_si512(p); }
ALWAYS_INLINE vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
ALWAYS_INLINE vi vi_set1_i8(char v) { return _mm512_set1_epi8(v); }
ALWAYS_INLINE vi vi_srli16(vi v, const int n) { return _mm512_srli_epi16(v, n); }
ALWAYS_INLINE vi vi_slli32(vi v, const int n) { return _mm512_slli_epi32(v, n); }
ALWAYS_INLINE vi vi_srli32(vi v, const int n) { return _mm512_srli_epi32(v, n); }
/* a | (b & mask), in one instruction. */
ALWAYS_INLINE vi vi_or_and(vi a, vi b, vi mask) { return _mm512_ternarylogic_epi32(a, b, mask, 0xF8); }

/* Two vectors of codes, a byte each: the low and high nibbles of one 64-byte load for 4-bit codes,
 * two loads for 8-bit. */
ALWAYS_INLINE void load_codes(const uint8_t *p, const int bits, const int book, vi *a, vi *b) {
    if (bits == 4) {
        const __m512i v = _mm512_loadu_si512(p);
        *a = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
        *b = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
        if (book) {
            const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)E2M1_CODES));
            *a = _mm512_shuffle_epi8(table, *a);
            *b = _mm512_shuffle_epi8(table, *b);
        }
    } else {
        *a = _mm512_loadu_si512(p);
        *b = _mm512_loadu_si512(p + 64);
    }
}

/* acc + sums of 4 consecutive products codes * x (unsigned codes by int8 x), per int32 lane. */
ALWAYS_INLINE vi dot4(vi acc, vi codes, vi x, const int bits) {
    (void)bits;
    return _mm512_dpbusd_epi32(acc, codes, x);
}

#define DOT4_ROWS 8 /* rows dot4_rows takes at a time */
/* a[r] += sum over i < n of dot4(codes[i], x[r][i] broadcast) for rows r < R, for codes below 128 whose
 * products' pair sums, added n at a time, stay within int16 (n * 2 * largest code * 127 <= 32,767:
 * AVX2 adds them there before widening). */
ALWAYS_INLINE void dot4_rows(vi *a, const vi *codes, const int32_t *const *x, const int n, const int R) {
    _Pragma("GCC unroll 8") for (int i = 0; i < n; i++)
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)
            a[r] = _mm512_dpbusd_epi32(a[r], codes[i], _mm512_set1_epi32(x[r][i]));
}

/* Quarter i (bytes 16i .. 16i + 15) of a vector. */
ALWAYS_INLINE __m128i row_codes(vi v, const int i) { return _mm512_extracti32x4_epi32(v, i); }

/* Byte b of each int32 lane, minus `offset`, as fp32. */
ALWAYS_INLINE vf byte_minus_to_vf(vi v, const int b, int32_t offset) {
    const __m512i byte = _mm512_and_si512(_mm512_srli_epi32(v, 8 * b), _mm512_set1_epi32(0xFF));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(byte, _mm512_set1_epi32(offset)));
}

/* Each lane rounded to the nearest bf16 (ties to even), as 16 uint16. */
ALWAYS_INLINE __m256i bf16_of(vf v) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

/* 16 unsigned bytes minus `offset`, as fp32. */
ALWAYS_INLINE vf u8x16_minus_to_vf(__m128i codes, int32_t offset) {
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(codes), _mm512_set1_epi32(offset)));
}

#else /* AVX2 + FMA + F16C */

typedef struct { __m256 lo, hi; } vf;
typedef struct { __m256i lo, hi; } vi;
#define CODE_BIAS(bits) ((bits) == 8 ? 128 : 0) /* dot4 takes 8-bit codes as u - 128 */

ALWAYS_INLINE vf vf_zero(void) { return (vf){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
ALWAYS_INLINE vf vf_set1(float s) { return (vf){_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
ALWAYS_INLINE vf vf_mul(vf a, vf b) { return (vf){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
ALWAYS_INLINE vf vf_sub(vf a, vf b) { return (vf){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
ALWAYS_INLINE vf vf_fmadd(vf a, vf b, vf c) {
    return (vf){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
ALWAYS_INLINE vf vf_loadu(const float *p) { return (vf){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
ALWAYS_INLINE void vf_storeu(float *p, vf v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
ALWAYS_INLINE vf vi_to_vf(vi v) { return (vf){_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }

ALWAYS_INLINE vf i8x16_to_vf(__m128i q) {
    return (vf){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
}

ALWAYS_INLINE float abs_max32(const float *p) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(p)), _mm256_andnot_ps(sign, _mm256_loadu_ps(p + 8)));
    m = _mm256_max_ps(m, _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(p + 16)),
                                       _mm256_andnot_ps(sign, _mm256_loadu_ps(p + 24))));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

ALWAYS_INLINE __m128i vf_to_i8x16(vf v) {
    /* packs interleaves 128-bit lanes: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> put lo's before hi's */
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(_mm256_cvtps_epi32(v.lo), _mm256_cvtps_epi32(v.hi)),
                                                   _MM_SHUFFLE(3, 1, 2, 0));
    return _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
}

ALWAYS_INLINE __m128i sums_of_4(__m128i q) {
    return _mm_madd_epi16(_mm_maddubs_epi16(_mm_set1_epi8(1), q), _mm_set1_epi16(1));
}

/* Full vectors load directly and fp32 tails with vmaskmovps: copying a tail to a zeroed stack array
 * and loading that back cannot be store-forwarded (the load spans several stores) and stalled the
 * kernel's chunk loop; at one row this took a 3,072 x 576 Q4_1 matmul from 0.25 to 0.14 ms. */
ALWAYS_INLINE vf load_values(const void *p, int64_t at, int count, const int f16) {
    if (f16 && count == 16) {
        const __m128i *h = (const __m128i *)((const uint16_t *)p + at);
        return (vf){_mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1))};
    }
    if (f16) { /* a matrix's last chunk of groups only */
        uint16_t h[16] = {0};
        memcpy(h, (const uint16_t *)p + at, sizeof h[0] * count);
        return (vf){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)),
                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8)))};
    }
    const float *f = (const float *)p + at;
    if (count == 16)
        return vf_loadu(f);
    const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    return (vf){_mm256_maskload_ps(f, _mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane)),
                _mm256_maskload_ps(f + 8, _mm256_cmpgt_epi32(_mm256_set1_epi32(count - 8), lane))};
}

/* base is a multiple of 4, so the lanes a half of the result takes lie in one half of v. */
ALWAYS_INLINE vf spread(vf v, int base, int width) {
    const __m256i lanes = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    const __m256 half = base < 8 ? v.lo : v.hi;
    const int first = base % 8, hi_first = first + 8 / width;
    const __m256i idx = _mm256_srli_epi32(lanes, width == 4 ? 2 : 3);
    return (vf){_mm256_permutevar8x32_ps(half, _mm256_add_epi32(_mm256_set1_epi32(first), idx)),
                _mm256_permutevar8x32_ps(half, _mm256_add_epi32(_mm256_set1_epi32(hi_first), idx))};
}

ALWAYS_INLINE void vf_store_first(float *p, vf v, int n) {
    const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane), v.lo);
    _mm256_maskstore_ps(p + 8, _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), lane), v.hi);
}

ALWAYS_INLINE vi vi_set1_i32(int32_t v) { return (vi){_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
ALWAYS_INLINE vi vi_add(vi a, vi b) { return (vi){_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
ALWAYS_INLINE vi vi_loadu(const void *p) {
    return (vi){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1)};
}
ALWAYS_INLINE vi vi_and(vi a, vi b) { return (vi){_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
ALWAYS_INLINE vi vi_set1_i8(char v) { return (vi){_mm256_set1_epi8(v), _mm256_set1_epi8(v)}; }
ALWAYS_INLINE vi vi_srli16(vi v, const int n) { return (vi){_mm256_srli_epi16(v.lo, n), _mm256_srli_epi16(v.hi, n)}; }
ALWAYS_INLINE vi vi_slli32(vi v, const int n) { return (vi){_mm256_slli_epi32(v.lo, n), _mm256_slli_epi32(v.hi, n)}; }
ALWAYS_INLINE vi vi_srli32(vi v, const int n) { return (vi){_mm256_srli_epi32(v.lo, n), _mm256_srli_epi32(v.hi, n)}; }
ALWAYS_INLINE vi vi_or_and(vi a, vi b, vi mask) {
    return (vi){_mm256_or_si256(a.lo, _mm256_and_si256(b.lo, mask.lo)),
                _mm256_or_si256(a.hi, _mm256_and_si256(b.hi, mask.hi))};
}

ALWAYS_INLINE void load_codes(const uint8_t *p, const int bits, const int book, vi *a, vi *b) {
    const __m256i lo = _mm256_loadu_si256((const __m256i *)p), hi = _mm256_loadu_si256((const __m256i *)(p + 32));
    if (bits == 4) {
        const __m256i nibble = _mm256_set1_epi8(0x0F);
        *a = (vi){_mm256_and_si256(lo, nibble), _mm256_and_si256(hi, nibble)};
        *b = (vi){_mm256_and_si256(_mm256_srli_epi16(lo, 4), nibble), _mm256_and_si256(_mm256_srli_epi16(hi, 4), nibble)};
        if (book) {
            const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)E2M1_CODES));
            *a = (vi){_mm256_shuffle_epi8(table, a->lo), _mm256_shuffle_epi8(table, a->hi)};
            *b = (vi){_mm256_shuffle_epi8(table, b->lo), _mm256_shuffle_epi8(table, b->hi)};
        }
    } else {
        *a = (vi){lo, hi};
        *b = (vi){_mm256_loadu_si256((const __m256i *)(p + 64)), _mm256_loadu_si256((const __m256i *)(p + 96))};
    }
}

/* 4-bit: vpmaddubsw on the codes as they are; 8-bit: on |u - 128|, x taking u - 128's sign. */
ALWAYS_INLINE __m256i dot4_half(__m256i acc, __m256i codes, __m256i x, const int bits) {
    __m256i pairs;
    if (bits == 4) {
        pairs = _mm256_maddubs_epi16(codes, x);
    } else {
        const __m256i s = _mm256_xor_si256(codes, _mm256_set1_epi8((char)0x80));
        pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(s, s), _mm256_sign_epi8(x, s));
    }
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
ALWAYS_INLINE vi dot4(vi acc, vi codes, vi x, const int bits) {
    return (vi){dot4_half(acc.lo, codes.lo, x.lo, bits), dot4_half(acc.hi, codes.hi, x.hi, bits)};
}

/* Runs of 8 code vectors (4-bit codes): each vector meets the R rows in turn, each row's int16 sums
 * one chain (the empty asm keeps GCC from reassociating it into a tree of all 8 products, which with
 * R rows spilled most of them to the stack): 16 rows through an 8,960 x 1,536 int4 matrix took 4.4
 * ms -> 2.5 (and one 0.29 -> 0.20) on an AMD EPYC without AVX-512; R <= DOT4_ROWS keeps the 2R sums,
 * a code vector and x in the 16 ymm. Shorter runs (Q5_K's 4, Q6_K's 2) go a row at a time: their
 * few products fit, and the chains made them 4-12% slower. */
#define DOT4_ROWS 4
ALWAYS_INLINE void dot4_rows(vi *a, const vi *codes, const int32_t *const *x, const int n, const int R) {
    if (n < 8) {
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
            __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
            _Pragma("GCC unroll 4") for (int i = 0; i < n; i++) {
                const __m256i xi = _mm256_set1_epi32(x[r][i]);
                lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(codes[i].lo, xi));
                hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(codes[i].hi, xi));
            }
            const __m256i ones = _mm256_set1_epi16(1);
            a[r] = (vi){_mm256_add_epi32(a[r].lo, _mm256_madd_epi16(lo, ones)),
                        _mm256_add_epi32(a[r].hi, _mm256_madd_epi16(hi, ones))};
        }
        return;
    }
    __m256i lo[DOT4_ROWS], hi[DOT4_ROWS];
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
        lo[r] = hi[r] = _mm256_setzero_si256();
    _Pragma("GCC unroll 8") for (int i = 0; i < n; i++)
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
            const __m256i xi = _mm256_set1_epi32(x[r][i]);
            lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(codes[i].lo, xi));
            hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(codes[i].hi, xi));
            __asm__("" : "+x"(lo[r]), "+x"(hi[r]));
        }
    const __m256i ones = _mm256_set1_epi16(1);
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
        a[r] = (vi){_mm256_add_epi32(a[r].lo, _mm256_madd_epi16(lo[r], ones)),
                    _mm256_add_epi32(a[r].hi, _mm256_madd_epi16(hi[r], ones))};
}

ALWAYS_INLINE __m128i row_codes(vi v, const int i) {
    const __m256i half = i < 2 ? v.lo : v.hi;
    return i % 2 ? _mm256_extracti128_si256(half, 1) : _mm256_castsi256_si128(half);
}

ALWAYS_INLINE __m256 byte_minus_half(__m256i v, const int b, int32_t offset) {
    const __m256i byte = _mm256_and_si256(_mm256_srli_epi32(v, 8 * b), _mm256_set1_epi32(0xFF));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(byte, _mm256_set1_epi32(offset)));
}
ALWAYS_INLINE vf byte_minus_to_vf(vi v, const int b, int32_t offset) {
    return (vf){byte_minus_half(v.lo, b, offset), byte_minus_half(v.hi, b, offset)};
}

ALWAYS_INLINE __m256i bf16_half(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
}
ALWAYS_INLINE __m256i bf16_of(vf v) {
    /* packus interleaves 128-bit lanes as packs does in vf_to_i8x16 */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_half(v.lo), bf16_half(v.hi)), _MM_SHUFFLE(3, 1, 2, 0));
}

ALWAYS_INLINE vf u8x16_minus_to_vf(__m128i codes, int32_t offset) {
    const __m256i o = _mm256_set1_epi32(offset);
    return (vf){_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(codes), o)),
                _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8)), o))};
}

#endif
