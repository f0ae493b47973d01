// quants_avx2.c: AVX2/FMA/F16C dot products and axpy, installed by ggml_quants_init when the CPU has them.
// Quantized dots multiply 8-bit integers (maddubs/madd), exact within a block, then scale in float.
// Several float accumulators are kept and summed once at the end; every result is checked against
// the scalar kernels of quants.c (tests/test_quants.py).
#include "ggml-impl.h"
#include "levels.h"
#include "quants.h"
#include "quants_avx2.h"

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

// signed x signed bytes -> 8 int32 sums of 4 products (sign moved onto b so maddubs sees |a| unsigned)
static inline __m256i avx2_dot_i8(__m256i a, __m256i b) {
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// unsigned x signed bytes -> 8 int32 sums of 4 products
static inline __m256i avx2_dot_u8i8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// ============================================================================================
// F32, F16
// ============================================================================================

static void f32_vec_dot_avx2(int64_t n, float *s, const void *w, const void *x) {
    const float *a = w, *b = x; // (n,), (n,)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
    }
    for (; i + 8 <= n; i += 8) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    }
    float sum = avx2_hsum_ps(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
    for (; i < n; i++) {
        sum += a[i] * b[i];
    }
    *s = sum;
}

// 8 halves -> 8 floats: F16 through F16C, BF16 by moving its bits to the top of a float (exact)
static inline __m256 avx2_load_halves(const uint16_t *p, bool bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}

static inline float avx2_half(uint16_t h, bool bf16) {
    return bf16 ? ggml_bf16_to_fp32(h) : avx2_f16(h);
}

// w . x over F16 or BF16 halves (bf16 a constant the compiler specializes on)
static inline __attribute__((always_inline)) float halves_dot(int64_t n, const uint16_t *a, const uint16_t *b,
                                                              bool bf16) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm256_fmadd_ps(avx2_load_halves(a + i, bf16), avx2_load_halves(b + i, bf16), acc0);
        acc1 = _mm256_fmadd_ps(avx2_load_halves(a + i + 8, bf16), avx2_load_halves(b + i + 8, bf16), acc1);
        acc2 = _mm256_fmadd_ps(avx2_load_halves(a + i + 16, bf16), avx2_load_halves(b + i + 16, bf16), acc2);
        acc3 = _mm256_fmadd_ps(avx2_load_halves(a + i + 24, bf16), avx2_load_halves(b + i + 24, bf16), acc3);
    }
    for (; i + 8 <= n; i += 8) {
        acc0 = _mm256_fmadd_ps(avx2_load_halves(a + i, bf16), avx2_load_halves(b + i, bf16), acc0);
    }
    float sum = avx2_hsum_ps(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
    for (; i < n; i++) {
        sum += avx2_half(a[i], bf16) * avx2_half(b[i], bf16);
    }
    return sum;
}

static void f16_vec_dot_avx2(int64_t n, float *s, const void *w, const void *x) {
    *s = halves_dot(n, w, x, false);
}

// BF16 weights had only the scalar kernels, which sum in double: a GEMV ran at 1.9 GB/s against F16's 30
static void bf16_vec_dot_avx2(int64_t n, float *s, const void *w, const void *x) {
    *s = halves_dot(n, w, x, true);
}

static void f32_axpy_avx2(int64_t n, float *y, float a, const void *row) {
    const float *x = row; // (n,)
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        for (int k = 0; k < 32; k += 8) {
            _mm256_storeu_ps(y + i + k, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i + k), _mm256_loadu_ps(y + i + k)));
        }
    }
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    }
    for (; i < n; i++) {
        y[i] += a * x[i];
    }
}

// conversions: F16C rounds to nearest even like the scalar path, so results are identical; BF16 to float is exact
static inline __attribute__((always_inline)) void halves_to_float(const uint16_t *x, float *dst, int64_t n, bool bf16) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(dst + i, avx2_load_halves(x + i, bf16));
    }
    for (; i < n; i++) {
        dst[i] = avx2_half(x[i], bf16);
    }
}

static void f16_to_float_avx2(const void *src, float *dst, int64_t n) {
    halves_to_float(src, dst, n, false);
}

static void bf16_to_float_avx2(const void *src, float *dst, int64_t n) {
    halves_to_float(src, dst, n, true);
}

// 32 levels (signed bytes, or unsigned where !is_signed) to y[0..32) = d * level - m: the scalar forms' float
// products and difference, rounded as they round them (no fused multiply-add), so the results are identical
static inline __attribute__((always_inline)) void levels32_to_float(__m256i q, bool is_signed, __m256 d, __m256 m,
                                                                    float *y) {
    const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int h = 0; h < 2; h++)
        for (int e = 0; e < 2; e++) {
            const __m128i b = e ? _mm_srli_si128(halves[h], 8) : halves[h];
            const __m256i w = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
            _mm256_storeu_ps(y + 16 * h + 8 * e, _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(w)), m));
        }
}

// prompt batches dequantize the sparse rows they sum (ops_sparse.c's batch walk): these had been a fifth of it
static void q4_0_to_float_avx2(const void *src, float *dst, int64_t n) {
    const block_q4_0 *x = src; // (n / 32,)
    for (int64_t i = 0; i < n / QK4_0; i++) {
        const __m256i q = _mm256_sub_epi8(avx2_unpack_nibbles(x[i].qs), _mm256_set1_epi8(8));
        levels32_to_float(q, true, _mm256_set1_ps(ggml_fp16_to_fp32(x[i].d)), _mm256_setzero_ps(), dst + i * QK4_0);
    }
}

static void q5_0_to_float_avx2(const void *src, float *dst, int64_t n) {
    const block_q5_0 *x = src; // (n / 32,)
    for (int64_t i = 0; i < n / QK5_0; i++) {
        const __m256i fifth = _mm256_and_si256(avx2_bits_to_bytes(x[i].qh), _mm256_set1_epi8(16));
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(avx2_unpack_nibbles(x[i].qs), fifth), _mm256_set1_epi8(16));
        levels32_to_float(q, true, _mm256_set1_ps(ggml_fp16_to_fp32(x[i].d)), _mm256_setzero_ps(), dst + i * QK5_0);
    }
}

static void q8_0_to_float_avx2(const void *src, float *dst, int64_t n) {
    const block_q8_0 *x = src; // (n / 32,)
    for (int64_t i = 0; i < n / QK8_0; i++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)x[i].qs);
        levels32_to_float(q, true, _mm256_set1_ps(ggml_fp16_to_fp32(x[i].d)), _mm256_setzero_ps(), dst + i * QK8_0);
    }
}

static void q4_K_to_float_avx2(const void *src, float *dst, int64_t n) {
    const block_q4_K *x = src; // (n / 256,)
    for (int64_t i = 0; i < n / QK_K; i++) {
        for (int p = 0; p < 4; p++) { // sub-blocks 2p (low nibbles of 32 bytes) and 2p + 1 (high)
            const __m256i qs = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * p));
            for (int h = 0; h < 2; h++) {
                float step, minimum;
                ggml_q4_K_sub_block(&x[i], 2 * p + h, &step, &minimum);
                const __m256i q = _mm256_and_si256(h ? _mm256_srli_epi16(qs, 4) : qs, _mm256_set1_epi8(0x0F));
                levels32_to_float(q, false, _mm256_set1_ps(step), _mm256_set1_ps(minimum),
                                  dst + i * QK_K + 32 * (2 * p + h));
            }
        }
    }
}

static void f16_from_float_avx2(const float *src, void *dst, int64_t n) {
    uint16_t *y = dst; // (n,)
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(y + i), h);
    }
    for (; i < n; i++) {
        y[i] = ggml_fp32_to_fp16(src[i]);
    }
}

// ============================================================================================
// Q4_0, Q4_1, Q5_0, Q8_0 with Q8 activations
// ============================================================================================

// products of the f16 scales of 4 weight blocks and 4 activation blocks, in lanes 0..3
static inline __m256 avx2_scales4(uint16_t w0, uint16_t w1, uint16_t w2, uint16_t w3,
                                  uint16_t x0, uint16_t x1, uint16_t x2, uint16_t x3) {
    return _mm256_castps128_ps256(_mm_mul_ps(avx2_f16x4(w0, w1, w2, w3), avx2_f16x4(x0, x1, x2, x3)));
}

// signed bytes a . b -> 16 int16 sums of 2 products (sign moved onto b so maddubs sees |a| unsigned)
static inline __m256i avx2_dot_i8_i16(__m256i a, __m256i b) {
    return _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}

// blocks 0 and 1 of Q4_0 . Q8_0 at once: one register holds both blocks' nibbles (block 0 in the low
// lane), so one madd serves two blocks -> int32 lanes 0..3 block 0, 4..7 block 1.
// sum (q - 8) y = sum q y - 8 sum y: unsigned maddubs, no sign juggling
static inline __m256i q4_0_pair_dot(const block_q4_0 *a, const block_q8_0 *b) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
    const __m256i v = avx2_load2_128(a[0].qs, a[1].qs);
    const __m256i lo = _mm256_and_si256(v, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    const __m256i ylo = avx2_load2_128(b[0].qs, b[1].qs), yhi = avx2_load2_128(b[0].qs + 16, b[1].qs + 16);
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, ylo), _mm256_maddubs_epi16(hi, yhi));
    const __m256i o = _mm256_add_epi16(_mm256_maddubs_epi16(eight, ylo), _mm256_maddubs_epi16(eight, yhi));
    return _mm256_madd_epi16(_mm256_sub_epi16(p, o), _mm256_set1_epi16(1));
}

static void q4_0_vec_dot_avx2(int64_t n, float *s, const void *w, const void *x) {
    const block_q4_0 *a = w; // (n / 32,)
    const block_q8_0 *b = x; // (n / 32,)
    const int64_t nb = n / QK4_0;
    // q4_0_pair_dot's lane order: scales [s0 x4, s1 x4]
    const __m256i order01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), order23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 4 <= nb; i += 4) {
        const __m256 sc = avx2_scales4(a[i].d, a[i + 1].d, a[i + 2].d, a[i + 3].d, b[i].d, b[i + 1].d, b[i + 2].d, b[i + 3].d);
        acc0 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc, order01), _mm256_cvtepi32_ps(q4_0_pair_dot(a + i, b + i)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc, order23), _mm256_cvtepi32_ps(q4_0_pair_dot(a + i + 2, b + i + 2)), acc1);
    }
    float sum = avx2_hsum_ps(_mm256_add_ps(acc0, acc1));
    for (; i < nb; i++) {
        const __m256i q = _mm256_sub_epi8(avx2_unpack_nibbles(a[i].qs), _mm256_set1_epi8(8));
        const __m256i p = avx2_dot_i8(q, _mm256_loadu_si256((const __m256i *)b[i].qs));
        sum += avx2_f16(a[i].d) * avx2_f16(b[i].d) * avx2_hsum_ps(_mm256_cvtepi32_ps(p));
    }
    *s = sum;
}

// blocks 0 and 1 of Q8_0 . Q8_0: int32 sums in lanes {0, 1, 4, 5} for block 0 and {2, 3, 6, 7} for block 1
static inline __m256i q8_0_pair_dot(const block_q8_0 *a, const block_q8_0 *b) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i p0 = _mm256_madd_epi16(avx2_dot_i8_i16(_mm256_loadu_si256((const __m256i *)a[0].qs),
                                                         _mm256_loadu_si256((const __m256i *)b[0].qs)), ones);
    const __m256i p1 = _mm256_madd_epi16(avx2_dot_i8_i16(_mm256_loadu_si256((const __m256i *)a[1].qs),
                                                         _mm256_loadu_si256((const __m256i *)b[1].qs)), ones);
    return _mm256_hadd_epi32(p0, p1);
}

static void q8_0_vec_dot_avx2(int64_t n, float *s, const void *w, const void *x) {
    const block_q8_0 *a = w; // (n / 32,)
    const block_q8_0 *b = x; // (n / 32,)
    const int64_t nb = n / QK8_0;
    // q8_0_pair_dot's lane order: scales [s0 s0 s1 s1 s0 s0 s1 s1]
    const __m256i order01 = _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1), order23 = _mm256_setr_epi32(2, 2, 3, 3, 2, 2, 3, 3);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 4 <= nb; i += 4) {
        const __m256 sc = avx2_scales4(a[i].d, a[i + 1].d, a[i + 2].d, a[i + 3].d, b[i].d, b[i + 1].d, b[i + 2].d, b[i + 3].d);
        acc0 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc, order01), _mm256_cvtepi32_ps(q8_0_pair_dot(a + i, b + i)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc, order23), _mm256_cvtepi32_ps(q8_0_pair_dot(a + i + 2, b + i + 2)), acc1);
    }
    float sum = avx2_hsum_ps(_mm256_add_ps(acc0, acc1));
    for (; i < nb; i++) {
        const __m256i p = avx2_dot_i8(_mm256_loadu_si256((const __m256i *)a[i].qs), _mm256_loadu_si256((const __m256i *)b[i].qs));
        sum += avx2_f16(a[i].d) * avx2_f16(b[i].d) * avx2_hsum_ps(_mm256_cvtepi32_ps(p));
    }
    *s = sum;
}

// blocks 0 and 1 of Q4_1 . Q8_1 (sum q y only; the minimum's share comes from s): lanes as q4_0_pair_dot
static inline __m256i q4_1_pair_dot(const block_q4_1 *a, const block_q8_1 *b) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i v = avx2_load2_128(a[0].qs, a[1].qs);
    const __m256i lo = _mm256_and_si256(v, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, avx2_load2_128(b[0].qs, b[1].qs)),
                                       _mm256_maddubs_epi16(hi, avx2_load2_128(b[0].qs + 16, b[1].qs + 16)));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

static void q4_1_vec_dot_avx2(int64_t n, float *s, const void *w, const void *x) {
    const block_q4_1 *a = w; // (n / 32,)
    const block_q8_1 *b = x; // (n / 32,)
    const int64_t nb = n / QK4_1;
    const __m256i order01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), order23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m128 accm = _mm_setzero_ps(); // sum of m * s: the minimum's share
    int64_t i = 0;
    for (; i + 4 <= nb; i += 4) {
        const __m256 sc = avx2_scales4(a[i].d, a[i + 1].d, a[i + 2].d, a[i + 3].d, b[i].d, b[i + 1].d, b[i + 2].d, b[i + 3].d);
        accm = _mm_fmadd_ps(avx2_f16x4(a[i].m, a[i + 1].m, a[i + 2].m, a[i + 3].m),
                            avx2_f16x4(b[i].s, b[i + 1].s, b[i + 2].s, b[i + 3].s), accm);
        acc0 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc, order01), _mm256_cvtepi32_ps(q4_1_pair_dot(a + i, b + i)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc, order23), _mm256_cvtepi32_ps(q4_1_pair_dot(a + i + 2, b + i + 2)), acc1);
    }
    float sum = avx2_hsum_ps(_mm256_add_ps(acc0, acc1)) + avx2_hsum_ps(_mm256_castps128_ps256(accm));
    for (; i < nb; i++) {
        const __m256i p = avx2_dot_u8i8(avx2_unpack_nibbles(a[i].qs), _mm256_loadu_si256((const __m256i *)b[i].qs));
        sum += avx2_f16(a[i].d) * avx2_f16(b[i].d) * avx2_hsum_ps(_mm256_cvtepi32_ps(p)) + avx2_f16(a[i].m) * avx2_f16(b[i].s);
    }
    *s = sum;
}

// blocks 0 and 1 of Q5_0 . Q8_0: q = nibble | fifth bit << 4 unsigned, sum (q - 16) y = sum q y - 16 sum y;
// lanes as q4_0_pair_dot
static inline __m256i q5_0_pair_dot(const block_q5_0 *a, const block_q8_0 *b) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10), sixteen = _mm256_set1_epi8(16);
    const uint32_t h0 = avx2_load_u32(a[0].qh), h1 = avx2_load_u32(a[1].qh);
    const uint32_t hlo = (h0 & 0xFFFF) | (h1 << 16), hhi = (h0 >> 16) | (h1 & 0xFFFF0000); // fifth bits per register
    const __m256i v = avx2_load2_128(a[0].qs, a[1].qs);
    const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(avx2_bits_to_bytes((const uint8_t *)&hlo), bit4));
    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                                       _mm256_and_si256(avx2_bits_to_bytes((const uint8_t *)&hhi), bit4));
    const __m256i ylo = avx2_load2_128(b[0].qs, b[1].qs), yhi = avx2_load2_128(b[0].qs + 16, b[1].qs + 16);
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, ylo), _mm256_maddubs_epi16(hi, yhi));
    const __m256i o = _mm256_add_epi16(_mm256_maddubs_epi16(sixteen, ylo), _mm256_maddubs_epi16(sixteen, yhi));
    return _mm256_madd_epi16(_mm256_sub_epi16(p, o), _mm256_set1_epi16(1));
}

static void q5_0_vec_dot_avx2(int64_t n, float *s, const void *w, const void *x) {
    const block_q5_0 *a = w; // (n / 32,)
    const block_q8_0 *b = x; // (n / 32,)
    const int64_t nb = n / QK5_0;
    const __m256i order01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), order23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 4 <= nb; i += 4) {
        const __m256 sc = avx2_scales4(a[i].d, a[i + 1].d, a[i + 2].d, a[i + 3].d, b[i].d, b[i + 1].d, b[i + 2].d, b[i + 3].d);
        acc0 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc, order01), _mm256_cvtepi32_ps(q5_0_pair_dot(a + i, b + i)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc, order23), _mm256_cvtepi32_ps(q5_0_pair_dot(a + i + 2, b + i + 2)), acc1);
    }
    float sum = avx2_hsum_ps(_mm256_add_ps(acc0, acc1));
    for (; i < nb; i++) {
        // q - 16 = nibble when the fifth bit is set, else nibble - 16 = nibble | 0xF0 (two's complement)
        const __m256i hi = _mm256_andnot_si256(avx2_bits_to_bytes(a[i].qh), _mm256_set1_epi8((char)0xF0));
        const __m256i q = _mm256_or_si256(avx2_unpack_nibbles(a[i].qs), hi);
        const __m256i p = avx2_dot_i8(q, _mm256_loadu_si256((const __m256i *)b[i].qs));
        sum += avx2_f16(a[i].d) * avx2_f16(b[i].d) * avx2_hsum_ps(_mm256_cvtepi32_ps(p));
    }
    *s = sum;
}

// ============================================================================================
// MXFP4 with Q8_0 activations: the nibbles index the 16 signed levels, a byte shuffle looks them up
// ============================================================================================

// blocks 0 and 1 of MXFP4 . Q8_0 (levels: ggml_mxfp4_kvalues in both 128-bit lanes); lanes as q4_0_pair_dot.
// |level| <= 12, so a maddubs pair stays far inside int16
static inline __m256i mxfp4_pair_dot(const block_mxfp4 *a, const block_q8_0 *b, __m256i levels) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i v = avx2_load2_128(a[0].qs, a[1].qs);
    const __m256i lo = _mm256_shuffle_epi8(levels, _mm256_and_si256(v, low4));
    const __m256i hi = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
    const __m256i ylo = avx2_load2_128(b[0].qs, b[1].qs), yhi = avx2_load2_128(b[0].qs + 16, b[1].qs + 16);
    const __m256i p = _mm256_add_epi16(avx2_dot_i8_i16(lo, ylo), avx2_dot_i8_i16(hi, yhi));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// the scales of four blocks
static inline __m128 mxfp4_scales4(const block_mxfp4 *b0, const block_mxfp4 *b1, const block_mxfp4 *b2,
                                   const block_mxfp4 *b3) {
    return _mm_setr_ps(ggml_e8m0_to_fp32_half(b0->e), ggml_e8m0_to_fp32_half(b1->e), ggml_e8m0_to_fp32_half(b2->e),
                       ggml_e8m0_to_fp32_half(b3->e));
}

// the power-of-two weight scale multiplies last, as in the scalar kernel: for a small e, d_w * d_x alone could
// fall below float's normal range where d_x * sum does not
static void mxfp4_vec_dot_avx2(int64_t n, float *s, const void *w, const void *x) {
    const block_mxfp4 *a = w; // (n / 32,)
    const block_q8_0 *b = x;  // (n / 32,)
    const int64_t nb = n / QK_MXFP4;
    const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)ggml_mxfp4_kvalues));
    const __m256i order01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), order23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 4 <= nb; i += 4) {
        const __m256 dw = _mm256_castps128_ps256(mxfp4_scales4(a + i, a + i + 1, a + i + 2, a + i + 3));
        const __m256 dx = _mm256_castps128_ps256(avx2_f16x4(b[i].d, b[i + 1].d, b[i + 2].d, b[i + 3].d));
        const __m256 p01 = _mm256_mul_ps(_mm256_permutevar8x32_ps(dx, order01),
                                         _mm256_cvtepi32_ps(mxfp4_pair_dot(a + i, b + i, levels)));
        const __m256 p23 = _mm256_mul_ps(_mm256_permutevar8x32_ps(dx, order23),
                                         _mm256_cvtepi32_ps(mxfp4_pair_dot(a + i + 2, b + i + 2, levels)));
        acc0 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(dw, order01), p01, acc0);
        acc1 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(dw, order23), p23, acc1);
    }
    float sum = avx2_hsum_ps(_mm256_add_ps(acc0, acc1));
    for (; i < nb; i++) {
        const __m256i q = _mm256_shuffle_epi8(levels, avx2_unpack_nibbles(a[i].qs));
        const __m256i p = avx2_dot_i8(q, _mm256_loadu_si256((const __m256i *)b[i].qs));
        sum += ggml_e8m0_to_fp32_half(a[i].e) * (avx2_f16(b[i].d) * avx2_hsum_ps(_mm256_cvtepi32_ps(p)));
    }
    *s = sum;
}

// ============================================================================================
// Q4_K, Q6_K with Q8_K activations
// ============================================================================================

static void q4_K_vec_dot_avx2(int64_t n, float *s, const void *w, const void *x) {
    const block_q4_K *a = w; // (n / 256,)
    const block_q8_K *b = x; // (n / 256,)
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps();
    float summ = 0.0f; // the mins' share, subtracted at the end
    for (int64_t i = 0; i < n / QK_K; i++) {
        // the 6-bit scales (sc) and mins (m) of the 8 sub-blocks, one a byte
        uint64_t sc_bytes, m_bytes;
        ggml_q4_K_scales_mins(a[i].scales, &sc_bytes, &m_bytes);
        uint8_t sc[8];
        memcpy(sc, &sc_bytes, 8);

        // sum over sub-blocks of m * sum(qx), from the per-16 sums of the activations
        const __m128i bs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)b[i].bsums),
                                          _mm_loadu_si128((const __m128i *)(b[i].bsums + 8))); // (8,) per 32
        const __m128i mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)m_bytes));
        __m128i pm = _mm_madd_epi16(bs, mins);
        pm = _mm_add_epi32(pm, _mm_shuffle_epi32(pm, _MM_SHUFFLE(1, 0, 3, 2)));
        pm = _mm_add_epi32(pm, _mm_shuffle_epi32(pm, _MM_SHUFFLE(2, 3, 0, 1)));
        summ += b[i].d * avx2_f16(a[i].dmin) * (float)_mm_cvtsi128_si32(pm);

        __m256i sumi = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i q4 = _mm256_loadu_si256((const __m256i *)(a[i].qs + 32 * c));
            const __m256i lo = _mm256_and_si256(q4, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), low4);
            const __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(b[i].qs + 64 * c)));
            const __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(b[i].qs + 64 * c + 32)));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p0, _mm256_set1_epi16(sc[2 * c])));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p1, _mm256_set1_epi16(sc[2 * c + 1])));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(b[i].d * avx2_f16(a[i].d)), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = avx2_hsum_ps(acc) - summ;
}

static void q6_K_vec_dot_avx2(int64_t n, float *s, const void *w, const void *x) {
    const block_q6_K *a = w; // (n / 256,)
    const block_q8_K *b = x; // (n / 256,)
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)a[i].scales)); // (16,) int16
        // the -32 offset: 32 * sum over sub-blocks of scale * sum(qx)
        const __m256i offs = _mm256_madd_epi16(scales, _mm256_loadu_si256((const __m256i *)b[i].bsums));
        __m256i sumi = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offs, 5));
        for (int h = 0; h < 2; h++) {
            const __m256i sc = h == 0 ? _mm256_permute2x128_si256(scales, scales, 0x00)
                                      : _mm256_permute2x128_si256(scales, scales, 0x11);
            __m256i q[4];
            avx2_q6_K_levels(&a[i], h, q);
            for (int g = 0; g < 4; g++) {
                const __m256i y = _mm256_loadu_si256((const __m256i *)(b[i].qs + 128 * h + 32 * g));
                const __m256i p = _mm256_maddubs_epi16(q[g], y);
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, avx2_q6_K_group_scales(sc, g)));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(b[i].d * avx2_f16(a[i].d)), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = avx2_hsum_ps(acc);
}

// ============================================================================================
// activation quantizers: the reference arithmetic (same division, multiply and rounding), 8 lanes at a time
// ============================================================================================

// 32 values -> clamp(round(x * id), -128, 127) as int8 in order; as the scalar quant_cast_int, values
// outside the int range, infinities and NaNs give 0 (cvttps returns INT_MIN for exactly those)
static inline __m256i avx2_quantize32(const float *x, float id) {
    const __m256 vid = _mm256_set1_ps(id);
    const __m256i bad = _mm256_set1_epi32(INT32_MIN);
    __m256i q[4];
    for (int i = 0; i < 4; i++) {
        q[i] = _mm256_cvttps_epi32(avx2_round_away(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), vid)));
        q[i] = _mm256_andnot_si256(_mm256_cmpeq_epi32(q[i], bad), q[i]);
    }
    // packs interleave the 128-bit lanes: dwords come out as q0 q1 q2 q3 (lo halves) then the hi halves
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// sums of 4 signed bytes each
static inline __m256i avx2_sum4_i8(__m256i q) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
}

static inline int sse_hsum_epi32(__m128i v) {
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(v);
}

static void q8_0_quantize_act_avx2(const float *src, void *dst, int64_t n) {
    block_q8_0 *y = dst; // (n / 32,)
    for (int64_t i = 0; i < n / QK8_0; i++) {
        const float *x = src + i * QK8_0; // (32,)
        const float d = avx2_amax(x, 4, true) / 127.0f;
        _mm256_storeu_si256((__m256i *)y[i].qs, avx2_quantize32(x, d != 0.0f ? 1.0f / d : 0.0f));
        y[i].d = ggml_fp32_to_fp16(d);
    }
}

static void q8_1_quantize_act_avx2(const float *src, void *dst, int64_t n) {
    block_q8_1 *y = dst; // (n / 32,)
    for (int64_t i = 0; i < n / QK8_1; i++) {
        const float *x = src + i * QK8_1; // (32,)
        const float d = avx2_amax(x, 4, true) / 127.0f;
        const __m256i q = avx2_quantize32(x, d != 0.0f ? 1.0f / d : 0.0f);
        _mm256_storeu_si256((__m256i *)y[i].qs, q);
        y[i].d = ggml_fp32_to_fp16(d);
        y[i].s = ggml_fp32_to_fp16(ggml_fp16_to_fp32(y[i].d) * (float)avx2_hsum_epi32(avx2_sum4_i8(q)));
    }
}

static void q8_K_quantize_act_avx2(const float *src, void *dst, int64_t n) {
    block_q8_K *y = dst; // (n / 256,)
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float *x = src + i * QK_K; // (256,)
        const float d = avx2_amax(x, QK_K / 8, false) / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = d;
        for (int c = 0; c < QK_K / 32; c++) {
            // Q8_K levels stop at -127; the bsums are of 16 values each
            const __m256i q = _mm256_max_epi8(avx2_quantize32(x + 32 * c, id), _mm256_set1_epi8(-127));
            _mm256_storeu_si256((__m256i *)(y[i].qs + 32 * c), q);
            const __m256i s4 = avx2_sum4_i8(q); // lanes 0..3: values 0..15, lanes 4..7: values 16..31
            y[i].bsums[2 * c] = (int16_t)sse_hsum_epi32(_mm256_castsi256_si128(s4));
            y[i].bsums[2 * c + 1] = (int16_t)sse_hsum_epi32(_mm256_extracti128_si256(s4, 1));
        }
    }
}

// ============================================================================================
// GEMM tiles (m > 1) of AVX2 alone: 4 weight rows x 4 activation columns per call, taken as two column pairs per
// block so that the 8 int32 accumulators, the pair's activations and a row's levels fit AVX2's 16 registers; each
// row's levels are unpacked once per column pair instead of once per column (vec_dot), each column's activations
// loaded once for four rows. What the VNNI tiles below do with vpdpbusd and vpdpwssd, maddubs + madd + add do here.
// (Q6_K's tile reads its rows rewritten as levels a byte each: a tile like its VNNI one, its levels rebuilt from two
// arrays for each 32 values, had run at half its vec_dot's rate on AVX2.)
// ============================================================================================

_Static_assert(GGML_GEMM_TILE_ROWS == 4 && GGML_GEMM_TILE_COLS == 4, "the tiles below are 4 x 4");


// the same for columns whose scales are f16
static inline __m256 tile_pair_scales(__m128 dw, uint16_t dx0, uint16_t dx1) {
    return tile_pair_scales_f32(dw, avx2_f16(dx0), avx2_f16(dx1));
}

// int32 lanes of u . x (u unsigned bytes, x signed; pairs of products within int16: u <= 128, |x| <= 127)
static inline __m256i tile_dot_u8s8(__m256i u, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}

// Q8_0 . Q8_0 (and Q5_0's rows rewritten as Q8_0, ops_matmul.c): |w| times x with w's signs (maddubs takes one
// unsigned operand), a fma per block and column pair applies the 8 scales
static void q8_0_gemm_tile_avx2(int64_t n, float *s, int64_t ss, const void *w, size_t bw, const void *x, size_t bx) {
    const block_q8_0 *wr[4], *xc[4]; // (4, n / 32) weight rows, activation columns
    for (int i = 0; i < 4; i++) {
        wr[i] = (const block_q8_0 *)((const char *)w + i * bw);
        xc[i] = (const block_q8_0 *)((const char *)x + i * bx);
    }
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < n / QK8_0; b++) {
        __m256i wq[4], wa[4];
        for (int r = 0; r < 4; r++) {
            wq[r] = _mm256_loadu_si256((const __m256i *)wr[r][b].qs);
            wa[r] = _mm256_sign_epi8(wq[r], wq[r]);
        }
        const __m128 dw = avx2_f16x4(wr[0][b].d, wr[1][b].d, wr[2][b].d, wr[3][b].d);
        for (int h = 0; h < 2; h++) {
            __m256i col[2];
            for (int j = 0; j < 2; j++) {
                const __m256i xj = _mm256_loadu_si256((const __m256i *)xc[2 * h + j][b].qs);
                col[j] = tile_sum4_epi32(tile_dot_u8s8(wa[0], _mm256_sign_epi8(xj, wq[0])),
                                         tile_dot_u8s8(wa[1], _mm256_sign_epi8(xj, wq[1])),
                                         tile_dot_u8s8(wa[2], _mm256_sign_epi8(xj, wq[2])),
                                         tile_dot_u8s8(wa[3], _mm256_sign_epi8(xj, wq[3])));
            }
            acc[h] = _mm256_fmadd_ps(tile_pair_scales(dw, xc[2 * h][b].d, xc[2 * h + 1][b].d),
                                     _mm256_cvtepi32_ps(tile_join_cols(col[0], col[1])), acc[h]);
        }
    }
    tile_store(s, ss, acc[0], acc[1]);
}

// the 4-bit types' tiles: levels (0..15) times x, scaled by d dx. Q4_1 . Q8_1: each block's minimum times the column's
// d sum(x) (Q8_1's s); Q4_0 . Q8_0: less 8 sum(x), formed once a column block for the four rows
static inline __attribute__((always_inline)) void tile_u4_avx2(enum ggml_type type, int64_t n, float *s, int64_t ss,
                                                               const void *w, size_t bw, const void *x, size_t bx) {
    const bool q4_1 = type == GGML_TYPE_Q4_1;
    const size_t wb = q4_1 ? sizeof(block_q4_1) : sizeof(block_q4_0), xb = q4_1 ? sizeof(block_q8_1) : sizeof(block_q8_0);
    const __m256i eight = _mm256_set1_epi8(8);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < n / 32; b++) {
        __m256i wq[4];
        uint16_t d[4], m[4]; // the rows' scales, and Q4_1's minima
        for (int r = 0; r < 4; r++) {
            const char *blk = (const char *)w + r * bw + b * wb;
            if (q4_1) {
                const block_q4_1 *a = (const block_q4_1 *)blk;
                wq[r] = avx2_unpack_nibbles(a->qs), d[r] = a->d, m[r] = a->m;
            } else {
                const block_q4_0 *a = (const block_q4_0 *)blk;
                wq[r] = avx2_unpack_nibbles(a->qs), d[r] = a->d;
            }
        }
        const __m128 dw = avx2_f16x4(d[0], d[1], d[2], d[3]);
        for (int h = 0; h < 2; h++) {
            const char *c0 = (const char *)x + 2 * h * bx + b * xb, *c1 = c0 + bx; // columns 2h, 2h + 1
            const int8_t *q0 = q4_1 ? ((const block_q8_1 *)c0)->qs : ((const block_q8_0 *)c0)->qs;
            const int8_t *q1 = q4_1 ? ((const block_q8_1 *)c1)->qs : ((const block_q8_0 *)c1)->qs;
            __m256i col[2];
            for (int j = 0; j < 2; j++) {
                const __m256i xj = _mm256_loadu_si256((const __m256i *)(j ? q1 : q0));
                const __m256i o = q4_1 ? _mm256_setzero_si256() : tile_dot_u8s8(eight, xj);
                col[j] = tile_sum4_epi32(_mm256_sub_epi32(tile_dot_u8s8(wq[0], xj), o),
                                         _mm256_sub_epi32(tile_dot_u8s8(wq[1], xj), o),
                                         _mm256_sub_epi32(tile_dot_u8s8(wq[2], xj), o),
                                         _mm256_sub_epi32(tile_dot_u8s8(wq[3], xj), o));
            }
            const uint16_t dx0 = q4_1 ? ((const block_q8_1 *)c0)->d : ((const block_q8_0 *)c0)->d;
            const uint16_t dx1 = q4_1 ? ((const block_q8_1 *)c1)->d : ((const block_q8_0 *)c1)->d;
            acc[h] = _mm256_fmadd_ps(tile_pair_scales(dw, dx0, dx1), _mm256_cvtepi32_ps(tile_join_cols(col[0], col[1])),
                                     acc[h]);
            if (q4_1)
                acc[h] = _mm256_add_ps(acc[h], tile_pair_scales(avx2_f16x4(m[0], m[1], m[2], m[3]),
                                                                ((const block_q8_1 *)c0)->s, ((const block_q8_1 *)c1)->s));
        }
    }
    tile_store(s, ss, acc[0], acc[1]);
}

static void q4_0_gemm_tile_avx2(int64_t n, float *s, int64_t ss, const void *w, size_t bw, const void *x, size_t bx) {
    tile_u4_avx2(GGML_TYPE_Q4_0, n, s, ss, w, bw, x, bx);
}

static void q4_1_gemm_tile_avx2(int64_t n, float *s, int64_t ss, const void *w, size_t bw, const void *x, size_t bx) {
    tile_u4_avx2(GGML_TYPE_Q4_1, n, s, ss, w, bw, x, bx);
}

// lane r: row r's sum over sub-blocks of m * sum(x) for one column's super-block, as a float (the mins' share)
static inline __m128 q4_K_tile_min_sums(const block_q8_K *xj, const __m128i mins[4]) {
    const __m128i bs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)xj->bsums),
                                      _mm_loadu_si128((const __m128i *)(xj->bsums + 8))); // (8,) per 32
    __m128i v[4];
    for (int r = 0; r < 4; r++) v[r] = _mm_madd_epi16(bs, mins[r]);
    return _mm_cvtepi32_ps(_mm_hadd_epi32(_mm_hadd_epi32(v[0], v[1]), _mm_hadd_epi32(v[2], v[3])));
}

// Q4_K . Q8_K: per sub-block of 32, levels (0..15) times x as int16 pairs (maddubs), times the six-bit scale
// into int32 (madd); one float fma per super-block applies d, the mins times the columns' per-32 sums come off
static void q4_K_gemm_tile_avx2(int64_t n, float *s, int64_t ss, const void *w, size_t bw, const void *x, size_t bx) {
    const block_q4_K *wr[4]; // (4, n / 256) weight rows
    const block_q8_K *xc[4]; // (4, n / 256) activation columns
    for (int i = 0; i < 4; i++) {
        wr[i] = (const block_q4_K *)((const char *)w + i * bw);
        xc[i] = (const block_q8_K *)((const char *)x + i * bx);
    }
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < n / QK_K; b++) {
        uint8_t sc[4][8];
        __m128i mins[4]; // (8,) int16 per row
        q4_K_tile_scales_mins(wr, b, sc, mins);
        const __m128 dw = avx2_f16x4(wr[0][b].d, wr[1][b].d, wr[2][b].d, wr[3][b].d);
        const __m128 mw = avx2_f16x4(wr[0][b].dmin, wr[1][b].dmin, wr[2][b].dmin, wr[3][b].dmin);
        for (int h = 0; h < 2; h++) { // columns 2h and 2h + 1
            const block_q8_K *x0 = &xc[2 * h][b], *x1 = &xc[2 * h + 1][b];
            __m256i p[8]; // lane sums of (row r, column 2h + j) in p[r + 4 j]
            for (int i = 0; i < 8; i++) p[i] = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) { // sub-blocks 2c (low nibbles) and 2c + 1 (high)
                const __m256i xl0 = _mm256_loadu_si256((const __m256i *)(x0->qs + 64 * c));
                const __m256i xh0 = _mm256_loadu_si256((const __m256i *)(x0->qs + 64 * c + 32));
                const __m256i xl1 = _mm256_loadu_si256((const __m256i *)(x1->qs + 64 * c));
                const __m256i xh1 = _mm256_loadu_si256((const __m256i *)(x1->qs + 64 * c + 32));
                for (int r = 0; r < 4; r++) {
                    const __m256i q4 = _mm256_loadu_si256((const __m256i *)(wr[r][b].qs + 32 * c));
                    const __m256i lo = _mm256_and_si256(q4, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), low4);
                    const __m256i s0 = _mm256_set1_epi16(sc[r][2 * c]), s1 = _mm256_set1_epi16(sc[r][2 * c + 1]);
                    p[r] = _mm256_add_epi32(p[r], _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl0), s0),
                                                                   _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh0), s1)));
                    p[r + 4] = _mm256_add_epi32(p[r + 4],
                                                _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl1), s0),
                                                                 _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh1), s1)));
                }
            }
            const __m128 msum[2] = {q4_K_tile_min_sums(x0, mins), q4_K_tile_min_sums(x1, mins)};
            acc[h] = _mm256_fmadd_ps(tile_pair_scales_f32(dw, x0->d, x1->d), _mm256_cvtepi32_ps(tile_sum8_epi32(p)),
                                     acc[h]);
            acc[h] = _mm256_fnmadd_ps(tile_pair_scales_f32(mw, x0->d, x1->d), _mm256_set_m128(msum[1], msum[0]), acc[h]);
        }
    }
    tile_store(s, ss, acc[0], acc[1]);
}

// Q6_K rows as block_q6_K_levels (ops_matmul.c rewrites a row tile once and runs every column tile over it)
static void q6_K_rows_as_levels(const void *w, size_t bw, int64_t rows, int64_t k, void *out) {
    const int64_t nb = k / QK_K;
    block_q6_K_levels *dst = out;
    for (int64_t r = 0; r < rows; r++) {
        const block_q6_K *src = (const block_q6_K *)((const char *)w + r * (int64_t)bw);
        for (int64_t b = 0; b < nb; b++, dst++) {
            for (int h = 0; h < 2; h++) {
                __m256i q[4];
                avx2_q6_K_levels(&src[b], h, q);
                for (int g = 0; g < 4; g++) _mm256_storeu_si256((__m256i *)(dst->q + 128 * h + 32 * g), q[g]);
            }
            memcpy(dst->scales, src[b].scales, sizeof dst->scales);
            dst->d = src[b].d;
        }
    }
}

// Q6_K (its levels, block_q6_K_levels) . Q8_K: per group of 32 values (two sub-blocks of 16), levels (0..63) times x
// as int16 pairs (maddubs: 2 * 63 * 127 stays within int16), each half times its sub-block's scale into int32
// (madd); the offset 32 comes off through the columns' per-16 sums, seeded into the same lanes as the VNNI tile seeds
// them, so one fma per super-block and column pair remains. The scale vectors are made once a super-block, for both
// column pairs.
static void q6_K_levels_gemm_tile_avx2(int64_t n, float *s, int64_t ss, const void *w, size_t bw, const void *x,
                                       size_t bx) {
    const block_q6_K_levels *wr[4]; // (4, n / 256) weight rows
    const block_q8_K *xc[4];        // (4, n / 256) activation columns
    for (int i = 0; i < 4; i++) {
        wr[i] = (const block_q6_K_levels *)((const char *)w + i * bw);
        xc[i] = (const block_q8_K *)((const char *)x + i * bx);
    }
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < n / QK_K; b++) {
        __m256i scv[4][8]; // row r, group g: sub-block 2g's scale in the low lane's int16s, 2g + 1's in the high
        for (int r = 0; r < 4; r++)
            for (int g = 0; g < 8; g++)
                scv[r][g] = _mm256_set_m128i(_mm_set1_epi16(wr[r][b].scales[2 * g + 1]), _mm_set1_epi16(wr[r][b].scales[2 * g]));
        for (int h = 0; h < 2; h++) { // columns 2h and 2h + 1
            const block_q8_K *x0 = &xc[2 * h][b], *x1 = &xc[2 * h + 1][b];
            const __m256i bs0 = _mm256_loadu_si256((const __m256i *)x0->bsums);
            const __m256i bs1 = _mm256_loadu_si256((const __m256i *)x1->bsums);
            __m256i p[8]; // (row r, column 2h + j) in p[r + 4 j], seeded with -32 sum over sub-blocks of scale * sum(x)
            for (int r = 0; r < 4; r++) {
                const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wr[r][b].scales));
                p[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(bs0, sc16), 5));
                p[r + 4] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(bs1, sc16), 5));
            }
            for (int g = 0; g < 8; g++) {
                const __m256i xq0 = _mm256_loadu_si256((const __m256i *)(x0->qs + 32 * g));
                const __m256i xq1 = _mm256_loadu_si256((const __m256i *)(x1->qs + 32 * g));
                for (int r = 0; r < 4; r++) {
                    const __m256i u = _mm256_loadu_si256((const __m256i *)(wr[r][b].q + 32 * g));
                    p[r] = _mm256_add_epi32(p[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, xq0), scv[r][g]));
                    p[r + 4] = _mm256_add_epi32(p[r + 4], _mm256_madd_epi16(_mm256_maddubs_epi16(u, xq1), scv[r][g]));
                }
            }
            const __m128 dw = avx2_f16x4(wr[0][b].d, wr[1][b].d, wr[2][b].d, wr[3][b].d);
            acc[h] = _mm256_fmadd_ps(tile_pair_scales_f32(dw, x0->d, x1->d), _mm256_cvtepi32_ps(tile_sum8_epi32(p)),
                                     acc[h]);
        }
    }
    tile_store(s, ss, acc[0], acc[1]);
}

// ============================================================================================
// GEMM tiles (m > 1): 4 weight rows x 4 activation columns per call, AVX512-VNNI on 256-bit registers.
// Each block of the 16 pairs is one vpdpbusd per pair (unsigned x signed bytes into int32, no int16
// saturation); the 8 pairs of two columns are summed across lanes together (lane r + 4 j' = pair (r, j')),
// so one fma applies the 8 scales and no horizontal sum is left per output.
// ============================================================================================

#define VNNI_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))

// Q8_0 . Q8_0: x + 128 is unsigned, so x . w = (x + 128) . w - 128 sum(w); the correction seeds each row's dot
VNNI_TARGET static void q8_0_gemm_tile_vnni(int64_t n, float *s, int64_t ss, const void *w, size_t bw,
                                            const void *x, size_t bx) {
    const block_q8_0 *wr[4], *xc[4]; // (4, n / 32) weight rows, activation columns
    for (int i = 0; i < 4; i++) {
        wr[i] = (const block_q8_0 *)((const char *)w + i * bw);
        xc[i] = (const block_q8_0 *)((const char *)x + i * bx);
    }
    const __m256i flip = _mm256_set1_epi8((char)0x80), zero = _mm256_setzero_si256();
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < n / QK8_0; b++) {
        __m256i wq[4], seed[4], ux[4];
        for (int r = 0; r < 4; r++) {
            wq[r] = _mm256_loadu_si256((const __m256i *)wr[r][b].qs);
            seed[r] = _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, flip, wq[r]));
        }
        for (int j = 0; j < 4; j++) ux[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)xc[j][b].qs), flip);
        const __m128 dw = avx2_f16x4(wr[0][b].d, wr[1][b].d, wr[2][b].d, wr[3][b].d);
        for (int h = 0; h < 2; h++) {
            __m256i p[8];
            for (int r = 0; r < 4; r++) {
                p[r] = _mm256_dpbusd_epi32(seed[r], ux[2 * h], wq[r]);
                p[r + 4] = _mm256_dpbusd_epi32(seed[r], ux[2 * h + 1], wq[r]);
            }
            const __m256 sc = tile_pair_scales(dw, xc[2 * h][b].d, xc[2 * h + 1][b].d);
            acc[h] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(tile_sum8_epi32(p)), acc[h]);
        }
    }
    tile_store(s, ss, acc[0], acc[1]);
}

// 32 unsigned weight levels of one block
typedef __m256i (*tile_levels_fn)(const void *block);
// the scales of 4 blocks (one of each row)
typedef __m128 (*tile_scales_fn)(const char *const blk[4]);

// a tile of weights whose blocks hold a scale d and 32 unsigned levels u, worth (u - offset) * d, times Q8_0
// columns: x . (u - offset) = u . x - offset sum(x), so -offset sum(x) seeds each column's dot.
// Inlined into each type's tile with its constants, so `levels` and `scales` are direct calls
VNNI_TARGET static inline __attribute__((always_inline)) void offset_gemm_tile(
    int64_t n, float *s, int64_t ss, const void *w, size_t bw, const void *x, size_t bx, size_t block_bytes,
    tile_levels_fn levels, tile_scales_fn scales, char offset) {
    const char *wr[4];       // (4, n / 32) weight rows
    const block_q8_0 *xc[4]; // (4, n / 32) activation columns
    for (int i = 0; i < 4; i++) {
        wr[i] = (const char *)w + i * bw;
        xc[i] = (const block_q8_0 *)((const char *)x + i * bx);
    }
    const __m256i off = _mm256_set1_epi8(offset), zero = _mm256_setzero_si256();
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < n / 32; b++) {
        __m256i wq[4], xq[4], seed[4];
        const char *blk[4];
        for (int r = 0; r < 4; r++) {
            blk[r] = wr[r] + b * block_bytes;
            wq[r] = levels(blk[r]);
        }
        for (int j = 0; j < 4; j++) {
            xq[j] = _mm256_loadu_si256((const __m256i *)xc[j][b].qs);
            seed[j] = _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, off, xq[j]));
        }
        const __m128 dw = scales(blk);
        for (int h = 0; h < 2; h++) {
            __m256i p[8];
            for (int r = 0; r < 4; r++) {
                p[r] = _mm256_dpbusd_epi32(seed[2 * h], wq[r], xq[2 * h]);
                p[r + 4] = _mm256_dpbusd_epi32(seed[2 * h + 1], wq[r], xq[2 * h + 1]);
            }
            const __m256 sc = tile_pair_scales(dw, xc[2 * h][b].d, xc[2 * h + 1][b].d);
            acc[h] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(tile_sum8_epi32(p)), acc[h]);
        }
    }
    tile_store(s, ss, acc[0], acc[1]);
}

// the f16 scales that Q4_0's and Q5_0's blocks start with
VNNI_TARGET static inline __m128 f16_block_scales(const char *const blk[4]) {
    uint16_t d[4];
    for (int r = 0; r < 4; r++) memcpy(&d[r], blk[r], sizeof d[r]);
    return avx2_f16x4(d[0], d[1], d[2], d[3]);
}

VNNI_TARGET static inline __m256i q4_0_levels(const void *block) {
    return avx2_unpack_nibbles(((const block_q4_0 *)block)->qs);
}

// the fifth bit joins the nibble: levels 0..31
VNNI_TARGET static inline __m256i q5_0_levels(const void *block) {
    const block_q5_0 *blk = block;
    return _mm256_or_si256(avx2_unpack_nibbles(blk->qs),
                           _mm256_and_si256(avx2_bits_to_bytes(blk->qh), _mm256_set1_epi8(16)));
}

// two blocks' unsigned levels for a row dot: lo holds values 0..15 of both (the first block in the low lane), hi
// values 16..31, in the order avx2_load2_128 gives the activations
typedef void (*pair_levels_fn)(const char *blocks, __m256i *lo, __m256i *hi);

// a decoded token's row dot for weights whose blocks start with an f16 scale d and hold unsigned levels u worth
// (u - offset) d, times Q8_0: four dpbusd per two blocks add the bytes' products straight into int32 (AVX2's
// maddubs, the add of its halves and the madd to int32 are three), less offset sum(y) formed the same way.
// int32 lanes 0..3 the first block of a pair, 4..7 the second. Inlined into each type's dot with its constants
VNNI_TARGET static inline __attribute__((always_inline)) float offset_vec_dot(int64_t nb, const char *a,
                                                                             size_t block_bytes,
                                                                             const block_q8_0 *b,
                                                                             pair_levels_fn levels, char offset) {
    const __m256i off = _mm256_set1_epi8(offset);
    const __m256i order01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), order23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 4 <= nb; i += 4) {
        uint16_t d[4];
        for (int j = 0; j < 4; j++) memcpy(&d[j], a + (i + j) * block_bytes, sizeof d[j]);
        const __m256 sc = avx2_scales4(d[0], d[1], d[2], d[3], b[i].d, b[i + 1].d, b[i + 2].d, b[i + 3].d);
        __m256i p[2];
        for (int h = 0; h < 2; h++) { // blocks i + 2h and i + 2h + 1
            __m256i lo, hi;
            levels(a + (i + 2 * h) * block_bytes, &lo, &hi);
            const __m256i ylo = avx2_load2_128(b[i + 2 * h].qs, b[i + 2 * h + 1].qs);
            const __m256i yhi = avx2_load2_128(b[i + 2 * h].qs + 16, b[i + 2 * h + 1].qs + 16);
            const __m256i q = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, ylo), hi, yhi);
            const __m256i o = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), off, ylo), off, yhi);
            p[h] = _mm256_sub_epi32(q, o);
        }
        acc0 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc, order01), _mm256_cvtepi32_ps(p[0]), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc, order23), _mm256_cvtepi32_ps(p[1]), acc1);
    }
    return avx2_hsum_ps(_mm256_add_ps(acc0, acc1));
}

// two blocks' 16 bytes of nibbles each: the low nibbles (values 0..15) and the high ones (16..31)
VNNI_TARGET static inline void nibble_pair(const uint8_t *qs0, const uint8_t *qs1, __m256i *lo, __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), v = avx2_load2_128(qs0, qs1);
    *lo = _mm256_and_si256(v, low4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
}

// offset_vec_dot over 4 rows (bw bytes apart) at once: the activations' loads and their offset sums serve the 4,
// each row's own operations are offset_vec_dot's, in its order (so each sum is bit for bit what it gives)
VNNI_TARGET static inline __attribute__((always_inline)) void offset_vec_dot4(int64_t nb, const char *a, size_t bw,
                                                                              size_t block_bytes,
                                                                              const block_q8_0 *b,
                                                                              pair_levels_fn levels, char offset,
                                                                              float s[4]) {
    const __m256i off = _mm256_set1_epi8(offset);
    const __m256i order01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), order23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    __m256 acc0[4], acc1[4];
    for (int r = 0; r < 4; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i + 4 <= nb; i += 4) {
        const __m128 dx = avx2_f16x4(b[i].d, b[i + 1].d, b[i + 2].d, b[i + 3].d);
        __m256i ylo[2], yhi[2], o[2];
        for (int h = 0; h < 2; h++) {
            ylo[h] = avx2_load2_128(b[i + 2 * h].qs, b[i + 2 * h + 1].qs);
            yhi[h] = avx2_load2_128(b[i + 2 * h].qs + 16, b[i + 2 * h + 1].qs + 16);
            o[h] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), off, ylo[h]), off, yhi[h]);
        }
        for (int r = 0; r < 4; r++) {
            const char *ar = a + r * bw;
            // the next 4 rows' bytes at this place (a step reads 4 blocks: two lines for Q4_0 and Q5_0, three for
            // Q8_0), asked for as the rows are read: a burst for whole rows between the calls had cost a 16-core
            // server's decode 6 %
            avx2_prefetch_span_l2(ar + 4 * bw + i * block_bytes, 4 * block_bytes);
            uint16_t d[4];
            for (int j = 0; j < 4; j++) memcpy(&d[j], ar + (i + j) * block_bytes, sizeof d[j]);
            const __m256 sc = _mm256_castps128_ps256(_mm_mul_ps(avx2_f16x4(d[0], d[1], d[2], d[3]), dx));
            __m256i p[2];
            for (int h = 0; h < 2; h++) {
                __m256i lo, hi;
                levels(ar + (i + 2 * h) * block_bytes, &lo, &hi);
                const __m256i q = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, ylo[h]), hi, yhi[h]);
                p[h] = _mm256_sub_epi32(q, o[h]);
            }
            acc0[r] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc, order01), _mm256_cvtepi32_ps(p[0]), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc, order23), _mm256_cvtepi32_ps(p[1]), acc1[r]);
        }
    }
    for (int r = 0; r < 4; r++) s[r] = avx2_hsum_ps(_mm256_add_ps(acc0[r], acc1[r]));
}

VNNI_TARGET static inline void q4_0_pair_levels(const char *blocks, __m256i *lo, __m256i *hi) {
    const block_q4_0 *a = (const block_q4_0 *)blocks;
    nibble_pair(a[0].qs, a[1].qs, lo, hi);
}

// the fifth bits become a byte mask (AVX512BW's k registers) that adds 16 to the nibbles where set: one masked add
// for 16 levels where AVX2 spreads the bits with a shuffle, a compare and two logic ops
VNNI_TARGET static inline void q5_0_pair_levels(const char *blocks, __m256i *lo, __m256i *hi) {
    const block_q5_0 *a = (const block_q5_0 *)blocks;
    const __m256i sixteen = _mm256_set1_epi8(16);
    const uint32_t h0 = avx2_load_u32(a[0].qh), h1 = avx2_load_u32(a[1].qh);
    const __mmask32 klo = (h0 & 0xFFFF) | (h1 << 16), khi = (h0 >> 16) | (h1 & 0xFFFF0000);
    nibble_pair(a[0].qs, a[1].qs, lo, hi);
    *lo = _mm256_mask_add_epi8(*lo, klo, *lo, sixteen);
    *hi = _mm256_mask_add_epi8(*hi, khi, *hi, sixteen);
}

// a row's dot of n values (whole blocks of 32): offset_vec_dot over whole groups of 4 blocks, the last blocks (fewer
// than 4) as the type's AVX2 kernel does them (rest_dot)
VNNI_TARGET static inline __attribute__((always_inline)) float offset_row_dot(int64_t n, const char *w,
                                                                             const block_q8_0 *x, size_t block_bytes,
                                                                             pair_levels_fn levels, char offset,
                                                                             ggml_vec_dot_fn rest_dot) {
    const int64_t nb = n / 32, nb4 = nb & ~(int64_t)3;
    float rest = 0.0f;
    const float sum = offset_vec_dot(nb4, w, block_bytes, x, levels, offset);
    if (nb4 < nb) rest_dot((nb - nb4) * 32, &rest, w + nb4 * block_bytes, x + nb4);
    return sum + rest;
}

// offset_row_dot for 4 rows (bw bytes apart): offset_vec_dot4, then each row's last blocks as offset_row_dot's
VNNI_TARGET static inline __attribute__((always_inline)) void offset_row_dot4(int64_t n, float *s, const char *w,
                                                                             size_t bw, const block_q8_0 *x,
                                                                             size_t block_bytes, pair_levels_fn levels,
                                                                             char offset, ggml_vec_dot_fn rest_dot) {
    const int64_t nb = n / 32, nb4 = nb & ~(int64_t)3;
    float sum[4];
    offset_vec_dot4(nb4, w, bw, block_bytes, x, levels, offset, sum);
    for (int r = 0; r < 4; r++) {
        float rest = 0.0f;
        if (nb4 < nb) rest_dot((nb - nb4) * 32, &rest, w + r * bw + nb4 * block_bytes, x + nb4);
        s[r] = sum[r] + rest;
    }
}

// Q8_0's signed levels made unsigned by flipping the top bit (w + 128), the 128 sum(y) taken off as the offset
VNNI_TARGET static inline void q8_0_pair_levels(const char *blocks, __m256i *lo, __m256i *hi) {
    const block_q8_0 *a = (const block_q8_0 *)blocks;
    const __m256i top = _mm256_set1_epi8((char)0x80);
    *lo = _mm256_xor_si256(avx2_load2_128(a[0].qs, a[1].qs), top);
    *hi = _mm256_xor_si256(avx2_load2_128(a[0].qs + 16, a[1].qs + 16), top);
}

VNNI_TARGET static void q4_0_vec_dot_vnni(int64_t n, float *s, const void *w, const void *x) {
    *s = offset_row_dot(n, w, x, sizeof(block_q4_0), q4_0_pair_levels, 8, q4_0_vec_dot_avx2);
}

VNNI_TARGET static void q4_0_vec_dot4_vnni(int64_t n, float *s, const void *w, size_t bw, const void *x) {
    offset_row_dot4(n, s, w, bw, x, sizeof(block_q4_0), q4_0_pair_levels, 8, q4_0_vec_dot_avx2);
}

VNNI_TARGET static void q5_0_vec_dot_vnni(int64_t n, float *s, const void *w, const void *x) {
    *s = offset_row_dot(n, w, x, sizeof(block_q5_0), q5_0_pair_levels, 16, q5_0_vec_dot_avx2);
}

VNNI_TARGET static void q5_0_vec_dot4_vnni(int64_t n, float *s, const void *w, size_t bw, const void *x) {
    offset_row_dot4(n, s, w, bw, x, sizeof(block_q5_0), q5_0_pair_levels, 16, q5_0_vec_dot_avx2);
}

VNNI_TARGET static void q8_0_vec_dot_vnni(int64_t n, float *s, const void *w, const void *x) {
    *s = offset_row_dot(n, w, x, sizeof(block_q8_0), q8_0_pair_levels, (char)0x80, q8_0_vec_dot_avx2);
}

VNNI_TARGET static void q8_0_vec_dot4_vnni(int64_t n, float *s, const void *w, size_t bw, const void *x) {
    offset_row_dot4(n, s, w, bw, x, sizeof(block_q8_0), q8_0_pair_levels, (char)0x80, q8_0_vec_dot_avx2);
}

// Q4_K . Q8_K on VNNI, AVX2's arithmetic bit for bit (the same exact integer sums, the same float steps): the
// scales' multiply-adds fold into vpdpwssd, and 4 rows share the activations' loads and their per-32 sums. One
// super-block of one row: its integer sums (8 lanes) and the mins' share m . sum(q)
struct q4_K_step {
    __m256i sumi;
    int32_t mins;
};

VNNI_TARGET static inline __attribute__((always_inline)) struct q4_K_step q4_K_step_vnni(const block_q4_K *a,
                                                                                        const __m256i y[8],
                                                                                        __m128i bsums32) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    uint64_t sc_bytes, m_bytes;
    ggml_q4_K_scales_mins(a->scales, &sc_bytes, &m_bytes);
    __m128i pm = _mm_madd_epi16(bsums32, _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)m_bytes)));
    pm = _mm_add_epi32(pm, _mm_shuffle_epi32(pm, _MM_SHUFFLE(1, 0, 3, 2)));
    pm = _mm_add_epi32(pm, _mm_shuffle_epi32(pm, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m256i sc = _mm256_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc_bytes)); // 16-bit lane j: sub-block j's
    __m256i sumi = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        const __m256i q4 = _mm256_loadu_si256((const __m256i *)(a->qs + 32 * c));
        const __m256i lo = _mm256_and_si256(q4, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), low4);
        const __m256i sc_lo = _mm256_permutexvar_epi16(_mm256_set1_epi16((short)(2 * c)), sc);
        const __m256i sc_hi = _mm256_permutexvar_epi16(_mm256_set1_epi16((short)(2 * c + 1)), sc);
        sumi = _mm256_dpwssd_epi32(sumi, _mm256_maddubs_epi16(lo, y[2 * c]), sc_lo);
        sumi = _mm256_dpwssd_epi32(sumi, _mm256_maddubs_epi16(hi, y[2 * c + 1]), sc_hi);
    }
    return (struct q4_K_step){sumi, _mm_cvtsi128_si32(pm)};
}

// the activations of super-block b: 8 loads of 32 and the 8 per-32 sums of q
VNNI_TARGET static inline __m128i q8_K_operands(const block_q8_K *b, __m256i y[8]) {
    for (int j = 0; j < 8; j++) y[j] = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * j));
    return _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)b->bsums), _mm_loadu_si128((const __m128i *)(b->bsums + 8)));
}

VNNI_TARGET static void q4_K_vec_dot_vnni(int64_t n, float *s, const void *w, const void *x) {
    const block_q4_K *a = w;
    const block_q8_K *b = x;
    __m256 acc = _mm256_setzero_ps();
    float summ = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        __m256i y[8];
        const struct q4_K_step t = q4_K_step_vnni(&a[i], y, q8_K_operands(&b[i], y));
        summ += b[i].d * avx2_f16(a[i].dmin) * (float)t.mins;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(b[i].d * avx2_f16(a[i].d)), _mm256_cvtepi32_ps(t.sumi), acc);
    }
    *s = avx2_hsum_ps(acc) - summ;
}

VNNI_TARGET static void q4_K_vec_dot4_vnni(int64_t n, float *s, const void *w, size_t bw, const void *x) {
    const block_q8_K *b = x;
    __m256 acc[4];
    float summ[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        __m256i y[8];
        const __m128i bsums32 = q8_K_operands(&b[i], y);
        for (int r = 0; r < 4; r++) {
            const block_q4_K *a = (const block_q4_K *)((const char *)w + r * bw) + i;
            // the next 4 rows' super-block here, asked for as these are read (as offset_vec_dot4)
            avx2_prefetch_span_l2((const char *)a + 4 * bw, sizeof(block_q4_K));
            const struct q4_K_step t = q4_K_step_vnni(a, y, bsums32);
            summ[r] += b[i].d * avx2_f16(a->dmin) * (float)t.mins;
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(b[i].d * avx2_f16(a->d)), _mm256_cvtepi32_ps(t.sumi), acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) s[r] = avx2_hsum_ps(acc[r]) - summ[r];
}

// Q6_K . Q8_K on VNNI the same way: AVX2's levels and sums with the scales folded into vpdpwssd, bit for bit
VNNI_TARGET static inline __attribute__((always_inline)) __m256i q6_K_step_vnni(const block_q6_K *a,
                                                                               const __m256i y[8], __m256i bsums) {
    const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)a->scales));
    __m256i sumi = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(scales, bsums), 5));
    for (int h = 0; h < 2; h++) {
        const __m256i sc = _mm256_permute2x128_si256(scales, scales, h ? 0x11 : 0x00);
        __m256i q[4];
        avx2_q6_K_levels(a, h, q);
        for (int g = 0; g < 4; g++)
            sumi = _mm256_dpwssd_epi32(sumi, _mm256_maddubs_epi16(q[g], y[4 * h + g]), avx2_q6_K_group_scales(sc, g));
    }
    return sumi;
}

VNNI_TARGET static void q6_K_vec_dot_vnni(int64_t n, float *s, const void *w, const void *x) {
    const block_q6_K *a = w;
    const block_q8_K *b = x;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        __m256i y[8];
        q8_K_operands(&b[i], y);
        const __m256i sumi = q6_K_step_vnni(&a[i], y, _mm256_loadu_si256((const __m256i *)b[i].bsums));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(b[i].d * avx2_f16(a[i].d)), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = avx2_hsum_ps(acc);
}

VNNI_TARGET static void q6_K_vec_dot4_vnni(int64_t n, float *s, const void *w, size_t bw, const void *x) {
    const block_q8_K *b = x;
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        __m256i y[8];
        q8_K_operands(&b[i], y);
        const __m256i bsums = _mm256_loadu_si256((const __m256i *)b[i].bsums);
        for (int r = 0; r < 4; r++) {
            const block_q6_K *a = (const block_q6_K *)((const char *)w + r * bw) + i;
            avx2_prefetch_span_l2((const char *)a + 4 * bw, sizeof(block_q6_K)); // as Q4_K's
            const __m256i sumi = q6_K_step_vnni(a, y, bsums);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(b[i].d * avx2_f16(a->d)), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) s[r] = avx2_hsum_ps(acc[r]);
}

VNNI_TARGET static void q4_0_gemm_tile_vnni(int64_t n, float *s, int64_t ss, const void *w, size_t bw,
                                            const void *x, size_t bx) {
    offset_gemm_tile(n, s, ss, w, bw, x, bx, sizeof(block_q4_0), q4_0_levels, f16_block_scales, 8);
}

VNNI_TARGET static void q5_0_gemm_tile_vnni(int64_t n, float *s, int64_t ss, const void *w, size_t bw,
                                            const void *x, size_t bx) {
    offset_gemm_tile(n, s, ss, w, bw, x, bx, sizeof(block_q5_0), q5_0_levels, f16_block_scales, 16);
}

// MXFP4: its levels + 12 (0..24) from the byte shuffle, the offset 12
VNNI_TARGET static inline __m256i mxfp4_levels(const void *block) {
    const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)ggml_mxfp4_kvalues));
    return _mm256_shuffle_epi8(_mm256_add_epi8(levels, _mm256_set1_epi8(12)),
                               avx2_unpack_nibbles(((const block_mxfp4 *)block)->qs));
}

VNNI_TARGET static inline __m128 mxfp4_block_scales(const char *const blk[4]) {
    return mxfp4_scales4((const block_mxfp4 *)blk[0], (const block_mxfp4 *)blk[1], (const block_mxfp4 *)blk[2],
                         (const block_mxfp4 *)blk[3]);
}

VNNI_TARGET static void mxfp4_gemm_tile_vnni(int64_t n, float *s, int64_t ss, const void *w, size_t bw,
                                             const void *x, size_t bx) {
    offset_gemm_tile(n, s, ss, w, bw, x, bx, sizeof(block_mxfp4), mxfp4_levels, mxfp4_block_scales, 12);
}

// Q4_1 . Q8_1: levels 0..15 unsigned; each row's minimum m times the column block's sum s (Q8_1 keeps d * sum(q))
VNNI_TARGET static void q4_1_gemm_tile_vnni(int64_t n, float *s, int64_t ss, const void *w, size_t bw,
                                            const void *x, size_t bx) {
    const block_q4_1 *wr[4]; // (4, n / 32) weight rows
    const block_q8_1 *xc[4]; // (4, n / 32) activation columns
    for (int i = 0; i < 4; i++) {
        wr[i] = (const block_q4_1 *)((const char *)w + i * bw);
        xc[i] = (const block_q8_1 *)((const char *)x + i * bx);
    }
    const __m256i zero = _mm256_setzero_si256();
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < n / QK4_1; b++) {
        __m256i wq[4], xq[4];
        for (int r = 0; r < 4; r++) wq[r] = avx2_unpack_nibbles(wr[r][b].qs);
        for (int j = 0; j < 4; j++) xq[j] = _mm256_loadu_si256((const __m256i *)xc[j][b].qs);
        const __m128 dw = avx2_f16x4(wr[0][b].d, wr[1][b].d, wr[2][b].d, wr[3][b].d);
        const __m128 mw = avx2_f16x4(wr[0][b].m, wr[1][b].m, wr[2][b].m, wr[3][b].m);
        for (int h = 0; h < 2; h++) {
            __m256i p[8];
            for (int r = 0; r < 4; r++) {
                p[r] = _mm256_dpbusd_epi32(zero, wq[r], xq[2 * h]);
                p[r + 4] = _mm256_dpbusd_epi32(zero, wq[r], xq[2 * h + 1]);
            }
            const __m256 sc = tile_pair_scales(dw, xc[2 * h][b].d, xc[2 * h + 1][b].d);
            acc[h] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(tile_sum8_epi32(p)), acc[h]);
            acc[h] = _mm256_add_ps(acc[h], tile_pair_scales(mw, xc[2 * h][b].s, xc[2 * h + 1][b].s));
        }
    }
    tile_store(s, ss, acc[0], acc[1]);
}

// p[r][j]: int32 lanes of the pair (row r, column j); lane r + 4 j' of the result = the sum of p[r][2 h + j']
VNNI_TARGET static inline __m256 vnni_pair_sums(__m256i p[4][4], int h) {
    __m256i q[8];
    for (int r = 0; r < 4; r++) {
        q[r] = p[r][2 * h];
        q[r + 4] = p[r][2 * h + 1];
    }
    return _mm256_cvtepi32_ps(tile_sum8_epi32(q));
}

// Q4_K . Q8_K: per sub-block of 32, levels (0..15) times x as int16 pairs (maddubs), scaled by the six-bit
// scale into int32 (vpdpwssd), so one float fma per super-block applies d; the mins times the columns'
// per-32 sums come off at the end of each super-block
VNNI_TARGET static void q4_K_gemm_tile_vnni(int64_t n, float *s, int64_t ss, const void *w, size_t bw,
                                            const void *x, size_t bx) {
    const block_q4_K *wr[4]; // (4, n / 256) weight rows
    const block_q8_K *xc[4]; // (4, n / 256) activation columns
    for (int i = 0; i < 4; i++) {
        wr[i] = (const block_q4_K *)((const char *)w + i * bw);
        xc[i] = (const block_q8_K *)((const char *)x + i * bx);
    }
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < n / QK_K; b++) {
        uint8_t sc[4][8];
        __m128i mins[4]; // (8,) int16 per row
        q4_K_tile_scales_mins(wr, b, sc, mins);
        __m256i p[4][4]; // (row, column) int32 lanes
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < 4; j++) p[r][j] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) { // sub-blocks 2c (low nibbles) and 2c + 1 (high)
            __m256i xl[4], xh[4];
            for (int j = 0; j < 4; j++) {
                xl[j] = _mm256_loadu_si256((const __m256i *)(xc[j][b].qs + 64 * c));
                xh[j] = _mm256_loadu_si256((const __m256i *)(xc[j][b].qs + 64 * c + 32));
            }
            for (int r = 0; r < 4; r++) {
                const __m256i q4 = _mm256_loadu_si256((const __m256i *)(wr[r][b].qs + 32 * c));
                const __m256i lo = _mm256_and_si256(q4, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), low4);
                const __m256i s0 = _mm256_set1_epi16(sc[r][2 * c]), s1 = _mm256_set1_epi16(sc[r][2 * c + 1]);
                for (int j = 0; j < 4; j++) {
                    p[r][j] = _mm256_dpwssd_epi32(p[r][j], _mm256_maddubs_epi16(lo, xl[j]), s0);
                    p[r][j] = _mm256_dpwssd_epi32(p[r][j], _mm256_maddubs_epi16(hi, xh[j]), s1);
                }
            }
        }
        const __m128 dw = avx2_f16x4(wr[0][b].d, wr[1][b].d, wr[2][b].d, wr[3][b].d);
        const __m128 mw = avx2_f16x4(wr[0][b].dmin, wr[1][b].dmin, wr[2][b].dmin, wr[3][b].dmin);
        __m128 msum[4]; // per column: each row's sum over sub-blocks of m * sum(x), as floats
        for (int j = 0; j < 4; j++) msum[j] = q4_K_tile_min_sums(&xc[j][b], mins);
        for (int h = 0; h < 2; h++) {
            const float dx0 = xc[2 * h][b].d, dx1 = xc[2 * h + 1][b].d;
            acc[h] = _mm256_fmadd_ps(tile_pair_scales_f32(dw, dx0, dx1), vnni_pair_sums(p, h), acc[h]);
            acc[h] = _mm256_fnmadd_ps(tile_pair_scales_f32(mw, dx0, dx1), _mm256_set_m128(msum[2 * h + 1], msum[2 * h]),
                                      acc[h]);
        }
    }
    tile_store(s, ss, acc[0], acc[1]);
}

// Q6_K . Q8_K: per group of 32 values (two sub-blocks of 16), levels (0..63) times x as int16 pairs
// (maddubs), each half scaled by its sub-block's scale into int32 (vpdpwssd); the offset 32 comes off
// through the columns' per-16 sums, seeded into the same int32 lanes, so one fma per super-block remains
VNNI_TARGET static void q6_K_gemm_tile_vnni(int64_t n, float *s, int64_t ss, const void *w, size_t bw,
                                            const void *x, size_t bx) {
    const block_q6_K *wr[4]; // (4, n / 256) weight rows
    const block_q8_K *xc[4]; // (4, n / 256) activation columns
    for (int i = 0; i < 4; i++) {
        wr[i] = (const block_q6_K *)((const char *)w + i * bw);
        xc[i] = (const block_q8_K *)((const char *)x + i * bx);
    }
    const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30), zero = _mm256_setzero_si256();
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < n / QK_K; b++) {
        __m256i p[4][4]; // (row, column) int32 lanes, seeded with -32 sum over sub-blocks of scale * sum(x)
        for (int r = 0; r < 4; r++) {
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wr[r][b].scales));
            for (int j = 0; j < 4; j++) {
                const __m256i bs = _mm256_loadu_si256((const __m256i *)xc[j][b].bsums);
                p[r][j] = _mm256_sub_epi32(zero, _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5));
            }
        }
        for (int g = 0; g < 8; g++) { // values [32 g, 32 g + 32): half g / 4, quarter t
            const int hh = g / 4, t = g % 4;
            __m256i xq[4];
            for (int j = 0; j < 4; j++) xq[j] = _mm256_loadu_si256((const __m256i *)(xc[j][b].qs + 32 * g));
            for (int r = 0; r < 4; r++) {
                const block_q6_K *blk = &wr[r][b];
                const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * hh + 32 * (t & 1)));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk->qh + 32 * hh));
                const __m256i lo = _mm256_and_si256(t < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
                const __m256i hi = _mm256_and_si256(t == 0   ? _mm256_slli_epi16(qh, 4)
                                                    : t == 1 ? _mm256_slli_epi16(qh, 2)
                                                    : t == 2 ? qh
                                                             : _mm256_srli_epi16(qh, 2),
                                                    high2);
                const __m256i u = _mm256_or_si256(lo, hi);
                const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(blk->scales[2 * g + 1]), _mm_set1_epi16(blk->scales[2 * g]));
                for (int j = 0; j < 4; j++) p[r][j] = _mm256_dpwssd_epi32(p[r][j], _mm256_maddubs_epi16(u, xq[j]), scv);
            }
        }
        const __m128 dw = avx2_f16x4(wr[0][b].d, wr[1][b].d, wr[2][b].d, wr[3][b].d);
        for (int h = 0; h < 2; h++)
            acc[h] = _mm256_fmadd_ps(tile_pair_scales_f32(dw, xc[2 * h][b].d, xc[2 * h + 1][b].d), vnni_pair_sums(p, h),
                                     acc[h]);
    }
    tile_store(s, ss, acc[0], acc[1]);
}

// F16 and BF16 tiles: 16 values a step in zmm registers (16 accumulators and 8 operands fit AVX-512's 32;
// AVX2's 16 would spill), each row and column converted once per step and used four times
VNNI_TARGET static inline __m512 halves16(const uint16_t *p, bool bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}

VNNI_TARGET static inline __attribute__((always_inline)) void halves_gemm_tile(int64_t n, float *s, int64_t ss,
                                                                               const void *w, size_t bw,
                                                                               const void *x, size_t bx, bool bf16) {
    const uint16_t *wr[4], *xc[4]; // weight rows, activation columns
    for (int r = 0; r < 4; r++) wr[r] = (const uint16_t *)((const char *)w + r * bw);
    for (int j = 0; j < 4; j++) xc[j] = (const uint16_t *)((const char *)x + j * bx);
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 a[4], b[4];
        for (int r = 0; r < 4; r++) a[r] = halves16(wr[r] + i, bf16);
        for (int j = 0; j < 4; j++) b[j] = halves16(xc[j] + i, bf16);
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(a[r], b[j], acc[r][j]);
    }
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 4; j++) {
            float sum = _mm512_reduce_add_ps(acc[r][j]);
            for (int64_t t = i; t < n; t++) sum += avx2_half(wr[r][t], bf16) * avx2_half(xc[j][t], bf16);
            s[j * ss + r] = sum;
        }
}

VNNI_TARGET static void f16_gemm_tile_avx512(int64_t n, float *s, int64_t ss, const void *w, size_t bw,
                                             const void *x, size_t bx) {
    halves_gemm_tile(n, s, ss, w, bw, x, bx, false);
}

VNNI_TARGET static void bf16_gemm_tile_avx512(int64_t n, float *s, int64_t ss, const void *w, size_t bw,
                                              const void *x, size_t bx) {
    halves_gemm_tile(n, s, ss, w, bw, x, bx, true);
}

static bool cpu_has_avx512_vnni(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}

// --- weight rows as levels (levels.h) for a prompt's AMX GEMM: the scalar rows' bytes and scales, 32 levels a
// store ---

void q4_0_levels_avx2(const void *row, int64_t k, int8_t *q, float *scale, float *offset, int64_t gs) {
    (void)offset;
    const block_q4_0 *b = row; // (k / 32,)
    for (int64_t i = 0; i < k / QK4_0; i++, q += QK4_0) {
        scale[i * gs] = ggml_fp16_to_fp32(b[i].d);
        _mm256_storeu_si256((__m256i *)q, _mm256_sub_epi8(avx2_unpack_nibbles(b[i].qs), _mm256_set1_epi8(8)));
    }
}

void q5_0_levels_avx2(const void *row, int64_t k, int8_t *q, float *scale, float *offset, int64_t gs) {
    (void)offset;
    const block_q5_0 *b = row; // (k / 32,)
    for (int64_t i = 0; i < k / QK5_0; i++, q += QK5_0) {
        scale[i * gs] = ggml_fp16_to_fp32(b[i].d);
        const __m256i fifth = _mm256_and_si256(avx2_bits_to_bytes(b[i].qh), _mm256_set1_epi8(16));
        const __m256i u = _mm256_or_si256(avx2_unpack_nibbles(b[i].qs), fifth);
        _mm256_storeu_si256((__m256i *)q, _mm256_sub_epi8(u, _mm256_set1_epi8(16)));
    }
}

void q4_K_levels_avx2(const void *row, int64_t k, int8_t *q, float *scale, float *offset, int64_t gs) {
    const block_q4_K *b = row; // (k / 256,)
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t i = 0; i < k / QK_K; i++) {
        for (int s = 0; s < 8; s++, q += 32) {
            float minimum;
            ggml_q4_K_sub_block(&b[i], s, &scale[(8 * i + s) * gs], &minimum);
            offset[(8 * i + s) * gs] = -minimum;
            const __m256i qs = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * (s / 2)));
            _mm256_storeu_si256((__m256i *)q, _mm256_and_si256(s % 2 ? _mm256_srli_epi16(qs, 4) : qs, low4));
        }
    }
}

// Q6_K: a half of 128 values from 64 bytes of ql (low nibbles, then high) and 32 of qh (2 bits each)
void q6_K_levels_avx2(const void *row, int64_t k, int8_t *q, float *scale, float *offset, int64_t gs) {
    (void)offset;
    const block_q6_K *b = row; // (k / 256,)
    const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
    for (int64_t i = 0; i < k / QK_K; i++, q += QK_K) {
        const float d = ggml_fp16_to_fp32(b[i].d);
        for (int s = 0; s < QK_K / 16; s++) scale[(16 * i + s) * gs] = d * (float)b[i].scales[s];
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b[i].ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b[i].ql + 64 * h + 32));
            const __m256i hi = _mm256_loadu_si256((const __m256i *)(b[i].qh + 32 * h));
            const __m256i lows[4] = {_mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4),
                                     _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                     _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4)};
            for (int g = 0; g < 4; g++) {
                const __m256i top = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 2 * g), two), 4);
                const __m256i level = _mm256_sub_epi8(_mm256_or_si256(lows[g], top), bias);
                _mm256_storeu_si256((__m256i *)(q + 128 * h + 32 * g), level);
            }
        }
    }
}

void ggml_quants_install_avx2(struct ggml_type_traits *traits, bool avx512) {
    traits[GGML_TYPE_F32].vec_dot = f32_vec_dot_avx2;
    traits[GGML_TYPE_F32].axpy = f32_axpy_avx2;
    traits[GGML_TYPE_F16].vec_dot = f16_vec_dot_avx2;
    traits[GGML_TYPE_BF16].vec_dot = bf16_vec_dot_avx2;
    traits[GGML_TYPE_BF16].to_float = bf16_to_float_avx2;
    traits[GGML_TYPE_F16].to_float = f16_to_float_avx2;
    traits[GGML_TYPE_Q4_0].to_float = q4_0_to_float_avx2;
    traits[GGML_TYPE_Q5_0].to_float = q5_0_to_float_avx2;
    traits[GGML_TYPE_Q8_0].to_float = q8_0_to_float_avx2;
    traits[GGML_TYPE_Q4_K].to_float = q4_K_to_float_avx2;
    // F16 weights dot F16 activations: converting them is the same conversion (it had stayed scalar, ~20 % of a
    // small sparse FFN's time on one thread)
    traits[GGML_TYPE_F16].from_float = traits[GGML_TYPE_F16].quantize_act = f16_from_float_avx2;
    traits[GGML_TYPE_Q4_0].vec_dot = q4_0_vec_dot_avx2;
    traits[GGML_TYPE_Q4_1].vec_dot = q4_1_vec_dot_avx2;
    traits[GGML_TYPE_Q5_0].vec_dot = q5_0_vec_dot_avx2;
    traits[GGML_TYPE_Q8_0].vec_dot = q8_0_vec_dot_avx2;
    traits[GGML_TYPE_Q4_K].vec_dot = q4_K_vec_dot_avx2;
    traits[GGML_TYPE_Q6_K].vec_dot = q6_K_vec_dot_avx2;
    traits[GGML_TYPE_MXFP4].vec_dot = mxfp4_vec_dot_avx2;
    ggml_quants_install_axpy_avx2(traits); // quants_axpy_avx2.c: axpy for Q4_0, Q8_0, Q4_1, Q5_0, Q4_K, Q6_K
    ggml_quants_install_axpy_rounded_avx2(traits, avx512); // quants_axpy_rounded_avx2.c: Q4_K, Q5_0
    traits[GGML_TYPE_Q8_0].quantize_act = q8_0_quantize_act_avx2;
    traits[GGML_TYPE_Q8_1].quantize_act = q8_1_quantize_act_avx2;
    traits[GGML_TYPE_Q8_K].quantize_act = q8_K_quantize_act_avx2;
    traits[GGML_TYPE_Q4_0].gemm_tile = q4_0_gemm_tile_avx2;
    traits[GGML_TYPE_Q8_0].gemm_tile = q8_0_gemm_tile_avx2;
    traits[GGML_TYPE_Q4_1].gemm_tile = q4_1_gemm_tile_avx2;
    traits[GGML_TYPE_Q4_K].gemm_tile = q4_K_gemm_tile_avx2;
    traits[GGML_TYPE_Q6_K].gemm_tile_rewritten = q6_K_levels_gemm_tile_avx2;
    traits[GGML_TYPE_Q6_K].rewrite_rows = q6_K_rows_as_levels;
    traits[GGML_TYPE_Q6_K].rewritten_block_size = sizeof(block_q6_K_levels);
    if (avx512 && cpu_has_avx512_vnni()) {
        traits[GGML_TYPE_F16].gemm_tile = f16_gemm_tile_avx512;
        traits[GGML_TYPE_BF16].gemm_tile = bf16_gemm_tile_avx512;
        traits[GGML_TYPE_Q4_0].gemm_tile = q4_0_gemm_tile_vnni;
        traits[GGML_TYPE_Q4_0].vec_dot = q4_0_vec_dot_vnni;
        traits[GGML_TYPE_Q4_0].vec_dot4 = q4_0_vec_dot4_vnni;
        traits[GGML_TYPE_Q4_1].gemm_tile = q4_1_gemm_tile_vnni;
        traits[GGML_TYPE_Q5_0].gemm_tile = q5_0_gemm_tile_vnni;
        traits[GGML_TYPE_Q5_0].vec_dot = q5_0_vec_dot_vnni;
        traits[GGML_TYPE_Q5_0].vec_dot4 = q5_0_vec_dot4_vnni;
        traits[GGML_TYPE_Q8_0].gemm_tile = q8_0_gemm_tile_vnni;
        traits[GGML_TYPE_Q8_0].vec_dot = q8_0_vec_dot_vnni;
        traits[GGML_TYPE_Q8_0].vec_dot4 = q8_0_vec_dot4_vnni;
        traits[GGML_TYPE_Q4_K].gemm_tile = q4_K_gemm_tile_vnni;
        traits[GGML_TYPE_Q4_K].vec_dot = q4_K_vec_dot_vnni;
        traits[GGML_TYPE_Q4_K].vec_dot4 = q4_K_vec_dot4_vnni;
        traits[GGML_TYPE_Q6_K].gemm_tile = q6_K_gemm_tile_vnni;
        traits[GGML_TYPE_Q6_K].vec_dot = q6_K_vec_dot_vnni;
        traits[GGML_TYPE_Q6_K].vec_dot4 = q6_K_vec_dot4_vnni;
        traits[GGML_TYPE_MXFP4].gemm_tile = mxfp4_gemm_tile_vnni;
    }
}
