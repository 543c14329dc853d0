/* One-pass checkpoint store/load on CPU: runs of bytes between slots of two buffers.
 *
 * A slot's data is addressed as base + slot * stride; a run names an offset in the source slot,
 * an offset in the destination slot and a length. Runs are precomputed once per checkpoint pool
 * (kernels/ragged_state/native.py), so a call is one memcpy (or memset) per run and slot: the
 * physical minimum of a store or load is a copy of the stored bytes.
 *
 * INT8 (paper eq. 10, the same bits as the torch reference kernels/int8_quant/naive.py): per row
 * of V values s = max(amax|x|, 1e-8) / 127, q = clip(round_half_even(x / s), -127, 127);
 * x' = q * s.
 * Built without -ffast-math and with -ffp-contract=off, so every division, product and rounding
 * is the IEEE one torch computes.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct { int64_t src, dst, len; } run_t; /* src < 0: zero-fill dst */

/* x86-64: AVX-512 and AVX2 clones of the INT8 loops beside the baseline, picked at load time. */
#if defined(__x86_64__) && defined(__GNUC__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

void dasc_copy_runs(const char *src, char *dst, int64_t num_slots, const int64_t *src_slots,
                    const int64_t *dst_slots, int64_t src_stride, int64_t dst_stride,
                    int64_t num_runs, const run_t *runs) {
    for (int64_t b = 0; b < num_slots; ++b) {
        const char *s = src + src_slots[b] * src_stride;
        char *d = dst + dst_slots[b] * dst_stride;
        for (int64_t i = 0; i < num_runs; ++i) {
            if (runs[i].src < 0)
                memset(d + runs[i].dst, 0, (size_t)runs[i].len);
            else
                memcpy(d + runs[i].dst, s + runs[i].src, (size_t)runs[i].len);
        }
    }
}

/* 1.5 * 2^23: (y + M) - M rounds y half to even for |y| < 2^22 (here |y| <= 127). */
static const float ROUND_MAGIC = 12582912.0f;

static inline void quantize_row(const float *x, int8_t *q, float *scale, int64_t v) {
    /* amax on the bit patterns: |x| orders as its bits do (and a NaN wins, as in torch) */
    uint32_t top = 0;
    for (int64_t j = 0; j < v; ++j) {
        uint32_t bits;
        memcpy(&bits, x + j, sizeof bits);
        bits &= 0x7fffffffu;
        top = bits > top ? bits : top;
    }
    float amax;
    memcpy(&amax, &top, sizeof amax);
    float s = (amax < 1e-8f ? 1e-8f : amax) / 127.0f; /* a NaN amax stays NaN, as in torch */
    *scale = s;
    if (!(amax <= 3.4028235e38f)) { /* NaN or inf in the row: codes 0 (torch's are undefined) */
        memset(q, 0, (size_t)v);
        return;
    }
    /* No clip needed: s >= amax / 127 (1 - 2^-24), so |x / s| <= 127.00001 rounds into
     * [-127, 127] for every finite x (torch's clip never binds either). */
    for (int64_t j = 0; j < v; ++j)
        q[j] = (int8_t)(int32_t)((x[j] / s + ROUND_MAGIC) - ROUND_MAGIC);
}

/* Runs in units of d = rows_per_unit * v floats: src = first float in the active slot (< 0:
 * the units are zero), dst = first checkpoint row, len = units. Checkpoint slot c: payload
 * q + c * q_stride (int8 [rows, d]), scales scale + c * s_stride (fp32 [rows, rows_per_unit]). */
VECTOR_CLONES void dasc_quantize_runs(const float *src, int8_t *q, float *scale, int64_t num_slots,
                        const int64_t *src_slots, const int64_t *dst_slots, int64_t src_stride,
                        int64_t q_stride, int64_t s_stride, int64_t num_runs, const run_t *runs,
                        int64_t d, int64_t v) {
    const int64_t per_unit = d / v;
    for (int64_t b = 0; b < num_slots; ++b) {
        const float *x = src + src_slots[b] * src_stride;
        int8_t *qs = q + dst_slots[b] * q_stride;
        float *ss = scale + dst_slots[b] * s_stride;
        for (int64_t i = 0; i < num_runs; ++i) {
            for (int64_t u = 0; u < runs[i].len; ++u) {
                const int64_t row = runs[i].dst + u;
                for (int64_t r = 0; r < per_unit; ++r) {
                    int8_t *qr = qs + row * d + r * v;
                    float *sr = ss + row * per_unit + r;
                    if (runs[i].src < 0) {
                        memset(qr, 0, (size_t)v);
                        *sr = 1e-8f / 127.0f;
                    } else {
                        quantize_row(x + runs[i].src + u * d + r * v, qr, sr, v);
                    }
                }
            }
        }
    }
}

/* Runs in units: src = first checkpoint row (< 0: zero-fill), dst = first float in the active
 * slot, len = units. */
VECTOR_CLONES void dasc_dequantize_runs(const int8_t *q, const float *scale, float *dst, int64_t num_slots,
                          const int64_t *src_slots, const int64_t *dst_slots, int64_t q_stride,
                          int64_t s_stride, int64_t dst_stride, int64_t num_runs,
                          const run_t *runs, int64_t d, int64_t v) {
    const int64_t per_unit = d / v;
    for (int64_t b = 0; b < num_slots; ++b) {
        const int8_t *qs = q + src_slots[b] * q_stride;
        const float *ss = scale + src_slots[b] * s_stride;
        float *out = dst + dst_slots[b] * dst_stride;
        for (int64_t i = 0; i < num_runs; ++i) {
            float *o = out + runs[i].dst;
            if (runs[i].src < 0) {
                memset(o, 0, (size_t)(runs[i].len * d) * sizeof(float));
                continue;
            }
            const int8_t *qr = qs + runs[i].src * d;
            const float *sr = ss + runs[i].src * per_unit;
            for (int64_t r = 0; r < runs[i].len * per_unit; ++r)
                for (int64_t j = 0; j < v; ++j)
                    o[r * v + j] = (float)qr[r * v + j] * sr[r];
        }
    }
}
