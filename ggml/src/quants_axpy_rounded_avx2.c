// quants_axpy_rounded_avx2.c: axpy8_rounded for Q4_K and Q5_0 on the integer units (AVX2): y += sum of a[r] * rows[r] over
// 8 rows, each row's coefficient a[r] * d * sc rounded to a multiple of 1/127 of the 8 rows' largest in that
// sub-block of 32 values, as mul_mat rounds its activations to 8 bits (what axpy_rows runs unless precise).
// The float axpy4 converts every level to a float and spends an FMA on it (about 1 instruction a weight: 10 G
// weights/s on one Zen 4 core, in cache); here the rows' levels are interleaved byte by byte, multiplied by
// their coefficients and summed 4 rows at a time with maddubs and 8 with madd, and converted once per 8 rows
// (22 G weights/s). Q4_K's minimums stay exact (a float per sub-block and row). Q8_0 measured no faster this
// way (its float kernel is already near memory speed), so it keeps axpy4.
// With AVX512-VNNI and VBMI the same sums go through byte permutes and vpdpbusd instead (below), bit for bit.
// Checked against float64 numpy within the rounding's bound, and the two ISAs against each other
// (tests/test_quants.py).
#include "ggml-impl.h"
#include "quants.h"
#include "quants_avx2.h"

#include <immintrin.h>
#include <stdbool.h>
#include <stddef.h>

// value j of row r at byte 4 j + r, 8 values a vector in value order: the dword permutation places the bytes
// that the two unpack levels take from each 128-bit lane so that their outputs come out in order
static inline void interleave4(const __m256i q[4], __m256i v[4]) {
    const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m256i p[4];
    for (int r = 0; r < 4; r++) p[r] = _mm256_permutevar8x32_epi32(q[r], perm);
    const __m256i lo01 = _mm256_unpacklo_epi8(p[0], p[1]), hi01 = _mm256_unpackhi_epi8(p[0], p[1]);
    const __m256i lo23 = _mm256_unpacklo_epi8(p[2], p[3]), hi23 = _mm256_unpackhi_epi8(p[2], p[3]);
    v[0] = _mm256_unpacklo_epi16(lo01, lo23); // values 0..7
    v[1] = _mm256_unpackhi_epi16(lo01, lo23); // 8..15
    v[2] = _mm256_unpacklo_epi16(hi01, hi23); // 16..23
    v[3] = _mm256_unpackhi_epi16(hi01, hi23); // 24..31
}

// the 8 rows' coefficients of 8 sub-blocks, c[r], as signed bytes [r0 r1 r2 r3] (lo) and [r4 r5 r6 r7] (hi) per
// sub-block, in units of the sub-block's largest / 127 (unit)
struct rounded_coefs {
    uint32_t lo[8], hi[8];
    float unit[8];
};

static inline void round_coefs(const __m256 c[8], struct rounded_coefs *out) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    __m256 largest = zero;
    for (int r = 0; r < 8; r++) largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign_bit, c[r]));
    // sub-blocks whose 8 coefficients are all 0 get 0 levels (not 0 / 0)
    const __m256 inv = _mm256_and_ps(_mm256_cmp_ps(largest, zero, _CMP_GT_OQ), _mm256_div_ps(_mm256_set1_ps(127.0f), largest));
    __m256i q[8];
    for (int r = 0; r < 8; r++) q[r] = _mm256_cvtps_epi32(_mm256_mul_ps(c[r], inv));
    // bytes r * 4 + b of each lane (sub-blocks b = 0..3, then 4..7) to b * 4 + r
    const __m256i transpose = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                               0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i lo = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i hi = _mm256_packs_epi16(_mm256_packs_epi32(q[4], q[5]), _mm256_packs_epi32(q[6], q[7]));
    _mm256_storeu_si256((__m256i *)out->lo, _mm256_shuffle_epi8(lo, transpose));
    _mm256_storeu_si256((__m256i *)out->hi, _mm256_shuffle_epi8(hi, transpose));
    _mm256_storeu_ps(out->unit, _mm256_mul_ps(largest, _mm256_set1_ps(1.0f / 127.0f)));
}

// bytes [offset, offset + bytes) of each of the 8 rows into L1, for a step a few ahead: the first loads of a step
// (the blocks' scales, which every sum of the step waits on) had missed the caches, and the out-of-order window,
// full of one step's sums, could not reach the next step's loads (a 3 MB Q5_0 matrix from memory: 2.2 -> 1.5x a
// GEMV's time over the same bytes)
static inline void prefetch_rows8(const void *const *rows, size_t offset, size_t bytes) {
    for (int r = 0; r < 8; r++) avx2_prefetch_span_l1((const char *)rows[r] + offset, bytes);
}

// the sum over 8 rows of level * rounded coefficient for 8 values, as int32: unsigned levels of rows 0..3 and
// 4..7 interleaved (l0, l1), their coefficients as 4 bytes each (k0, k1); maddubs' pairs stay within int16 for
// levels up to 31 (2 * 31 * 127, twice that after the add)
static inline __m256i dot8(__m256i l0, __m256i l1, __m256i k0, __m256i k1) {
    const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(l0, k0), _mm256_maddubs_epi16(l1, k1));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

// y[0..8) += unit * sum + offset
static inline void add8(float *y, __m256i sum, __m256 unit, __m256 offset) {
    _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), unit, offset)));
}

#define Q4K_AHEAD 3 // super-blocks (432 bytes) ahead that a Q4_K step asks for; 1, 2 and 3 measured alike
// Q4_K: super-block i (of nsb) of the 8 rows (x), their coefficients a * d * sc rounded (k) and minus the sum over
// the rows of a * dmin * m (minf), per sub-block, super-block i + Q4K_AHEAD asked for: both ISAs' step begins so
static inline void q4_K_step_coefs(const void *const *rows, int64_t i, int64_t nsb, const float *a,
                                   const block_q4_K *x[8], struct rounded_coefs *k, float minf[8]) {
    if (i + Q4K_AHEAD < nsb) prefetch_rows8(rows, (i + Q4K_AHEAD) * sizeof(block_q4_K), sizeof(block_q4_K));
    __m256 c[8], mins = _mm256_setzero_ps();
    for (int r = 0; r < 8; r++) {
        x[r] = (const block_q4_K *)rows[r] + i;
        uint64_t sc_bytes, m_bytes;
        ggml_q4_K_scales_mins(x[r]->scales, &sc_bytes, &m_bytes);
        const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc_bytes)));
        const __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m_bytes)));
        c[r] = _mm256_mul_ps(_mm256_set1_ps(a[r] * _cvtsh_ss(x[r]->d)), scf);
        mins = _mm256_fmadd_ps(_mm256_set1_ps(-a[r] * _cvtsh_ss(x[r]->dmin)), mf, mins);
    }
    round_coefs(c, k);
    _mm256_storeu_ps(minf, mins);
}

// Q4_K: 8 sub-blocks of 32, x = d * sc * q - dmin * m; qs[32 c + l] holds value l of sub-blocks 2c (low nibble)
// and 2c + 1 (high nibble)
static void q4_K_axpy8_rounded_avx2(int64_t n, float *y, const float *a, const void *const *rows) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t i = 0; i < n / QK_K; i++) {
        const block_q4_K *x[8]; // block i of each row
        struct rounded_coefs k;
        float minf[8];
        q4_K_step_coefs(rows, i, n / QK_K, a, x, &k, minf);
        for (int p = 0; p < 4; p++) { // sub-blocks 2p and 2p + 1
            __m256i q[8], v0[4], v1[4];
            for (int r = 0; r < 8; r++) q[r] = _mm256_loadu_si256((const __m256i *)(x[r]->qs + 32 * p));
            interleave4(q, v0);
            interleave4(q + 4, v1);
            const __m256i k0_lo = _mm256_set1_epi32((int)k.lo[2 * p]), k1_lo = _mm256_set1_epi32((int)k.hi[2 * p]);
            const __m256i k0_hi = _mm256_set1_epi32((int)k.lo[2 * p + 1]), k1_hi = _mm256_set1_epi32((int)k.hi[2 * p + 1]);
            const __m256 unit_lo = _mm256_set1_ps(k.unit[2 * p]), unit_hi = _mm256_set1_ps(k.unit[2 * p + 1]);
            const __m256 min_lo = _mm256_set1_ps(minf[2 * p]), min_hi = _mm256_set1_ps(minf[2 * p + 1]);
            float *yb = y + i * QK_K + 64 * p;
            for (int g = 0; g < 4; g++) {
                const __m256i lo0 = _mm256_and_si256(v0[g], low4), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0[g], 4), low4);
                const __m256i lo1 = _mm256_and_si256(v1[g], low4), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1[g], 4), low4);
                add8(yb + 8 * g, dot8(lo0, lo1, k0_lo, k1_lo), unit_lo, min_lo);
                add8(yb + 32 + 8 * g, dot8(hi0, hi1, k0_hi, k1_hi), unit_hi, min_hi);
            }
        }
    }
}

// the scales d of up to 8 consecutive blocks (0 past them), packed as integers on the scalar side: eight
// float stores read back as one vector stall the store forwarding on every row
static inline __m256 q5_0_scales8(const block_q5_0 *x, int blocks) {
    uint64_t half[2] = {0, 0}; // in registers once unrolled
    for (int j = 0; j < 8; j++) half[j / 4] |= (uint64_t)(j < blocks ? x[j].d : 0) << 16 * (j % 4);
    return _mm256_cvtph_ps(_mm_set_epi64x((long long)half[1], (long long)half[0]));
}

// Q5_0: blocks [b0, b0 + blocks) of the 8 rows: their coefficients a * d rounded (k) and the -16 a d offsets
// summed over the rows (offsets), per block
static inline void q5_0_coefs8(const void *const *rows, int64_t b0, int blocks, const float *a,
                               struct rounded_coefs *k, float offsets[8]) {
    __m256 c[8], offset = _mm256_setzero_ps();
    for (int r = 0; r < 8; r++) {
        c[r] = _mm256_mul_ps(_mm256_set1_ps(a[r]), q5_0_scales8((const block_q5_0 *)rows[r] + b0, blocks));
        offset = _mm256_fmadd_ps(_mm256_set1_ps(-16.0f), c[r], offset);
    }
    round_coefs(c, k);
    _mm256_storeu_ps(offsets, offset);
}

// Q5_0: x = d (u - 16), u = nibble | fifth bit << 4 (0..31), one scale a block: the 8 rows' coefficients a * d
// rounded per block as Q4_K's are per sub-block, 8 blocks at a time (round_coefs' lanes), the -16 a d offsets
// summed exactly; maddubs' pairs stay within int16 (2 * 31 * 127, twice that after the add). Qwen2.5-Coder-0.5B's
// channel-major gate and up are Q5_0 (896 is no multiple of 256)
static void q5_0_axpy8_rounded_avx2(int64_t n, float *y, const float *a, const void *const *rows) {
    const int64_t nb = n / QK5_0;
    const __m256i bit4 = _mm256_set1_epi8(16);
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const int blocks = nb - b0 < 8 ? (int)(nb - b0) : 8; // lanes past them stay 0
        if (b0 + 16 < nb) prefetch_rows8(rows, (b0 + 16) * sizeof(block_q5_0), 8 * sizeof(block_q5_0));
        struct rounded_coefs k;
        float offsets[8];
        q5_0_coefs8(rows, b0, blocks, a, &k, offsets);
        for (int j = 0; j < blocks; j++) {
            __m256i u[8], v0[4], v1[4];
            for (int r = 0; r < 8; r++) {
                const block_q5_0 *x = (const block_q5_0 *)rows[r] + b0 + j;
                u[r] = _mm256_or_si256(avx2_unpack_nibbles(x->qs), _mm256_and_si256(avx2_bits_to_bytes(x->qh), bit4));
            }
            interleave4(u, v0);
            interleave4(u + 4, v1);
            const __m256i k0 = _mm256_set1_epi32((int)k.lo[j]), k1 = _mm256_set1_epi32((int)k.hi[j]);
            const __m256 unit = _mm256_set1_ps(k.unit[j]), off = _mm256_set1_ps(offsets[j]);
            float *yb = y + (b0 + j) * QK5_0;
            for (int g = 0; g < 4; g++) add8(yb + 8 * g, dot8(v0[g], v1[g], k0, k1), unit, off);
        }
    }
}

// ============================================================================================
// AVX512-VNNI with VBMI: the same sums, bit for bit (the same rounded coefficients and exact integer sums,
// converted by the same fma), 4 rows a vpdpbusd. One byte permute (vpermt2b) of two pairs of rows lays 4 rows'
// bytes of 16 values side by side, where AVX2 spent 12 shuffles on 4 rows of 8 (Q5_0 rows in L2, one Xeon core:
// 11.3 -> 16.9 G weights/s).
// ============================================================================================

#define VBMI_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,avx512vbmi")))

// permute tables: byte 4 l + r <- byte f(l) of row r, rows 0, 1 in the halves of vpermt2b's first operand and
// rows 2, 3 in its second's; byte tables in .rodata (built at run time, the 64 byte stores read back as one
// vector stalled every call)
#define ROWS4(f, l) (f(l)), 32 + (f(l)), 64 + (f(l)), 96 + (f(l))
#define VALUES16(f) ROWS4(f, 0), ROWS4(f, 1), ROWS4(f, 2), ROWS4(f, 3), ROWS4(f, 4), ROWS4(f, 5), ROWS4(f, 6), \
                    ROWS4(f, 7), ROWS4(f, 8), ROWS4(f, 9), ROWS4(f, 10), ROWS4(f, 11), ROWS4(f, 12), ROWS4(f, 13), \
                    ROWS4(f, 14), ROWS4(f, 15)
#define Q4K_FIRST(l) (l)         // byte l of 32 qs: value l of sub-blocks 2p (low nibble) and 2p + 1 (high)
#define Q4K_SECOND(l) (16 + (l)) // their values 16 + l
#define Q50_NIBBLES(l) (6 + (l)) // block byte 6 + l: values l and 16 + l
#define Q50_FIFTH_LO(l) (2 + (l) / 8) // qh byte holding value l's fifth bit
#define Q50_FIFTH_HI(l) (4 + (l) / 8) // value 16 + l's
#define BIT4(l) (1 << ((l) % 8)), (1 << ((l) % 8)), (1 << ((l) % 8)), (1 << ((l) % 8))
static const uint8_t q4_K_first[64] = {VALUES16(Q4K_FIRST)}, q4_K_second[64] = {VALUES16(Q4K_SECOND)};
static const uint8_t q5_0_nibbles[64] = {VALUES16(Q50_NIBBLES)}, q5_0_fifth_lo[64] = {VALUES16(Q50_FIFTH_LO)},
                     q5_0_fifth_hi[64] = {VALUES16(Q50_FIFTH_HI)};
static const uint8_t q5_0_bit_of_value[64] = {BIT4(0), BIT4(1), BIT4(2), BIT4(3), BIT4(4), BIT4(5), BIT4(6), BIT4(7),
                                              BIT4(8), BIT4(9), BIT4(10), BIT4(11), BIT4(12), BIT4(13), BIT4(14), BIT4(15)};
_Static_assert(offsetof(block_q5_0, qh) == 2 && offsetof(block_q5_0, qs) == 6, "Q5_0's permute tables");

// 32 bytes of each of two rows: row p0's in the low half, p1's in the high
VBMI_TARGET static inline __m512i load_row_pair(const void *p0, const void *p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}

// Q5_0: 32 bytes from each of two blocks (22 of them the block's); the last block of a row's slice is read masked
// to its own 22, so that no read runs past the rows
VBMI_TARGET static inline __m512i load_q5_0_pair(const block_q5_0 *p0, const block_q5_0 *p1, bool last) {
    if (!last) return load_row_pair(p0, p1);
    const __mmask32 own = (__mmask32)((1u << sizeof(block_q5_0)) - 1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi8(own, p0)), _mm256_maskz_loadu_epi8(own, p1), 1);
}

// y[0..16) += unit * sum + offset
VBMI_TARGET static inline void add16(float *y, __m512i sum, __m512 unit, __m512 offset) {
    _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), unit, offset)));
}

// Q4_K: per 32 bytes of qs (sub-blocks 2p and 2p + 1) and 4 rows, two permutes give values 0..15 and 16..31;
// the high nibbles are summed in place (16 times the level) and their unit divided by 16, exactly
VBMI_TARGET static void q4_K_axpy8_rounded_vnni(int64_t n, float *y, const float *a, const void *const *rows) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8((char)0xF0);
    const __m512i first = _mm512_loadu_si512(q4_K_first), second = _mm512_loadu_si512(q4_K_second);
    for (int64_t i = 0; i < n / QK_K; i++) {
        const block_q4_K *x[8]; // block i of each row
        struct rounded_coefs k;
        float minf[8];
        q4_K_step_coefs(rows, i, n / QK_K, a, x, &k, minf);
        for (int p = 0; p < 4; p++) {
            __m512i lo_a = _mm512_setzero_si512(), lo_b = lo_a, hi_a = lo_a, hi_b = lo_a;
            for (int g = 0; g < 2; g++) { // rows 4 g .. 4 g + 3
                const __m512i r01 = load_row_pair(x[4 * g]->qs + 32 * p, x[4 * g + 1]->qs + 32 * p);
                const __m512i r23 = load_row_pair(x[4 * g + 2]->qs + 32 * p, x[4 * g + 3]->qs + 32 * p);
                const __m512i va = _mm512_permutex2var_epi8(r01, first, r23);
                const __m512i vb = _mm512_permutex2var_epi8(r01, second, r23);
                const uint32_t *kg = g ? k.hi : k.lo;
                const __m512i k_lo = _mm512_set1_epi32((int)kg[2 * p]), k_hi = _mm512_set1_epi32((int)kg[2 * p + 1]);
                lo_a = _mm512_dpbusd_epi32(lo_a, _mm512_and_si512(va, low4), k_lo);
                lo_b = _mm512_dpbusd_epi32(lo_b, _mm512_and_si512(vb, low4), k_lo);
                hi_a = _mm512_dpbusd_epi32(hi_a, _mm512_and_si512(va, high4), k_hi);
                hi_b = _mm512_dpbusd_epi32(hi_b, _mm512_and_si512(vb, high4), k_hi);
            }
            const __m512 unit_lo = _mm512_set1_ps(k.unit[2 * p]), unit_hi = _mm512_set1_ps(k.unit[2 * p + 1] / 16.0f);
            const __m512 min_lo = _mm512_set1_ps(minf[2 * p]), min_hi = _mm512_set1_ps(minf[2 * p + 1]);
            float *yb = y + i * QK_K + 64 * p;
            add16(yb, lo_a, unit_lo, min_lo);
            add16(yb + 16, lo_b, unit_lo, min_lo);
            add16(yb + 32, hi_a, unit_hi, min_hi);
            add16(yb + 48, hi_b, unit_hi, min_hi);
        }
    }
}

// Q5_0: blocks read as 32 bytes (load_q5_0_pair); one permute lays out the nibbles of 4 rows, two more each row's
// fifth-bit byte beside every value, whose bit a test picks
VBMI_TARGET static void q5_0_axpy8_rounded_vnni(int64_t n, float *y, const float *a, const void *const *rows) {
    const int64_t nb = n / QK5_0;
    const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(16);
    const __m512i nibbles = _mm512_loadu_si512(q5_0_nibbles), bit_of_value = _mm512_loadu_si512(q5_0_bit_of_value);
    const __m512i fifth_lo = _mm512_loadu_si512(q5_0_fifth_lo), fifth_hi = _mm512_loadu_si512(q5_0_fifth_hi);
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const int blocks = nb - b0 < 8 ? (int)(nb - b0) : 8;
        if (b0 + 16 < nb) prefetch_rows8(rows, (b0 + 16) * sizeof(block_q5_0), 8 * sizeof(block_q5_0));
        struct rounded_coefs k;
        float offsets[8];
        q5_0_coefs8(rows, b0, blocks, a, &k, offsets);
        for (int j = 0; j < blocks; j++) {
            const bool last = b0 + j == nb - 1;
            __m512i sum_lo = _mm512_setzero_si512(), sum_hi = sum_lo;
            for (int g = 0; g < 2; g++) {
                const block_q5_0 *x[4];
                for (int r = 0; r < 4; r++) x[r] = (const block_q5_0 *)rows[4 * g + r] + b0 + j;
                const __m512i r01 = load_q5_0_pair(x[0], x[1], last), r23 = load_q5_0_pair(x[2], x[3], last);
                const __m512i v = _mm512_permutex2var_epi8(r01, nibbles, r23);
                const __mmask64 f_lo = _mm512_test_epi8_mask(_mm512_permutex2var_epi8(r01, fifth_lo, r23), bit_of_value);
                const __mmask64 f_hi = _mm512_test_epi8_mask(_mm512_permutex2var_epi8(r01, fifth_hi, r23), bit_of_value);
                const __m512i u_lo = _mm512_mask_add_epi8(_mm512_and_si512(v, low4), f_lo, _mm512_and_si512(v, low4), bit4);
                const __m512i hi4 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                const __m512i u_hi = _mm512_mask_add_epi8(hi4, f_hi, hi4, bit4);
                const __m512i kg = _mm512_set1_epi32((int)(g ? k.hi : k.lo)[j]);
                sum_lo = _mm512_dpbusd_epi32(sum_lo, u_lo, kg);
                sum_hi = _mm512_dpbusd_epi32(sum_hi, u_hi, kg);
            }
            const __m512 unit = _mm512_set1_ps(k.unit[j]), off = _mm512_set1_ps(offsets[j]);
            float *yb = y + (b0 + j) * QK5_0;
            add16(yb, sum_lo, unit, off);
            add16(yb + 16, sum_hi, unit, off);
        }
    }
}

static bool cpu_has_vnni_vbmi(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512vbmi");
}

void ggml_quants_install_axpy_rounded_avx2(struct ggml_type_traits *traits, bool avx512) {
    const bool vnni = avx512 && cpu_has_vnni_vbmi();
    traits[GGML_TYPE_Q4_K].axpy8_rounded = vnni ? q4_K_axpy8_rounded_vnni : q4_K_axpy8_rounded_avx2;
    traits[GGML_TYPE_Q5_0].axpy8_rounded = vnni ? q5_0_axpy8_rounded_vnni : q5_0_axpy8_rounded_avx2;
}
