/* Causal attention of a prefill chunk on AMX tiles: CPU, bf16, one sequence per call.
 *
 * Queries q [n, H, D] (bf16, contiguous) sit at positions prefix .. prefix + n - 1 and attend
 * over the keys and values of positions 0 .. prefix + n - 1, which lie in the KV pool where
 * rows[j] says (row r: key head g at pool + r * row_stride + g * D, its value v_offset further,
 * bf16).  Query head h reads KV head h / (H / Hkv).  The arithmetic is that of torch's flash
 * attention on a CPU (``F.scaled_dot_product_attention``, which it stands in for):
 *
 *     s = (q . k) scale      from bf16 operands, FP32 sums (AMX);
 *     m, l, o                a row's running max, sum and output over key blocks of KB keys,
 *                            o <- o exp(m_old - m) + bf16(exp(s - m)) . v (FP32 sums, AMX);
 *     out = bf16(o / l).
 *
 * A query row's result depends on that row and the key blocks alone, and the blocks start at
 * position 0 whatever the chunk: a block past a row's last key (masked whole) is skipped for
 * that row, so the row's max, sum and output do not depend on the chunk the query arrives in,
 * nor on the other rows of its tile (a prompt prefilled at once or after a cached prefix gets
 * the same bits).  Tests: tests/kernels/test_cpu_prefill_attention.py.
 *
 * A work item is one KV head's query heads over a group of query tiles, whose running softmax
 * states (~48 KB a tile and head pair) stay in L2 while each key block is read once for all of
 * them; a tile sees the blocks in the same order whatever its group, so the bits do not depend
 * on the grouping or the thread count.
 */
#define _GNU_SOURCE /* syscall */
#include "../cpu_simd.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define QT 16     /* query rows per tile */
#define KB 64     /* keys per block */
#define MAX_D 256 /* head dims up to this, multiples of 64 */
#define MAX_STATES 16 /* query tile states a work item keeps (~48 KB each) */

#ifdef HAVE_X86
#include "../cpu_amx.h"

/* The 16 x 16 32-bit matrix r[j][c] -> r[c][j], in registers. */
AVX512 static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* r[4 i + k], 128-bit lane L: column 4 L + k of rows 4 i .. 4 i + 3 */
    for (int i = 0; i < 2; ++i)
        for (int k = 0; k < 4; ++k) {
            t[8 * i + k] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + 4 + k], 0x88);
            t[8 * i + 4 + k] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + 4 + k], 0xdd);
        }
    for (int k = 0; k < 8; ++k) {
        r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
        r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
    }
}

/* One KV head's keys and values as AMX B tiles of 1 KB each, 16 rows of 16 32-bit pairs, keys
 * past L zero.  Keys in pairs of channels: tile (b, t) holds Kp[c][j] = k_j[2c] | k_j[2c + 1]
 * << 16 for the 16 keys j of block b and the 16 pairs c of channels [32 t, 32 t + 32), at
 * Kp + (b D / 32 + t) 256.  Values in pairs of keys: tile (b, t) holds v_j[d] | v_{j+1}[d] << 16
 * for the 16 pairs of keys j of block b (32 keys) and the 16 channels d of [16 t, 16 t + 16),
 * at Vp + (b D / 16 + t) 256. */
AVX512 static void pack_kv(const uint16_t *pool, int64_t row_stride, int64_t v_offset,
                           const int64_t *rows, int64_t L, int64_t Lp, int64_t D, int64_t g,
                           uint32_t *Kp, uint32_t *Vp) {
    /* keys: 16 keys' rows of 16 channel pairs at a time, transposed in registers */
    for (int64_t j0 = 0; j0 < Lp; j0 += 16) {
        const uint32_t *k[16];
        for (int j = 0; j < 16; ++j)
            k[j] = j0 + j < L ? (const uint32_t *)(pool + rows[j0 + j] * row_stride + g * D)
                              : NULL;
        for (int64_t t = 0; t < D / 32; ++t) {
            __m512i r[16];
            for (int j = 0; j < 16; ++j)
                r[j] = k[j] ? _mm512_loadu_si512(k[j] + 16 * t) : _mm512_setzero_si512();
            transpose16(r);
            uint32_t *dst = Kp + (j0 / 16 * (D / 32) + t) * 256;
            for (int c = 0; c < 16; ++c)
                _mm512_storeu_si512(dst + 16 * c, r[c]);
        }
    }
    for (int64_t j = 0; j < Lp; j += 2) {
        const uint16_t *a = j < L ? pool + rows[j] * row_stride + v_offset + g * D : NULL;
        const uint16_t *b = j + 1 < L ? pool + rows[j + 1] * row_stride + v_offset + g * D
                                      : NULL;
        uint32_t *dst = Vp + j / 32 * (D / 16) * 256 + j / 2 % 16 * 16;
        for (int64_t d = 0; d < D; d += 16) {
            const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + d)))
                                 : _mm512_setzero_si512();
            const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + d)))
                                 : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + d / 16 * 256, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* The lanes of keys kb + 16 v + [0, 16) at or before position last. */
static inline __mmask16 visible(int64_t kb, int v, int64_t last) {
    const int64_t first = kb + 16 * v, count = last - first + 1;
    return count >= 16 ? 0xffff : count <= 0 ? 0 : (__mmask16)((1u << count) - 1);
}

/* A head's running softmax over a block for its 16 query rows: S [QT, KB] the block's scores
 * (unscaled), m, l the rows' max and sum, O [QT, D] their output; P [QT, KB] gets
 * bf16(exp(s - m)), 0 past a row's last key.  Each row's max first, then one exponential for
 * the 16 rows' rescale factors. */
__attribute__((target("avx512f,avx512bw,avx512bf16,fma")))
static void block_softmax(const float *S, int64_t kb, int64_t first_last, int64_t rows,
                          float scale, int64_t D, float *m, float *l, float *O, uint16_t *P) {
    const __m512 vscale = _mm512_set1_ps(scale);
    float m_new[QT] __attribute__((aligned(64)));
    for (int64_t r = 0; r < QT; ++r) {
        const int64_t row_last = r < rows ? first_last + r : -1;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int v = 0; v < 4 && row_last >= kb; ++v)
            mx = _mm512_mask_max_ps(mx, visible(kb, v, row_last), mx,
                                    _mm512_mul_ps(_mm512_loadu_ps(S + r * KB + 16 * v), vscale));
        m_new[r] = fmaxf(m[r], _mm512_reduce_max_ps(mx));
    }
    const __m512 m_old = _mm512_loadu_ps(m), m_now = _mm512_loadu_ps(m_new);
    /* exp(m_old - m_new); 0 where nothing was seen before, 1 where the max stays */
    __m512 alpha = exp16(_mm512_sub_ps(m_old, m_now));
    alpha = _mm512_maskz_mov_ps(
        _mm512_cmp_ps_mask(m_old, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), alpha);
    alpha = _mm512_mask_mov_ps(alpha, _mm512_cmp_ps_mask(m_old, m_now, _CMP_EQ_OQ),
                               _mm512_set1_ps(1.0f));
    float a[QT] __attribute__((aligned(64)));
    _mm512_storeu_ps(a, alpha);
    for (int64_t r = 0; r < QT; ++r) {
        uint16_t *pr = P + r * KB;
        const int64_t row_last = r < rows ? first_last + r : -1;
        if (row_last < kb) { /* the whole block is past this row's keys */
            memset(pr, 0, KB * 2);
            continue;
        }
        const __m512 mb = _mm512_set1_ps(m_new[r]);
        __m512 sum = _mm512_setzero_ps();
        for (int v = 0; v < 4; ++v) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(S + r * KB + 16 * v), vscale);
            const __m512 e = _mm512_maskz_mov_ps(visible(kb, v, row_last),
                                                 exp16(_mm512_sub_ps(x, mb)));
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i *)(pr + 16 * v), (__m256i)_mm512_cvtneps_pbh(e));
        }
        l[r] = l[r] * a[r] + hsum16(sum);
        if (a[r] != 1.0f) {
            const __m512 va = _mm512_set1_ps(a[r]);
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(O + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(O + r * D + d), va));
        }
        m[r] = m_new[r];
    }
}

/* The running softmax of one tile of query rows for one or two heads (one KV head's): their
 * queries, max, sum and output over the key blocks seen so far. */
typedef struct {
    uint16_t Qb[2][QT * MAX_D];
    float O[2][QT * MAX_D];
    float m[2][QT], l[2][QT];
} TileState;

/* Query rows [i0, i0 + rows) of heads h and, with nh = 2, h + 1: their queries, nothing seen. */
static void tile_start(TileState *st, const uint16_t *q, int64_t H, int64_t D, int64_t h, int nh,
                       int64_t i0, int64_t rows) {
    for (int e = 0; e < 2; ++e) {
        for (int64_t r = 0; r < QT; ++r) {
            if (e < nh && r < rows)
                memcpy(st->Qb[e] + r * D, q + ((i0 + r) * H + h + e) * D, (size_t)D * 2);
            else
                memset(st->Qb[e] + r * D, 0, (size_t)D * 2);
            st->m[e][r] = -INFINITY;
            st->l[e][r] = 0.0f;
        }
        memset(st->O[e], 0, sizeof(float) * QT * (size_t)D);
    }
}

/* The tile's rows (the first at position first_last) over key block kb: scores, softmax, and
 * the block's values into the output.  Two heads share each key and value tile loaded. */
__attribute__((target("avx512f,avx512bw,avx512bf16,fma,amx-tile,amx-bf16")))
static void tile_block(TileState *st, int nh, int64_t kb, int64_t first_last, int64_t rows,
                       int64_t D, float scale, const uint32_t *Kp, const uint32_t *Vp) {
    uint16_t P[2][QT * KB] __attribute__((aligned(64)));
    float S[2][QT * KB] __attribute__((aligned(64)));
    const int64_t kt = D / 32 * 256; /* one block of 16 keys' tiles */
    /* S [QT, KB] = Q K^T per head: 32 keys at a time, tiles (head, 16 keys) */
    for (int64_t half = 0; half < 2; ++half) {
        const uint32_t *k0 = Kp + (kb / 16 + 2 * half) * kt;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t = 0; t < D / 32; ++t) {
            _tile_loadd(4, st->Qb[0] + 32 * t, D * 2);
            _tile_loadd(6, k0 + t * 256, 64);
            _tile_loadd(7, k0 + kt + t * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (nh == 2) {
                _tile_loadd(5, st->Qb[1] + 32 * t, D * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, S[0] + 32 * half, KB * 4);
        _tile_stored(1, S[0] + 32 * half + 16, KB * 4);
        if (nh == 2) {
            _tile_stored(2, S[1] + 32 * half, KB * 4);
            _tile_stored(3, S[1] + 32 * half + 16, KB * 4);
        }
    }
    for (int e = 0; e < nh; ++e)
        block_softmax(S[e], kb, first_last, rows, scale, D, st->m[e], st->l[e], st->O[e], P[e]);
    /* O += P V per head: per 16 output columns, two steps of 32 keys */
    _tile_loadd(4, P[0], KB * 2);
    _tile_loadd(5, P[0] + 32, KB * 2);
    if (nh == 2) {
        _tile_loadd(6, P[1], KB * 2);
        _tile_loadd(7, P[1] + 32, KB * 2);
    }
    const uint32_t *vp = Vp + kb / 32 * (D / 16) * 256, *vq = vp + (D / 16) * 256;
    for (int64_t c = 0; c < D; c += 16) {
        _tile_loadd(0, st->O[0] + c, D * 4);
        _tile_loadd(2, vp + c * 16, 64);
        _tile_loadd(3, vq + c * 16, 64);
        _tile_dpbf16ps(0, 4, 2);
        if (nh == 2) {
            _tile_loadd(1, st->O[1] + c, D * 4);
            _tile_dpbf16ps(1, 6, 2);
            _tile_dpbf16ps(1, 7, 3);
            _tile_stored(1, st->O[1] + c, D * 4);
        }
        _tile_dpbf16ps(0, 5, 3);
        _tile_stored(0, st->O[0] + c, D * 4);
    }
}

/* The tile's output rows: bf16(o / l). */
__attribute__((target("avx512f,avx512bw,avx512bf16,fma")))
static void tile_finish(const TileState *st, int64_t H, int64_t D, int64_t h, int nh,
                               int64_t i0, int64_t rows, uint16_t *out) {
    for (int e = 0; e < nh; ++e)
        for (int64_t r = 0; r < rows; ++r) {
            const __m512 vl = _mm512_set1_ps(st->l[e][r]);
            uint16_t *o = out + ((i0 + r) * H + h + e) * D;
            for (int64_t d = 0; d < D; d += 16) {
                const __m256bh b = _mm512_cvtneps_pbh(
                    _mm512_div_ps(_mm512_loadu_ps(st->O[e] + r * D + d), vl));
                _mm256_storeu_si256((__m256i *)(o + d), (__m256i)b);
            }
        }
}
#endif

/* The chunk's attention into out [n, H, D] (bf16).  Returns 0, -1 where it does not run here
 * (no AMX, D not a multiple of 64 or above MAX_D, H not a multiple of Hkv) and -2 where its
 * scratch could not be allocated; then nothing is written. */
int dasc_attention_prefill(const uint16_t *q, const uint16_t *pool, int64_t row_stride,
                           int64_t v_offset, const int64_t *rows, int64_t prefix, int64_t n,
                           int64_t H, int64_t Hkv, int64_t D, float scale, uint16_t *out,
                           int64_t threads) {
#ifdef HAVE_X86
    if (!amx_usable() || D % 64 || D > MAX_D || Hkv < 1 || H % Hkv || n < 1 || prefix < 0)
        return -1;
    const int64_t L = prefix + n, Lp = (L + KB - 1) / KB * KB, ratio = H / Hkv;
    const int64_t per_head = (D / 2) * Lp + (Lp / 2) * D; /* Kp, then Vp */
    const size_t bytes = ((size_t)(Hkv * per_head) * sizeof(uint32_t) + 63) / 64 * 64;
    uint32_t *packed = aligned_alloc(64, bytes);
    if (!packed)
        return -2;
    /* A work item is a KV head's query heads (units of one or two heads) over a group of query
     * tiles, their states in L2: each key block is read once for the whole group, a unit's
     * rows see the blocks in order from position 0, whatever the group. */
    const int64_t workers = threads > 0 ? threads : 1, tiles = (n + QT - 1) / QT;
    const int nh = ratio % 2 ? 1 : 2;
    const int64_t units = ratio / nh, group = units >= MAX_STATES ? 1 : MAX_STATES / units;
    const int64_t groups = (tiles + group - 1) / group;
    const int64_t per_worker = group * units;
    TileState *states = aligned_alloc(64, sizeof(TileState) * (size_t)(per_worker * workers));
    if (!states) {
        free(packed);
        return -2;
    }
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)workers) schedule(static)
#endif
    for (int64_t g = 0; g < Hkv; ++g)
        pack_kv(pool, row_stride, v_offset, rows, L, Lp, D, g, packed + g * per_head,
                packed + g * per_head + (D / 2) * Lp);
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)workers) schedule(dynamic)
#endif
    for (int64_t item = 0; item < Hkv * groups; ++item) {
#ifdef _OPENMP
        TileState *mine = states + per_worker * omp_get_thread_num();
#else
        TileState *mine = states;
#endif
        const int64_t g = item / groups, t0 = item % groups * group;
        const int64_t t1 = t0 + group < tiles ? t0 + group : tiles;
        const uint32_t *Kp = packed + g * per_head, *Vp = Kp + (D / 2) * Lp;
        for (int64_t t = t0; t < t1; ++t)
            for (int64_t u = 0; u < units; ++u)
                tile_start(mine + (t - t0) * units + u, q, H, D, g * ratio + u * nh, nh, t * QT,
                           n - t * QT < QT ? n - t * QT : QT);
        amx_configure();
        const int64_t last = prefix + (t1 * QT < n ? t1 * QT : n) - 1;
        for (int64_t kb = 0; kb <= last; kb += KB)
            for (int64_t t = t0; t < t1; ++t) {
                const int64_t rows = n - t * QT < QT ? n - t * QT : QT;
                if (kb > prefix + t * QT + rows - 1) /* past the tile's last key */
                    continue;
                for (int64_t u = 0; u < units; ++u)
                    tile_block(mine + (t - t0) * units + u, nh, kb, prefix + t * QT, rows, D,
                               scale, Kp, Vp);
            }
        amx_release();
        for (int64_t t = t0; t < t1; ++t)
            for (int64_t u = 0; u < units; ++u)
                tile_finish(mine + (t - t0) * units + u, H, D, g * ratio + u * nh, nh, t * QT,
                            n - t * QT < QT ? n - t * QT : QT, out);
    }
    free(states);
    free(packed);
    return 0;
#else
    (void)q, (void)pool, (void)row_stride, (void)v_offset, (void)rows, (void)prefix, (void)n;
    (void)H, (void)Hkv, (void)D, (void)scale, (void)out, (void)threads;
    return -1;
#endif
}

/* 1 where dasc_attention_prefill runs here (a CPU with AMX-BF16, the tile state granted). */
int dasc_attention_prefill_amx(void) {
#ifdef HAVE_X86
    return amx_usable();
#else
    return 0;
#endif
}
