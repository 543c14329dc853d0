#include "../cpu_simd.h"

/* y [m, n] = x [m, k] W^T for a bf16 weight W [n, k] (row-major, as a checkpoint stores it) and
 * a few bf16 rows x (decode), FP32 sums rounded once to bf16.  Weight rows are read four at a
 * time (one core reads memory faster from a few interleaved streams than from one; two, three,
 * five, six and eight rows were no faster than four) and the next four rows' lines are
 * prefetched into L2 while these are summed: each weight element is loaded once for all m rows.
 *
 * Each output is one chain of fmas into 16 lanes: over each block of 32 inputs, lane j adds
 * input 2j, then input 2j + 1 (a weight's 32-bit pair split into its even and odd halves
 * without a shuffle); then the lanes are summed as hsum16 sums them.  The order depends on
 * neither m nor n, so a row's bits do not depend on the rows beside it; the AVX-512 and
 * portable forms give the same bits.  k must be a multiple of 32. */

#define ROWS 4  /* weight rows streamed together */
#define MAX_M 4 /* rows of x */

/* x's rows in FP32, each block of 32 inputs as its 16 even inputs, then its 16 odd ones. */
static void split_even_odd(const uint16_t *x, int64_t m, int64_t k, float *xs) {
    for (int64_t i = 0; i < m * k; i += 32)
        for (int64_t j = 0; j < 16; ++j) {
            xs[i + j] = bf16_value(x[i + 2 * j]);
            xs[i + 16 + j] = bf16_value(x[i + 2 * j + 1]);
        }
}

/* The 16 lanes summed in hsum16's order. */
static float lane_sum(const float *v) {
    float a[8], b[4];
    for (int j = 0; j < 8; ++j)
        a[j] = v[j] + v[j + 8];
    for (int j = 0; j < 4; ++j)
        b[j] = a[j] + a[j + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static void gemv_portable(const float *xs, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                          uint16_t *y) {
    for (int64_t r = 0; r < n; ++r)
        for (int64_t i = 0; i < m; ++i) {
            float acc[16] = {0};
            for (int64_t b = 0; b < k; b += 32)
                for (int64_t j = 0; j < 16; ++j) {
                    const uint16_t *wb = w + r * k + b;
                    const float *xb = xs + i * k + b;
                    acc[j] = fmaf(bf16_value(wb[2 * j]), xb[j], acc[j]);
                    acc[j] = fmaf(bf16_value(wb[2 * j + 1]), xb[16 + j], acc[j]);
                }
            y[i * n + r] = round_bf16(lane_sum(acc));
        }
}

#ifdef HAVE_X86
/* Rows [r0, r0 + rows) of W against m rows of x; rows and m are constants where it is inlined,
 * so the sums stay in registers (rows * m <= 16). */
AVX512 static inline __attribute__((always_inline)) void
rows_avx512(const float *xs, const int64_t m, int64_t k, const uint16_t *w, int64_t n, int64_t r0,
            const int64_t rows, uint16_t *y) {
    const __m512i odd = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[ROWS][MAX_M];
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < m; ++i)
            acc[r][i] = _mm512_setzero_ps();
    const uint16_t *wr = w + r0 * k;
    for (int64_t b = 0; b < k; b += 32) {
        for (int64_t r = 0; r < rows; ++r) {
            /* the line the next block of rows reads at this column (a prefetch never faults) */
            _mm_prefetch((const char *)(wr + (rows + r) * k + b), _MM_HINT_T1);
            const __m512i pair = _mm512_loadu_si512(wr + r * k + b);
            const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
            const __m512 high = _mm512_castsi512_ps(_mm512_and_si512(pair, odd));
            for (int64_t i = 0; i < m; ++i) {
                const float *xb = xs + i * k + b;
                acc[r][i] = _mm512_fmadd_ps(even, _mm512_loadu_ps(xb), acc[r][i]);
                acc[r][i] = _mm512_fmadd_ps(high, _mm512_loadu_ps(xb + 16), acc[r][i]);
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < m; ++i)
            y[i * n + r0 + r] = round_bf16(hsum16(acc[r][i]));
}

/* The weight's rows split among the OpenMP threads in blocks of ROWS, each thread's a
 * contiguous run (one stream a thread). */
AVX512 static inline __attribute__((always_inline)) void
gemv_m(const float *xs, const int64_t m, int64_t k, const uint16_t *w, int64_t n, uint16_t *y) {
    const int64_t blocks = n / ROWS;
#pragma omp parallel for schedule(static) if (n * k >= PARALLEL_MIN)
    for (int64_t b = 0; b < blocks; ++b)
        rows_avx512(xs, m, k, w, n, b * ROWS, ROWS, y);
    for (int64_t r = blocks * ROWS; r < n; ++r)
        rows_avx512(xs, m, k, w, n, r, 1, y);
}

AVX512 static void gemv_avx512(const float *xs, int64_t m, int64_t k, const uint16_t *w,
                               int64_t n, uint16_t *y) {
    switch (m) {
    case 1: gemv_m(xs, 1, k, w, n, y); break;
    case 2: gemv_m(xs, 2, k, w, n, y); break;
    case 3: gemv_m(xs, 3, k, w, n, y); break;
    default: gemv_m(xs, 4, k, w, n, y); break;
    }
}
#endif

int dasc_gemv_simd(void) {
#ifdef HAVE_X86
    return simd_ok(32, 1);
#else
    return 0;
#endif
}

/* y [m, n] = x [m, k] @ w [n, k]^T, all bf16; 1 <= m <= MAX_M, k % 32 == 0.  Returns nonzero
 * where it did not run (bad sizes, no memory). */
int dasc_gemv(const void *x, int64_t m, int64_t k, const void *w, int64_t n, void *y,
              int64_t simd) {
    if (m < 1 || m > MAX_M || k < 32 || k % 32 || n < 1)
        return 1;
    float *xs = malloc((size_t)(m * k) * sizeof *xs);
    if (!xs)
        return 1;
    split_even_odd(x, m, k, xs);
#ifdef HAVE_X86
    if (simd_ok(k, simd))
        gemv_avx512(xs, m, k, w, n, y);
    else
#endif
        gemv_portable(xs, m, k, w, n, y);
    free(xs);
    return 0;
}
