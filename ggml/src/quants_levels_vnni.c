// quants_levels_vnni.c: a few columns of the levels GEMM (levels.h) straight from the weights' blocks (Q4_0, Q4_1,
// Q5_0, Q8_0, Q4_K, Q6_K) on AVX512-VNNI, rounded or precise (two planes of activation bytes). The
// tile GEMM unpacks each panel of 16 weight rows to levels for every batch, which a batch of a few tokens cannot
// repay (Qwen2.5-Coder-1.5B, 2 threads: 4 tokens a batch at 14 t/s where decoding runs 15). Here 16 rows' bytes
// are transposed in registers, a lane a row, their levels dotted with a column's broadcast values by vpdpbusd,
// and the int32 dots scaled in levels_gemm_ref's order: the tile GEMM's bits for every column, so that a token's
// result still does not depend on the batch it came in.
#include "levels.h"
#include "quants.h"

#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define VNNI_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))

// the 8 dwords of each of 16 rows (lo: rows 0..7, hi: rows 8..15, 32 bytes each) -> t[i]: dword i of every row,
// lane r row r (two 8 x 8 transposes side by side in the 256-bit halves)
VNNI_TARGET static inline void transpose16x8(const __m256i lo[8], const __m256i hi[8], __m512i t[8]) {
    __m512i a[8], u[8];
    for (int j = 0; j < 8; j++) a[j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo[j]), hi[j], 1);
    for (int j = 0; j < 8; j += 2) { // (rows j, j + 1) interleaved by dword
        u[j] = _mm512_unpacklo_epi32(a[j], a[j + 1]);
        u[j + 1] = _mm512_unpackhi_epi32(a[j], a[j + 1]);
    }
    __m512i v[8];
    for (int q = 0; q < 2; q++) { // rows 4q .. 4q + 3 by dword: v[4q + i'] holds dwords i', i' + 4 of each lane pair
        v[4 * q + 0] = _mm512_unpacklo_epi64(u[4 * q], u[4 * q + 2]);
        v[4 * q + 1] = _mm512_unpackhi_epi64(u[4 * q], u[4 * q + 2]);
        v[4 * q + 2] = _mm512_unpacklo_epi64(u[4 * q + 1], u[4 * q + 3]);
        v[4 * q + 3] = _mm512_unpackhi_epi64(u[4 * q + 1], u[4 * q + 3]);
    }
    // 128-bit lane 0 of each half holds dword i of rows 0..3 (v[i]) or 4..7 (v[4 + i]), lane 1 dword i + 4
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_permutex2var_epi64(v[i], first, v[4 + i]);
        t[i + 4] = _mm512_permutex2var_epi64(v[i], second, v[4 + i]);
    }
}

// 32 bytes at byte offset `at` of block i of each of rows [0, rows) (bw bytes apart), transposed: t[j] dword j of
// every row, lane r row r (rows past them zero)
VNNI_TARGET static inline void load_transposed(const char *blk, size_t bw, int64_t rows, size_t at, __m512i t[8]) {
    __m256i lo[8], hi[8];
    for (int r = 0; r < 8; r++) {
        lo[r] = r < rows ? _mm256_loadu_si256((const __m256i *)(blk + r * bw + at)) : _mm256_setzero_si256();
        hi[r] = r + 8 < rows ? _mm256_loadu_si256((const __m256i *)(blk + (r + 8) * bw + at)) : _mm256_setzero_si256();
    }
    transpose16x8(lo, hi, t);
}

// byte s % 4 of w (the sub-block's six-bit scale or minimum) as floats
VNNI_TARGET static inline __m512 byte_as_float(__m512i w, int s) {
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 8 * (s % 4)), _mm512_set1_epi32(0xFF)));
}

// byte offsets of rows 0..15, bw bytes apart (the gathers' index)
VNNI_TARGET static inline __m512i row_offsets(size_t bw) {
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_epi32((int)bw));
}

// sums[c] = 2^shift times column c's activations over rows [j0, j0 + n) of a block (each 4 values of 16 columns):
// what a level's unsigned form adds, given back
VNNI_TARGET static inline void column_sums(const int32_t *x, int j0, int n, int shift, int32_t sums[LEVELS_COLS]) {
    __m512i sum = _mm512_setzero_si512();
    for (int j = j0; j < j0 + n; j++)
        sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi32(0x01010101), _mm512_loadu_si512(x + j * LEVELS_COLS));
    _mm512_storeu_si512(sums, _mm512_slli_epi32(sum, shift));
}

// an activation block's planes (levels.h): its values, or a precise batch's high bytes then low bytes, each
// (8, LEVELS_COLS) dwords; the group's d, and s where the weights have offsets
struct xblock {
    const int32_t *plane[2];
    int planes;
    const float *d, *s;
};

// block b of a group of k values (levels_x_pack's layout)
static inline struct xblock xblock_at(const char *xgroup, int64_t k, bool wide, bool sums, int64_t b) {
    const int64_t nb = k / LEVELS_XBLOCK, planes = wide ? 2 : 1;
    const char *at = xgroup + b * planes * LEVELS_XBLOCK_BYTES;
    const float *d = (const float *)(xgroup + nb * planes * LEVELS_XBLOCK_BYTES) + b * LEVELS_COLS;
    return (struct xblock){{(const int32_t *)at, (const int32_t *)(at + LEVELS_XBLOCK_BYTES)}, (int)planes, d,
                           sums ? d + nb * LEVELS_COLS : NULL};
}

// one scale group into columns [0, ncols): the int32 dot of q[j0 .. j0 + n) with column c's values of each plane,
// less 2^shift times their sum where the levels went in unsigned (shift >= 0), planes as 255 hi + lo; then
// acc[c] += dot * (d[c] * scale) and, with offsets, + s[c] * offset: levels_gemm_ref's integers and two fmas
VNNI_TARGET static inline void add_group(__m512 *acc, int ncols, const __m512i *q, struct xblock x, int j0, int n,
                                         int shift, __m512 scale, __m512 offset) {
    int32_t sums[2][LEVELS_COLS] = {{0}};
    for (int p = 0; p < x.planes && shift >= 0; p++) column_sums(x.plane[p], j0, n, shift, sums[p]);
    for (int c = 0; c < ncols; c++) {
        __m512i dot[2];
        for (int p = 0; p < x.planes; p++) {
            dot[p] = _mm512_set1_epi32(-sums[p][c]);
            for (int j = j0; j < j0 + n; j++)
                dot[p] = _mm512_dpbusd_epi32(dot[p], q[j], _mm512_set1_epi32(x.plane[p][j * LEVELS_COLS + c]));
        }
        if (x.planes == 2) // 255 hi + lo = (hi << 8) - hi + lo
            dot[0] = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(dot[0], 8), dot[0]), dot[1]);
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[0]), _mm512_mul_ps(_mm512_set1_ps(x.d[c]), scale), acc[c]);
        if (x.s) acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(x.s[c]), offset, acc[c]);
    }
}

// 16 bytes at byte offset `at` of each of rows [0, rows) (bw bytes apart), transposed: t[j] dword j of every row,
// lane r row r (4 x 4 dword transposes in each 128-bit lane, whose rows are q, q + 4, q + 8, q + 12 before)
VNNI_TARGET static inline void load_transposed16(const char *blk, size_t bw, int64_t rows, size_t at, __m512i t[4]) {
    __m512i z[4];
    for (int q = 0; q < 4; q++) {
        __m128i part[4];
        for (int l = 0; l < 4; l++) {
            const int64_t r = q + 4 * l;
            part[l] = r < rows ? _mm_loadu_si128((const __m128i *)(blk + r * bw + at)) : _mm_setzero_si128();
        }
        z[q] = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(part[0]), part[1], 1),
                                                     part[2], 2), part[3], 3);
    }
    const __m512i u0 = _mm512_unpacklo_epi32(z[0], z[1]), u1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i u2 = _mm512_unpacklo_epi32(z[2], z[3]), u3 = _mm512_unpackhi_epi32(z[2], z[3]);
    t[0] = _mm512_unpacklo_epi64(u0, u2), t[1] = _mm512_unpackhi_epi64(u0, u2);
    t[2] = _mm512_unpacklo_epi64(u1, u3), t[3] = _mm512_unpackhi_epi64(u1, u3);
}

// a Q4_0/Q4_1-style block's 16 bytes of nibbles, transposed, as 8 dwords of levels 0..15: u[j] values 4 j ..
// 4 j + 3 (low nibbles, j < 4) and 16 + 4 (j - 4) .. (high nibbles)
VNNI_TARGET static inline void nibble_levels16(const __m512i t[4], __m512i u[8]) {
    const __m512i low4 = _mm512_set1_epi32(0x0F0F0F0F);
    for (int j = 0; j < 4; j++) {
        u[j] = _mm512_and_si512(t[j], low4);
        u[j + 4] = _mm512_and_si512(_mm512_srli_epi32(t[j], 4), low4);
    }
}

// Q4_0 (levels nibble - 8: 8 times the activation sum given back; scale d) and Q4_1 (levels the nibbles, scale d,
// offset m): blocks of 32, one activation block each
VNNI_TARGET static void q4_levels_direct(const char *w, size_t bw, int64_t rows, int64_t k, const char *xgroup,
                                         bool wide, int ncols, float *y, size_t y_stride, bool q4_1) {
    const size_t block = q4_1 ? sizeof(block_q4_1) : sizeof(block_q4_0);
    const __mmask16 live = (__mmask16)((1u << rows) - 1);
    const __m512i index = row_offsets(bw), zero = _mm512_setzero_si512();
    __m512 acc[LEVELS_COLS];
    for (int c = 0; c < ncols; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t ib = 0; ib < k / LEVELS_XBLOCK; ib++) {
        const char *blk = w + ib * (int64_t)block;
        __m512i t[4], u[8];
        load_transposed16(blk, bw, rows, q4_1 ? offsetof(block_q4_1, qs) : offsetof(block_q4_0, qs), t);
        nibble_levels16(t, u);
        // d, and Q4_1's m above it (Q4_0: its first two nibble bytes, not read)
        const __m512i dm = _mm512_mask_i32gather_epi32(zero, live, index, blk, 1);
        const __m512 scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
        const __m512 offset = q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))) : scale;
        add_group(acc, ncols, u, xblock_at(xgroup, k, wide, q4_1, ib), 0, 8, q4_1 ? -1 : 3, scale, offset);
    }
    for (int c = 0; c < ncols; c++) _mm512_mask_storeu_ps(y + c * y_stride, live, acc[c]);
}

VNNI_TARGET static void q4_0_levels_direct(const char *w, size_t bw, int64_t rows, int64_t k, const char *xgroup,
                                           bool wide, int ncols, float *y, size_t y_stride) {
    q4_levels_direct(w, bw, rows, k, xgroup, wide, ncols, y, y_stride, false);
}

VNNI_TARGET static void q4_1_levels_direct(const char *w, size_t bw, int64_t rows, int64_t k, const char *xgroup,
                                           bool wide, int ncols, float *y, size_t y_stride) {
    q4_levels_direct(w, bw, rows, k, xgroup, wide, ncols, y, y_stride, true);
}

// Q8_0: levels the signed bytes, in as unsigned (top bit flipped: + 128, 128 times the activation sum given back)
VNNI_TARGET static void q8_0_levels_direct(const char *w, size_t bw, int64_t rows, int64_t k, const char *xgroup,
                                           bool wide, int ncols, float *y, size_t y_stride) {
    const __mmask16 live = (__mmask16)((1u << rows) - 1);
    const __m512i index = row_offsets(bw), zero = _mm512_setzero_si512(), flip = _mm512_set1_epi32((int)0x80808080u);
    __m512 acc[LEVELS_COLS];
    for (int c = 0; c < ncols; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t ib = 0; ib < k / LEVELS_XBLOCK; ib++) {
        const char *blk = w + ib * (int64_t)sizeof(block_q8_0);
        __m512i u[8];
        load_transposed(blk, bw, rows, offsetof(block_q8_0, qs), u);
        for (int j = 0; j < 8; j++) u[j] = _mm512_xor_si512(u[j], flip);
        const __m512 scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_mask_i32gather_epi32(zero, live, index, blk, 1)));
        add_group(acc, ncols, u, xblock_at(xgroup, k, wide, false, ib), 0, 8, 7, scale, scale);
    }
    for (int c = 0; c < ncols; c++) _mm512_mask_storeu_ps(y + c * y_stride, live, acc[c]);
}

// rows [0, rows) (rows <= LEVELS_ROWS, bw bytes apart) of a Q4_K matrix of k columns times columns [0, ncols) of a
// levels activation group (levels_x_pack, Q8_K with sums): y[c * y_stride + r]
VNNI_TARGET static void q4_K_levels_direct(const char *w, size_t bw, int64_t rows, int64_t k, const char *xgroup,
                                           bool wide, int ncols, float *y, size_t y_stride) {
    const __mmask16 live = (__mmask16)((1u << rows) - 1);
    const __m512i index = row_offsets(bw), low4 = _mm512_set1_epi32(0x0F0F0F0F);
    __m512 acc[LEVELS_COLS];
    for (int c = 0; c < ncols; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k / QK_K; i++) {
        const char *blk = w + i * (int64_t)sizeof(block_q4_K);
        // every row's d and dmin, and its twelve bytes of six-bit scales and minimums (ggml_q4_K_scales_mins)
        const __m512i zero = _mm512_setzero_si512();
        const __m512i dd = _mm512_mask_i32gather_epi32(zero, live, index, blk + offsetof(block_q4_K, d), 1);
        const __m512i u0 = _mm512_mask_i32gather_epi32(zero, live, index, blk + offsetof(block_q4_K, scales), 1);
        const __m512i u1 = _mm512_mask_i32gather_epi32(zero, live, index, blk + offsetof(block_q4_K, scales) + 4, 1);
        const __m512i u2 = _mm512_mask_i32gather_epi32(zero, live, index, blk + offsetof(block_q4_K, scales) + 8, 1);
        const __m512i six = _mm512_set1_epi32(0x3F3F3F3F), tops = _mm512_set1_epi32(0x30303030);
        const __m512i sc[2] = {_mm512_and_si512(u0, six),
                               _mm512_or_si512(_mm512_and_si512(u2, low4), _mm512_and_si512(_mm512_srli_epi32(u0, 2), tops))};
        const __m512i mn[2] = {_mm512_and_si512(u1, six),
                               _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), low4),
                                               _mm512_and_si512(_mm512_srli_epi32(u1, 2), tops))};
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
        const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16)));
        for (int p = 0; p < 4; p++) { // qs[32 p ..]: sub-blocks 2p (low nibbles) and 2p + 1 (high)
            __m512i t[8];
            load_transposed(blk, bw, rows, offsetof(block_q4_K, qs) + 32 * p, t);
            for (int half = 0; half < 2; half++) {
                const int s = 2 * p + half;     // the sub-block
                const int64_t g = 8 * i + s;    // its scale group, and the activations' block
                const __m512 scale = _mm512_mul_ps(d, byte_as_float(sc[s / 4], s));
                const __m512 offset = _mm512_castsi512_ps(_mm512_xor_si512( // -minimum
                    _mm512_castps_si512(_mm512_mul_ps(dmin, byte_as_float(mn[s / 4], s))), _mm512_set1_epi32(INT32_MIN)));
                __m512i lv[8];
                for (int j = 0; j < 8; j++)
                    lv[j] = _mm512_and_si512(half ? _mm512_srli_epi32(t[j], 4) : t[j], low4);
                add_group(acc, ncols, lv, xblock_at(xgroup, k, wide, true, g), 0, 8, -1, scale, offset);
            }
        }
    }
    for (int c = 0; c < ncols; c++) _mm512_mask_storeu_ps(y + c * y_stride, live, acc[c]);
}

// Q6_K: levels q - 32 with q in 0..63, a scale d * scales[s] per 16 values (levels_gemm_ref's groups). vpdpbusd
// multiplies unsigned bytes by signed ones, so the dots take q and give back 32 times the group's activation sum
// (16 columns' sums at once: the activation bytes dotted with ones)
VNNI_TARGET static void q6_K_levels_direct(const char *w, size_t bw, int64_t rows, int64_t k, const char *xgroup,
                                           bool wide, int ncols, float *y, size_t y_stride) {
    const __mmask16 live = (__mmask16)((1u << rows) - 1);
    const __m512i index = row_offsets(bw), zero = _mm512_setzero_si512();
    const __m512i low4 = _mm512_set1_epi32(0x0F0F0F0F), two = _mm512_set1_epi32(0x03030303);
    __m512 acc[LEVELS_COLS];
    for (int c = 0; c < ncols; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k / QK_K; i++) {
        const char *blk = w + i * (int64_t)sizeof(block_q6_K);
        // every row's sixteen int8 scales (four dwords) and d (the high half of the dword that ends the block)
        __m512i sc[4];
        for (int q = 0; q < 4; q++)
            sc[q] = _mm512_mask_i32gather_epi32(zero, live, index, blk + offsetof(block_q6_K, scales) + 4 * q, 1);
        const __m512i dd = _mm512_mask_i32gather_epi32(zero, live, index, blk + sizeof(block_q6_K) - 4, 1);
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16)));
        for (int h = 0; h < 2; h++) { // values 128 h ..: ql[64 h ..], ql[64 h + 32 ..], qh[32 h ..]
            __m512i l0[8], l1[8], qh[8];
            load_transposed(blk, bw, rows, offsetof(block_q6_K, ql) + 64 * h, l0);
            load_transposed(blk, bw, rows, offsetof(block_q6_K, ql) + 64 * h + 32, l1);
            load_transposed(blk, bw, rows, offsetof(block_q6_K, qh) + 32 * h, qh);
            for (int quarter = 0; quarter < 4; quarter++) { // values 128 h + 32 quarter + l: one activation block
                const int64_t b = 8 * i + 4 * h + quarter;
                __m512i q[8];
                for (int j = 0; j < 8; j++) {
                    const __m512i nib = quarter % 2 ? l1[j] : l0[j];
                    const __m512i lown = _mm512_and_si512(quarter < 2 ? nib : _mm512_srli_epi32(nib, 4), low4);
                    const __m512i top = _mm512_and_si512(_mm512_srli_epi32(qh[j], 2 * quarter), two);
                    q[j] = _mm512_or_si512(lown, _mm512_slli_epi32(top, 4));
                }
                const struct xblock x = xblock_at(xgroup, k, wide, false, b);
                for (int sub = 0; sub < 2; sub++) { // the block's two groups of 16 (x rows 4 sub .. 4 sub + 3)
                    const int s = 8 * h + 2 * quarter + sub; // the group's scale in the super-block
                    const __m512i word = sc[s / 4];
                    const __m512 scale = _mm512_mul_ps(
                        d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(word, 24 - 8 * (s % 4)), 24)));
                    add_group(acc, ncols, q, x, 4 * sub, 4, 5, scale, scale);
                }
            }
        }
    }
    for (int c = 0; c < ncols; c++) _mm512_mask_storeu_ps(y + c * y_stride, live, acc[c]);
}

// the four bits (x >> shift) & 15 of each lane as bit 4 of its four bytes (bit b into byte b): the copies the
// product places at b + 4 + 7 j never overlap, so no carry reaches them
VNNI_TARGET static inline __m512i fifth_bits(__m512i x, int shift) {
    const __m512i four = _mm512_and_si512(_mm512_srli_epi32(x, shift), _mm512_set1_epi32(0x0F));
    return _mm512_and_si512(_mm512_mullo_epi32(four, _mm512_set1_epi32(0x02040810)), _mm512_set1_epi32(0x10101010));
}

// Q5_0: levels u - 16 with u = nibble | fifth bit << 4 (0..31), one scale a block of 32 (the activations' block);
// the 16 nibble bytes of 16 rows transposed as 4 x 4 dwords in each 128-bit lane, the fifth bits and the scales
// gathered, 16 times the block's activation sum given back
VNNI_TARGET static void q5_0_levels_direct(const char *w, size_t bw, int64_t rows, int64_t k, const char *xgroup,
                                           bool wide, int ncols, float *y, size_t y_stride) {
    const int64_t nb = k / LEVELS_XBLOCK;
    const __mmask16 live = (__mmask16)((1u << rows) - 1);
    const __m512i index = row_offsets(bw), zero = _mm512_setzero_si512();
    __m512 acc[LEVELS_COLS];
    for (int c = 0; c < ncols; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t ib = 0; ib < nb; ib++) {
        const char *blk = w + ib * (int64_t)sizeof(block_q5_0);
        __m512i t[4];
        load_transposed16(blk, bw, rows, offsetof(block_q5_0, qs), t);
        const __m512i dq = _mm512_mask_i32gather_epi32(zero, live, index, blk, 1); // d, then qh's first two bytes
        const __m512i qh = _mm512_mask_i32gather_epi32(zero, live, index, blk + offsetof(block_q5_0, qh), 1);
        const __m512 scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dq));
        __m512i u[8];
        nibble_levels16(t, u);
        for (int j = 0; j < 4; j++) {
            u[j] = _mm512_or_si512(u[j], fifth_bits(qh, 4 * j));
            u[j + 4] = _mm512_or_si512(u[j + 4], fifth_bits(qh, 16 + 4 * j));
        }
        add_group(acc, ncols, u, xblock_at(xgroup, k, wide, false, ib), 0, 8, 4, scale, scale);
    }
    for (int c = 0; c < ncols; c++) _mm512_mask_storeu_ps(y + c * y_stride, live, acc[c]);
}

// the most columns that take a direct kernel instead of the tiles over a panel of levels: the tiles repay a panel's
// unpacking from about 128 columns on (Qwen2.5-Coder-1.5B, 2 threads, direct / tiles: pp16 97 / 55 t/s, pp32 124 /
// 84, pp64 121 / 107, pp128 131 / 121, pp512 110 / 122), a precise batch's two planes from about 48 (Gemma-3-270M:
// pp32 611 / 586, pp64 661-710 / 702-771)
#define DIRECT_MAX_COLS 64
#define DIRECT_MAX_COLS_WIDE 32

levels_direct_fn levels_direct_for(levels_gemm_fn gemm, enum ggml_type type, int64_t cols, bool wide) {
    if (gemm == levels_gemm_ref || cols > (wide ? DIRECT_MAX_COLS_WIDE : DIRECT_MAX_COLS)) return NULL;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512vnni"))
        return NULL;
    switch (type) {
    case GGML_TYPE_Q4_0: return q4_0_levels_direct;
    case GGML_TYPE_Q4_1: return q4_1_levels_direct;
    case GGML_TYPE_Q5_0: return q5_0_levels_direct;
    case GGML_TYPE_Q8_0: return q8_0_levels_direct;
    case GGML_TYPE_Q4_K: return q4_K_levels_direct;
    case GGML_TYPE_Q6_K: return q6_K_levels_direct;
    default: return NULL;
    }
}

#else

levels_direct_fn levels_direct_for(levels_gemm_fn gemm, enum ggml_type type, int64_t cols, bool wide) {
    (void)gemm, (void)type, (void)cols, (void)wide;
    return NULL;
}

#endif
