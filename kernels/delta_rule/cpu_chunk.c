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
 * Work is split over (sequence, head) pairs, in parallel where built with OpenMP.
 */
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
#endif

typedef struct {
    int simd;
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

/* Scratch floats one worker needs for chunk size C (padded to Cp columns), K, V. */
static int64_t scratch_floats(int64_t C, int64_t Cp, int64_t K, int64_t V) {
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
        const float *kk = dots, *qk = dots + L * Cp, *P = PQ, *Qs = PQ + L * V;
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
            scale2(ops, b, D + i * C, kk + i * Cp, i, 1, coef + i * C);
            scale2(ops, scale_, D + i * C, qk + i * Cp, i + 1, 0, wq + i * C);
        }
        triangle(ops, L, coef, C, 0, n, V, n, V);
        for (int64_t i = 0; i < L; ++i)
            scale(ops, Qs + i * V, scale_ * E[i], V, o + (c0 + i) * H * V);
        triangle(ops, L, wq, C, 1, n, V, o + c0 * H * V, H * V);
        /* S <- S E_{L-1} + (D[L-1][i] k_i)^T n */
        for (int64_t r = 0; r < K; ++r)
            scale2(ops, 1.0f, kt + r * Cp, D + (L - 1) * C, L, 0, kts + r * Cp);
        gemm(ops, K, V, L, kts, Cp, n, V, S, V, 1, E[L - 1]);
    }
}

/* Sequences b < B with tokens [cu[b], cu[b + 1]) of q, k [N, Hk, K], v [N, H, V], g, beta
 * [N, H] (FP32, contiguous); head h of sequence b reads and updates the state
 * pool + slots[b] * slot_stride + h * K * V ([K, V] FP32) and writes o [N, H, V].  H is a
 * multiple of Hk (value head h reads key head h / (H / Hk)).  simd = 0 forces the portable
 * loops (tests); threads: OpenMP workers where built with it.  Returns 0, or -1 when its
 * scratch could not be allocated (then nothing is written). */
int dasc_gdn_chunk(const float *q, const float *k, const float *v, const float *g,
                   const float *beta, float *pool, int64_t slot_stride, const int64_t *slots,
                   const int64_t *cu, int64_t B, int64_t Hk, int64_t H, int64_t K, int64_t V,
                   float scale, int64_t C, float *o, int64_t threads, int64_t simd) {
    Ops ops = {0};
#ifdef HAVE_X86
    ops.simd = simd && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
#else
    (void)simd;
#endif
    const int64_t Cp = (C + 15) / 16 * 16, ratio = H / Hk, workers = threads > 0 ? threads : 1;
    const int64_t per_worker = scratch_floats(C, Cp, K, V);
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
        run_head(&ops, q + hk * K, k + hk * K, Hk * K, v + h * V, g, beta, H, h, K, V, scale, C,
                 cu[b], cu[b + 1], pool + slots[b] * slot_stride + h * K * V, o + h * V, work);
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
