// quants_avx2.h: small AVX2 helpers shared by the AVX2 kernel files (include only from *_avx2.c: they are
// compiled with -mavx2 -mfma -mf16c).
#pragma once
#include "quants.h"

#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

static inline float avx2_hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float avx2_f16(uint16_t h) {
    return _cvtsh_ss(h);
}

// 16 bytes of nibbles -> 32 bytes: low nibbles (values 0..15) in the low lane, high nibbles above
static inline __m256i avx2_unpack_nibbles(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m256i v = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

// 32 bits -> 32 bytes, 0xFF where the bit is set (byte j <- bit j)
static inline __m256i avx2_bits_to_bytes(const uint8_t *bits) {
    uint32_t b32;
    memcpy(&b32, bits, sizeof b32);
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)b32), spread);
    const __m256i mask = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(bytes, mask), mask);
}

// four halves -> four floats; packed on the scalar side, which is idle while the vector units work
static inline __m128 avx2_f16x4(uint16_t h0, uint16_t h1, uint16_t h2, uint16_t h3) {
    const uint64_t packed = (uint64_t)h0 | (uint64_t)h1 << 16 | (uint64_t)h2 << 32 | (uint64_t)h3 << 48;
    return _mm_cvtph_ps(_mm_cvtsi64_si128((long long)packed));
}

static inline __m256i avx2_load2_128(const void *lo, const void *hi) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)lo)),
                                   _mm_loadu_si128((const __m128i *)hi), 1);
}

// every cache line of [p, p + bytes), p anywhere in its line, asked for into L2 (dots that read the next rows soon)
// or L1 (steps that read them next)
static inline void avx2_prefetch_span_l2(const char *p, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 1);
    __builtin_prefetch(p + bytes - 1, 0, 1);
}

static inline void avx2_prefetch_span_l1(const char *p, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
    __builtin_prefetch(p + bytes - 1, 0, 3);
}

static inline uint32_t avx2_load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

// roundf (half away from zero) exactly: v - trunc(v) is exact in float, so the tie test is too
static inline __m256 avx2_round_away(__m256 v) {
    const __m256 sign = _mm256_and_ps(v, _mm256_set1_ps(-0.0f));
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 frac = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_sub_ps(v, t));
    const __m256 up = _mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    return _mm256_add_ps(t, _mm256_and_ps(up, _mm256_or_ps(sign, _mm256_set1_ps(1.0f))));
}

// largest |x| over 8 * nv values; a NaN anywhere gives NaN when nan_wins (Q8_0/Q8_1), else NaNs are
// skipped (Q8_K), as in the scalar quantizers
static inline float avx2_amax(const float *x, int nv, bool nan_wins) {
    __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int i = 0; i < nv; i++) {
        const __m256 v = _mm256_loadu_ps(x + 8 * i);
        m = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v), m); // maxps keeps m where v is NaN
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (nan_wins && _mm256_movemask_ps(nan)) {
        // the first NaN's magnitude, payload and all, as the scalar loop finds it
        for (int j = 0;; j++) {
            if (isnan(x[j])) return fabsf(x[j]);
        }
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

static inline int avx2_hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

// one column's four row sums, half-reduced (tile_join_cols finishes them): a tile that reduces each column as soon
// as its sums exist keeps four of them live, not eight (eight had spilled to the stack)
static inline __m256i tile_sum4_epi32(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
}

// lane r of the result = row r's sum of column 0 (of a), lane r + 4 of column 1 (of b)
static inline __m256i tile_join_cols(__m256i a, __m256i b) {
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// lane i of the result = sum of the lanes of p[i]
static inline __m256i tile_sum8_epi32(const __m256i p[8]) {
    return tile_join_cols(tile_sum4_epi32(p[0], p[1], p[2], p[3]), tile_sum4_epi32(p[4], p[5], p[6], p[7]));
}

// acc01 lanes r + 4 j for columns 0, 1; acc23 for 2, 3 -> s[j * ss + r]
static inline void tile_store(float *s, int64_t ss, __m256 acc01, __m256 acc23) {
    _mm_storeu_ps(s, _mm256_castps256_ps128(acc01));
    _mm_storeu_ps(s + ss, _mm256_extractf128_ps(acc01, 1));
    _mm_storeu_ps(s + 2 * ss, _mm256_castps256_ps128(acc23));
    _mm_storeu_ps(s + 3 * ss, _mm256_extractf128_ps(acc23, 1));
}

// Q6_K: the levels (0..63) of half h of a super-block, 32 bytes for each of its four groups of 32 values (the layout of
// quants.h: group g's low nibbles from ql, its two high bits from qh)
static inline void avx2_q6_K_levels(const block_q6_K *a, int h, __m256i q[4]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03), bits45 = _mm256_set1_epi8(0x30);
    const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(a->ql + 64 * h));
    const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(a->ql + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(a->qh + 32 * h));
    q[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, two), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, bits45));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45));
}

// Q6_K: group g's two sub-block scales from the half's 8 int16 scales (in both lanes): sub-block 2g's in the low lane,
// 2g + 1's in the high lane, each broadcast
static inline __m256i avx2_q6_K_group_scales(__m256i half_scales, int g) {
    const __m256i pick = _mm256_set_epi64x(0x0302030203020302 + 0x0404040404040404LL * g, 0x0302030203020302 + 0x0404040404040404LL * g,
                                           0x0100010001000100 + 0x0404040404040404LL * g, 0x0100010001000100 + 0x0404040404040404LL * g);
    return _mm256_shuffle_epi8(half_scales, pick);
}

// the 4 rows' six-bit scales (sc[r][s]) and mins (mins[r]: 8 int16) of super-block b, for the Q4_K tiles
static inline void q4_K_tile_scales_mins(const block_q4_K *const wr[4], int64_t b, uint8_t sc[4][8], __m128i mins[4]) {
    for (int r = 0; r < 4; r++) {
        uint64_t sc_bytes, m_bytes;
        ggml_q4_K_scales_mins(wr[r][b].scales, &sc_bytes, &m_bytes);
        memcpy(sc[r], &sc_bytes, 8);
        mins[r] = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)m_bytes));
    }
}

// the 8 pair scales: weight scales of rows 0..3 times the scale of column j (lanes 0..3) and j + 1 (4..7)
static inline __m256 tile_pair_scales_f32(__m128 dw, float dx0, float dx1) {
    return _mm256_set_m128(_mm_mul_ps(dw, _mm_set1_ps(dx1)), _mm_mul_ps(dw, _mm_set1_ps(dx0)));
}
