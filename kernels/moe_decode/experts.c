#include "../cpu_simd.h"

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

/* One expert over m of the tokens: token tok[i] with weight load_elem(wsrc, wat[i]) (1 when
 * wsrc is NULL); w13 [H, 2I], w2 [I, H].  buf: FP32 scratch of m * (2H + 3I). */
static void expert_pass(const void *x, const int64_t *tok, const void *wsrc, const int64_t *wat,
                        int64_t m, int64_t H, int64_t I, const void *w13, const void *w2, int b,
                        int fast, float *buf, void *out) {
    const int64_t G = 2 * I;
    float *xin = buf, *gu = xin + m * H, *act = gu + m * G, *hs = act + m * I;
    for (int64_t i = 0; i < m; ++i)
        for (int64_t h = 0; h < H; ++h)
            xin[i * H + h] = load_elem(x, tok[i] * H + h, b);
    expert_rows(xin, m, H, G, w13, b, fast, gu);
    for (int64_t i = 0; i < m; ++i)
        for (int64_t c = 0; c < I; ++c) {
            const float g = round_to(gu[i * G + c], b), u = round_to(gu[i * G + I + c], b);
            act[i * I + c] = round_to(round_to(silu1(g), b) * u, b);
        }
    expert_rows(act, m, I, H, w2, b, fast, hs);
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
 * SparseMoE.forward adds them.  out [T, H] starts at zero.  Returns 0, or -1 when the scratch
 * could not be allocated (nothing written). */
int dasc_moe_decode(const void *x, int64_t T, int64_t H, int64_t I, const int64_t *ids,
                    const void *weights, int64_t k, const void *w13, const void *w2,
                    const void *shared13, const void *shared2, int64_t Is,
                    const void *shared_weights, int64_t bf16, void *out, int64_t simd) {
    const int b = (int)bf16;
    const int64_t elem = bf16 ? 2 : 4, widest = Is > I ? Is : I;
#ifdef HAVE_X86
    const int fast = simd_ok(H, simd) && simd_ok(I, simd) && (!shared13 || simd_ok(Is, simd));
#else
    const int fast = 0;
    (void)simd;
#endif
    float *buf = malloc(sizeof(float) * (size_t)(T * (2 * H + 3 * widest)));
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
        expert_pass(x, tok, weights, at, m, H, I, (const char *)w13 + e * H * 2 * I * elem,
                    (const char *)w2 + e * I * H * elem, b, fast, buf, out);
    }
    if (shared13) {
        for (int64_t t = 0; t < T; ++t)
            tok[t] = at[t] = t;
        expert_pass(x, tok, shared_weights, at, T, H, Is, shared13, shared2, b, fast, buf, out);
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
