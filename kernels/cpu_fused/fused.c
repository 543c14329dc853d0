/* CPU inference passes in one pass each where torch takes two to seven, or copies first.
 *
 * dasc_gated_rmsnorm: Qwen3-Next's and Qwen3.5's gated output norm
 * (model_runner/layers/norm.py's GatedRMSNorm, silu gate) of rows of D FP32 values,
 *
 *     x = round(o);  y = round(w * round(x * rsqrt(mean(x^2) + eps)));  out = round(y * silu(z))
 *
 * where round() is the model dtype's rounding (bf16: to nearest even; FP32: none), exactly the
 * roundings torch makes.  The mean and the exponential in silu(z) = z / (1 + exp(-z)) run in
 * another order and polynomial than torch's, so results may differ from torch's in the last
 * bit of the model dtype (tests/test_cpu_fused_native.py bounds it).
 *
 * dasc_l2norm_qkv: q and k of a GDN layer, x * rsqrt(sum(x^2) + eps) per head row of D, read
 * from the conv's output (bf16 or FP32, any row stride) into FP32 rows; v converted likewise.
 *
 * dasc_silu_mul: a dense MLP's round(round(silu(gate)) * up) from the gate-up projection.
 *
 * dasc_rmsnorm: the hidden-state and per-head RMS norms (layers/norm.py's RMSNorm).
 *
 * dasc_moe_decode: the routed experts of a decode step's few tokens (described above it).
 *
 * dasc_attention_decode: one query token per sequence over its KV rows where they lie in the
 * pool (described above it).
 *
 * Each has an AVX-512 form (D % 16 == 0) and a portable one that give the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

static inline float bf16_value(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t round_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0; /* NaN, as torch writes it */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline float round_to(float f, int bf16) { return bf16 ? bf16_value(round_bf16(f)) : f; }

static inline float load_elem(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_value(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_elem(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = round_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* exp by Cody-Waite reduction and a degree-5 polynomial (Cephes' expf; ~1 ulp), the same
 * operations as exp16 below. */
#define EXP_HI 88.3762626647949f
#define EXP_LO -88.3762626647949f
static const float P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                           4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp1(float x) {
    x = fminf(fmaxf(x, EXP_LO), EXP_HI);
    const float n = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = P[0];
    for (int i = 1; i < 6; ++i)
        p = fmaf(p, r, P[i]);
    const float y = fmaf(p, r * r, r) + 1.0f;
    return ldexpf(y, (int)n);
}

static inline float silu1(float z) { return z / (1.0f + exp1(-z)); }

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
#define AVX512 __attribute__((target("avx512f,avx512bw,fma")))

AVX512 static inline __m512 load16(const void *p, int64_t i, int bf16) {
    if (!bf16)
        return _mm512_loadu_ps((const float *)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AVX512 static inline __m512 round16(__m512 f, int bf16) {
    if (!bf16)
        return f;
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(r);
}

AVX512 static inline void store16(void *p, int64_t i, __m512 f, int bf16) {
    if (!bf16) {
        _mm512_storeu_ps((float *)p + i, f);
        return;
    }
    const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round16(f, 1)), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(r));
}

AVX512 static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(P[0]);
    for (int i = 1; i < 6; ++i)
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P[i]));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}
#endif

#ifdef HAVE_X86
AVX512 static inline float hsum16(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));
    return _mm_cvtss_f32(b);
}

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

static int simd_ok(int64_t D, int64_t simd) {
    return simd && D % 16 == 0 && __builtin_cpu_supports("avx512f")
           && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("fma");
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
    float x[D > 0 ? D : 1];
#else
    (void)simd;
#endif
    for (int64_t t = 0; t < N; ++t)
        for (int64_t h = 0; h < H; ++h) {
            const int64_t row = t * H + h;
            const float *orow = o + row * D;
            const void *zr = (const char *)z + (t * z_stride + h * D) * elem;
            void *outr = (char *)out + row * D * elem;
#ifdef HAVE_X86
            if (fast) {
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

/* One query token per sequence attending over its KV rows in the pool, read where they lie.
 * Mirrors model_runner/layers/attention.py's `_decode_each` for one (sequence, KV head):
 *
 *     s_j = round(round(q . k_j) * scale);  p = round(softmax(s));  out = round(sum_j p_j v_j)
 *
 * round() as above, so FP32 models round nowhere.  The r = H / Hkv query heads of KV head g
 * (heads g * r ... g * r + r - 1) share each key row as it is read.  Each dot product runs in
 * 16 lanes (lane l takes elements l, l + 16, ... by one fma chain) added pairwise; the softmax
 * sum likewise over j; each output element is one fma chain over j in order.  The portable
 * form follows the same order, so both give the same bits. */
static float dot_portable(const float *q, const void *k, int64_t D, int bf16) {
    float lane[16] = {0};
    for (int64_t c = 0; c < D; ++c)
        lane[c % 16] = fmaf(q[c], load_elem(k, c, bf16), lane[c % 16]);
    for (int half = 8; half; half /= 2)
        for (int l = 0; l < half; ++l)
            lane[l] = lane[l] + lane[l + half];
    return lane[0];
}

/* p[j] = exp(s[j] - max) / sum, rounded; the sum in 16 lanes by j % 16, added pairwise. */
static void softmax_portable(float *s, int64_t n, int bf16) {
    float m = -INFINITY, lane[16] = {0};
    for (int64_t j = 0; j < n; ++j)
        m = fmaxf(m, s[j]);
    for (int64_t j = 0; j < n; ++j) {
        s[j] = exp1(s[j] - m);
        lane[j % 16] = lane[j % 16] + s[j];
    }
    for (int half = 8; half; half /= 2)
        for (int l = 0; l < half; ++l)
            lane[l] = lane[l] + lane[l + half];
    const float inv = 1.0f / lane[0];
    for (int64_t j = 0; j < n; ++j)
        s[j] = round_to(s[j] * inv, bf16);
}

#ifdef HAVE_X86
AVX512 static void softmax_avx512(float *s, int64_t n, int bf16) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
    float m = _mm512_reduce_max_ps(mv);
    for (; j < n; ++j)
        m = fmaxf(m, s[j]);
    const __m512 mb = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j < n; j += 16) {
        const __mmask16 keep = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + j), mb));
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(keep, e));
        _mm512_mask_storeu_ps(s + j, keep, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / hsum16(sum));
    for (j = 0; j < n; j += 16) {
        const __mmask16 keep = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512 p = round16(_mm512_mul_ps(_mm512_maskz_loadu_ps(keep, s + j), inv), bf16);
        _mm512_mask_storeu_ps(s + j, keep, p);
    }
}
#endif

#ifdef HAVE_X86
/* attend_group's AVX-512 form (D % 16 == 0, r <= 16); inlined for each common r, so that
 * the accumulators stay in registers. */
AVX512 static inline __attribute__((always_inline)) void attend_avx512(const float *qf, int64_t r, const char *base, int64_t row_stride,
                                 int64_t v_offset, const int64_t *rows, int64_t n, int64_t D,
                                 float scale, int bf16, float *s, void *out) {
    const int64_t elem = bf16 ? 2 : 4;
    for (int64_t j = 0; j < n; ++j) {
        const char *k = base + rows[j] * row_stride * elem;
        __m512 acc[16];
        for (int64_t i = 0; i < r; ++i)
            acc[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 16) {
            const __m512 kc = load16(k, c, bf16);
            for (int64_t i = 0; i < r; ++i)
                acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + i * D + c), kc, acc[i]);
        }
        for (int64_t i = 0; i < r; ++i)
            s[i * n + j] = hsum16(acc[i]);
    }
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < r; ++i) {
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 keep = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
            const __m512 raw = _mm512_maskz_loadu_ps(keep, s + i * n + j);
            _mm512_mask_storeu_ps(s + i * n + j, keep,
                                  round16(_mm512_mul_ps(round16(raw, bf16), scale16), bf16));
        }
        softmax_avx512(s + i * n, n, bf16);
    }
    const int64_t group = 16 / r; /* 16-wide column blocks per pass: r * group <= 16 */
    for (int64_t c0 = 0; c0 < D; c0 += 16 * group) {
        const int64_t width = D - c0 < 16 * group ? (D - c0) / 16 : group;
        __m512 acc[16];
        for (int64_t a = 0; a < r * width; ++a)
            acc[a] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; ++j) {
            const char *v = base + (rows[j] * row_stride + v_offset) * elem;
            for (int64_t c = 0; c < width; ++c) {
                const __m512 vc = load16(v, c0 + 16 * c, bf16);
                for (int64_t i = 0; i < r; ++i)
                    acc[i * width + c] =
                        _mm512_fmadd_ps(_mm512_set1_ps(s[i * n + j]), vc, acc[i * width + c]);
            }
        }
        for (int64_t i = 0; i < r; ++i)
            for (int64_t c = 0; c < width; ++c)
                store16(out, i * D + c0 + 16 * c, acc[i * width + c], bf16);
    }
}

AVX512 static void attend_fast(const float *qf, int64_t r, const char *base, int64_t row_stride,
                               int64_t v_offset, const int64_t *rows, int64_t n, int64_t D,
                               float scale, int bf16, float *s, void *out) {
    switch (r) { /* a constant r for the common group sizes */
    case 1: attend_avx512(qf, 1, base, row_stride, v_offset, rows, n, D, scale, bf16, s, out);
        break;
    case 2: attend_avx512(qf, 2, base, row_stride, v_offset, rows, n, D, scale, bf16, s, out);
        break;
    case 4: attend_avx512(qf, 4, base, row_stride, v_offset, rows, n, D, scale, bf16, s, out);
        break;
    case 8: attend_avx512(qf, 8, base, row_stride, v_offset, rows, n, D, scale, bf16, s, out);
        break;
    default: attend_avx512(qf, r, base, row_stride, v_offset, rows, n, D, scale, bf16, s, out);
    }
}
#endif

/* Sequence b (rows index[starts[b] + j], j < n), KV head g (base: the cache offset to its
 * key): the r query rows qf [r, D] (FP32) -> out rows [r, D] (the model dtype).  s: scratch
 * [r, n]. */
static void attend_group(const float *qf, int64_t r, const char *base, int64_t row_stride,
                         int64_t v_offset, const int64_t *rows, int64_t n, int64_t D,
                         float scale, int bf16, int fast, float *s, void *out) {
#ifdef HAVE_X86
    if (fast) {
        attend_fast(qf, r, base, row_stride, v_offset, rows, n, D, scale, bf16, s, out);
        return;
    }
#endif
    (void)fast;
    const int64_t elem = bf16 ? 2 : 4;
    for (int64_t j = 0; j < n; ++j) {
        const char *k = base + rows[j] * row_stride * elem;
        for (int64_t i = 0; i < r; ++i)
            s[i * n + j] = round_to(round_to(dot_portable(qf + i * D, k, D, bf16), bf16) * scale,
                                    bf16);
    }
    for (int64_t i = 0; i < r; ++i)
        softmax_portable(s + i * n, n, bf16);
    for (int64_t i = 0; i < r; ++i)
        for (int64_t c = 0; c < D; ++c) {
            float acc = 0.0f;
            for (int64_t j = 0; j < n; ++j)
                acc = fmaf(s[i * n + j],
                           load_elem(base + (rows[j] * row_stride + v_offset) * elem, c, bf16),
                           acc);
            store_elem(out, i * D + c, acc, bf16);
        }
}

/* q [B, H, D] and out [B, H, D] contiguous, in the cache's dtype (bf16 or FP32); the key of
 * row x, KV head g at cache + x * row_stride + g * D, its value v_offset further (elements).
 * Sequence b reads rows index[starts[b] ... starts[b] + lens[b]).  Returns 0, or -1 when the
 * scratch could not be allocated (nothing written). */
int dasc_attention_decode(const void *q, const void *cache, int64_t row_stride, int64_t v_offset,
                          const int64_t *index, const int64_t *starts, const int64_t *lens,
                          int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale,
                          int64_t bf16, void *out, int64_t simd) {
    const int64_t r = H / Hkv, elem = bf16 ? 2 : 4;
    int64_t longest = 1;
    for (int64_t b = 0; b < B; ++b)
        longest = lens[b] > longest ? lens[b] : longest;
    float *s = malloc(sizeof(float) * (size_t)(r * longest + r * D));
    if (!s)
        return -1;
    float *qf = s + r * longest;
#ifdef HAVE_X86
    const int fast = simd_ok(D, simd) && r <= 16;
#else
    const int fast = 0;
    (void)simd;
#endif
    for (int64_t b = 0; b < B; ++b)
        for (int64_t g = 0; g < Hkv; ++g) {
            const int64_t first = (b * H + g * r) * D;
            for (int64_t a = 0; a < r * D; ++a)
                qf[a] = load_elem(q, first + a, (int)bf16);
            attend_group(qf, r, (const char *)cache + g * D * elem, row_stride, v_offset,
                         index + starts[b], lens[b], D, scale, (int)bf16, fast, s,
                         (char *)out + first * elem);
        }
    free(s);
    return 0;
}

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
/* acc [m, cols] = in [m, rows] @ w [rows, cols]: w read once, four rows at a time (one load
 * and store of each sum per four rows; the fmas still run row by row, in order). */
AVX512 static void expert_rows_avx512(const float *in, int64_t m, int64_t rows, int64_t cols,
                                      const void *w, int bf16, float *acc) {
    for (int64_t a = 0; a < m * cols; a += 16)
        _mm512_storeu_ps(acc + a, _mm512_setzero_ps());
    const int64_t elem = bf16 ? 2 : 4, step = cols * elem;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        const char *row = (const char *)w + r * step;
        for (int64_t c = 0; c < cols; c += 16) {
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
        const char *row = (const char *)w + r * step;
        for (int64_t c = 0; c < cols; c += 16) {
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
#ifdef HAVE_X86
    if (fast)
        expert_rows_avx512(xin, m, H, G, w13, b, gu);
    else
#endif
        expert_rows_portable(xin, m, H, G, w13, b, gu);
    for (int64_t i = 0; i < m; ++i)
        for (int64_t c = 0; c < I; ++c) {
            const float g = round_to(gu[i * G + c], b), u = round_to(gu[i * G + I + c], b);
            act[i * I + c] = round_to(round_to(silu1(g), b) * u, b);
        }
#ifdef HAVE_X86
    if (fast)
        expert_rows_avx512(act, m, I, H, w2, b, hs);
    else
#endif
        expert_rows_portable(act, m, I, H, w2, b, hs);
    (void)fast;
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
 * references, slower than torch's vectorised passes. */
int dasc_fused_simd(void) {
#ifdef HAVE_X86
    return simd_ok(16, 1);
#else
    return 0;
#endif
}
