/* CPU prefill of the gated delta rule with one log-decay per head (GDN), chunk by chunk, each
 * (sequence, head) state advanced in place in its slot.
 *
 * Per chunk of L <= C tokens with the state S [K, V] entering it (FP32, row-major), per-token
 * decay a_t = exp(g_t), and within the chunk the decay products
 *
 *     D[i][j] = a_{j+1} ... a_i  (j <= i),   E_i = a_0 ... a_i   (chained products),
 *
 * the WY form of kernels/delta_rule/naive.py's ``chunk_delta_rule`` is evaluated without
 * forming the triangular inverse:
 *
 *     P = K S, Q = Q_rows S                           (the entering state read once per chunk)
 *     rhs_i = (v_i - E_i P_i) beta_i
 *     n_i = rhs_i - sum_{j<i} beta_i D[i][j] (k_i . k_j) n_j      (forward substitution)
 *     o_i = scale E_i Q_i + sum_{j<=i} scale D[i][j] (q_i . k_j) n_j
 *     S <- S E_{L-1} + sum_i (D[L-1][i] k_i)^T n_i
 *
 * n is the chunk's v_new (u - w S in the torch form).  Every sum is one fused multiply-add
 * chain in index order, the same in the AVX-512 and the portable forms, so the two give the
 * same bits (tests/kernels/test_cpu_chunk_native.py); against the torch form (explicit inverse, decay
 * products as exp of cumulative-sum differences) they differ in rounding only.  A chunk's
 * operands stay in cache; the state is read twice and written once per chunk.
 *
 * With amx (a bf16 model on a CPU with AMX: run_head_amx), the chunk's products run on AMX tiles
 * from bf16 operands with FP32 accumulation, as fla's GPU kernels read them: k_i . k_j and
 * q_i . k_j from the bf16-rounded k and q rows, K S and Q S from them and the bf16-rounded state
 * entering the chunk, the outputs' intra-chunk sum as bf16(W) bf16(n) with
 * W[i][j] = scale D[i][j] (q_i . k_j), and the state update as bf16(K)^T bf16(D[L-1] n).  The
 * decays, the right-hand sides, the forward substitution and the state are FP32 as above.
 *
 * Work is split over (sequence, head) pairs, in parallel where built with OpenMP.
 */
#define _GNU_SOURCE /* syscall */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#include "../cpu_amx.h"
#endif

/* out[M, N] = (accumulate ? out * alpha : 0) + A[M, Kd] B[Kd, N]; rows of A, B and out at
 * strides lda, ldb, ldo; each element one fma chain over k in order. */
static void gemm_portable(int64_t M, int64_t N, int64_t Kd, const float *A, int64_t lda,
                          const float *B, int64_t ldb, float *out, int64_t ldo, int accumulate,
                          float alpha) {
    for (int64_t i = 0; i < M; ++i) {
        float *row = out + i * ldo;
        for (int64_t j = 0; j < N; ++j)
            row[j] = accumulate ? row[j] * alpha : 0.0f;
        for (int64_t k = 0; k < Kd; ++k) {
            const float a = A[i * lda + k], *b = B + k * ldb;
            for (int64_t j = 0; j < N; ++j)
                row[j] = fmaf(a, b[j], row[j]);
        }
    }
}

/* y[0..n) = fma chain over j < m of coef[j] * X[j][0..n) (rows of X at stride ldx), from y. */
static void combine_portable(int64_t n, int64_t m, const float *coef, const float *X,
                             int64_t ldx, float *y) {
    for (int64_t j = 0; j < m; ++j)
        for (int64_t c = 0; c < n; ++c)
            y[c] = fmaf(coef[j], X[j * ldx + c], y[c]);
}

#ifdef HAVE_X86
/* ROWS rows x NV 16-float columns of out, accumulators in registers. */
#define GEMM_BLOCK(ROWS, NV)                                                                  \
    do {                                                                                      \
        __m512 acc[ROWS][NV];                                                                 \
        for (int r = 0; r < ROWS; ++r)                                                        \
            for (int t = 0; t < NV; ++t)                                                      \
                acc[r][t] = accumulate ? _mm512_mul_ps(_mm512_loadu_ps(o + r * ldo + 16 * t), \
                                                       va)                                    \
                                       : _mm512_setzero_ps();                                 \
        for (int64_t k = 0; k < Kd; ++k) {                                                    \
            __m512 b[NV];                                                                     \
            for (int t = 0; t < NV; ++t)                                                      \
                b[t] = _mm512_loadu_ps(B + k * ldb + j0 + 16 * t);                            \
            for (int r = 0; r < ROWS; ++r) {                                                  \
                const __m512 a = _mm512_set1_ps(A[(i + r) * lda + k]);                        \
                for (int t = 0; t < NV; ++t)                                                  \
                    acc[r][t] = _mm512_fmadd_ps(a, b[t], acc[r][t]);                          \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < ROWS; ++r)                                                        \
            for (int t = 0; t < NV; ++t)                                                      \
                _mm512_storeu_ps(o + r * ldo + 16 * t, acc[r][t]);                            \
    } while (0)

/* gemm_portable's result for N % 16 == 0.  One 16-float column (the chunk's k_i . k_j and
 * q_i . k_j) goes eight rows at a time, eight fma chains where four waited on each other's
 * latency: 3-6 % of the kernel at Qwen3.5's GDN shape (folded into the switch below instead,
 * gcc's code for the 4 x 4 block got 17 % slower). */
__attribute__((target("avx512f,fma")))
static void gemm_avx512(int64_t M, int64_t N, int64_t Kd, const float *A, int64_t lda,
                        const float *B, int64_t ldb, float *out, int64_t ldo, int accumulate,
                        float alpha) {
    const __m512 va = _mm512_set1_ps(alpha);
    if (N == 16) {
        const int64_t j0 = 0;
        int64_t i = 0;
        for (float *o = out; i + 8 <= M; i += 8, o += 8 * ldo)
            GEMM_BLOCK(8, 1);
        for (float *o = out + i * ldo; i < M; ++i, o += ldo)
            GEMM_BLOCK(1, 1);
        return;
    }
    for (int64_t j0 = 0; j0 < N; j0 += 64) {
        const int64_t nv = N - j0 >= 64 ? 4 : (N - j0) / 16;
        for (int64_t i = 0; i < M;) {
            float *o = out + i * ldo + j0;
            const int four = M - i >= 4;
            switch (nv * 2 + four) {
            case 9: GEMM_BLOCK(4, 4); break;
            case 8: GEMM_BLOCK(1, 4); break;
            case 7: GEMM_BLOCK(4, 3); break;
            case 6: GEMM_BLOCK(1, 3); break;
            case 5: GEMM_BLOCK(4, 2); break;
            case 4: GEMM_BLOCK(1, 2); break;
            case 3: GEMM_BLOCK(4, 1); break;
            default: GEMM_BLOCK(1, 1); break;
            }
            i += four ? 4 : 1;
        }
    }
}

/* combine_portable's result for n % 16 == 0, y held in registers 128 floats at a time: each
 * element is one fma chain over j, so the eight chains of a block keep both FMA units busy
 * where four left them waiting on each other's latency. */
#define COMBINE_BLOCK(NV)                                                                     \
    do {                                                                                      \
        __m512 acc[NV];                                                                       \
        for (int t = 0; t < NV; ++t)                                                          \
            acc[t] = _mm512_loadu_ps(y + c0 + 16 * t);                                        \
        for (int64_t j = 0; j < m; ++j) {                                                     \
            const __m512 a = _mm512_set1_ps(coef[j]);                                         \
            for (int t = 0; t < NV; ++t)                                                      \
                acc[t] = _mm512_fmadd_ps(a, _mm512_loadu_ps(X + j * ldx + c0 + 16 * t), acc[t]); \
        }                                                                                     \
        for (int t = 0; t < NV; ++t)                                                          \
            _mm512_storeu_ps(y + c0 + 16 * t, acc[t]);                                        \
    } while (0)

__attribute__((target("avx512f,fma")))
static void combine_avx512(int64_t n, int64_t m, const float *coef, const float *X,
                           int64_t ldx, float *y) {
    int64_t c0 = 0;
    for (; c0 + 128 <= n; c0 += 128)
        COMBINE_BLOCK(8);
    for (; c0 + 64 <= n; c0 += 64)
        COMBINE_BLOCK(4);
    for (; c0 < n; c0 += 16)
        COMBINE_BLOCK(1);
}

/* The chunk's elementwise passes (kernels below), 16 lanes at a time, each lane the scalar
 * form's operations in its order (no fused multiply-adds), so both give the same bits. */
#define LANES(n, j) (__mmask16)((n) - (j) >= 16 ? 0xffff : (1u << ((n) - (j))) - 1)

/* dst[r * ldd + i] = src[i * lds + r], i < rows, r < cols: a transpose by 16-row gathers. */
__attribute__((target("avx512f")))
static void transpose_avx512(const float *src, int64_t lds, int64_t rows, int64_t cols,
                             float *dst, int64_t ldd) {
    const __m512i step = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                             6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32((int)lds));
    for (int64_t i = 0; i < rows; i += 16) {
        const __mmask16 keep = LANES(rows, i);
        for (int64_t r = 0; r < cols; ++r)
            _mm512_mask_storeu_ps(dst + r * ldd + i, keep,
                                  _mm512_mask_i32gather_ps(_mm512_setzero_ps(), keep, step,
                                                           src + i * lds + r, 4));
    }
}

/* y[j] = x[j] * f, j < n. */
__attribute__((target("avx512f")))
static void scale_avx512(const float *x, float f, int64_t n, float *y) {
    const __m512 fv = _mm512_set1_ps(f);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 keep = LANES(n, j);
        _mm512_mask_storeu_ps(y + j, keep, _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, x + j), fv));
    }
}

/* y[j] = (f * a[j]) * b[j], j < n, negated where neg. */
__attribute__((target("avx512f")))
static void scale2_avx512(float f, const float *a, const float *b, int64_t n, int neg,
                          float *y) {
    const __m512 fv = _mm512_set1_ps(f);
    const __m512i sign = _mm512_set1_epi32(neg ? (int)0x80000000u : 0);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 keep = LANES(n, j);
        const __m512 p = _mm512_mul_ps(_mm512_mul_ps(fv, _mm512_maskz_loadu_ps(keep, a + j)),
                                       _mm512_maskz_loadu_ps(keep, b + j));
        _mm512_mask_storeu_ps(y + j, keep,
                              _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(p), sign)));
    }
}

/* y[c] = (v[c] - p[c] * e) * b, c < n. */
__attribute__((target("avx512f")))
static void rhs_avx512(const float *v, const float *p, float e, float b, int64_t n, float *y) {
    const __m512 ev = _mm512_set1_ps(e), bv = _mm512_set1_ps(b);
    for (int64_t c = 0; c < n; c += 16) {
        const __mmask16 keep = LANES(n, c);
        const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(keep, v + c),
                                       _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, p + c), ev));
        _mm512_mask_storeu_ps(y + c, keep, _mm512_mul_ps(d, bv));
    }
}

/* AMX: 8 tile registers of 16 rows x 64 bytes; a bf16 product adds, per FP32 element of a
 * 16 x 16 tile, the pairs of a 16 x 32 bf16 tile's row and a 16 x 16-pair tile's column. */
/* out[M, N] = (accumulate ? out : 0) + A[M, Kd] B[Kd, N], M, N and Kd multiples of 32: A bf16
 * rows lda apart; B in pairs, Bp[k / 2][n] = B[k][n] | B[k + 1][n] << 16 (rows ldb apart); out
 * FP32 rows ldo apart.  A 32 x 32 block of out in four tiles. */
__attribute__((target("amx-tile,amx-bf16")))
static void gemm_amx(int64_t M, int64_t N, int64_t Kd, const uint16_t *A, int64_t lda,
                     const uint32_t *Bp, int64_t ldb, float *out, int64_t ldo, int accumulate) {
    const int64_t so = ldo * 4, sa = lda * 2, sb = ldb * 4;
    for (int64_t i = 0; i < M; i += 32)
        for (int64_t j = 0; j < N; j += 32) {
            float *o = out + i * ldo + j;
            if (accumulate) {
                _tile_loadd(0, o, so);
                _tile_loadd(1, o + 16, so);
                _tile_loadd(2, o + 16 * ldo, so);
                _tile_loadd(3, o + 16 * ldo + 16, so);
            } else {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int64_t k = 0; k < Kd; k += 32) {
                _tile_loadd(4, A + i * lda + k, sa);
                _tile_loadd(5, A + (i + 16) * lda + k, sa);
                _tile_loadd(6, Bp + k / 2 * ldb + j, sb);
                _tile_loadd(7, Bp + k / 2 * ldb + j + 16, sb);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, o, so);
            _tile_stored(1, o + 16, so);
            _tile_stored(2, o + 16 * ldo, so);
            _tile_stored(3, o + 16 * ldo + 16, so);
        }
}

/* dst[c] = bf16(src[c]) (round to nearest even) for c < n, 0 for n <= c < np (np % 16 == 0). */
__attribute__((target("avx512f,avx512bf16")))
static void to_bf16(const float *src, int64_t n, int64_t np, uint16_t *dst) {
    for (int64_t c = 0; c < np; c += 16) {
        const __mmask16 keep = c < n ? LANES(n, c) : 0;
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, src + c));
        _mm256_storeu_si256((__m256i *)(dst + c), (__m256i)h);
    }
}

/* dst[c] = bf16(a[c] fa) | bf16(b[c] fb) << 16, c < n (n % 16 == 0); b NULL: the high halves
 * 0. */
__attribute__((target("avx512f,avx512bf16")))
static void pair_bf16(const float *a, float fa, const float *b, float fb, int64_t n,
                      uint32_t *dst) {
    const __m512 va = _mm512_set1_ps(fa), vb = _mm512_set1_ps(fb);
    for (int64_t c = 0; c < n; c += 16) {
        const __m256bh lo = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(a + c), va));
        __m512i w = _mm512_cvtepu16_epi32((__m256i)lo);
        if (b) {
            const __m256bh hi = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(b + c), vb));
            w = _mm512_or_si512(w, _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)hi), 16));
        }
        _mm512_storeu_si512(dst + c, w);
    }
}

/* Rows [0, rows) of X [*, n] (ldx apart), row r times f[r] (f NULL: 1), in pairs:
 * Xp[r / 2] = X[r] | X[r + 1] << 16, rows past ``rows`` zero, up to rows_p (even). */
static void pairs_bf16(const float *X, int64_t ldx, int64_t rows, int64_t rows_p, int64_t n,
                       const float *f, uint32_t *Xp) {
    for (int64_t r = 0; r < rows_p; r += 2) {
        uint32_t *dst = Xp + r / 2 * n;
        if (r >= rows)
            memset(dst, 0, (size_t)n * sizeof(uint32_t));
        else
            pair_bf16(X + r * ldx, f ? f[r] : 1.0f, r + 1 < rows ? X + (r + 1) * ldx : NULL,
                      f && r + 1 < rows ? f[r + 1] : 1.0f, n, dst);
    }
}

/* y[c] = x[c] f + t[c], c < n (n % 16 == 0); y streamed past the caches where 64-byte aligned
 * (a step's o, larger than the caches, is written without first being read). */
__attribute__((target("avx512f")))
static void scale_add(const float *x, float f, const float *t, int64_t n, float *y) {
    const __m512 fv = _mm512_set1_ps(f);
    const int stream = ((uintptr_t)y & 63) == 0;
    for (int64_t c = 0; c < n; c += 16) {
        const __m512 r = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(x + c), fv),
                                       _mm512_loadu_ps(t + c));
        if (stream)
            _mm512_stream_ps(y + c, r);
        else
            _mm512_storeu_ps(y + c, r);
    }
}
#endif

typedef struct {
    int simd, amx;
} Ops;

static void gemm(const Ops *ops, int64_t M, int64_t N, int64_t Kd, const float *A, int64_t lda,
                 const float *B, int64_t ldb, float *out, int64_t ldo, int accumulate,
                 float alpha) {
#ifdef HAVE_X86
    if (ops->simd && N % 16 == 0) {
        gemm_avx512(M, N, Kd, A, lda, B, ldb, out, ldo, accumulate, alpha);
        return;
    }
#endif
    gemm_portable(M, N, Kd, A, lda, B, ldb, out, ldo, accumulate, alpha);
}

static void combine(const Ops *ops, int64_t n, int64_t m, const float *coef, const float *X,
                    int64_t ldx, float *y) {
#ifdef HAVE_X86
    if (ops->simd && n % 16 == 0) {
        combine_avx512(n, m, coef, X, ldx, y);
        return;
    }
#endif
    combine_portable(n, m, coef, X, ldx, y);
}

static void transpose(const Ops *ops, const float *src, int64_t lds, int64_t rows,
                      int64_t cols, float *dst, int64_t ldd) {
#ifdef HAVE_X86
    if (ops->simd) {
        transpose_avx512(src, lds, rows, cols, dst, ldd);
        return;
    }
#endif
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t r = 0; r < cols; ++r)
            dst[r * ldd + i] = src[i * lds + r];
}

static void scale(const Ops *ops, const float *x, float f, int64_t n, float *y) {
#ifdef HAVE_X86
    if (ops->simd) {
        scale_avx512(x, f, n, y);
        return;
    }
#endif
    for (int64_t j = 0; j < n; ++j)
        y[j] = x[j] * f;
}

static void scale2(const Ops *ops, float f, const float *a, const float *b, int64_t n, int neg,
                   float *y) {
#ifdef HAVE_X86
    if (ops->simd) {
        scale2_avx512(f, a, b, n, neg, y);
        return;
    }
#endif
    for (int64_t j = 0; j < n; ++j)
        y[j] = neg ? -(f * a[j] * b[j]) : f * a[j] * b[j];
}

static void rhs(const Ops *ops, const float *v, const float *p, float e, float b, int64_t n,
                float *y) {
#ifdef HAVE_X86
    if (ops->simd) {
        rhs_avx512(v, p, e, b, n, y);
        return;
    }
#endif
    for (int64_t c = 0; c < n; ++c)
        y[c] = (v[c] - p[c] * e) * b;
}

/* Rows i < L of out (ldo apart) add sum over j < i + diag of W[i][j] X_j (W's rows ldw apart,
 * X's V), each element by one fma chain over j in order, a block of TRI rows at a time: the
 * terms every row of the block has are one product (gemm, adding to the rows as they are),
 * the rest go row by row.  diag = 0 with out == X is the forward substitution: X_j is final
 * before a row reads it. */
#define TRI 8
static void triangle(const Ops *ops, int64_t L, const float *W, int64_t ldw, int64_t diag,
                     const float *X, int64_t V, float *out, int64_t ldo) {
    for (int64_t i0 = 0; i0 < L; i0 += TRI) {
        const int64_t rows = L - i0 < TRI ? L - i0 : TRI, shared = i0 + diag;
        if (shared > 0)
            gemm(ops, rows, V, shared, W + i0 * ldw, ldw, X, V, out + i0 * ldo, ldo, 1, 1.0f);
        for (int64_t i = i0 + 1; i < i0 + rows; ++i)
            combine(ops, V, i - i0, W + i * ldw + shared, X + shared * V, V, out + i * ldo);
    }
}

/* A chunk's FP32 middle, given k_i . k_j (kk) and q_i . k_j (qk), rows ld apart, and P = K S:
 * the decays a_i, E_i and D (rows C apart), n by forward substitution, and the outputs'
 * intra-chunk weights wq[i][j] = scale D[i][j] (q_i . k_j), j <= i. */
static void solve_chunk(const Ops *ops, int64_t L, int64_t C, int64_t c0, const float *g,
                        const float *beta, const float *v, int64_t H, int64_t h, int64_t V,
                        float scale_, const float *kk, const float *qk, int64_t ld,
                        const float *P, float *a, float *E, float *D, float *coef, float *wq,
                        float *n) {
    for (int64_t i = 0; i < L; ++i)
        a[i] = expf(g[(c0 + i) * H + h]);
    for (int64_t i = 0; i < L; ++i) {
        E[i] = i ? E[i - 1] * a[i] : a[i];
        if (i)
            scale(ops, D + (i - 1) * C, a[i], i, D + i * C);
        D[i * C + i] = 1.0f;
    }
    for (int64_t i = 0; i < L; ++i) {
        const float b = beta[(c0 + i) * H + h];
        rhs(ops, v + (c0 + i) * H * V, P + i * V, E[i], b, V, n + i * V);
        scale2(ops, b, D + i * C, kk + i * ld, i, 1, coef + i * C);
        scale2(ops, scale_, D + i * C, qk + i * ld, i + 1, 0, wq + i * C);
    }
    triangle(ops, L, coef, C, 0, n, V, n, V);
}

/* Chunk rows padded for the AMX products (a multiple of 32 of bf16 pairs). */
static int64_t amx_rows(int64_t L) {
    return (L + 31) / 32 * 32;
}

/* Scratch floats one worker needs for chunk size C, K, V. */
static int64_t scratch_floats(int64_t C, int64_t K, int64_t V, int amx) {
    const int64_t Cp = (C + 15) / 16 * 16, Cq = amx_rows(C);
    if (amx) /* run_head_amx's buffers */
        return Cq * K + K * Cq + K * V / 2 + 2 * Cq * Cq + 6 * Cq * V + Cq * Cq / 2 +
               3 * C * C + 2 * C;
    return 2 * K * Cp + 2 * C * K + 2 * C * Cp + 3 * C * V + 3 * C * C + 2 * C;
}

/* One (sequence, head): tokens [t0, t1), state S advanced in place, o rows written.  The
 * chunk's k and q rows are copied next to each other first, so that k_i . k_j and q_i . k_j
 * are one product and K S and Q S another. */
static void run_head(const Ops *ops, const float *q, const float *k, int64_t qk_stride,
                     const float *v, const float *g, const float *beta, int64_t H, int64_t h,
                     int64_t K, int64_t V, float scale_, int64_t C, int64_t t0, int64_t t1,
                     float *S, float *o, float *work) {
    const int64_t Cp = (C + 15) / 16 * 16;
    float *kt = work, *kts = kt + K * Cp, *kq = kts + K * Cp, *dots = kq + 2 * C * K;
    float *PQ = dots + 2 * C * Cp, *n = PQ + 2 * C * V;
    float *D = n + C * V, *coef = D + C * C, *wq = coef + C * C, *E = wq + C * C, *a = E + C;
    for (int64_t c0 = t0; c0 < t1; c0 += C) {
        const int64_t L = t1 - c0 < C ? t1 - c0 : C;
        /* kq [2L, K]: the chunk's k rows, then its q rows */
        for (int64_t i = 0; i < L; ++i) {
            memcpy(kq + i * K, k + (c0 + i) * qk_stride, (size_t)K * sizeof(float));
            memcpy(kq + (L + i) * K, q + (c0 + i) * qk_stride, (size_t)K * sizeof(float));
        }
        /* the chunk's keys transposed, zero beyond L: kt [K, Cp] */
        if (L < Cp)
            memset(kt, 0, (size_t)(K * Cp) * sizeof(float));
        transpose(ops, kq, K, L, K, kt, Cp);
        gemm(ops, 2 * L, Cp, K, kq, K, kt, Cp, dots, Cp, 0, 0.0f); /* k_i . k_j, q_i . k_j */
        gemm(ops, 2 * L, V, K, kq, K, S, V, PQ, V, 0, 0.0f);       /* K S, Q S */
        const float *Qs = PQ + L * V;
        solve_chunk(ops, L, C, c0, g, beta, v, H, h, V, scale_, dots, dots + L * Cp, Cp, PQ,
                    a, E, D, coef, wq, n);
        for (int64_t i = 0; i < L; ++i)
            scale(ops, Qs + i * V, scale_ * E[i], V, o + (c0 + i) * H * V);
        triangle(ops, L, wq, C, 1, n, V, o + c0 * H * V, H * V);
        /* S <- S E_{L-1} + (D[L-1][i] k_i)^T n */
        for (int64_t r = 0; r < K; ++r)
            scale2(ops, 1.0f, kt + r * Cp, D + (L - 1) * C, L, 0, kts + r * Cp);
        gemm(ops, K, V, L, kts, Cp, n, V, S, V, 1, E[L - 1]);
    }
}

#ifdef HAVE_X86
/* run_head with the chunk's products on AMX (K, V multiples of 32; tiles configured).  Rows are
 * padded to Lp (a multiple of 32) with zeros.  The outputs' intra-chunk sum is a product too,
 * o = scale E Q S + W n with W[i][j] = scale D[i][j] (q_i . k_j) (j <= i), and the state update
 * takes the decay on n: S <- S E_{L-1} + K^T (D[L-1] n), the keys' transpose then coming from
 * their pairs.  The forward substitution stays FP32. */
__attribute__((target("avx512f,avx512bf16")))
static void run_head_amx(const Ops *ops, const float *q, const float *k, int64_t qk_stride,
                         const float *v, const float *g, const float *beta, int64_t H,
                         int64_t h, int64_t K, int64_t V, float scale_, int64_t C, int64_t t0,
                         int64_t t1, float *S, float *o, float *work) {
    const int64_t Cq = amx_rows(C);
    float *dots = work, *PQ = dots + 2 * Cq * Cq, *n = PQ + 2 * Cq * V, *ow = n + Cq * V;
    float *D = ow + Cq * V, *coef = D + C * C, *wq = coef + C * C, *E = wq + C * C, *a = E + C;
    uint16_t *kqb = (uint16_t *)(a + C), *ktb = kqb + 2 * Cq * K, *wqb = ktb + K * Cq;
    uint32_t *kp = (uint32_t *)(wqb + Cq * Cq), *sp = kp + K / 2 * Cq, *np = sp + K / 2 * V;
    uint32_t *nd = np + Cq / 2 * V;
    for (int64_t c0 = t0; c0 < t1; c0 += C) {
        const int64_t L = t1 - c0 < C ? t1 - c0 : C, Lp = amx_rows(L);
        /* kqb [2 Lp, K]: the chunk's k rows from 0, its q rows from Lp */
        if (L < Lp) {
            memset(kqb + L * K, 0, (size_t)((Lp - L) * K) * sizeof(uint16_t));
            memset(kqb + (Lp + L) * K, 0, (size_t)((Lp - L) * K) * sizeof(uint16_t));
        }
        for (int64_t i = 0; i < L; ++i) {
            to_bf16(k + (c0 + i) * qk_stride, K, K, kqb + i * K);
            to_bf16(q + (c0 + i) * qk_stride, K, K, kqb + (Lp + i) * K);
        }
        /* the keys in pairs of channels: kp[c / 2][j] = k_j[c] | k_j[c + 1] << 16 */
        transpose(ops, (const float *)kqb, K / 2, Lp, K / 2, (float *)kp, Lp);
        gemm_amx(2 * Lp, Lp, K, kqb, K, kp, Lp, dots, Lp, 0); /* k_i . k_j, q_i . k_j */
        pairs_bf16(S, V, K, K, V, NULL, sp);
        gemm_amx(2 * Lp, V, K, kqb, K, sp, V, PQ, V, 0); /* K S, Q S */
        const float *Qs = PQ + Lp * V;
        solve_chunk(ops, L, C, c0, g, beta, v, H, h, V, scale_, dots, dots + Lp * Lp, Lp, PQ,
                    a, E, D, coef, wq, n);
        /* o_i = scale E_i (Q S)_i + (W n)_i */
        for (int64_t i = 0; i < Lp; ++i)
            to_bf16(wq + i * C, i < L ? i + 1 : 0, Lp, wqb + i * Lp);
        pairs_bf16(n, V, L, Lp, V, NULL, np);
        gemm_amx(Lp, V, Lp, wqb, Lp, np, V, ow, V, 0);
        for (int64_t i = 0; i < L; ++i)
            scale_add(Qs + i * V, scale_ * E[i], ow + i * V, V, o + (c0 + i) * H * V);
        /* S <- S E_{L-1} + K^T (D[L-1] n): the keys' transpose ktb [K, Lp] from their pairs */
        for (int64_t c = 0; c < K / 2; ++c)
            for (int64_t j = 0; j < Lp; j += 16) {
                const __m512i w = _mm512_loadu_si512(kp + c * Lp + j);
                _mm256_storeu_si256((__m256i *)(ktb + 2 * c * Lp + j), _mm512_cvtepi32_epi16(w));
                _mm256_storeu_si256((__m256i *)(ktb + (2 * c + 1) * Lp + j),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)));
            }
        pairs_bf16(n, V, L, Lp, V, D + (L - 1) * C, nd);
        scale(ops, S, E[L - 1], K * V, S);
        gemm_amx(K, V, Lp, ktb, Lp, nd, V, S, V, 1);
    }
    _mm_sfence(); /* the streamed o rows before anyone reads them */
}
#endif

/* Sequences b < B with tokens [cu[b], cu[b + 1]) of q, k [N, Hk, K], v [N, H, V], g, beta
 * [N, H] (FP32, contiguous); head h of sequence b reads and updates the state
 * pool + slots[b] * slot_stride + h * K * V ([K, V] FP32) and writes o [N, H, V].  H is a
 * multiple of Hk (value head h reads key head h / (H / Hk)).  simd = 0 forces the portable
 * loops (tests); amx = 1 takes the AMX products where the CPU has them and K, V are
 * multiples of 32 (dasc_gdn_chunk_amx); threads: OpenMP workers where built with it.  Returns
 * 0, or -1 when its scratch could not be allocated (then nothing is written). */
int dasc_gdn_chunk(const float *q, const float *k, const float *v, const float *g,
                   const float *beta, float *pool, int64_t slot_stride, const int64_t *slots,
                   const int64_t *cu, int64_t B, int64_t Hk, int64_t H, int64_t K, int64_t V,
                   float scale, int64_t C, float *o, int64_t threads, int64_t simd,
                   int64_t amx) {
    Ops ops = {0, 0};
#ifdef HAVE_X86
    ops.simd = simd && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
    ops.amx = ops.simd && amx && K % 32 == 0 && V % 32 == 0 && amx_usable();
#else
    (void)simd;
    (void)amx;
#endif
    const int64_t ratio = H / Hk, workers = threads > 0 ? threads : 1;
    const int64_t per_worker = scratch_floats(C, K, V, ops.amx);
    float *scratch = malloc((size_t)(workers * per_worker) * sizeof(float));
    if (!scratch)
        return -1;
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)workers) schedule(dynamic)
#endif
    for (int64_t item = 0; item < B * H; ++item) {
#ifdef _OPENMP
        float *work = scratch + omp_get_thread_num() * per_worker;
#else
        float *work = scratch;
#endif
        const int64_t b = item / H, h = item % H, hk = h / ratio;
        float *S = pool + slots[b] * slot_stride + h * K * V;
#ifdef HAVE_X86
        if (ops.amx) {
            amx_configure();
            run_head_amx(&ops, q + hk * K, k + hk * K, Hk * K, v + h * V, g, beta, H, h, K, V,
                         scale, C, cu[b], cu[b + 1], S, o + h * V, work);
            amx_release();
            continue;
        }
#endif
        run_head(&ops, q + hk * K, k + hk * K, Hk * K, v + h * V, g, beta, H, h, K, V, scale, C,
                 cu[b], cu[b + 1], S, o + h * V, work);
    }
    free(scratch);
    return 0;
}

/* 1 where dasc_gdn_chunk's AVX-512 form runs on this CPU; its portable form is a reference
 * (scalar fused multiply-adds), far slower than the torch form it stands in for. */
int dasc_gdn_chunk_simd(void) {
#ifdef HAVE_X86
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* 1 where dasc_gdn_chunk's amx = 1 runs its products on AMX here (for K, V multiples of 32). */
int dasc_gdn_chunk_amx(void) {
#ifdef HAVE_X86
    return dasc_gdn_chunk_simd() && amx_usable();
#else
    return 0;
#endif
}
