/* CPU decode of the gated delta rule: one token per sequence, each sequence's state updated in
 * place in its slot.
 *
 * dasc_delta_decode: the update, one pass over each state.
 *
 * Per (sequence, head) row with state S [K, V] (FP32, row-major), the operands of
 * kernels/delta_rule/decode.py's `_operands` (decayed key wk and query wq [K], q . k,
 * v [V], beta, the decay d [1 or K], the key k [K]):
 *
 *     pk = wk^T S, pq = wq^T S          each column a fused multiply-add chain over k in order
 *     delta = (v - pk) * beta           o = pq + (q . k) * delta
 *     S[i] = fma(k[i], delta, S[i] * d[i])
 *
 * These are the torch path's own roundings: `embedding_bag`'s weighted sum is that FMA chain,
 * `mul_` then `addcmul_` round S * d and then fuse the add, and the other operations round one
 * by one (built with -ffp-contract=off), so both give the same bits
 * (tests/kernels/test_cpu_decode_native.py).  The torch path reads S three times and writes it
 * twice; here a head's state (64 KiB at 128 x 128) is read from memory once, then updated from
 * cache.  The AVX-512 form for V = 128 keeps both projections in registers and prefetches the
 * next head's state; any other shape or CPU takes the portable loop.
 */
#include "../cpu_simd.h"

static void head_portable(float *S, int64_t K, int64_t V, const float *wk, const float *wq,
                          float beta, float qk, const float *v, const float *k, const float *d,
                          int64_t per_k, float *o, float *delta) {
    for (int64_t j = 0; j < V; ++j) {
        float pk = 0.0f, pq = 0.0f;
        for (int64_t i = 0; i < K; ++i) {
            pk = fmaf(wk[i], S[i * V + j], pk);
            pq = fmaf(wq[i], S[i * V + j], pq);
        }
        delta[j] = (v[j] - pk) * beta;
        o[j] = pq + qk * delta[j];
    }
    for (int64_t i = 0; i < K; ++i) {
        const float di = per_k ? d[i] : d[0], ki = k[i];
        float *s = S + i * V;
        for (int64_t j = 0; j < V; ++j)
            s[j] = fmaf(ki, delta[j], s[j] * di);
    }
}

#ifdef HAVE_X86
__attribute__((target("avx512f,fma")))
static void head_avx512_v128(float *S, int64_t K, const float *wk, const float *wq, float beta,
                             float qk, const float *v, const float *k, const float *d,
                             int64_t per_k, float *o, const float *next) {
    __m512 pk[8], pq[8], delta[8];
    for (int t = 0; t < 8; ++t)
        pk[t] = pq[t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K; ++i) {
        const float *s = S + i * 128;
        if (next) {
            _mm_prefetch((const char *)(next + i * 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(next + i * 128 + 64), _MM_HINT_T0);
        }
        const __m512 a = _mm512_set1_ps(wk[i]), c = _mm512_set1_ps(wq[i]);
        for (int t = 0; t < 8; ++t) {
            const __m512 x = _mm512_loadu_ps(s + 16 * t);
            pk[t] = _mm512_fmadd_ps(a, x, pk[t]);
            pq[t] = _mm512_fmadd_ps(c, x, pq[t]);
        }
    }
    const __m512 b = _mm512_set1_ps(beta), kq = _mm512_set1_ps(qk);
    for (int t = 0; t < 8; ++t) {
        delta[t] = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + 16 * t), pk[t]), b);
        _mm512_storeu_ps(o + 16 * t, _mm512_add_ps(pq[t], _mm512_mul_ps(kq, delta[t])));
    }
    for (int64_t i = 0; i < K; ++i) {
        const __m512 di = _mm512_set1_ps(per_k ? d[i] : d[0]), ki = _mm512_set1_ps(k[i]);
        float *s = S + i * 128;
        for (int t = 0; t < 8; ++t) {
            const __m512 decayed = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * t), di);
            _mm512_storeu_ps(s + 16 * t, _mm512_fmadd_ps(ki, delta[t], decayed));
        }
    }
}
#endif

/* Rows b * H + h for b < num_seqs: state pool + slots[b] * slot_stride + h * K * V (floats).
 * wkq [rows, 2, K], qk [rows], v [rows, V], beta [rows], decay [rows, per_k ? K : 1],
 * k [rows, K], o [rows, V] (written), delta: V floats of scratch.  simd = 0 forces the
 * portable loop (tests). */
void dasc_delta_decode(float *pool, int64_t slot_stride, const int64_t *slots, int64_t num_seqs,
                       int64_t H, int64_t K, int64_t V, const float *wkq, const float *qk,
                       const float *v, const float *beta, const float *decay, int64_t per_k,
                       const float *k, float *o, float *delta, int64_t simd) {
#ifdef HAVE_X86
    const int fast = simd && V == 128 && __builtin_cpu_supports("avx512f")
                     && __builtin_cpu_supports("fma");
    if (fast) { /* each (sequence, head) on one OpenMP thread (the slots are distinct) */
#pragma omp parallel for schedule(static) if (num_seqs * H * K * V >= PARALLEL_MIN)
        for (int64_t row = 0; row < num_seqs * H; ++row) {
            const int64_t b = row / H, h = row % H;
            float *S = pool + slots[b] * slot_stride + h * K * V;
            const float *wk = wkq + row * 2 * K, *d = decay + row * (per_k ? K : 1);
            const float *next = h + 1 < H ? S + K * V
                                : b + 1 < num_seqs ? pool + slots[b + 1] * slot_stride : 0;
            head_avx512_v128(S, K, wk, wk + K, beta[row], qk[row], v + row * V, k + row * K, d,
                             per_k, o + row * V, next);
        }
        return;
    }
#else
    (void)simd;
#endif
    for (int64_t b = 0; b < num_seqs; ++b) {
        for (int64_t h = 0; h < H; ++h) {
            float *S = pool + slots[b] * slot_stride + h * K * V;
            const int64_t row = b * H + h;
            const float *wk = wkq + row * 2 * K, *d = decay + row * (per_k ? K : 1);
            head_portable(S, K, V, wk, wk + K, beta[row], qk[row], v + row * V, k + row * K, d,
                          per_k, o + row * V, delta);
        }
    }
}
