/* The coded form of a bf16 weight (included by kernels/gemv/gemv.c, which codes weights, and
 * kernels/moe_decode/experts.c): decoding a row's blocks, in the portable form and AVX-512's. */
#ifndef DASC_CPU_CODED_H
#define DASC_CPU_CODED_H

#include "cpu_simd.h"

/* The coded form of a bf16 weight (``CodedWeight``, kernels/gemv/__init__.py): the same values
 * in 12 bits an element instead of 16, so a decode step streams 3/4 of the bytes.  A bf16 value
 * is a low byte (the exponent's last bit, the 7 mantissa bits) and a high byte (the sign, the
 * exponent's first 7 bits).  Each row's 64-element blocks are stored as 96 bytes: the 64 low
 * bytes, then 32 bytes of 4-bit codes of the high bytes.  Code c < 14 stands for the high byte
 * (c & 1) << 7 | (base + (c >> 1)), base the block's header byte: the block's top exponents
 * in a window of 7; code 14 and 15 for 0x00 and 0x80 (zeros, subnormals, the least exponent).
 * A block whose high bytes do not fit (~2 % of a Gaussian weight's) has header RAW and keeps
 * its 64 high bytes in the row's side run, in block order.  Within a block, position q holds
 * element PERM(q), the order in which the AVX-512 form's byte interleave yields the elements
 * as 32-bit pairs (q < 32: the low nibble of code byte q; else the high nibble of byte
 * q - 32).  Decoding gives the weight's exact bits, and a kernel over the coded form sums in
 * its plain form's order, so both give the same bits. */
#define CODE_BLOCK 64
#define CODE_BYTES 96 /* a block's bytes: 64 low bytes, 32 of codes */
#define RAW 0xff
#define WINDOW 7
#define PERM(q) (((q) % 16 < 8 ? 0 : 32) + (q) / 16 * 8 + (q) % 8)

/* A coded matrix [n, k]: body [n, k / 64, 96], head [n, k / 64], side, side_at [n]. */
typedef struct {
    const uint8_t *body, *head, *side;
    const int64_t *side_at;
} Coded;

/* Row r's elements back in bf16 (the portable form's decoding). */
static void decode_row(const uint8_t *body, const uint8_t *head, const uint8_t *side,
                       const int64_t *side_at, int64_t k, int64_t r, uint16_t *row) {
    const int64_t blocks = k / CODE_BLOCK;
    const uint8_t *raw = side + side_at[r];
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *low = body + (r * blocks + b) * CODE_BYTES, *codes = low + CODE_BLOCK;
        const int base = head[r * blocks + b];
        for (int q = 0; q < CODE_BLOCK; ++q) {
            int high;
            if (base == RAW) {
                high = raw[q];
            } else {
                const int c = (codes[q % 32] >> (q < 32 ? 0 : 4)) & 0xf;
                high = c < 14 ? (c & 1) << 7 | (base + (c >> 1)) : (c - 14) << 7;
            }
            row[b * CODE_BLOCK + PERM(q)] = (uint16_t)(high << 8 | low[q]);
        }
        raw += base == RAW ? CODE_BLOCK : 0;
    }
}

#ifdef HAVE_X86
/* The 64 elements of one row's block: its high bytes looked up from the codes (or
 * read from the side run), interleaved with the low bytes into two vectors of 32-bit pairs,
 * elements 0-31 and 32-63. */
AVX512 static inline __attribute__((always_inline)) void
decode_block(const uint8_t *block, int base, const uint8_t *raw, __m512i *first, __m512i *second) {
    __m512i high;
    if (__builtin_expect(base == RAW, 0)) {
        high = _mm512_loadu_si512(raw);
    } else {
        /* byte c of each 16-byte lane: the high byte code c stands for */
        const __m512i codes_table = _mm512_broadcast_i32x4(_mm_setr_epi8(
            0, (char)0x80, 1, (char)0x81, 2, (char)0x82, 3, (char)0x83, 4, (char)0x84, 5,
            (char)0x85, 6, (char)0x86, 0, (char)0x80));
        const __m512i table = _mm512_mask_add_epi8(codes_table, 0x3fff3fff3fff3fffULL, codes_table,
                                                   _mm512_set1_epi8((char)base));
        /* the 32 code bytes in both halves; the upper half shifted to its high nibbles */
        const __m512i both = _mm512_broadcast_i64x4(
            _mm256_loadu_si256((const __m256i *)(block + CODE_BLOCK)));
        const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
        const __m512i codes = _mm512_and_si512(_mm512_srlv_epi16(both, shift),
                                               _mm512_set1_epi8(0x0f));
        high = _mm512_shuffle_epi8(table, codes);
    }
    const __m512i low = _mm512_loadu_si512(block);
    *first = _mm512_unpacklo_epi8(low, high);
    *second = _mm512_unpackhi_epi8(low, high);
}

#endif

#endif
