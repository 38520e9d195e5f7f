/* y = x @ W^T in bf16: AVX-512 BF16 dot products (vdpbf16ps), made for decode's few rows of x.
 *
 * Built by kvgen/model/kernels/bf16.py with explicit flags (AVX-512 F/BW/VL/BF16; never
 * -march=native, never AMX) and called through ctypes, only on CPUs that report those features.
 *
 * W [N, K] bf16, packed once at load (kvgen/model/kernels/bf16.py) in tiles of 4 rows stored span
 * (32 columns) by span, K padded with zeros to whole spans: a thread reads one sequential stream,
 * where 4 row streams per thread read the LM head from memory at half the speed. x [T, K] bf16,
 * y [T, N] bf16 (or fp32, for the quantized layers' many-row path). The loop is few_rows.h's.
 *
 * Why not oneDNN: at one row its bf16 GEMV reads the mid-size matrices of a small model (576 x 1536)
 * at a third of the memory's speed, slower than fp32 OpenBLAS on twice the bytes (BENCHMARKS.md).
 */
#define ELEM uint16_t
#define SPAN 32
#define MASK __mmask32
#define VEC __m512bh
#define LOAD(m, p) ((__m512bh)_mm512_maskz_loadu_epi16((m), (p)))
#define DOT(acc, x, w) _mm512_dpbf16_ps((acc), (x), (w))
#define ROW_STRIDE(K) SPAN
#define SPAN_STEP (WROWS * SPAN)
#define BLOCK_START(b, K) ((b) * (((K) + SPAN - 1) / SPAN) * WROWS * SPAN)
#include "few_rows.h"

/* x [T, K] bf16, w packed as kernels/bf16.py's pack() lays it out (tiles of 4 rows, K padded to
 * spans of 32), y [T, N] bf16, or fp32 (the unrounded sums) when f32 is set. */
void bf16_matmul(const uint16_t *x, int64_t T, int64_t K, const uint16_t *w, int64_t N, void *y, int32_t f32,
                 int32_t num_threads) {
    few_rows_matmul(x, T, K, w, N, y, f32, num_threads, NULL);
}

/* One call's arguments as a struct, for a call list (kvgen/model/kernels/step.c). */
struct bf16_matmul_args {
    const uint16_t *x;
    int64_t T, K;
    const uint16_t *w;
    int64_t N;
    void *y;
    int32_t f32, num_threads;
};

int bf16_matmul_call(const struct bf16_matmul_args *a) {
    bf16_matmul(a->x, a->T, a->K, a->w, a->N, a->y, a->f32, a->num_threads);
    return 0;
}

/* The packed weight back to row-major bf16 [N, K] (tiles of 4 rows, span by span, as pack() lays
 * them out; the padding dropped): for the many-row path, which hands it to oneDNN's GEMM. */
void bf16_unpack(const uint16_t *w, int64_t N, int64_t K, uint16_t *out, int32_t num_threads) {
    const int64_t spans = (K + SPAN - 1) / SPAN, tiles = (N + WROWS - 1) / WROWS;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t b = 0; b < tiles; b++)
        for (int64_t s = 0; s < spans; s++)
            for (int64_t r = 0; r < WROWS && b * WROWS + r < N; r++) {
                const int64_t count = K - s * SPAN < SPAN ? K - s * SPAN : SPAN;
                memcpy(out + (b * WROWS + r) * K + s * SPAN, w + ((b * spans + s) * WROWS + r) * SPAN,
                       sizeof(uint16_t) * count);
            }
}
