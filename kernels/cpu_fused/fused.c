/* Norm and activation passes in one pass each where torch takes two to seven (CPU inference).
 *
 * dasc_gated_rmsnorm: Qwen3-Next's and Qwen3.5's gated output norm
 * (model_runner/layers/norm.py's GatedRMSNorm, silu gate) of rows of D FP32 values,
 *
 *     x = round(o);  y = round(w * round(x * rsqrt(mean(x^2) + eps)));  out = round(y * silu(z))
 *
 * where round() is the model dtype's rounding (bf16: to nearest even; FP32: none), exactly the
 * roundings torch makes.  The mean and the exponential in silu(z) = z / (1 + exp(-z)) run in
 * another order and polynomial than torch's, so results may differ from torch's in the last
 * bit of the model dtype (tests/kernels/test_cpu_fused_native.py bounds it).
 *
 * dasc_l2norm_qkv: q and k of a GDN layer, x * rsqrt(sum(x^2) + eps) per head row of D, read
 * from the conv's output (bf16 or FP32, any row stride) into FP32 rows; v converted likewise.
 *
 * dasc_silu_mul: a dense MLP's round(round(silu(gate)) * up) from the gate-up projection.
 *
 * dasc_rmsnorm: the hidden-state and per-head RMS norms (layers/norm.py's RMSNorm).
 *
 * Each has an AVX-512 form (D % 16 == 0) and a portable one that give the same bits.
 */
#include "../cpu_simd.h"

/* Sums of squares in the lane order both forms use: lane l accumulates elements l, l + 16, ...
 * by one fma chain, then the 16 lanes add pairwise (l and l + 8, then + 4, + 2, + 1). */
static float sum_squares_portable(const float *x, int64_t D) {
    if (D % 16) {
        float sum = 0.0f;
        for (int64_t c = 0; c < D; ++c)
            sum = fmaf(x[c], x[c], sum);
        return sum;
    }
    float lane[16] = {0};
    for (int64_t c = 0; c < D; c += 16)
        for (int l = 0; l < 16; ++l)
            lane[l] = fmaf(x[c + l], x[c + l], lane[l]);
    for (int half = 8; half; half /= 2)
        for (int l = 0; l < half; ++l)
            lane[l] = lane[l] + lane[l + half];
    return lane[0];
}

static void gated_row_portable(const float *o, const void *z, const float *w, int64_t D,
                               float eps, int bf16, void *out) {
    float x[D > 0 ? D : 1];
    for (int64_t c = 0; c < D; ++c)
        x[c] = round_to(o[c], bf16);
    const float r = 1.0f / sqrtf(sum_squares_portable(x, D) / (float)D + eps);
    for (int64_t c = 0; c < D; ++c) {
        const float y = round_to(w[c] * round_to(x[c] * r, bf16), bf16);
        store_elem(out, c, y * silu1(load_elem(z, c, bf16)), bf16);
    }
}

static void l2_row_portable(const void *x, int64_t D, float eps, int bf16, float *out) {
    for (int64_t c = 0; c < D; ++c)
        out[c] = load_elem(x, c, bf16);
    const float r = 1.0f / sqrtf(sum_squares_portable(out, D) + eps);
    for (int64_t c = 0; c < D; ++c)
        out[c] = out[c] * r;
}

#ifdef HAVE_X86
AVX512 static void gated_row_avx512(const float *o, const void *z, const float *w, int64_t D,
                                    float eps, int bf16, void *out, float *x) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) {
        const __m512 v = round16(_mm512_loadu_ps(o + c), bf16);
        _mm512_storeu_ps(x + c, v);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 r = _mm512_set1_ps(1.0f / sqrtf(hsum16(acc) / (float)D + eps));
    for (int64_t c = 0; c < D; c += 16) {
        const __m512 n = round16(_mm512_mul_ps(_mm512_loadu_ps(x + c), r), bf16);
        const __m512 y = round16(_mm512_mul_ps(_mm512_loadu_ps(w + c), n), bf16);
        const __m512 zc = load16(z, c, bf16);
        const __m512 s = _mm512_div_ps(zc, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                          exp16(_mm512_sub_ps(_mm512_setzero_ps(), zc))));
        store16(out, c, round16(_mm512_mul_ps(y, s), bf16), bf16);
    }
}

AVX512 static void l2_row_avx512(const void *x, int64_t D, float eps, int bf16, float *out) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) {
        const __m512 v = load16(x, c, bf16);
        _mm512_storeu_ps(out + c, v);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 r = _mm512_set1_ps(1.0f / sqrtf(hsum16(acc) + eps));
    for (int64_t c = 0; c < D; c += 16)
        _mm512_storeu_ps(out + c, _mm512_mul_ps(_mm512_loadu_ps(out + c), r));
}

#endif

/* token t < N, head h < H: out[t, h] (bf16 or FP32, [N, H, D] contiguous) = the gated norm of
 * o[t, h] (FP32, [N, H, D] contiguous) by w [D] (FP32: the weight's own values) and z[t, h]
 * (as out, at z + t * z_stride + h * D). */
void dasc_gated_rmsnorm(const float *o, const void *z, int64_t z_stride, const float *w,
                        int64_t N, int64_t H, int64_t D, float eps, int64_t bf16, void *out,
                        int64_t simd) {
    const int64_t elem = bf16 ? 2 : 4;
#ifdef HAVE_X86
    const int fast = simd_ok(D, simd);
#else
    (void)simd;
#endif
#pragma omp parallel for schedule(static) if (N * H * D >= PARALLEL_MIN)
    for (int64_t row = 0; row < N * H; ++row) {
        const int64_t t = row / H, h = row % H;
        const float *orow = o + row * D;
        const void *zr = (const char *)z + (t * z_stride + h * D) * elem;
        void *outr = (char *)out + row * D * elem;
#ifdef HAVE_X86
        if (fast) {
            float x[D];
            gated_row_avx512(orow, zr, w, D, eps, (int)bf16, outr, x);
            continue;
        }
#endif
        gated_row_portable(orow, zr, w, D, eps, (int)bf16, outr);
    }
}

/* token t < N of x (bf16 or FP32, rows at x_stride): q (its first Hk * D values) and k (the
 * next Hk * D) L2-normalised per head of D into q_out and k_out [N, Hk, D] FP32, v (the E
 * values after them) converted into v_out [N, E] FP32. */
void dasc_l2norm_qkv(const void *x, int64_t x_stride, int64_t N, int64_t Hk, int64_t D,
                     float eps, int64_t E, int64_t bf16, float *q_out, float *k_out,
                     float *v_out, int64_t simd) {
    const int64_t elem = bf16 ? 2 : 4;
#ifdef HAVE_X86
    const int fast = simd_ok(D, simd);
#else
    (void)simd;
#endif
#pragma omp parallel for schedule(static) if (N * (2 * Hk * D + E) >= PARALLEL_MIN)
    for (int64_t t = 0; t < N; ++t) {
        const char *row = (const char *)x + t * x_stride * elem;
        for (int64_t h = 0; h < 2 * Hk; ++h) {
            const void *xh = row + h * D * elem;
            float *oh = (h < Hk ? q_out + (t * Hk + h) * D : k_out + (t * Hk + h - Hk) * D);
#ifdef HAVE_X86
            if (fast) {
                l2_row_avx512(xh, D, eps, (int)bf16, oh);
                continue;
            }
#endif
            l2_row_portable(xh, D, eps, (int)bf16, oh);
        }
        const char *rest = row + 2 * Hk * D * elem;
        float *vo = v_out + t * E;
        if (bf16)
            for (int64_t c = 0; c < E; ++c)
                vo[c] = bf16_value(((const uint16_t *)rest)[c]);
        else
            memcpy(vo, rest, (size_t)E * sizeof(float));
    }
}

#ifdef HAVE_X86
AVX512 static void silu_mul_row_avx512(const void *gate, const void *up, int64_t D, int bf16,
                                       void *out) {
    for (int64_t c = 0; c < D; c += 16) {
        const __m512 g = load16(gate, c, bf16);
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                         exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store16(out, c, round16(_mm512_mul_ps(round16(s, bf16), load16(up, c, bf16)), bf16), bf16);
    }
}
#endif

/* rows r < R of x (bf16 or FP32, [gate (D) | up (D)] at x_stride):
 * out[r] ([R, D], x's dtype) = round(round(silu(gate)) * up), the model dtype's roundings. */
void dasc_silu_mul(const void *x, int64_t x_stride, int64_t R, int64_t D, int64_t bf16,
                   void *out, int64_t simd) {
    const int64_t elem = bf16 ? 2 : 4;
#ifdef HAVE_X86
    const int fast = simd_ok(D, simd);
#else
    (void)simd;
#endif
#pragma omp parallel for schedule(static) if (R * D >= PARALLEL_MIN)
    for (int64_t r = 0; r < R; ++r) {
        const char *gate = (const char *)x + r * x_stride * elem, *up = gate + D * elem;
        char *o = (char *)out + r * D * elem;
#ifdef HAVE_X86
        if (fast) {
            silu_mul_row_avx512(gate, up, D, (int)bf16, o);
            continue;
        }
#endif
        for (int64_t c = 0; c < D; ++c) {
            const float s = round_to(silu1(load_elem(gate, c, (int)bf16)), (int)bf16);
            store_elem(o, c, s * load_elem(up, c, (int)bf16), (int)bf16);
        }
    }
}

/* Rows of D (bf16 or FP32, x_stride elements apart) -> out [N, D] contiguous, in x's dtype:
 *
 *     y = x * rsqrt(mean(x^2) + eps);   out = round(w * round(y))  (round_first)
 *                                       out = round(w * y)         (otherwise)
 *
 * with w the FP32 weight as the module applies it ((1 + w) for Qwen's unit offset): the
 * roundings of layers/norm.py's RMSNorm in each architecture's order. */
static void rms_row_portable(const void *x, int64_t D, const float *w, float eps, int bf16,
                             int round_first, void *out) {
    float v[D > 0 ? D : 1];
    for (int64_t c = 0; c < D; ++c)
        v[c] = load_elem(x, c, bf16);
    const float r = 1.0f / sqrtf(sum_squares_portable(v, D) / (float)D + eps);
    for (int64_t c = 0; c < D; ++c) {
        const float y = v[c] * r;
        store_elem(out, c, w[c] * (round_first ? round_to(y, bf16) : y), bf16);
    }
}

#ifdef HAVE_X86
AVX512 static void rms_row_avx512(const void *x, int64_t D, const float *w, float eps, int bf16,
                                  int round_first, void *out) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) {
        const __m512 v = load16(x, c, bf16);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 r = _mm512_set1_ps(1.0f / sqrtf(hsum16(acc) / (float)D + eps));
    for (int64_t c = 0; c < D; c += 16) {
        __m512 y = _mm512_mul_ps(load16(x, c, bf16), r);
        if (round_first)
            y = round16(y, bf16);
        store16(out, c, _mm512_mul_ps(_mm512_loadu_ps(w + c), y), bf16);
    }
}
#endif

void dasc_rmsnorm(const void *x, int64_t x_stride, int64_t N, int64_t D, const float *w,
                  float eps, int64_t bf16, int64_t round_first, void *out, int64_t simd) {
    const int64_t elem = bf16 ? 2 : 4;
#ifdef HAVE_X86
    const int fast = simd_ok(D, simd);
#else
    (void)simd;
#endif
#pragma omp parallel for schedule(static) if (N * D >= PARALLEL_MIN)
    for (int64_t n = 0; n < N; ++n) {
        const char *row = (const char *)x + n * x_stride * elem;
        char *o = (char *)out + n * D * elem;
#ifdef HAVE_X86
        if (fast) {
            rms_row_avx512(row, D, w, eps, (int)bf16, (int)round_first, o);
            continue;
        }
#endif
        rms_row_portable(row, D, w, eps, (int)bf16, (int)round_first, o);
    }
}

/* 1 where the AVX-512 forms run on this CPU; the portable forms (a scalar exponential) are
 * references, slower than torch's vectorised passes. */
int dasc_fused_simd(void) {
#ifdef HAVE_X86
    return simd_ok(16, 1);
#else
    return 0;
#endif
}
