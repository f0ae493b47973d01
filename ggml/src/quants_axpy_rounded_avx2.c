// quants_axpy_rounded_avx2.c: axpy8_rounded for Q4_K and Q5_0 on the integer units (AVX2): y += sum of a[r] * rows[r] over
// 8 rows, each row's coefficient a[r] * d * sc rounded to a multiple of 1/127 of the 8 rows' largest in that
// sub-block of 32 values, as mul_mat rounds its activations to 8 bits (what axpy_rows runs unless precise).
// The float axpy4 converts every level to a float and spends an FMA on it (about 1 instruction a weight: 10 G
// weights/s on one Zen 4 core, in cache); here the rows' levels are interleaved byte by byte, multiplied by
// their coefficients and summed 4 rows at a time with maddubs and 8 with madd, and converted once per 8 rows
// (22 G weights/s). Q4_K's minimums stay exact (a float per sub-block and row). Q8_0 measured no faster this
// way (its float kernel is already near memory speed), so it keeps axpy4.
// Checked against float64 numpy within the rounding's bound (tests/test_quants.py).
#include "ggml-impl.h"
#include "quants.h"
#include "quants_avx2.h"

#include <immintrin.h>

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

// Q4_K: 8 sub-blocks of 32, x = d * sc * q - dmin * m; qs[32 c + l] holds value l of sub-blocks 2c (low nibble)
// and 2c + 1 (high nibble)
static void q4_K_axpy8_rounded_avx2(int64_t n, float *y, const float *a, const void *const *rows) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t i = 0; i < n / QK_K; i++) {
        const block_q4_K *x[8];            // block i of each row
        __m256 c[8];                       // a * d * sc per sub-block
        __m256 mins = _mm256_setzero_ps(); // -(sum over rows of a * dmin * m) per sub-block
        for (int r = 0; r < 8; r++) {
            x[r] = (const block_q4_K *)rows[r] + i;
            uint64_t sc_bytes, m_bytes;
            ggml_q4_K_scales_mins(x[r]->scales, &sc_bytes, &m_bytes);
            const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc_bytes)));
            const __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m_bytes)));
            c[r] = _mm256_mul_ps(_mm256_set1_ps(a[r] * _cvtsh_ss(x[r]->d)), scf);
            mins = _mm256_fmadd_ps(_mm256_set1_ps(-a[r] * _cvtsh_ss(x[r]->dmin)), mf, mins);
        }
        struct rounded_coefs k;
        round_coefs(c, &k);
        float minf[8];
        _mm256_storeu_ps(minf, mins);
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

// Q5_0: x = d (u - 16), u = nibble | fifth bit << 4 (0..31), one scale a block: the 8 rows' coefficients a * d
// rounded per block as Q4_K's are per sub-block, 8 blocks at a time (round_coefs' lanes), the -16 a d offsets
// summed exactly; maddubs' pairs stay within int16 (2 * 31 * 127, twice that after the add). Qwen2.5-Coder-0.5B's
// channel-major gate and up are Q5_0 (896 is no multiple of 256)
static void q5_0_axpy8_rounded_avx2(int64_t n, float *y, const float *a, const void *const *rows) {
    const int64_t nb = n / QK5_0;
    const __m256i bit4 = _mm256_set1_epi8(16);
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const int blocks = nb - b0 < 8 ? (int)(nb - b0) : 8; // lanes past them stay 0
        __m256 c[8], offset = _mm256_setzero_ps();          // a * d per block; -16 sum of them
        for (int r = 0; r < 8; r++) {
            const block_q5_0 *x = (const block_q5_0 *)rows[r] + b0;
            float d[8] = {0};
            for (int j = 0; j < blocks; j++) d[j] = _cvtsh_ss(x[j].d);
            c[r] = _mm256_mul_ps(_mm256_set1_ps(a[r]), _mm256_loadu_ps(d));
            offset = _mm256_fmadd_ps(_mm256_set1_ps(-16.0f), c[r], offset);
        }
        struct rounded_coefs k;
        round_coefs(c, &k);
        float offsets[8];
        _mm256_storeu_ps(offsets, offset);
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

void ggml_quants_install_axpy_rounded_avx2(struct ggml_type_traits *traits) {
    traits[GGML_TYPE_Q4_K].axpy8_rounded = q4_K_axpy8_rounded_avx2;
    traits[GGML_TYPE_Q5_0].axpy8_rounded = q5_0_axpy8_rounded_avx2;
}
