/* Helpers the CPU kernels share (included by kernels/delta_rule/cpu_decode.c,
 * kernels/short_conv/cpu.c and the .c files of kernels/cpu_fused, kernels/decode_attention,
 * kernels/gemv and kernels/moe_decode): the model dtype's loads, stores and roundings (bf16 to
 * nearest even, as torch rounds; FP32 none), an exponential, and their AVX-512 forms, which
 * give the scalar forms' bits.  Everything is static: each library gets its own copy. */
#ifndef DASC_CPU_SIMD_H
#define DASC_CPU_SIMD_H

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

/* A loop over at least this many values (weight elements, activations) splits among the
 * OpenMP threads (the rank's --cpu-threads); a smaller one stays on the calling thread, where
 * waking the others costs more than it saves.  Each output is computed by one thread in the
 * same order whatever their number, so the bits do not depend on it. */
#define PARALLEL_MIN (1 << 16)

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

AVX512 static inline float hsum16(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));
    return _mm_cvtss_f32(b);
}


/* 1 where the AVX-512 forms run: rows of D % 16 == 0 on a CPU with AVX-512 (and simd asked). */
static inline int simd_ok(int64_t D, int64_t simd) {
    return simd && D % 16 == 0 && __builtin_cpu_supports("avx512f")
           && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("fma");
}
#endif

#endif
