// quants_q16_avx2.c: precise matmuls' 16-bit activations on AVX2 (quants.h's block_q16, block_q16_K): the
// quantizer (bit for bit the scalar one), the dots of one row and the 4 x 4 GEMM tiles. Each weight's unpacked
// levels multiply both bytes of q (maddubs, as the 8-bit kernels of quants_avx2.c do once), and 255 (w . hi) + w . lo
// is formed in int32 (madd by 255 and by 1), so one conversion and one scale serve the two products. Oracles: the
// scalar kernels of quants_q16.c (tests/test_quants.py).
#include "ggml-impl.h"
#include "quants.h"
#include "quants_avx2.h"

// ============================================================================================
// the quantizer
// ============================================================================================

// 8 values -> clamp(round(x * id), +-Q16_MAX) in int32 lanes; as the scalar cast, values outside the int range,
// infinities and NaNs give 0 (cvttps returns INT_MIN for exactly those)
static inline __m256i q16_levels8(const float *x, __m256 vid) {
    __m256i q = _mm256_cvttps_epi32(avx2_round_away(_mm256_mul_ps(_mm256_loadu_ps(x), vid)));
    q = _mm256_andnot_si256(_mm256_cmpeq_epi32(q, _mm256_set1_epi32(INT32_MIN)), q);
    return _mm256_max_epi32(_mm256_min_epi32(q, _mm256_set1_epi32(Q16_MAX)), _mm256_set1_epi32(-Q16_MAX));
}

// 32 int32 (4 registers, in order) that fit a byte -> 32 bytes in order
static inline __m256i q16_bytes(const __m256i v[4]) {
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// n values (a multiple of 32) -> d, their two bytes and sums of q per 16, as q16_quantize_block in quants_q16.c
static float q16_quantize_avx2(const float *x, int n, int8_t *hi, int8_t *lo, int32_t *sums) {
    const float d = avx2_amax(x, n / 8, true) / (float)Q16_MAX;
    const __m256 vid = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    // q / 255 to nearest: never a tie, and float's error here is far below the 1/510 to the nearest half
    const __m256 inv255 = _mm256_set1_ps(1.0f / 255.0f);
    for (int c = 0; c < n / 32; c++) {
        __m256i q[4], h[4], l[4];
        for (int i = 0; i < 4; i++) {
            q[i] = q16_levels8(x + 32 * c + 8 * i, vid);
            h[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_cvtepi32_ps(q[i]), inv255));
            l[i] = _mm256_sub_epi32(q[i], _mm256_sub_epi32(_mm256_slli_epi32(h[i], 8), h[i]));
        }
        _mm256_storeu_si256((__m256i *)(hi + 32 * c), q16_bytes(h));
        _mm256_storeu_si256((__m256i *)(lo + 32 * c), q16_bytes(l));
        sums[2 * c] = avx2_hsum_epi32(_mm256_add_epi32(q[0], q[1]));
        sums[2 * c + 1] = avx2_hsum_epi32(_mm256_add_epi32(q[2], q[3]));
    }
    return d;
}

static void q16_quantize_act_avx2(const float *src, void *dst, int64_t n) {
    block_q16 *y = dst; // (n / 32,)
    for (int64_t i = 0; i < n / 32; i++) {
        int32_t sums[2];
        y[i].d = q16_quantize_avx2(src + 32 * i, 32, y[i].hi, y[i].lo, sums);
        y[i].sum = sums[0] + sums[1];
    }
}

static void q16_K_quantize_act_avx2(const float *src, void *dst, int64_t n) {
    block_q16_K *y = dst; // (n / 256,)
    for (int64_t i = 0; i < n / QK_K; i++) y[i].d = q16_quantize_avx2(src + QK_K * i, QK_K, y[i].hi, y[i].lo, y[i].bsums);
}

// ============================================================================================
// dots of one row, 32-value blocks: the levels as unsigned bytes u (Q4_0, Q4_1, Q5_0), the weight worth d u + c
// (c = Q4_1's minimum, -8 d for Q4_0, -16 d for Q5_0), so w . x = d dx (u . q) + c dx sum(q); Q8_0 signed
// ============================================================================================

// 255 (u . hi) + u . lo of two blocks at once: u0 holds values 0..15 of both (block 0 in the low lane), u1 values
// 16..31 -> int32 lanes 0..3 block 0, 4..7 block 1. The int16 sums stay below 2 * 2 * 31 * 127
static inline __m256i q16_pair_dot_u8(__m256i u0, __m256i u1, const block_q16 *b) {
    const __m256i ph = _mm256_add_epi16(_mm256_maddubs_epi16(u0, avx2_load2_128(b[0].hi, b[1].hi)),
                                        _mm256_maddubs_epi16(u1, avx2_load2_128(b[0].hi + 16, b[1].hi + 16)));
    const __m256i pl = _mm256_add_epi16(_mm256_maddubs_epi16(u0, avx2_load2_128(b[0].lo, b[1].lo)),
                                        _mm256_maddubs_epi16(u1, avx2_load2_128(b[0].lo + 16, b[1].lo + 16)));
    return _mm256_add_epi32(_mm256_madd_epi16(ph, _mm256_set1_epi16(255)), _mm256_madd_epi16(pl, _mm256_set1_epi16(1)));
}

// a block pair's levels and their (d, c) for the weight types with unsigned levels
struct q16_pair {
    __m256i u0, u1;   // as q16_pair_dot_u8 takes them
    float d[2], c[2]; // scale and offset of block 0 and 1
};

static inline __attribute__((always_inline)) struct q16_pair q16_levels(enum ggml_type type, const void *w, int64_t i) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    struct q16_pair p;
    if (type == GGML_TYPE_Q4_1) {
        const block_q4_1 *a = (const block_q4_1 *)w + i;
        const __m256i v = avx2_load2_128(a[0].qs, a[1].qs);
        p.u0 = _mm256_and_si256(v, low4);
        p.u1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int k = 0; k < 2; k++) p.d[k] = avx2_f16(a[k].d), p.c[k] = avx2_f16(a[k].m);
    } else if (type == GGML_TYPE_Q4_0) {
        const block_q4_0 *a = (const block_q4_0 *)w + i;
        const __m256i v = avx2_load2_128(a[0].qs, a[1].qs);
        p.u0 = _mm256_and_si256(v, low4);
        p.u1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int k = 0; k < 2; k++) p.d[k] = avx2_f16(a[k].d), p.c[k] = -8.0f * p.d[k];
    } else { // Q5_0: the fifth bits join the nibbles
        const block_q5_0 *a = (const block_q5_0 *)w + i;
        const uint32_t h0 = avx2_load_u32(a[0].qh), h1 = avx2_load_u32(a[1].qh);
        const uint32_t hlo = (h0 & 0xFFFF) | (h1 << 16), hhi = (h0 >> 16) | (h1 & 0xFFFF0000); // per register
        const __m256i v = avx2_load2_128(a[0].qs, a[1].qs), bit4 = _mm256_set1_epi8(0x10);
        p.u0 = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(avx2_bits_to_bytes((const uint8_t *)&hlo), bit4));
        p.u1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                               _mm256_and_si256(avx2_bits_to_bytes((const uint8_t *)&hhi), bit4));
        for (int k = 0; k < 2; k++) p.d[k] = avx2_f16(a[k].d), p.c[k] = -16.0f * p.d[k];
    }
    return p;
}

static inline __attribute__((always_inline)) float q16_vec_dot_u8(enum ggml_type type, int64_t n, const void *w,
                                                                  const block_q16 *b) {
    const int64_t nb = n / 32; // in pairs (an odd last block: q16_vec_dot_rows)
    __m256 acc = _mm256_setzero_ps();
    float offs = 0.0f; // sum of c dx sum(q)
    for (int64_t i = 0; i + 2 <= nb; i += 2) {
        const struct q16_pair p = q16_levels(type, w, i);
        const __m256 sc = _mm256_set_m128(_mm_set1_ps(p.d[1] * b[i + 1].d), _mm_set1_ps(p.d[0] * b[i].d));
        acc = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(q16_pair_dot_u8(p.u0, p.u1, b + i)), acc);
        offs += p.c[0] * (b[i].d * (float)b[i].sum) + p.c[1] * (b[i + 1].d * (float)b[i + 1].sum);
    }
    return avx2_hsum_ps(acc) + offs;
}

// the dot of a row of a type with unsigned levels, an odd last block through the oracle's arithmetic
static inline __attribute__((always_inline)) float q16_vec_dot_rows(enum ggml_type type, size_t wbytes, int64_t n,
                                                                    const void *w, const void *x) {
    float s = q16_vec_dot_u8(type, n, w, x);
    if ((n / 32) % 2) {
        float tail;
        ggml_get_type_traits(type)->vec_dot_q16_ref(32, &tail, (const char *)w + (size_t)(n / 32 - 1) * wbytes,
                                                     (const block_q16 *)x + n / 32 - 1);
        s += tail;
    }
    return s;
}

static void q4_0_vec_dot_q16_avx2(int64_t n, float *s, const void *w, const void *x) {
    *s = q16_vec_dot_rows(GGML_TYPE_Q4_0, sizeof(block_q4_0), n, w, x);
}

static void q4_1_vec_dot_q16_avx2(int64_t n, float *s, const void *w, const void *x) {
    *s = q16_vec_dot_rows(GGML_TYPE_Q4_1, sizeof(block_q4_1), n, w, x);
}

static void q5_0_vec_dot_q16_avx2(int64_t n, float *s, const void *w, const void *x) {
    *s = q16_vec_dot_rows(GGML_TYPE_Q5_0, sizeof(block_q5_0), n, w, x);
}

// 255 (u . hi) + u . lo of one 32-value block, u its unsigned levels in order (int16 pair sums stay below
// 2 * 128 * 127) -> 8 int32 lanes
static inline __m256i q16_dot_u8(__m256i u, __m256i xh, __m256i xl) {
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, xh), _mm256_set1_epi16(255)),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(u, xl), _mm256_set1_epi16(1)));
}

// 255 (w . hi) + w . lo of one block of signed levels: |w| times each byte with w's sign (both bytes are within
// [-127, 127], so negating them cannot overflow) -> 8 int32 lanes
static inline __m256i q16_dot_i8(__m256i wq, const block_q16 *b) {
    return q16_dot_u8(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)b->hi), wq),
                      _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)b->lo), wq));
}

static void q8_0_vec_dot_q16_avx2(int64_t n, float *s, const void *w, const void *x) {
    const block_q8_0 *a = w; // (n / 32,)
    const block_q16 *b = x;  // (n / 32,)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 2 <= n / 32; i += 2) {
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(avx2_f16(a[i].d) * b[i].d),
                               _mm256_cvtepi32_ps(q16_dot_i8(_mm256_loadu_si256((const __m256i *)a[i].qs), b + i)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(avx2_f16(a[i + 1].d) * b[i + 1].d),
                               _mm256_cvtepi32_ps(q16_dot_i8(_mm256_loadu_si256((const __m256i *)a[i + 1].qs), b + i + 1)),
                               acc1);
    }
    float sum = avx2_hsum_ps(_mm256_add_ps(acc0, acc1));
    if (i < n / 32)
        sum += avx2_f16(a[i].d) * b[i].d *
               avx2_hsum_ps(_mm256_cvtepi32_ps(q16_dot_i8(_mm256_loadu_si256((const __m256i *)a[i].qs), b + i)));
    *s = sum;
}

// ============================================================================================
// dots of one row, K-quants
// ============================================================================================

// a super-block's sums of q per sub-block of 32 (8 int32), from its per-16 ones
static inline __m256i q16_K_sums32(const block_q16_K *b) {
    const __m256i lo = _mm256_loadu_si256((const __m256i *)b->bsums), hi = _mm256_loadu_si256((const __m256i *)(b->bsums + 8));
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(lo, hi), _MM_SHUFFLE(3, 1, 2, 0));
}

// Q4_K: per sub-block of 32, levels (0..15) times both bytes (maddubs), times the six-bit scale and 255 times it
// (madd): a lane sums 8 such pairs of at most 2 * 15 * 127 * 63 * 256 (below 2^31)
static void q4_K_vec_dot_q16_avx2(int64_t n, float *s, const void *w, const void *x) {
    const block_q4_K *a = w;  // (n / 256,)
    const block_q16_K *b = x; // (n / 256,)
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps();
    float summ = 0.0f; // the mins' share, subtracted at the end
    for (int64_t i = 0; i < n / QK_K; i++) {
        uint64_t sc_bytes, m_bytes;
        ggml_q4_K_scales_mins(a[i].scales, &sc_bytes, &m_bytes);
        uint8_t sc[8];
        memcpy(sc, &sc_bytes, 8);
        // sum over sub-blocks of m * sum(q)
        const __m256i mins = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m_bytes));
        summ += b[i].d * avx2_f16(a[i].dmin) * (float)avx2_hsum_epi32(_mm256_mullo_epi32(q16_K_sums32(&b[i]), mins));

        __m256i sumi = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) { // sub-blocks 2c (low nibbles) and 2c + 1 (high)
            const __m256i q4 = _mm256_loadu_si256((const __m256i *)(a[i].qs + 32 * c));
            const __m256i u[2] = {_mm256_and_si256(q4, low4), _mm256_and_si256(_mm256_srli_epi16(q4, 4), low4)};
            for (int k = 0; k < 2; k++) {
                const int sb = 2 * c + k;
                const __m256i ph = _mm256_maddubs_epi16(u[k], _mm256_loadu_si256((const __m256i *)(b[i].hi + 32 * sb)));
                const __m256i pl = _mm256_maddubs_epi16(u[k], _mm256_loadu_si256((const __m256i *)(b[i].lo + 32 * sb)));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(ph, _mm256_set1_epi16((short)(255 * sc[sb]))));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(pl, _mm256_set1_epi16(sc[sb])));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(b[i].d * avx2_f16(a[i].d)), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = avx2_hsum_ps(acc) - summ;
}

// Q6_K: levels (0..63) times both bytes, times the int8 sub-block scale; the hi and lo sums are kept apart (255
// times the hi one would leave int32) and the -32 offset comes off through the per-16 sums of q
static void q6_K_vec_dot_q16_avx2(int64_t n, float *s, const void *w, const void *x) {
    const block_q6_K *a = w;  // (n / 256,)
    const block_q16_K *b = x; // (n / 256,)
    __m256 acc = _mm256_setzero_ps();
    float offs = 0.0f; // 32 times the sum over sub-blocks of d scale sum(q)
    for (int64_t i = 0; i < n / QK_K; i++) {
        const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)a[i].scales)); // (16,) int16
        const __m256i sc32lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)a[i].scales));
        const __m256i sc32hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(a[i].scales + 8)));
        const float dd = b[i].d * avx2_f16(a[i].d);
        const __m256i bs0 = _mm256_loadu_si256((const __m256i *)b[i].bsums);
        const __m256i bs1 = _mm256_loadu_si256((const __m256i *)(b[i].bsums + 8));
        offs += dd * (float)avx2_hsum_epi32(_mm256_add_epi32(_mm256_mullo_epi32(sc32lo, bs0), _mm256_mullo_epi32(sc32hi, bs1)));
        __m256i sh = _mm256_setzero_si256(), sl = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i sc = h == 0 ? _mm256_permute2x128_si256(scales, scales, 0x00)
                                      : _mm256_permute2x128_si256(scales, scales, 0x11);
            __m256i q[4];
            avx2_q6_K_levels(&a[i], h, q);
            for (int g = 0; g < 4; g++) {
                const __m256i scg = avx2_q6_K_group_scales(sc, g);
                const __m256i xh = _mm256_loadu_si256((const __m256i *)(b[i].hi + 128 * h + 32 * g));
                const __m256i xl = _mm256_loadu_si256((const __m256i *)(b[i].lo + 128 * h + 32 * g));
                sh = _mm256_add_epi32(sh, _mm256_madd_epi16(_mm256_maddubs_epi16(q[g], xh), scg));
                sl = _mm256_add_epi32(sl, _mm256_madd_epi16(_mm256_maddubs_epi16(q[g], xl), scg));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(255.0f * dd), _mm256_cvtepi32_ps(sh), acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(sl), acc);
    }
    *s = avx2_hsum_ps(acc) - 32.0f * offs;
}

// ============================================================================================
// GEMM tiles: 4 weight rows x 4 columns, two column pairs a block as quants_avx2.c's tiles; a row's levels are
// unpacked once for the four columns and multiply both bytes of each
// ============================================================================================

// the 4-bit types with nibble levels (0..15) worth d u + c (c: Q4_1's minimum, -8 d for Q4_0): levels times q,
// scaled by d dx; each block's c times the column's dx sum(q)
static inline __attribute__((always_inline)) void q16_gemm_tile_u4(enum ggml_type type, int64_t n, float *s,
                                                                   int64_t ss, const void *w, size_t bw, const void *x,
                                                                   size_t bx) {
    const size_t wb = type == GGML_TYPE_Q4_1 ? sizeof(block_q4_1) : sizeof(block_q4_0); // bytes a block
    const char *wr[4];      // (4, n / 32) weight rows
    const block_q16 *xc[4]; // (4, n / 32) activation columns
    for (int i = 0; i < 4; i++) {
        wr[i] = (const char *)w + i * bw;
        xc[i] = (const block_q16 *)((const char *)x + i * bx);
    }
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < n / 32; b++) {
        __m256i wq[4];
        __m128 dw, cw;
        if (type == GGML_TYPE_Q4_1) {
            const block_q4_1 *a[4];
            for (int r = 0; r < 4; r++) a[r] = (const block_q4_1 *)(wr[r] + b * wb), wq[r] = avx2_unpack_nibbles(a[r]->qs);
            dw = avx2_f16x4(a[0]->d, a[1]->d, a[2]->d, a[3]->d);
            cw = avx2_f16x4(a[0]->m, a[1]->m, a[2]->m, a[3]->m);
        } else {
            const block_q4_0 *a[4];
            for (int r = 0; r < 4; r++) a[r] = (const block_q4_0 *)(wr[r] + b * wb), wq[r] = avx2_unpack_nibbles(a[r]->qs);
            dw = avx2_f16x4(a[0]->d, a[1]->d, a[2]->d, a[3]->d);
            cw = _mm_mul_ps(dw, _mm_set1_ps(-8.0f));
        }
        for (int h = 0; h < 2; h++) {
            const block_q16 *x0 = &xc[2 * h][b], *x1 = &xc[2 * h + 1][b];
            const __m256i h0 = _mm256_loadu_si256((const __m256i *)x0->hi), l0 = _mm256_loadu_si256((const __m256i *)x0->lo);
            const __m256i h1 = _mm256_loadu_si256((const __m256i *)x1->hi), l1 = _mm256_loadu_si256((const __m256i *)x1->lo);
            __m256i p[8];
            for (int r = 0; r < 4; r++) {
                p[r] = q16_dot_u8(wq[r], h0, l0);
                p[r + 4] = q16_dot_u8(wq[r], h1, l1);
            }
            acc[h] = _mm256_fmadd_ps(tile_pair_scales_f32(dw, x0->d, x1->d), _mm256_cvtepi32_ps(tile_sum8_epi32(p)), acc[h]);
            acc[h] = _mm256_fmadd_ps(tile_pair_scales_f32(cw, x0->d, x1->d),
                                     _mm256_set_m128(_mm_set1_ps((float)x1->sum), _mm_set1_ps((float)x0->sum)), acc[h]);
        }
    }
    tile_store(s, ss, acc[0], acc[1]);
}

static void q4_0_gemm_tile_q16_avx2(int64_t n, float *s, int64_t ss, const void *w, size_t bw, const void *x, size_t bx) {
    q16_gemm_tile_u4(GGML_TYPE_Q4_0, n, s, ss, w, bw, x, bx);
}

static void q4_1_gemm_tile_q16_avx2(int64_t n, float *s, int64_t ss, const void *w, size_t bw, const void *x, size_t bx) {
    q16_gemm_tile_u4(GGML_TYPE_Q4_1, n, s, ss, w, bw, x, bx);
}

// Q8_0 . Q16 (and Q5_0's rows rewritten as Q8_0, ops_matmul.c): |w| times each byte with w's signs
static void q8_0_gemm_tile_q16_avx2(int64_t n, float *s, int64_t ss, const void *w, size_t bw, const void *x, size_t bx) {
    const block_q8_0 *wr[4]; // (4, n / 32) weight rows
    const block_q16 *xc[4];  // (4, n / 32) activation columns
    for (int i = 0; i < 4; i++) {
        wr[i] = (const block_q8_0 *)((const char *)w + i * bw);
        xc[i] = (const block_q16 *)((const char *)x + i * bx);
    }
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < n / 32; b++) {
        __m256i wq[4], wa[4];
        for (int r = 0; r < 4; r++) {
            wq[r] = _mm256_loadu_si256((const __m256i *)wr[r][b].qs);
            wa[r] = _mm256_sign_epi8(wq[r], wq[r]);
        }
        const __m128 dw = avx2_f16x4(wr[0][b].d, wr[1][b].d, wr[2][b].d, wr[3][b].d);
        for (int h = 0; h < 2; h++) {
            __m256i col[2]; // each column's row sums reduced as soon as they exist (tile_sum4_epi32)
            for (int j = 0; j < 2; j++) {
                const block_q16 *xj = &xc[2 * h + j][b];
                const __m256i hi = _mm256_loadu_si256((const __m256i *)xj->hi), lo = _mm256_loadu_si256((const __m256i *)xj->lo);
                __m256i p[4];
                for (int r = 0; r < 4; r++) p[r] = q16_dot_u8(wa[r], _mm256_sign_epi8(hi, wq[r]), _mm256_sign_epi8(lo, wq[r]));
                col[j] = tile_sum4_epi32(p[0], p[1], p[2], p[3]);
            }
            acc[h] = _mm256_fmadd_ps(tile_pair_scales_f32(dw, xc[2 * h][b].d, xc[2 * h + 1][b].d),
                                     _mm256_cvtepi32_ps(tile_join_cols(col[0], col[1])), acc[h]);
        }
    }
    tile_store(s, ss, acc[0], acc[1]);
}

// Q4_K . Q16_K: per sub-block of 32, levels (0..15) times each byte, times 255 sc and sc (madd) into int32 (bounded
// as q4_K_vec_dot_q16_avx2); one fma per super-block applies d, the mins times the columns' per-32 sums come off
static void q4_K_gemm_tile_q16_avx2(int64_t n, float *s, int64_t ss, const void *w, size_t bw, const void *x, size_t bx) {
    const block_q4_K *wr[4];  // (4, n / 256) weight rows
    const block_q16_K *xc[4]; // (4, n / 256) activation columns
    for (int i = 0; i < 4; i++) {
        wr[i] = (const block_q4_K *)((const char *)w + i * bw);
        xc[i] = (const block_q16_K *)((const char *)x + i * bx);
    }
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < n / QK_K; b++) {
        uint8_t sc[4][8];
        __m128i mins16[4];
        q4_K_tile_scales_mins(wr, b, sc, mins16);
        __m256i mins[4]; // (8,) int32 per row
        for (int r = 0; r < 4; r++) mins[r] = _mm256_cvtepu16_epi32(mins16[r]);
        const __m128 dw = avx2_f16x4(wr[0][b].d, wr[1][b].d, wr[2][b].d, wr[3][b].d);
        const __m128 mw = avx2_f16x4(wr[0][b].dmin, wr[1][b].dmin, wr[2][b].dmin, wr[3][b].dmin);
        for (int h = 0; h < 2; h++) { // columns 2h and 2h + 1
            const block_q16_K *xj[2] = {&xc[2 * h][b], &xc[2 * h + 1][b]};
            __m256i p[8]; // lane sums of (row r, column 2h + j) in p[r + 4 j]
            for (int i = 0; i < 8; i++) p[i] = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) { // sub-blocks 2c (low nibbles) and 2c + 1 (high)
                for (int r = 0; r < 4; r++) {
                    const __m256i q4 = _mm256_loadu_si256((const __m256i *)(wr[r][b].qs + 32 * c));
                    const __m256i u[2] = {_mm256_and_si256(q4, low4), _mm256_and_si256(_mm256_srli_epi16(q4, 4), low4)};
                    for (int k = 0; k < 2; k++) {
                        const int sb = 2 * c + k;
                        const __m256i s255 = _mm256_set1_epi16((short)(255 * sc[r][sb])), s1 = _mm256_set1_epi16(sc[r][sb]);
                        for (int j = 0; j < 2; j++) {
                            const __m256i xh = _mm256_loadu_si256((const __m256i *)(xj[j]->hi + 32 * sb));
                            const __m256i xl = _mm256_loadu_si256((const __m256i *)(xj[j]->lo + 32 * sb));
                            p[r + 4 * j] = _mm256_add_epi32(
                                p[r + 4 * j], _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u[k], xh), s255),
                                                               _mm256_madd_epi16(_mm256_maddubs_epi16(u[k], xl), s1)));
                        }
                    }
                }
            }
            // the mins' share: lane r + 4 j = row r's sum over sub-blocks of m * sum(q) of column 2h + j
            __m256i pm[8];
            for (int j = 0; j < 2; j++) {
                const __m256i s32 = q16_K_sums32(xj[j]);
                for (int r = 0; r < 4; r++) pm[r + 4 * j] = _mm256_mullo_epi32(s32, mins[r]);
            }
            acc[h] = _mm256_fmadd_ps(tile_pair_scales_f32(dw, xj[0]->d, xj[1]->d), _mm256_cvtepi32_ps(tile_sum8_epi32(p)),
                                     acc[h]);
            acc[h] = _mm256_fnmadd_ps(tile_pair_scales_f32(mw, xj[0]->d, xj[1]->d), _mm256_cvtepi32_ps(tile_sum8_epi32(pm)),
                                      acc[h]);
        }
    }
    tile_store(s, ss, acc[0], acc[1]);
}

void ggml_quants_install_q16_avx2(struct ggml_type_traits *traits) {
    static const struct {
        enum ggml_type type;
        ggml_vec_dot_fn dot;
        ggml_gemm_tile_fn tile;
    } kernels[] = {{GGML_TYPE_Q4_0, q4_0_vec_dot_q16_avx2, q4_0_gemm_tile_q16_avx2},
                   {GGML_TYPE_Q4_1, q4_1_vec_dot_q16_avx2, q4_1_gemm_tile_q16_avx2},
                   {GGML_TYPE_Q5_0, q5_0_vec_dot_q16_avx2, NULL},
                   {GGML_TYPE_Q8_0, q8_0_vec_dot_q16_avx2, q8_0_gemm_tile_q16_avx2},
                   {GGML_TYPE_Q4_K, q4_K_vec_dot_q16_avx2, q4_K_gemm_tile_q16_avx2},
                   {GGML_TYPE_Q6_K, q6_K_vec_dot_q16_avx2, NULL}};
    for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; i++) {
        struct ggml_type_traits *t = &traits[kernels[i].type];
        t->vec_dot_q16 = kernels[i].dot;
        t->gemm_tile_q16 = kernels[i].tile;
        t->quantize_q16 = t->blck_size == QK_K ? q16_K_quantize_act_avx2 : q16_quantize_act_avx2;
    }
}
