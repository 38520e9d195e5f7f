/* y = x @ W^T in fp32 (AVX-512 F FMA, or AVX2 FMA), for fp32 layers at every row count: decode's one
 * row, a speculative verify chunk's few, prefill's hundreds.
 *
 * Built by kvgen/model/kernels/f32.py with explicit flags (AVX-512 F, else AVX2 and FMA; never
 * -march=native, never AMX) and called through ctypes, only on CPUs that report those features.
 *
 * W [N, K] is packed once at load (kernels/f32.py's pack) into panels of PANEL = 32 output
 * features, packed [ceil(N / 32), K, 32]: panel p holds W[32p + j, k] at [p, k, j], zeros past N.
 * x [T, K] fp32, y [T, N] fp32.
 *
 * A pass of up to MAX_ROWS rows of x over one panel keeps their 32 outputs each in registers (2
 * vectors a row) and, for each k, loads the panel's 32 weights once and multiplies them by every
 * row's x[t, k], broadcast: 28 multiply-adds per 2 weight loads (AVX-512; AVX2 has registers for 3
 * rows, 12 per 4) and no horizontal sums. So each output is one chain of fused multiply-adds over k
 * = 0 .. K-1 from zero, whatever T and however the threads split the work: a row's bits never
 * depend on the rows beside it (what speculation's exactness rests on). A panel is one sequential
 * stream of K x 128 bytes, prefetched into L2 ahead; further passes over the same panel (rows past
 * the first MAX_ROWS) read it from cache.
 *
 * Against the kernel it replaced (dot products over 16 lanes summed at the end, on W as loaded), on
 * four matrices of a layer's shapes (1,728 / 576 / 3,072 x 576, 576 x 1,536; 30 copies for few
 * rows), alternated in one process: 171 -> 216 GFLOP/s at 512 rows, level at one row (~30 GB/s),
 * 1.05-1.3x faster at 2-9 rows and 1.7x at 16 (BENCHMARKS.md).
 */
#include "f32_passes.h"

/* Every row of x over panel p, in passes of up to MAX_ROWS rows. */
static void panel_rows(const float *x, int64_t T, int64_t K, const float *packed, int64_t p, int64_t N, float *y) {
    const int64_t n0 = p * PANEL, left = N - n0;
    const float *panel = packed + p * K * PANEL;
    for (int64_t t = 0; t < T; t += MAX_ROWS) {
        const int64_t rows = T - t < MAX_ROWS ? T - t : MAX_ROWS;
        PASSES[rows](x + t * K, K, panel, y + t * N + n0, N, left);
    }
}

/* x [T, K] fp32, packed [ceil(N / 32), K, 32] (see above), y [T, N] fp32. */
void f32_matmul(const float *x, int64_t T, int64_t K, const float *packed, int64_t N, float *y, int32_t num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const int64_t work = N * K * (int64_t)sizeof(float) * (1 + T / MAX_ROWS);
    const int threads = num_threads > 1 && work >= PARALLEL_BYTES ? num_threads : 1;
    if (threads == 1) { /* no parallel region at all: entering even a serial one costs time */
        for (int64_t p = 0; p < panels; p++)
            panel_rows(x, T, K, packed, p, N, y);
        return;
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++)
        panel_rows(x, T, K, packed, p, N, y);
}

/* One call's arguments as a struct, for a call list (kvgen/model/kernels/step.c). */
struct f32_matmul_args {
    const float *x;
    int64_t T, K;
    const float *packed;
    int64_t N;
    float *y;
    int32_t num_threads;
};

int f32_matmul_call(const struct f32_matmul_args *a) {
    f32_matmul(a->x, a->T, a->K, a->packed, a->N, a->y, a->num_threads);
    return 0;
}
