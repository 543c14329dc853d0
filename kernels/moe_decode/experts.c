#include "../cpu_coded.h"

#include <omp.h>

/* The experts of a few tokens (decode), each used expert's weights streamed once, in order,
 * from their input-major storage: w13 [E, H, 2I] ([gate | up] columns), w2 [E, I, H].  Token
 * t's pair (e, weight), pairs in ascending e (layers/mlp.py's `_routed_experts`), then the
 * shared expert with its gate's weight:
 *
 *     gu = round(x_t W13[e]);  act = round(round(silu(gu[:I])) * gu[I:])
 *     out_t = round(out_t + round(round(act W2[e]) * weight))
 *
 * Each product accumulates its input rows in order, one fma per row and output (the AVX-512
 * and portable forms give the same bits); oneDNN's GEMMs sum in another order. */
static void expert_rows_portable(const float *in, int64_t m, int64_t rows, int64_t cols,
                                 const void *w, int bf16, float *acc) {
    for (int64_t a = 0; a < m * cols; ++a)
        acc[a] = 0.0f;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < m; ++i)
            for (int64_t c = 0; c < cols; ++c)
                acc[i * cols + c] = fmaf(in[i * rows + r], load_elem(w, r * cols + c, bf16),
                                         acc[i * cols + c]);
}

#ifdef HAVE_X86
/* Columns [c0, c1) of acc [m, cols] = in [m, rows] @ w [rows, cols]: w read once, four rows
 * at a time (one load and store of each sum per four rows; the fmas still run row by row, in
 * order). */
AVX512 static void expert_cols_avx512(const float *in, int64_t m, int64_t rows, int64_t cols,
                                      int64_t c0, int64_t c1, const char *w, int64_t elem,
                                      int bf16, float *acc) {
    for (int64_t i = 0; i < m; ++i)
        for (int64_t c = c0; c < c1; c += 16)
            _mm512_storeu_ps(acc + i * cols + c, _mm512_setzero_ps());
    const int64_t step = cols * elem;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        const char *row = w + r * step;
        for (int64_t c = c0; c < c1; c += 16) {
            if (r + 8 <= rows) /* the next four rows' lines, while these four are summed */
                for (int64_t k = 4; k < 8; ++k)
                    _mm_prefetch(row + k * step + c * elem, _MM_HINT_T0);
            const __m512 w0 = load16(row, c, bf16), w1 = load16(row + step, c, bf16);
            const __m512 w2 = load16(row + 2 * step, c, bf16);
            const __m512 w3 = load16(row + 3 * step, c, bf16);
            for (int64_t i = 0; i < m; ++i) {
                const float *x = in + i * rows + r;
                float *a = acc + i * cols + c;
                __m512 v = _mm512_fmadd_ps(_mm512_set1_ps(x[0]), w0, _mm512_loadu_ps(a));
                v = _mm512_fmadd_ps(_mm512_set1_ps(x[1]), w1, v);
                v = _mm512_fmadd_ps(_mm512_set1_ps(x[2]), w2, v);
                _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(x[3]), w3, v));
            }
        }
    }
    for (; r < rows; ++r) {
        const char *row = w + r * step;
        for (int64_t c = c0; c < c1; c += 16) {
            const __m512 wv = load16(row, c, bf16);
            for (int64_t i = 0; i < m; ++i) {
                float *a = acc + i * cols + c;
                _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(in[i * rows + r]), wv,
                                                    _mm512_loadu_ps(a)));
            }
        }
    }
}
#endif

/* expert_rows_portable over rows [row0, row0 + rows) of a coded matrix, each decoded first
 * into row (scratch of cols bf16 values). */
static void coded_rows_portable(const float *in, int64_t m, int64_t rows, int64_t cols,
                                const Coded *w, int64_t row0, uint16_t *row, float *acc) {
    for (int64_t a = 0; a < m * cols; ++a)
        acc[a] = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
        decode_row(w->body, w->head, w->side, w->side_at, cols, row0 + r, row);
        for (int64_t i = 0; i < m; ++i)
            for (int64_t c = 0; c < cols; ++c)
                acc[i * cols + c] = fmaf(in[i * rows + r], bf16_value(row[c]), acc[i * cols + c]);
    }
}

#ifdef HAVE_X86
/* expert_cols_avx512 over a coded w: columns [c0, c1) (multiples of 64) of rows
 * [row0, row0 + rows), a block of 64 columns at a time.  A block decodes into its even and odd
 * columns, so the sums run in that order in perm (scratch [m, cols]) and are put back in
 * column order at the end; each still adds the rows in order, one fma a row. */
AVX512 static void coded_cols_avx512(const float *in, int64_t m, int64_t rows, int64_t cols,
                                     int64_t c0, int64_t c1, const Coded *w, int64_t row0,
                                     float *perm, float *acc) {
    const __m512i odd = _mm512_set1_epi32((int)0xffff0000u);
    const int64_t blocks = cols / CODE_BLOCK, b0 = c0 / CODE_BLOCK, b1 = c1 / CODE_BLOCK;
    const int64_t row_bytes = blocks * CODE_BYTES;
    for (int64_t i = 0; i < m; ++i)
        for (int64_t c = c0; c < c1; c += 16)
            _mm512_storeu_ps(perm + i * cols + c, _mm512_setzero_ps());
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = row0 + r;
        const uint8_t *head = w->head + at * blocks, *raw = w->side + w->side_at[at];
        for (int64_t b = 0; b < b0; ++b) /* the side run of the blocks before this part's */
            raw += head[b] == RAW ? CODE_BLOCK : 0;
        for (int64_t b = b0; b < b1; ++b) {
            const uint8_t *block = w->body + at * row_bytes + b * CODE_BYTES;
            if (r + 2 < rows) { /* two rows ahead (a prefetch never faults) */
                _mm_prefetch((const char *)(block + 2 * row_bytes), _MM_HINT_T0);
                _mm_prefetch((const char *)(block + 2 * row_bytes + 64), _MM_HINT_T0);
            }
            __m512i pairs[2];
            decode_block(block, head[b], raw, &pairs[0], &pairs[1]);
            raw += head[b] == RAW ? CODE_BLOCK : 0;
            const __m512 v[4] = {_mm512_castsi512_ps(_mm512_slli_epi32(pairs[0], 16)),
                                 _mm512_castsi512_ps(_mm512_and_si512(pairs[0], odd)),
                                 _mm512_castsi512_ps(_mm512_slli_epi32(pairs[1], 16)),
                                 _mm512_castsi512_ps(_mm512_and_si512(pairs[1], odd))};
            for (int64_t i = 0; i < m; ++i) {
                const __m512 x = _mm512_set1_ps(in[i * rows + r]);
                float *p = perm + i * cols + b * CODE_BLOCK;
                for (int64_t j = 0; j < 4; ++j)
                    _mm512_storeu_ps(p + 16 * j,
                                     _mm512_fmadd_ps(x, v[j], _mm512_loadu_ps(p + 16 * j)));
            }
        }
    }
    /* perm's block: even columns 0-30, odd 1-31, even 32-62, odd 33-63 */
    for (int64_t i = 0; i < m; ++i)
        for (int64_t c = c0; c < c1; c += CODE_BLOCK)
            for (int64_t j = 0; j < CODE_BLOCK; ++j) {
                const int64_t from = j / 32 * 32 + (j % 2) * 16 + j % 32 / 2;
                acc[i * cols + c + j] = perm[i * cols + c + from];
            }
}
#endif

/* acc = in @ w in the form ``fast`` says (both give the same bits).  The AVX-512 form splits
 * the columns among the OpenMP threads in runs of 16: each reads its part of every row, and
 * each sum still adds the rows in order. */
static void expert_rows(const float *in, int64_t m, int64_t rows, int64_t cols, const void *w,
                        int bf16, int fast, float *acc) {
#ifdef HAVE_X86
    if (fast) {
        const int64_t elem = bf16 ? 2 : 4, runs = cols / 16;
#pragma omp parallel if (rows * cols >= PARALLEL_MIN)
        {
            const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
            const int64_t c0 = runs * part / parts * 16, c1 = runs * (part + 1) / parts * 16;
            if (c1 > c0)
                expert_cols_avx512(in, m, rows, cols, c0, c1, (const char *)w, elem, bf16, acc);
        }
        return;
    }
#endif
    (void)fast;
    expert_rows_portable(in, m, rows, cols, w, bf16, acc);
}

/* expert_rows over rows [row0, row0 + rows) of a coded bf16 matrix (cols % 64 == 0): the same
 * bits.  The AVX-512 form splits the columns among the threads in blocks of 64.  perm: FP32
 * scratch of m * cols. */
static void coded_rows(const float *in, int64_t m, int64_t rows, int64_t cols, const Coded *w,
                       int64_t row0, int fast, float *perm, float *acc) {
#ifdef HAVE_X86
    if (fast) {
        const int64_t blocks = cols / CODE_BLOCK;
#pragma omp parallel if (rows * cols >= PARALLEL_MIN)
        {
            const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
            const int64_t c0 = blocks * part / parts * CODE_BLOCK;
            const int64_t c1 = blocks * (part + 1) / parts * CODE_BLOCK;
            if (c1 > c0)
                coded_cols_avx512(in, m, rows, cols, c0, c1, w, row0, perm, acc);
        }
        return;
    }
#endif
    (void)fast;
    coded_rows_portable(in, m, rows, cols, w, row0, (uint16_t *)perm, acc);
}

/* acc = in @ (expert e's rows of w, or of its coded form code where that is not NULL). */
static void product(const float *in, int64_t m, int64_t rows, int64_t cols, const void *w,
                    const Coded *code, int64_t e, int bf16, int fast, float *perm, float *acc) {
    if (code)
        coded_rows(in, m, rows, cols, code, e * rows, fast, perm, acc);
    else
        expert_rows(in, m, rows, cols, (const char *)w + e * rows * cols * (bf16 ? 2 : 4), bf16,
                    fast, acc);
}

/* Expert e over m of the tokens: token tok[i] with weight load_elem(wsrc, wat[i]) (1 when
 * wsrc is NULL); w13 [E, H, 2I], w2 [E, I, H], or their coded forms c13, c2 where not NULL.
 * buf: FP32 scratch of m * (3H + 5I). */
static void expert_pass(const void *x, const int64_t *tok, const void *wsrc, const int64_t *wat,
                        int64_t m, int64_t H, int64_t I, const void *w13, const void *w2,
                        const Coded *c13, const Coded *c2, int64_t e, int b, int fast, float *buf,
                        void *out) {
    const int64_t G = 2 * I;
    float *xin = buf, *gu = xin + m * H, *act = gu + m * G, *hs = act + m * I;
    float *perm = hs + m * H; /* m * max(2I, H) */
    for (int64_t i = 0; i < m; ++i)
        for (int64_t h = 0; h < H; ++h)
            xin[i * H + h] = load_elem(x, tok[i] * H + h, b);
    product(xin, m, H, G, w13, c13, e, b, fast, perm, gu);
    for (int64_t i = 0; i < m; ++i)
        for (int64_t c = 0; c < I; ++c) {
            const float g = round_to(gu[i * G + c], b), u = round_to(gu[i * G + I + c], b);
            act[i * I + c] = round_to(round_to(silu1(g), b) * u, b);
        }
    product(act, m, I, H, w2, c2, e, b, fast, perm, hs);
    for (int64_t i = 0; i < m; ++i) {
        const float wgt = wsrc ? load_elem(wsrc, wat[i], b) : 1.0f;
        for (int64_t h = 0; h < H; ++h) {
            const float y = round_to(round_to(hs[i * H + h], b) * wgt, b);
            store_elem(out, tok[i] * H + h, load_elem(out, tok[i] * H + h, b) + y, b);
        }
    }
}

/* x [T, H]; ids, weights [T, k]; w13 [E, H, 2I], w2 [E, I, H]; then, where shared13 is not
 * NULL, the shared expert (shared13 [H, 2Is], shared2 [Is, H]) over every token with weight
 * shared_weights[t] (1 where NULL), added last: out = round(routed + shared), as
 * SparseMoE.forward adds them.  codes: NULL, or the coded forms of (w13 as [E H, 2I], w2 as
 * [E I, H], shared13, shared2), read instead of each whose body is not NULL (bf16; H, 2I, 2Is
 * multiples of 64): the same bits.  out [T, H] starts at zero.  Returns 0, or -1 when the
 * scratch could not be allocated (nothing written). */
int dasc_moe_decode(const void *x, int64_t T, int64_t H, int64_t I, const int64_t *ids,
                    const void *weights, int64_t k, const void *w13, const void *w2,
                    const void *shared13, const void *shared2, int64_t Is,
                    const void *shared_weights, int64_t bf16, void *out, int64_t simd,
                    const Coded *codes) {
    const int b = (int)bf16;
    const int64_t widest = Is > I ? Is : I;
    const Coded *code[4];
    for (int j = 0; j < 4; ++j)
        code[j] = codes && codes[j].body ? &codes[j] : NULL;
#ifdef HAVE_X86
    const int fast = simd_ok(H, simd) && simd_ok(I, simd) && (!shared13 || simd_ok(Is, simd));
#else
    const int fast = 0;
    (void)simd;
#endif
    float *buf = malloc(sizeof(float) * (size_t)(T * (3 * H + 5 * widest)));
    int64_t *tok = malloc(sizeof(int64_t) * (size_t)(2 * T + 1));
    if (!buf || !tok) {
        free(buf);
        free(tok);
        return -1;
    }
    int64_t *at = tok + T, last = -1;
    for (;;) { /* the next expert above `last` that a token routes to */
        int64_t e = -1;
        for (int64_t a = 0; a < T * k; ++a)
            if (ids[a] > last && (e < 0 || ids[a] < e))
                e = ids[a];
        if (e < 0)
            break;
        last = e;
        int64_t m = 0;
        for (int64_t a = 0; a < T * k; ++a)
            if (ids[a] == e) {
                tok[m] = a / k;
                at[m++] = a;
            }
        expert_pass(x, tok, weights, at, m, H, I, w13, w2, code[0], code[1], e, b, fast, buf,
                    out);
    }
    if (shared13) {
        for (int64_t t = 0; t < T; ++t)
            tok[t] = at[t] = t;
        expert_pass(x, tok, shared_weights, at, T, H, Is, shared13, shared2, code[2], code[3], 0,
                    b, fast, buf, out);
    }
    free(buf);
    free(tok);
    return 0;
}

/* 1 where the AVX-512 forms run on this CPU; the portable forms (a scalar exponential) are
 * references, slower than torch's GEMMs. */
int dasc_moe_simd(void) {
#ifdef HAVE_X86
    return simd_ok(16, 1);
#else
    return 0;
#endif
}
