#include "../cpu_simd.h"

#include <omp.h>

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
/* Rows of values a block of attend_seq's second pass holds in cache (every KV head's values:
 * 16 KB at two heads of 256 in bf16) while it runs each head's column blocks over them. */
#define VALUE_BLOCK_ROWS 16
/* Rows ahead the first pass asks for (their keys). */
#define PREFETCH_ROWS 8

/* The first pass over rows j .. j + nr - 1 (nr = 1 or 2, a constant where inlined: two rows
 * give each query head two independent fma chains): s[(g * r + i) * n + j] = q_i . k_j for
 * every KV head g.  The keys of the rows PREFETCH_ROWS ahead are asked for a line at a time as
 * the keys are read, not a row at once: a burst of requests stalls on the core's few
 * outstanding misses. */
AVX512 static inline __attribute__((always_inline)) void
key_rows(const float *qf, const int64_t r, int64_t Hkv, const char *cache, int64_t row_stride,
         const int64_t *rows, int64_t n, int64_t j, const int64_t nr, int64_t D, int bf16,
         float *s) {
    const int64_t elem = bf16 ? 2 : 4;
    const char *row[2], *ahead[2];
    for (int64_t t = 0; t < nr; ++t) {
        row[t] = cache + rows[j + t] * row_stride * elem;
        ahead[t] = j + t + PREFETCH_ROWS < n
                       ? cache + rows[j + t + PREFETCH_ROWS] * row_stride * elem : NULL;
    }
    for (int64_t g = 0; g < Hkv; ++g) {
        const float *qg = qf + g * r * D;
        __m512 a[2][16];
        for (int64_t t = 0; t < nr; ++t)
            for (int64_t i = 0; i < r; ++i)
                a[t][i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 16) {
            const int64_t at = (g * D + c) * elem;
            __m512 kc[2];
            for (int64_t t = 0; t < nr; ++t) {
                if (at % 64 == 0 && ahead[t])
                    _mm_prefetch(ahead[t] + at, _MM_HINT_T1);
                kc[t] = load16(row[t], g * D + c, bf16);
            }
            for (int64_t i = 0; i < r; ++i) {
                const __m512 qc = _mm512_loadu_ps(qg + i * D + c);
                for (int64_t t = 0; t < nr; ++t)
                    a[t][i] = _mm512_fmadd_ps(qc, kc[t], a[t][i]);
            }
        }
        for (int64_t t = 0; t < nr; ++t)
            for (int64_t i = 0; i < r; ++i)
                s[(g * r + i) * n + j + t] = hsum16(a[t][i]);
    }
}

/* The second pass's sums for one KV head g over rows [j0, j1): the r query heads' columns
 * [c0, c0 + 16 * width) of acc, each summing over j in order; width is a constant where
 * inlined, so the r * width <= 16 sums stay in registers.  Asks for the next block's values
 * (`per` lines a row, from *pf_row / *pf_at on). */
AVX512 static inline __attribute__((always_inline)) void
value_cols(const char *cache, int64_t row_stride, int64_t v_offset, const int64_t *rows,
           int64_t n, int64_t j0, int64_t j1, const int64_t r, int64_t D, int64_t g, int64_t c0,
           const int64_t width, int bf16, const float *sg, float *ag, int64_t per,
           int64_t row_bytes, int64_t *pf_row, int64_t *pf_at) {
    const int64_t elem = bf16 ? 2 : 4;
    __m512 a[16];
    for (int64_t i = 0; i < r; ++i)
        for (int64_t c = 0; c < width; ++c)
            a[i * width + c] = _mm512_loadu_ps(ag + i * D + 16 * c);
    for (int64_t j = j0; j < j1; ++j) {
        for (int64_t t = 0; t < per && *pf_row < n; ++t) {
            _mm_prefetch(cache + (rows[*pf_row] * row_stride + v_offset) * elem + *pf_at,
                         _MM_HINT_T1);
            if ((*pf_at += 64) >= row_bytes) {
                *pf_at = 0;
                ++*pf_row;
            }
        }
        const char *v = cache + (rows[j] * row_stride + v_offset + g * D) * elem;
        for (int64_t c = 0; c < width; ++c) {
            const __m512 vc = load16(v, c0 + 16 * c, bf16);
            for (int64_t i = 0; i < r; ++i)
                a[i * width + c] =
                    _mm512_fmadd_ps(_mm512_set1_ps(sg[i * n + j]), vc, a[i * width + c]);
        }
    }
    for (int64_t i = 0; i < r; ++i)
        for (int64_t c = 0; c < width; ++c)
            _mm512_storeu_ps(ag + i * D + 16 * c, a[i * width + c]);
}

/* attend_group's AVX-512 form (D % 16 == 0, r <= 16) for all Hkv KV heads of one sequence at
 * once, the portable form's sums in the same orders (so the same bits), the rows read in two
 * passes: the first reads each row's keys of every KV head (one contiguous span), two rows at
 * a time, the second its values, a block of rows at a time, each (query head, 16 columns)
 * summing over j in order through acc [H, D] between blocks, while the next block's values
 * are asked for a few lines an iteration.  A step's KV rows come from memory, not cache (the
 * weights streamed since evict them). */
AVX512 static inline __attribute__((always_inline)) void
attend_seq_avx512(const float *qf, int64_t r, int64_t Hkv, const char *cache, int64_t row_stride,
                  int64_t v_offset, const int64_t *rows, int64_t n, int64_t D, float scale,
                  int bf16, float *s, float *acc, void *out) {
    const int64_t H = r * Hkv, elem = bf16 ? 2 : 4;
    int64_t j = 0;
    if (r <= 8) /* two rows' sums fit the registers */
        for (; j + 2 <= n; j += 2)
            key_rows(qf, r, Hkv, cache, row_stride, rows, n, j, 2, D, bf16, s);
    for (; j < n; ++j)
        key_rows(qf, r, Hkv, cache, row_stride, rows, n, j, 1, D, bf16, s);
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (int64_t h = 0; h < H; ++h) {
        for (j = 0; j < n; j += 16) {
            const __mmask16 keep = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
            const __m512 raw = _mm512_maskz_loadu_ps(keep, s + h * n + j);
            _mm512_mask_storeu_ps(s + h * n + j, keep,
                                  round16(_mm512_mul_ps(round16(raw, bf16), scale16), bf16));
        }
        softmax_avx512(s + h * n, n, bf16);
    }
    memset(acc, 0, (size_t)(H * D) * sizeof(float));
    const int64_t group = 16 / r; /* 16-wide column blocks per pass: r * group <= 16 */
    /* the next block's values (Hkv * D * elem bytes a row) over this block's Hkv * passes *
     * VALUE_BLOCK_ROWS iterations: `per` lines an iteration */
    const int64_t passes = (D + 16 * group - 1) / (16 * group), row_bytes = Hkv * D * elem;
    const int64_t per = (D * elem + 64 * passes - 1) / (64 * passes);
    int64_t pf_row = 0, pf_at = 0;
    for (int64_t j0 = 0; j0 < n; j0 += VALUE_BLOCK_ROWS) {
        const int64_t j1 = n - j0 < VALUE_BLOCK_ROWS ? n : j0 + VALUE_BLOCK_ROWS;
        if (pf_row < j1) { /* fell behind: start at the next block */
            pf_row = j1;
            pf_at = 0;
        }
        for (int64_t g = 0; g < Hkv; ++g)
            for (int64_t c0 = 0; c0 < D; c0 += 16 * group) {
                float *ag = acc + g * r * D + c0;
                const float *sg = s + g * r * n;
                if (D - c0 >= 16 * group) /* a whole block: its width a constant */
                    value_cols(cache, row_stride, v_offset, rows, n, j0, j1, r, D, g, c0, group,
                               bf16, sg, ag, per, row_bytes, &pf_row, &pf_at);
                else
                    value_cols(cache, row_stride, v_offset, rows, n, j0, j1, r, D, g, c0,
                               (D - c0) / 16, bf16, sg, ag, per, row_bytes, &pf_row, &pf_at);
            }
    }
    for (int64_t a = 0; a < H * D; a += 16)
        store16(out, a, _mm512_loadu_ps(acc + a), bf16);
}

/* attend_seq_avx512 inlined for each common group size r = H / Hkv, so that the accumulators
 * stay in registers. */
AVX512 static void attend_seq_fast(const float *qf, int64_t r, int64_t Hkv, const char *cache,
                                   int64_t row_stride, int64_t v_offset, const int64_t *rows,
                                   int64_t n, int64_t D, float scale, int bf16, float *s,
                                   float *acc, void *out) {
#define ATTEND_SEQ(R) attend_seq_avx512(qf, R, Hkv, cache, row_stride, v_offset, rows, n, D, \
                                        scale, bf16, s, acc, out)
    switch (r) {
    case 1: ATTEND_SEQ(1); break;
    case 2: ATTEND_SEQ(2); break;
    case 4: ATTEND_SEQ(4); break;
    case 8: ATTEND_SEQ(8); break;
    default: ATTEND_SEQ(r);
    }
#undef ATTEND_SEQ
}
#endif

/* Sequence b (rows index[starts[b] + j], j < n), KV head g (base: the cache offset to its
 * key): the r query rows qf [r, D] (FP32) -> out rows [r, D] (the model dtype).  s: scratch
 * [r, n]. */
static void attend_group(const float *qf, int64_t r, const char *base, int64_t row_stride,
                         int64_t v_offset, const int64_t *rows, int64_t n, int64_t D,
                         float scale, int bf16, float *s, void *out) {
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
    const int64_t per = H * longest + 2 * H * D; /* one sequence's scratch floats */
#ifdef HAVE_X86
    if (simd_ok(D, simd) && r <= 16) {
        /* each sequence on one OpenMP thread, with its own scratch */
        const int parallel = B > 1 && B * longest * Hkv * D >= PARALLEL_MIN;
        const int64_t workers = parallel ? omp_get_max_threads() : 1;
        float *all = malloc(sizeof(float) * (size_t)(per * workers));
        if (!all)
            return -1;
#pragma omp parallel for schedule(dynamic) num_threads((int)workers) if (parallel)
        for (int64_t b = 0; b < B; ++b) {
            float *s = all + omp_get_thread_num() * per, *qf = s + H * longest;
            for (int64_t a = 0; a < H * D; ++a)
                qf[a] = load_elem(q, b * H * D + a, (int)bf16);
            attend_seq_fast(qf, r, Hkv, (const char *)cache, row_stride, v_offset,
                            index + starts[b], lens[b], D, scale, (int)bf16, s, qf + H * D,
                            (char *)out + b * H * D * elem);
        }
        free(all);
        return 0;
    }
#else
    (void)simd;
#endif
    float *s = malloc(sizeof(float) * (size_t)per);
    if (!s)
        return -1;
    float *qf = s + H * longest;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t g = 0; g < Hkv; ++g) {
            const int64_t first = (b * H + g * r) * D;
            for (int64_t a = 0; a < r * D; ++a)
                qf[a] = load_elem(q, first + a, (int)bf16);
            attend_group(qf, r, (const char *)cache + g * D * elem, row_stride, v_offset,
                         index + starts[b], lens[b], D, scale, (int)bf16, s,
                         (char *)out + first * elem);
        }
    free(s);
    return 0;
}

/* 1 where the AVX-512 forms run on this CPU; the portable forms (a scalar exponential) are
 * references, slower than torch's products. */
int dasc_attention_simd(void) {
#ifdef HAVE_X86
    return simd_ok(16, 1);
#else
    return 0;
#endif
}
