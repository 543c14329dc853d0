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

/* The weight's rows split among the OpenMP threads in blocks of ROWS, as kernels/gemv. */
VNNI static inline __attribute__((always_inline)) void
screen_m(const uint8_t *x, const int64_t m, int64_t k, const int8_t *w, int64_t n, int32_t *y) {
    const int64_t blocks = n / ROWS;
#pragma omp parallel for schedule(static) if (n * k >= PARALLEL_MIN)
    for (int64_t b = 0; b < blocks; ++b)
        rows_vnni(x, m, k, w, n, b * ROWS, ROWS, y);
    for (int64_t r = blocks * ROWS; r < n; ++r)
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

/* The bound of kernels/lm_head/__init__.py for one hidden row: with its int8 sums dots [n]
 * (of x + 128), its scale sx, |x|_1 x1 and the head's per-row values, each logit's screening
 * value a = (dots - 128 rowsum) (sx s) and bound b = (x1 (err + gamma wmax) + sx / 2 l1)
 * (1 + slack) + 4u |a|.  Writes to ids, ascending, every row whose a + b reaches the best
 * a - b less a margin of two bf16 units or more at the largest magnitude in play, and returns
 * their count; -1 when there are more than max_ids. */
typedef struct {
    const int32_t *dots, *rowsum;
    const float *scale, *err, *l1, *wmax;
    float sx, x1, gamma, grow;
} Screened;

/* Row r's screening value, and its bound in *b. */
static inline float screened(const Screened *s, int64_t r, float *b) {
    const float a = (float)(s->dots[r] - 128 * s->rowsum[r]) * (s->sx * s->scale[r]);
    *b = (s->x1 * (s->err[r] + s->gamma * s->wmax[r]) + 0.5f * s->sx * s->l1[r]) * s->grow
         + 4.0f * 0x1p-24f * fabsf(a);
    return a;
}

int64_t dasc_screen_candidates(const int32_t *dots, int64_t n, const int32_t *rowsum,
                               const float *scale, const float *err, const float *l1,
                               const float *wmax, float sx, float x1, float gamma, float slack,
                               int64_t max_ids, int64_t *ids) {
    const Screened s = {dots, rowsum, scale, err, l1, wmax, sx, x1, gamma, 1.0f + slack};
    float best = -INFINITY, top = 0x1p-120f, b;
    for (int64_t r = 0; r < n; ++r) {
        const float a = screened(&s, r, &b);
        const float lo = a - b, hi = a + b;
        if (lo > best)
            best = lo;
        if (fabsf(hi) > top)
            top = fabsf(hi);
    }
    if (fabsf(best) > top)
        top = fabsf(best);
    int ex;
    frexpf(top, &ex); /* top < 2^ex: a bf16 unit there is at most 2^(ex - 8) */
    const float floor = best - ldexpf(1.0f, ex - 6);
    int64_t count = 0;
    for (int64_t r = 0; r < n; ++r) {
        const float a = screened(&s, r, &b);
        if (a + b >= floor) {
            if (count == max_ids)
                return -1;
            ids[count++] = r;
        }
    }
    return count;
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
