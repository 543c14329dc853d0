/* The short convolution on a CPU, in the state slots.
 *
 * dasc_conv_decode: the window sum over [state ; x] (kernels/short_conv/naive.py's
 * `_window_sum`: a product, then one fused add per further tap, in FP32), the state shifted by
 * one token in place.  dasc_conv_prefill: the same sums for a prefill chunk's packed sequences,
 * read straight from x and the states.  The SiLU stays in torch.  (With bf16 inputs and weights
 * each product is exact in FP32, so fusing the add or not gives the same bits there; FP32
 * models need the fused add.)  Tests: tests/kernels/test_cpu_decode_native.py.
 */
#include "../cpu_simd.h"

/* A kernel of 4 taps (width 3), the models' conv: straight-line, so it vectorises. */
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
static void conv4_bf16(uint16_t *s, const uint16_t *x, const float *w, int64_t C, float *o) {
    for (int64_t c = 0; c < C; ++c) {
        const uint16_t h0 = s[3 * c], h1 = s[3 * c + 1], h2 = s[3 * c + 2], h3 = x[c];
        float acc = bf16_value(h0) * w[c];
        acc = fmaf(bf16_value(h1), w[C + c], acc);
        acc = fmaf(bf16_value(h2), w[2 * C + c], acc);
        o[c] = fmaf(bf16_value(h3), w[3 * C + c], acc);
        s[3 * c] = h1;
        s[3 * c + 1] = h2;
        s[3 * c + 2] = h3;
    }
}

/* Any width, bf16 or FP32: the state's elements move as they are (2 or 4 bytes). */
static void conv_portable(void *s, const void *x, const float *w, int64_t C, int64_t width,
                          float *o, int64_t bf16) {
    const int64_t elem = bf16 ? 2 : 4;
    for (int64_t c = 0; c < C; ++c) {
        float acc = load_elem(s, c * width, bf16) * w[c];
        for (int64_t j = 1; j < width; ++j)
            acc = fmaf(load_elem(s, c * width + j, bf16), w[j * C + c], acc);
        o[c] = fmaf(load_elem(x, c, bf16), w[width * C + c], acc);
        char *sc = (char *)s + c * width * elem;
        __builtin_memmove(sc, sc + elem, (size_t)((width - 1) * elem));
        __builtin_memcpy(sc + (width - 1) * elem, (const char *)x + c * elem, (size_t)elem);
    }
}

/* Sequence b: state pool + slots[b] * slot_stride ([C, width] elements, channel-major), x row
 * x + b * x_stride ([C]); columns [width + 1, C] FP32 (tap j of every channel); out [B, C]
 * FP32.  bf16: pool and x hold bf16 (the states move as raw bits), else FP32. */
void dasc_conv_decode(void *pool, int64_t slot_stride, const int64_t *slots, int64_t num_seqs,
                      int64_t C, int64_t width, const void *x, int64_t x_stride,
                      const float *columns, float *out, int64_t bf16) {
    const int64_t elem = bf16 ? 2 : 4;
    for (int64_t b = 0; b < num_seqs; ++b) {
        char *s = (char *)pool + slots[b] * slot_stride * elem;
        const char *xb = (const char *)x + b * x_stride * elem;
        if (bf16 && width == 3)
            conv4_bf16((uint16_t *)s, (const uint16_t *)xb, columns, C, out + b * C);
        else
            conv_portable(s, xb, columns, C, width, out + b * C, bf16);
    }
}

/* The window sums of a chunk of sequences, the prefill's: sequence i holds tokens
 * [cu[i], cu[i + 1]) of x (rows x_stride apart) after its state states + i * state_stride
 * ([C, width], channel-major).  Token t's sum reads [state ; x] rows t to t + width, the
 * first width tokens partly from the state, the rest from x rows alone.  Each token's row of
 * sums goes to out [N, C] FP32, or, with out_bf16, rounded to bf16 (to nearest even, as
 * torch rounds), straight from the registers (the first width tokens through the scratch
 * row): a chunk's FP32 sums would be a fresh buffer every call (33 MB for 1,024 tokens of
 * 8,192 channels, ~15 ms of page faults to write). */
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
static void window_row(const void *r, int64_t x_stride, int64_t C, int64_t width,
                       const float *w, float *o, int64_t bf16) {
    for (int64_t c = 0; c < C; ++c)
        o[c] = load_elem(r, c, bf16) * w[c];
    for (int64_t j = 1; j <= width; ++j)
        for (int64_t c = 0; c < C; ++c)
            o[c] = fmaf(load_elem(r, j * x_stride + c, bf16), w[j * C + c], o[c]);
}

#ifdef HAVE_X86
/* window_row for C a multiple of 16: sixteen channels at a time, the taps in registers, the
 * sums stored as FP32 or, with round_out, rounded to bf16 (store16: round_bf16's bits). */
__attribute__((target("avx512f,avx512bw,fma")))
static void window_row_avx512(const void *r, int64_t x_stride, int64_t C, int64_t width,
                              const float *w, void *o, int64_t bf16, int round_out) {
    for (int64_t c = 0; c < C; c += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j <= width; ++j) {
            const __m512 e = load16(r, j * x_stride + c, (int)bf16);
            const __m512 wj = _mm512_loadu_ps(w + j * C + c);
            acc = j == 0 ? _mm512_mul_ps(e, wj) : _mm512_fmadd_ps(e, wj, acc);
        }
        store16(o, c, acc, round_out);
    }
}
#endif

void dasc_conv_prefill(const void *x, int64_t x_stride, const void *states, int64_t state_stride,
                       const int64_t *cu, int64_t num_seqs, int64_t C, int64_t width,
                       const float *columns, float *out, uint16_t *out_bf16, float *scratch,
                       int64_t bf16) {
    const int64_t elem = bf16 ? 2 : 4;
#ifdef HAVE_X86
    const int fast = C % 16 == 0 && __builtin_cpu_supports("avx512f")
                     && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("fma");
#endif
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t a = cu[i], n = cu[i + 1] - a;
#ifdef HAVE_X86
        /* the rows past the state's taps, each on one OpenMP thread */
        if (fast && n > width) {
#pragma omp parallel for schedule(static) if ((n - width) * C * (width + 1) >= PARALLEL_MIN)
            for (int64_t t = width; t < n; ++t)
                window_row_avx512((const char *)x + (a + t - width) * x_stride * elem, x_stride,
                                  C, width, columns,
                                  out_bf16 ? (void *)(out_bf16 + (a + t) * C)
                                           : (void *)(out + (a + t) * C),
                                  bf16, out_bf16 != NULL);
        }
#endif
        for (int64_t t = 0; t < n; ++t) {
            float *o = out_bf16 ? scratch : out + (a + t) * C;
            if (t < width) { /* taps p = t + j < width read the state */
                for (int64_t c = 0; c < C; ++c) {
                    float acc = 0.0f;
                    for (int64_t j = 0; j <= width; ++j) {
                        const int64_t p = t + j;
                        const float e = p < width
                            ? load_elem(states, i * state_stride + c * width + p, bf16)
                            : load_elem(x, (a + p - width) * x_stride + c, bf16);
                        acc = j == 0 ? e * columns[c] : fmaf(e, columns[j * C + c], acc);
                    }
                    o[c] = acc;
                }
            } else {
#ifdef HAVE_X86
                if (fast)
                    continue; /* run above */
#endif
                window_row((const char *)x + (a + t - width) * x_stride * elem, x_stride, C,
                           width, columns, o, bf16);
            }
            if (out_bf16)
                for (int64_t c = 0; c < C; ++c)
                    out_bf16[(a + t) * C + c] = round_bf16(o[c]);
        }
    }
}
