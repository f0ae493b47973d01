// quants_axpy_avx2.c: AVX2/FMA axpy (y[0..n) += a * dequant(row)) and axpy4 (the same for 4 rows in
// turn, y loaded and stored once per 8 values) for F16, BF16, Q4_0, Q8_0, Q4_1, Q5_0, Q4_K and Q6_K: the
// kernels of the sparse axpy_rows and sparse_ffn ops. Levels are widened straight from memory into 32-bit lanes (vpmovzxbd), 8 values a step.
// Types with only an offset (Q4_0, Q8_0, Q5_0, Q6_K) fold a into the scale: their levels are exact integers, so
// that costs one rounding. Types with a minimum (Q4_1, Q4_K) dequantize exactly as the scalar to_float
// does (d * q, then + m, no FMA) because d * q and m can cancel.
// Each kernel is written once for nr rows (a compile-time 1 or 4), so axpy4 gives bit for bit what four
// axpy calls give. Checked against the scalar kernels and float64 numpy (tests/test_quants.py).
#include "ggml-impl.h"
#include "quants.h"

#include <immintrin.h>
#include <string.h>

#define AXPY_INLINE static inline __attribute__((always_inline))
#define AXPY_MAX_ROWS 4

static inline float axpy_f16(uint16_t h) {
    return _cvtsh_ss(h);
}

// 8 bytes -> 8 zero-extended 32-bit lanes
static inline __m256i axpy_load_u8x8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

// acc + s * q
static inline __m256 axpy_fma8(__m256 acc, __m256 s, __m256i q) {
    return _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(q), acc);
}

// acc + a * (d * q + m), the dequantized value rounded exactly as the scalar to_float rounds it
static inline __m256 axpy_min8(__m256 acc, __m256 a, __m256 d, __m256 m, __m256i q) {
    return _mm256_fmadd_ps(a, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), m), acc);
}

// ============================================================================================
// F16 and BF16: one rounding per row, a * x added to y by an FMA, as the scalar kernel does
// ============================================================================================

AXPY_INLINE __m256 axpy_load_halves(const uint16_t *p, bool bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}

AXPY_INLINE void halves_axpy_rows(int64_t n, float *y, const float *a, const void *const *rows, int nr, bool bf16) {
    __m256 s[AXPY_MAX_ROWS];
    for (int r = 0; r < nr; r++) s[r] = _mm256_set1_ps(a[r]);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 acc = _mm256_loadu_ps(y + i);
        for (int r = 0; r < nr; r++) acc = _mm256_fmadd_ps(s[r], axpy_load_halves((const uint16_t *)rows[r] + i, bf16), acc);
        _mm256_storeu_ps(y + i, acc);
    }
    for (; i < n; i++)
        for (int r = 0; r < nr; r++) {
            const uint16_t h = ((const uint16_t *)rows[r])[i];
            y[i] += a[r] * (bf16 ? ggml_bf16_to_fp32(h) : axpy_f16(h));
        }
}

AXPY_INLINE void f16_axpy_rows(int64_t n, float *y, const float *a, const void *const *rows, int nr) {
    halves_axpy_rows(n, y, a, rows, nr, false);
}

AXPY_INLINE void bf16_axpy_rows(int64_t n, float *y, const float *a, const void *const *rows, int nr) {
    halves_axpy_rows(n, y, a, rows, nr, true);
}

// ============================================================================================
// Q4_0: x = d * (q - 8); qs[j] holds value j (low nibble) and j + 16 (high nibble)
// ============================================================================================

AXPY_INLINE void q4_0_axpy_rows(int64_t n, float *y, const float *a, const void *const *rows, int nr) {
    const __m256i low4 = _mm256_set1_epi32(0x0F), eight = _mm256_set1_epi32(8);
    for (int64_t i = 0; i < n / QK4_0; i++) {
        const block_q4_0 *x[AXPY_MAX_ROWS]; // block i of each row
        __m256 s[AXPY_MAX_ROWS];            // a * d
        for (int r = 0; r < nr; r++) {
            x[r] = (const block_q4_0 *)rows[r] + i;
            s[r] = _mm256_set1_ps(a[r] * axpy_f16(x[r]->d));
        }
        float *yb = y + i * QK4_0; // (32,)
        for (int j = 0; j < QK4_0 / 2; j += 8) {
            __m256 lo = _mm256_loadu_ps(yb + j), hi = _mm256_loadu_ps(yb + j + QK4_0 / 2);
            for (int r = 0; r < nr; r++) {
                const __m256i b = axpy_load_u8x8(x[r]->qs + j);
                lo = axpy_fma8(lo, s[r], _mm256_sub_epi32(_mm256_and_si256(b, low4), eight));
                hi = axpy_fma8(hi, s[r], _mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight));
            }
            _mm256_storeu_ps(yb + j, lo);
            _mm256_storeu_ps(yb + j + QK4_0 / 2, hi);
        }
    }
}

// ============================================================================================
// Q8_0: x = d * q, q signed bytes
// ============================================================================================

AXPY_INLINE void q8_0_axpy_rows(int64_t n, float *y, const float *a, const void *const *rows, int nr) {
    for (int64_t i = 0; i < n / QK8_0; i++) {
        const block_q8_0 *x[AXPY_MAX_ROWS]; // block i of each row
        __m256 s[AXPY_MAX_ROWS];            // a * d
        for (int r = 0; r < nr; r++) {
            x[r] = (const block_q8_0 *)rows[r] + i;
            s[r] = _mm256_set1_ps(a[r] * axpy_f16(x[r]->d));
        }
        float *yb = y + i * QK8_0; // (32,)
        for (int j = 0; j < QK8_0; j += 8) {
            __m256 acc = _mm256_loadu_ps(yb + j);
            for (int r = 0; r < nr; r++)
                acc = axpy_fma8(acc, s[r], _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(x[r]->qs + j))));
            _mm256_storeu_ps(yb + j, acc);
        }
    }
}

// ============================================================================================
// Q4_1: x = d * q + m; qs[j] holds value j (low nibble) and j + 16 (high nibble)
// ============================================================================================

AXPY_INLINE void q4_1_axpy_rows(int64_t n, float *y, const float *a, const void *const *rows, int nr) {
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    for (int64_t i = 0; i < n / QK4_1; i++) {
        const block_q4_1 *x[AXPY_MAX_ROWS]; // block i of each row
        float d[AXPY_MAX_ROWS], m[AXPY_MAX_ROWS];
        for (int r = 0; r < nr; r++) {
            x[r] = (const block_q4_1 *)rows[r] + i;
            d[r] = axpy_f16(x[r]->d);
            m[r] = axpy_f16(x[r]->m);
        }
        float *yb = y + i * QK4_1; // (32,)
        for (int j = 0; j < QK4_1 / 2; j += 8) {
            __m256 lo = _mm256_loadu_ps(yb + j), hi = _mm256_loadu_ps(yb + j + QK4_1 / 2);
            for (int r = 0; r < nr; r++) {
                const __m256i b = axpy_load_u8x8(x[r]->qs + j);
                const __m256 ar = _mm256_set1_ps(a[r]), dr = _mm256_set1_ps(d[r]), mr = _mm256_set1_ps(m[r]);
                lo = axpy_min8(lo, ar, dr, mr, _mm256_and_si256(b, low4));
                hi = axpy_min8(hi, ar, dr, mr, _mm256_srli_epi32(b, 4));
            }
            _mm256_storeu_ps(yb + j, lo);
            _mm256_storeu_ps(yb + j + QK4_1 / 2, hi);
        }
    }
}

// ============================================================================================
// Q5_0: x = d * (q - 16), fifth bit of value j in bit j of qh
// ============================================================================================

AXPY_INLINE void q5_0_axpy_rows(int64_t n, float *y, const float *a, const void *const *rows, int nr) {
    const __m256i low4 = _mm256_set1_epi32(0x0F), minus16 = _mm256_set1_epi32(-16), zero = _mm256_setzero_si256();
    // the qh bit of each lane, for values 0..7, 8..15, 16..23, 24..31
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
    const __m256i bit[4] = {_mm256_sllv_epi32(one, lane), _mm256_sllv_epi32(one, _mm256_add_epi32(lane, _mm256_set1_epi32(8))),
                            _mm256_sllv_epi32(one, _mm256_add_epi32(lane, _mm256_set1_epi32(16))),
                            _mm256_sllv_epi32(one, _mm256_add_epi32(lane, _mm256_set1_epi32(24)))};
    for (int64_t i = 0; i < n / QK5_0; i++) {
        const block_q5_0 *x[AXPY_MAX_ROWS]; // block i of each row
        float s[AXPY_MAX_ROWS];             // a * d
        uint32_t qh[AXPY_MAX_ROWS];
        for (int r = 0; r < nr; r++) {
            x[r] = (const block_q5_0 *)rows[r] + i;
            s[r] = a[r] * axpy_f16(x[r]->d);
            memcpy(&qh[r], x[r]->qh, sizeof qh[r]);
        }
        float *yb = y + i * QK5_0; // (32,)
        for (int g = 0; g < 2; g++) {
            __m256 lo = _mm256_loadu_ps(yb + 8 * g), hi = _mm256_loadu_ps(yb + 8 * g + QK5_0 / 2);
            for (int r = 0; r < nr; r++) {
                const __m256i h = _mm256_set1_epi32((int)qh[r]);
                const __m256i b = axpy_load_u8x8(x[r]->qs + 8 * g);
                // q - 16 is the nibble where the fifth bit is set, else nibble - 16 = nibble | ~15
                const __m256i clear_lo = _mm256_cmpeq_epi32(_mm256_and_si256(h, bit[g]), zero);
                const __m256i clear_hi = _mm256_cmpeq_epi32(_mm256_and_si256(h, bit[g + 2]), zero);
                const __m256 sr = _mm256_set1_ps(s[r]);
                lo = axpy_fma8(lo, sr, _mm256_or_si256(_mm256_and_si256(b, low4), _mm256_and_si256(clear_lo, minus16)));
                hi = axpy_fma8(hi, sr, _mm256_or_si256(_mm256_srli_epi32(b, 4), _mm256_and_si256(clear_hi, minus16)));
            }
            _mm256_storeu_ps(yb + 8 * g, lo);
            _mm256_storeu_ps(yb + 8 * g + QK5_0 / 2, hi);
        }
    }
}

// ============================================================================================
// Q4_K: 8 sub-blocks of 32, x = d * sc * q - dmin * m; qs[32 c + l] holds sub-blocks 2c, 2c + 1
// ============================================================================================

AXPY_INLINE void q4_K_axpy_rows(int64_t n, float *y, const float *a, const void *const *rows, int nr) {
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    for (int64_t i = 0; i < n / QK_K; i++) {
        const block_q4_K *x[AXPY_MAX_ROWS]; // block i of each row
        float dl[AXPY_MAX_ROWS][8], ml[AXPY_MAX_ROWS][8]; // (rows, sub-blocks) d * sc and -(dmin * m)
        for (int r = 0; r < nr; r++) {
            x[r] = (const block_q4_K *)rows[r] + i;
            uint64_t sc_bytes, m_bytes;
            ggml_q4_K_scales_mins(x[r]->scales, &sc_bytes, &m_bytes);
            const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc_bytes)));
            const __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m_bytes)));
            _mm256_storeu_ps(dl[r], _mm256_mul_ps(_mm256_set1_ps(axpy_f16(x[r]->d)), scf));
            // dl * q + (-ml) is bit-identical to the scalar dl * q - ml
            _mm256_storeu_ps(ml[r], _mm256_mul_ps(_mm256_set1_ps(-axpy_f16(x[r]->dmin)), mf));
        }
        for (int c = 0; c < 4; c++) {
            float *yb = y + i * QK_K + 64 * c; // (64,) sub-blocks 2c and 2c + 1
            for (int l = 0; l < 32; l += 8) {
                __m256 lo = _mm256_loadu_ps(yb + l), hi = _mm256_loadu_ps(yb + 32 + l);
                for (int r = 0; r < nr; r++) {
                    const __m256i b = axpy_load_u8x8(x[r]->qs + 32 * c + l);
                    const __m256 ar = _mm256_set1_ps(a[r]);
                    lo = axpy_min8(lo, ar, _mm256_set1_ps(dl[r][2 * c]), _mm256_set1_ps(ml[r][2 * c]), _mm256_and_si256(b, low4));
                    hi = axpy_min8(hi, ar, _mm256_set1_ps(dl[r][2 * c + 1]), _mm256_set1_ps(ml[r][2 * c + 1]),
                                   _mm256_srli_epi32(b, 4));
                }
                _mm256_storeu_ps(yb + l, lo);
                _mm256_storeu_ps(yb + 32 + l, hi);
            }
        }
    }
}

// ============================================================================================
// Q6_K: 16 sub-blocks of 16, x = d * scales[s] * (q - 32), q = 4 low bits (ql) | 2 high bits (qh) << 4
// ============================================================================================

AXPY_INLINE void q6_K_axpy_rows(int64_t n, float *y, const float *a, const void *const *rows, int nr) {
    const __m256i low4 = _mm256_set1_epi32(0x0F), bits45 = _mm256_set1_epi32(0x30), off = _mm256_set1_epi32(32);
    for (int64_t i = 0; i < n / QK_K; i++) {
        const block_q6_K *x[AXPY_MAX_ROWS]; // block i of each row
        float s[AXPY_MAX_ROWS][16];         // (rows, sub-blocks) a * d * scales
        for (int r = 0; r < nr; r++) {
            x[r] = (const block_q6_K *)rows[r] + i;
            const __m256 ad = _mm256_set1_ps(a[r] * axpy_f16(x[r]->d));
            const __m128i sc8 = _mm_loadu_si128((const __m128i *)x[r]->scales);
            _mm256_storeu_ps(s[r], _mm256_mul_ps(ad, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8))));
            _mm256_storeu_ps(s[r] + 8, _mm256_mul_ps(ad, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8)))));
        }
        for (int h = 0; h < 2; h++) {
            float *yb = y + i * QK_K + 128 * h; // (128,) value 32 g + l of this half at yb[32 g + l]
            for (int l = 0; l < 32; l += 8) {
                __m256 y0 = _mm256_loadu_ps(yb + l), y1 = _mm256_loadu_ps(yb + 32 + l);
                __m256 y2 = _mm256_loadu_ps(yb + 64 + l), y3 = _mm256_loadu_ps(yb + 96 + l);
                for (int r = 0; r < nr; r++) {
                    const __m256i ql0 = axpy_load_u8x8(x[r]->ql + 64 * h + l);
                    const __m256i ql1 = axpy_load_u8x8(x[r]->ql + 64 * h + 32 + l);
                    const __m256i qh = axpy_load_u8x8(x[r]->qh + 32 * h + l);
                    const __m256i q0 = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi32(qh, 4), bits45));
                    const __m256i q1 = _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi32(qh, 2), bits45));
                    const __m256i q2 = _mm256_or_si256(_mm256_srli_epi32(ql0, 4), _mm256_and_si256(qh, bits45));
                    const __m256i q3 = _mm256_or_si256(_mm256_srli_epi32(ql1, 4), _mm256_and_si256(_mm256_srli_epi32(qh, 2), bits45));
                    const float *sg = s[r] + 8 * h + l / 16; // value 128 h + 32 g + l is in sub-block 8 h + 2 g + l / 16
                    y0 = axpy_fma8(y0, _mm256_set1_ps(sg[0]), _mm256_sub_epi32(q0, off));
                    y1 = axpy_fma8(y1, _mm256_set1_ps(sg[2]), _mm256_sub_epi32(q1, off));
                    y2 = axpy_fma8(y2, _mm256_set1_ps(sg[4]), _mm256_sub_epi32(q2, off));
                    y3 = axpy_fma8(y3, _mm256_set1_ps(sg[6]), _mm256_sub_epi32(q3, off));
                }
                _mm256_storeu_ps(yb + l, y0);
                _mm256_storeu_ps(yb + 32 + l, y1);
                _mm256_storeu_ps(yb + 64 + l, y2);
                _mm256_storeu_ps(yb + 96 + l, y3);
            }
        }
    }
}

// ============================================================================================
// entry points: one row (axpy) and four rows (axpy4) of each type
// ============================================================================================

#define AXPY_ENTRY_POINTS(name)                                                                  \
    static void name##_axpy_avx2(int64_t n, float *y, float a, const void *row) {                 \
        name##_axpy_rows(n, y, &a, &row, 1);                                                      \
    }                                                                                             \
    static void name##_axpy4_avx2(int64_t n, float *y, const float *a, const void *const *rows) { \
        name##_axpy_rows(n, y, a, rows, 4);                                                       \
    }
AXPY_ENTRY_POINTS(f16)
AXPY_ENTRY_POINTS(bf16)
AXPY_ENTRY_POINTS(q4_0)
AXPY_ENTRY_POINTS(q8_0)
AXPY_ENTRY_POINTS(q4_1)
AXPY_ENTRY_POINTS(q5_0)
AXPY_ENTRY_POINTS(q4_K)
AXPY_ENTRY_POINTS(q6_K)

void ggml_quants_install_axpy_avx2(struct ggml_type_traits *traits) {
    traits[GGML_TYPE_F16].axpy = f16_axpy_avx2;
    traits[GGML_TYPE_F16].axpy4 = f16_axpy4_avx2;
    traits[GGML_TYPE_BF16].axpy = bf16_axpy_avx2;
    traits[GGML_TYPE_BF16].axpy4 = bf16_axpy4_avx2;
    traits[GGML_TYPE_Q4_0].axpy = q4_0_axpy_avx2;
    traits[GGML_TYPE_Q4_0].axpy4 = q4_0_axpy4_avx2;
    traits[GGML_TYPE_Q8_0].axpy = q8_0_axpy_avx2;
    traits[GGML_TYPE_Q8_0].axpy4 = q8_0_axpy4_avx2;
    traits[GGML_TYPE_Q4_1].axpy = q4_1_axpy_avx2;
    traits[GGML_TYPE_Q4_1].axpy4 = q4_1_axpy4_avx2;
    traits[GGML_TYPE_Q5_0].axpy = q5_0_axpy_avx2;
    traits[GGML_TYPE_Q5_0].axpy4 = q5_0_axpy4_avx2;
    traits[GGML_TYPE_Q4_K].axpy = q4_K_axpy_avx2;
    traits[GGML_TYPE_Q4_K].axpy4 = q4_K_axpy4_avx2;
    traits[GGML_TYPE_Q6_K].axpy = q6_K_axpy_avx2;
    traits[GGML_TYPE_Q6_K].axpy4 = q6_K_axpy4_avx2;
}
