#include "../cpu_coded.h"

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

/* Output r of each of x's m rows against weight row wr. */
static void row_portable(const float *xs, int64_t m, int64_t k, const uint16_t *wr, int64_t n,
                         int64_t r, uint16_t *y) {
    for (int64_t i = 0; i < m; ++i) {
        float acc[16] = {0};
        for (int64_t b = 0; b < k; b += 32)
            for (int64_t j = 0; j < 16; ++j) {
                const float *xb = xs + i * k + b;
                acc[j] = fmaf(bf16_value(wr[b + 2 * j]), xb[j], acc[j]);
                acc[j] = fmaf(bf16_value(wr[b + 2 * j + 1]), xb[16 + j], acc[j]);
            }
        y[i * n + r] = round_bf16(lane_sum(acc));
    }
}

static void gemv_portable(const float *xs, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                          uint16_t *y) {
    for (int64_t r = 0; r < n; ++r)
        row_portable(xs, m, k, w + r * k, n, r, y);
}

/* Block x's header: the first top-exponent of its window, or RAW where its high bytes do not
 * fit one (the loops are written to vectorize). */
static uint8_t block_head(const uint16_t *x) {
    uint8_t e[CODE_BLOCK], top = 0, outside = 0;
    for (int i = 0; i < CODE_BLOCK; ++i)
        e[i] = (uint8_t)((x[i] >> 8) & 0x7f);
    for (int i = 0; i < CODE_BLOCK; ++i)
        top = e[i] > top ? e[i] : top;
    const uint8_t base = top < WINDOW ? 1 : (uint8_t)(top - (WINDOW - 1));
    for (int i = 0; i < CODE_BLOCK; ++i) /* e - base wraps below base */
        outside |= (uint8_t)(e[i] != 0) & (uint8_t)((uint8_t)(e[i] - base) >= WINDOW);
    return outside ? RAW : base;
}

/* head [n, k / 64] of w [n, k] (k % 64 == 0): each block's header. */
void dasc_code_heads(const void *w, int64_t n, int64_t k, uint8_t *head) {
    const int64_t blocks = k / CODE_BLOCK;
#pragma omp parallel for schedule(static) if (n * k >= PARALLEL_MIN)
    for (int64_t r = 0; r < n; ++r)
        for (int64_t b = 0; b < blocks; ++b)
            head[r * blocks + b] = block_head((const uint16_t *)w + r * k + b * CODE_BLOCK);
}

/* Code w [n, k] into body [n, k / 64, 96] and side (row r's run from side_at[r]: 64 bytes a RAW
 * block), given dasc_code_heads' head. */
void dasc_code(const void *w, int64_t n, int64_t k, const uint8_t *head, uint8_t *body,
               uint8_t *side, const int64_t *side_at) {
    const int64_t blocks = k / CODE_BLOCK;
#pragma omp parallel for schedule(static) if (n * k >= PARALLEL_MIN)
    for (int64_t r = 0; r < n; ++r) {
        uint8_t *raw = side + side_at[r];
        for (int64_t b = 0; b < blocks; ++b) {
            const uint16_t *x = (const uint16_t *)w + r * k + b * CODE_BLOCK;
            uint8_t *low = body + (r * blocks + b) * CODE_BYTES, *codes = low + CODE_BLOCK;
            const int base = head[r * blocks + b];
            uint8_t code[CODE_BLOCK];
            for (int q = 0; q < CODE_BLOCK; ++q) {
                const uint16_t v = x[PERM(q)];
                const int e = (v >> 8) & 0x7f, sign = v >> 15;
                low[q] = (uint8_t)v;
                code[q] = (uint8_t)(e ? (e - base) << 1 | sign : 14 + sign);
            }
            if (base == RAW) {
                for (int q = 0; q < CODE_BLOCK; ++q)
                    raw[q] = (uint8_t)(x[PERM(q)] >> 8);
                raw += CODE_BLOCK;
                memset(codes, 0, CODE_BYTES - CODE_BLOCK);
                continue;
            }
            for (int q = 0; q < 32; ++q)
                codes[q] = (uint8_t)(code[q] | code[q + 32] << 4);
        }
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

#ifdef HAVE_X86
/* rows_avx512 over the coded form: rows [r0, r0 + rows) against m rows of x, the sums in the
 * same order; rows and m are constants where it is inlined. */
AVX512 static inline __attribute__((always_inline)) void
coded_rows(const float *xs, const int64_t m, int64_t k, const uint8_t *body, const uint8_t *head,
           const uint8_t *side, const int64_t *side_at, int64_t n, int64_t r0, const int64_t rows,
           uint16_t *y) {
    const __m512i odd = _mm512_set1_epi32((int)0xffff0000u);
    const int64_t blocks = k / CODE_BLOCK, row_bytes = blocks * CODE_BYTES;
    __m512 acc[ROWS][MAX_M];
    const uint8_t *raw[ROWS];
    for (int64_t r = 0; r < rows; ++r) {
        raw[r] = side + side_at[r0 + r];
        for (int64_t i = 0; i < m; ++i)
            acc[r][i] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; ++b) {
        for (int64_t r = 0; r < rows; ++r) {
            const uint8_t *block = body + (r0 + r) * row_bytes + b * CODE_BYTES;
            /* the lines the next block of rows reads here (a prefetch never faults) */
            _mm_prefetch((const char *)(block + rows * row_bytes), _MM_HINT_T1);
            _mm_prefetch((const char *)(block + rows * row_bytes + 64), _MM_HINT_T1);
            const int base = head[(r0 + r) * blocks + b];
            __m512i pairs[2];
            decode_block(block, base, raw[r], &pairs[0], &pairs[1]);
            raw[r] += base == RAW ? CODE_BLOCK : 0;
            for (int64_t h = 0; h < 2; ++h) { /* rows_avx512's products, kept inline: a
                                                * helper taking acc by pointer ran 5-15 % slower */
                const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs[h], 16));
                const __m512 high = _mm512_castsi512_ps(_mm512_and_si512(pairs[h], odd));
                for (int64_t i = 0; i < m; ++i) {
                    const float *xb = xs + i * k + b * CODE_BLOCK + h * 32;
                    acc[r][i] = _mm512_fmadd_ps(even, _mm512_loadu_ps(xb), acc[r][i]);
                    acc[r][i] = _mm512_fmadd_ps(high, _mm512_loadu_ps(xb + 16), acc[r][i]);
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < m; ++i)
            y[i * n + r0 + r] = round_bf16(hsum16(acc[r][i]));
}

AVX512 static inline __attribute__((always_inline)) void
coded_m(const float *xs, const int64_t m, int64_t k, const uint8_t *body, const uint8_t *head,
        const uint8_t *side, const int64_t *side_at, int64_t n, uint16_t *y) {
    const int64_t blocks = n / ROWS;
#pragma omp parallel for schedule(static) if (n * k >= PARALLEL_MIN)
    for (int64_t b = 0; b < blocks; ++b)
        coded_rows(xs, m, k, body, head, side, side_at, n, b * ROWS, ROWS, y);
    for (int64_t r = blocks * ROWS; r < n; ++r)
        coded_rows(xs, m, k, body, head, side, side_at, n, r, 1, y);
}

AVX512 static void coded_avx512(const float *xs, int64_t m, int64_t k, const uint8_t *body,
                                const uint8_t *head, const uint8_t *side, const int64_t *side_at,
                                int64_t n, uint16_t *y) {
    switch (m) {
    case 1: coded_m(xs, 1, k, body, head, side, side_at, n, y); break;
    case 2: coded_m(xs, 2, k, body, head, side, side_at, n, y); break;
    case 3: coded_m(xs, 3, k, body, head, side, side_at, n, y); break;
    default: coded_m(xs, 4, k, body, head, side, side_at, n, y); break;
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

/* dasc_gemv over the coded form of w [n, k] (k % 64 == 0): the same bits. */
int dasc_gemv_coded(const void *x, int64_t m, int64_t k, const uint8_t *body, const uint8_t *head,
                    const uint8_t *side, const int64_t *side_at, int64_t n, void *y,
                    int64_t simd) {
    if (m < 1 || m > MAX_M || k < CODE_BLOCK || k % CODE_BLOCK || n < 1)
        return 1;
    float *xs = malloc((size_t)(m * k) * sizeof *xs);
    if (!xs)
        return 1;
    split_even_odd(x, m, k, xs);
#ifdef HAVE_X86
    if (simd_ok(k, simd)) {
        coded_avx512(xs, m, k, body, head, side, side_at, n, y);
        free(xs);
        return 0;
    }
#endif
    uint16_t *row = malloc((size_t)k * sizeof *row); /* the portable form's decoded row */
    if (!row) {
        free(xs);
        return 1;
    }
    for (int64_t r = 0; r < n; ++r) {
        decode_row(body, head, side, side_at, k, r, row);
        row_portable(xs, m, k, row, n, r, y);
    }
    free(row);
    free(xs);
    return 0;
}

#ifdef HAVE_X86
/* decode_row by decode_block: a block's two vectors of 32-bit pairs are its elements 0-31 and
 * 32-63 in order (each pair's low half the even element), so they are stored as they are. */
AVX512 static void decode_row_avx512(const uint8_t *body, const uint8_t *head,
                                     const uint8_t *side, const int64_t *side_at, int64_t k,
                                     int64_t r, uint16_t *row) {
    const int64_t blocks = k / CODE_BLOCK;
    const uint8_t *raw = side + side_at[r];
    for (int64_t b = 0; b < blocks; ++b) {
        const int base = head[r * blocks + b];
        __m512i first, second;
        decode_block(body + (r * blocks + b) * CODE_BYTES, base, raw, &first, &second);
        raw += base == RAW ? CODE_BLOCK : 0;
        _mm512_storeu_si512(row + b * CODE_BLOCK, first);
        _mm512_storeu_si512(row + b * CODE_BLOCK + 32, second);
    }
}
#endif

/* Rows ids[0..n) of the weight [*, k] that body/head/side stand for, exactly, as bf16 into
 * out [n, k]: an input embedding's lookup, the LM head screen's candidate rows. */
void dasc_coded_rows(const uint8_t *body, const uint8_t *head, const uint8_t *side,
                     const int64_t *side_at, int64_t k, const int64_t *ids, int64_t n,
                     uint16_t *out, int64_t simd) {
#ifdef HAVE_X86
    if (simd_ok(k, simd)) {
#pragma omp parallel for schedule(static) if (n >= 64)
        for (int64_t i = 0; i < n; ++i)
            decode_row_avx512(body, head, side, side_at, k, ids[i], out + i * k);
        return;
    }
#endif
#pragma omp parallel for schedule(static) if (n >= 64)
    for (int64_t i = 0; i < n; ++i)
        decode_row(body, head, side, side_at, k, ids[i], out + i * k);
}
