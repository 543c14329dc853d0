#include "../cpu_simd.h"

/* y [m, n] = xu [m, k] . w [n, k]^T for unsigned 8-bit rows xu and a signed 8-bit weight w
 * (row-major), each sum exact in 32 bits (k * 255 * 127 < 2^31 for k < 66,000).  The weight is
 * streamed once for all m rows, four weight rows at a time with the next four prefetched, as
 * kernels/gemv streams a bf16 one: at half the bytes, the screening pass of the LM head
 * (kernels/lm_head/__init__.py).  Integer sums: every form gives the same values.  k must be a
 * multiple of 64. */

#define ROWS 4  /* weight rows streamed together */
#define MAX_M 4 /* rows of x */

static void screen_portable(const uint8_t *x, int64_t m, int64_t k, const int8_t *w, int64_t n,
                            int32_t *y) {
    for (int64_t r = 0; r < n; ++r)
        for (int64_t i = 0; i < m; ++i) {
            int32_t acc = 0;
            for (int64_t j = 0; j < k; ++j)
                acc += (int32_t)x[i * k + j] * (int32_t)w[r * k + j];
            y[i * n + r] = acc;
        }
}

#ifdef HAVE_X86
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

VNNI static inline __attribute__((always_inline)) void
rows_vnni(const uint8_t *x, const int64_t m, int64_t k, const int8_t *w, int64_t n, int64_t r0,
          const int64_t rows, int32_t *y) {
    __m512i acc[ROWS][MAX_M];
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < m; ++i)
            acc[r][i] = _mm512_setzero_si512();
    const int8_t *wr = w + r0 * k;
    for (int64_t b = 0; b < k; b += 64) {
        for (int64_t r = 0; r < rows; ++r) {
            _mm_prefetch((const char *)(wr + (rows + r) * k + b), _MM_HINT_T1);
            const __m512i wv = _mm512_loadu_si512(wr + r * k + b);
            for (int64_t i = 0; i < m; ++i)
                acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], _mm512_loadu_si512(x + i * k + b), wv);
        }
    }
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < m; ++i)
            y[i * n + r0 + r] = _mm512_reduce_add_epi32(acc[r][i]);
}

VNNI static inline __attribute__((always_inline)) void
screen_m(const uint8_t *x, const int64_t m, int64_t k, const int8_t *w, int64_t n, int32_t *y) {
    int64_t r = 0;
    for (; r + ROWS <= n; r += ROWS)
        rows_vnni(x, m, k, w, n, r, ROWS, y);
    for (; r < n; ++r)
        rows_vnni(x, m, k, w, n, r, 1, y);
}

VNNI static void screen_vnni(const uint8_t *x, int64_t m, int64_t k, const int8_t *w, int64_t n,
                             int32_t *y) {
    switch (m) {
    case 1: screen_m(x, 1, k, w, n, y); break;
    case 2: screen_m(x, 2, k, w, n, y); break;
    case 3: screen_m(x, 3, k, w, n, y); break;
    default: screen_m(x, 4, k, w, n, y); break;
    }
}

static int vnni_ok(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
           && __builtin_cpu_supports("avx512vnni");
}
#endif

/* Each row of a bf16 weight w [n, k] as int8, q = round(w * (127 / max |w|)) (to nearest even)
 * in [-127, 127], and what the screen's bound reads per row: s = max |w| / 127 (1 for a zero
 * row), the sum of q, max |w - s q| (FP32, as computed here: the bound reads the value), s sum |q|
 * and max |w|.  Returns 1 where a
 * weight is not finite (the rows are written all the same), else 0. */
int dasc_screen_quantize(const void *weight, int64_t n, int64_t k, void *quantized, float *scale,
                         int32_t *rowsum, float *err, float *l1, float *wmax) {
    const uint16_t *w = weight;
    int8_t *q = quantized;
    int bad = 0;
    for (int64_t r = 0; r < n; ++r) {
        const uint16_t *row = w + r * k;
        float top = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
            const float a = fabsf(bf16_value(row[j]));
            if (!(a <= top)) /* NaN takes it too */
                top = a;
        }
        if (!isfinite(top))
            bad = 1;
        const float s = top > 0.0f ? top / 127.0f : 1.0f;
        const float inv = top > 0.0f ? 127.0f / top : 0.0f;
        int32_t sum = 0, abs_sum = 0;
        float e = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
            const float v = bf16_value(row[j]);
            float t = rintf(v * inv);
            t = t > 127.0f ? 127.0f : (t < -127.0f ? -127.0f : t);
            const int32_t qi = isfinite(t) ? (int32_t)t : 0;
            q[r * k + j] = (int8_t)qi;
            sum += qi;
            abs_sum += qi < 0 ? -qi : qi;
            const float d = fabsf(v - (float)qi * s);
            if (!(d <= e))
                e = d;
        }
        scale[r] = s;
        rowsum[r] = sum;
        err[r] = e;
        l1[r] = (float)abs_sum * s;
        wmax[r] = top;
    }
    return bad;
}

int dasc_screen_simd(void) {
#ifdef HAVE_X86
    return vnni_ok();
#else
    return 0;
#endif
}

/* Returns nonzero where it did not run (bad sizes). */
int dasc_screen(const void *x, int64_t m, int64_t k, const void *w, int64_t n, void *y,
                int64_t simd) {
    if (m < 1 || m > MAX_M || k < 64 || k % 64 || n < 1)
        return 1;
#ifdef HAVE_X86
    if (simd && vnni_ok())
        screen_vnni(x, m, k, w, n, y);
    else
#endif
        screen_portable(x, m, k, w, n, y);
    return 0;
}
