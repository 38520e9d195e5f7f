/* What the coded float kernels share (bf16_coded.c, f32_coded.c; formats/coded.py lays it out). */
#include <stdint.h>

/* A coded matrix's outliers, by group of rows (a tile of 4 rows in bf16_coded.c, a panel of 32 in
 * f32_coded.c): entries start[g]..start[g+1]-1 belong to group g; entry e is weight value[e], at
 * column at[e] / rows and row g * rows + at[e] % rows (rows per group, a power of two). */
struct outliers {
    const int64_t *start;
    const int32_t *at;
    const float *value;
};

/* One call's arguments: y [T, N] = x [T, K] @ W^T for a coded W (w, table, outliers). */
struct coded_args {
    const void *x; /* bf16 (bf16_coded.c) or fp32 (f32_coded.c) */
    int64_t T, K;
    const uint8_t *w;
    const uint8_t *table; /* 16 top bytes, by code */
    struct outliers outliers;
    int64_t N;
    void *y;         /* fp32, or bf16 where bf16_coded.c is called with f32 unset */
    int32_t f32;     /* f32_coded.c: always set */
    int32_t num_threads;
};
