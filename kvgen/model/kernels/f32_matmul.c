/* y = x @ W^T in fp32 (AVX-512 FMA), made for decode's few rows of x (one row, or a speculative
 * verify chunk of up to ~16) and run by fp32 layers at every row count: at prefill's hundreds of rows
 * it keeps within a few percent of OpenBLAS's GEMM, and a row's bits then never depend on the batch.
 *
 * Built by kvgen/model/kernels/f32.py with explicit flags (AVX-512 F; never -march=native, never
 * AMX) and called through ctypes, only on CPUs that report AVX-512 F.
 *
 * W [N, K] fp32 row-major, as loaded: the same memory OpenBLAS's GEMM reads for many rows, so fp32
 * layers keep one copy of their weights. A block's 4 rows are 4 streams.
 * x [T, K] fp32, y [T, N] fp32. The loop is few_rows.h's.
 *
 * Why not OpenBLAS's GEMV/GEMM: at one row its GEMV reads a small model's weights at ~19 GB/s here
 * where this reads them at ~23; at 2-16 rows its GEMM costs 1.5-2.2x its GEMV, this 1.1-1.8x
 * (BENCHMARKS.md), which is what a speculative verify chunk needs.
 */
#define ELEM float
#define SPAN 16
#define MASK __mmask16
#define VEC __m512
#define LOAD(m, p) _mm512_maskz_loadu_ps((m), (p))
#define DOT(acc, x, w) _mm512_fmadd_ps((x), (w), (acc))
#define ROW_STRIDE(K) (K)
#define SPAN_STEP SPAN
#define BLOCK_START(b, K) ((b) * WROWS * (K))
#define ROWS_CONTIGUOUS
#include "few_rows.h"

/* x [T, K] fp32, w [N, K] fp32 row-major, y [T, N] fp32. */
void f32_matmul(const float *x, int64_t T, int64_t K, const float *w, int64_t N, float *y, int32_t num_threads) {
    few_rows_matmul(x, T, K, w, N, y, 1, num_threads);
}

/* One call's arguments as a struct, for a call list (kvgen/model/kernels/step.c). */
struct f32_matmul_args {
    const float *x;
    int64_t T, K;
    const float *w;
    int64_t N;
    float *y;
    int32_t num_threads;
};

int f32_matmul_call(const struct f32_matmul_args *a) {
    f32_matmul(a->x, a->T, a->K, a->w, a->N, a->y, a->num_threads);
    return 0;
}
