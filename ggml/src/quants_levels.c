// quants_levels.c: each weight type's rows as int8 levels under a scale (and an offset) per group, activation
// columns repacked into AMX's tile layout, and the scalar oracle of the tile GEMM over them (levels.h).
#include "levels.h"
#include "quants.h"

#include <math.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------------
// weight rows as levels: value = scale * level + offset, the float arithmetic of each type's to_float
// ---------------------------------------------------------------------------------------------------

// a 32-value block's nibbles (value j low in qs[j], value j + 16 high) plus `bias` (arithmetic, not a table: it
// vectorizes, and the unpacking is a tenth of an AMX prompt's time)
static void nibble_levels(const uint8_t *qs, int bias, int8_t *q) {
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)((qs[j] & 0x0F) + bias);
        q[j + 16] = (int8_t)((qs[j] >> 4) + bias);
    }
}

static void q4_0_levels(const void *row, int64_t k, int8_t *q, float *scale, float *offset, int64_t gs) {
    (void)offset;
    const block_q4_0 *b = row; // (k / 32,)
    for (int64_t i = 0; i < k / QK4_0; i++, q += QK4_0) {
        scale[i * gs] = ggml_fp16_to_fp32(b[i].d);
        nibble_levels(b[i].qs, -8, q);
    }
}

static void q4_1_levels(const void *row, int64_t k, int8_t *q, float *scale, float *offset, int64_t gs) {
    const block_q4_1 *b = row; // (k / 32,)
    for (int64_t i = 0; i < k / QK4_1; i++, q += QK4_1) {
        scale[i * gs] = ggml_fp16_to_fp32(b[i].d);
        offset[i * gs] = ggml_fp16_to_fp32(b[i].m);
        nibble_levels(b[i].qs, 0, q);
    }
}

static void q5_0_levels(const void *row, int64_t k, int8_t *q, float *scale, float *offset, int64_t gs) {
    (void)offset;
    const block_q5_0 *b = row; // (k / 32,)
    for (int64_t i = 0; i < k / QK5_0; i++, q += QK5_0) {
        const uint32_t qh = ggml_q5_0_qh(&b[i]);
        scale[i * gs] = ggml_fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK5_0 / 2; j++) {
            q[j] = (int8_t)(((b[i].qs[j] & 0x0F) | ((qh >> j) & 1) << 4) - 16);
            q[j + QK5_0 / 2] = (int8_t)(((b[i].qs[j] >> 4) | ((qh >> (j + QK5_0 / 2)) & 1) << 4) - 16);
        }
    }
}

static void q8_0_levels(const void *row, int64_t k, int8_t *q, float *scale, float *offset, int64_t gs) {
    (void)offset;
    const block_q8_0 *b = row; // (k / 32,)
    for (int64_t i = 0; i < k / QK8_0; i++, q += QK8_0) {
        scale[i * gs] = ggml_fp16_to_fp32(b[i].d);
        memcpy(q, b[i].qs, QK8_0);
    }
}

static void mxfp4_levels(const void *row, int64_t k, int8_t *q, float *scale, float *offset, int64_t gs) {
    (void)offset;
    const block_mxfp4 *b = row; // (k / 32,)
    for (int64_t i = 0; i < k / QK_MXFP4; i++, q += QK_MXFP4) {
        scale[i * gs] = ggml_e8m0_to_fp32_half(b[i].e);
        for (int j = 0; j < QK_MXFP4 / 2; j++) {
            q[j] = ggml_mxfp4_kvalues[b[i].qs[j] & 0x0F];
            q[j + QK_MXFP4 / 2] = ggml_mxfp4_kvalues[b[i].qs[j] >> 4];
        }
    }
}

// sub-block s of 32: scale d * sc[s], offset -dmin * m[s], levels the nibbles 0..15
static void q4_K_levels(const void *row, int64_t k, int8_t *q, float *scale, float *offset, int64_t gs) {
    const block_q4_K *b = row; // (k / 256,)
    for (int64_t i = 0; i < k / QK_K; i++) {
        for (int s = 0; s < 8; s++, q += 32) {
            float minimum;
            ggml_q4_K_sub_block(&b[i], s, &scale[(8 * i + s) * gs], &minimum);
            offset[(8 * i + s) * gs] = -minimum;
            const uint8_t *qs = b[i].qs + 32 * (s / 2); // (32,) nibbles shared by sub-blocks 2c, 2c + 1
            for (int l = 0; l < 32; l++) q[l] = (int8_t)((qs[l] >> (4 * (s % 2))) & 0x0F);
        }
    }
}

// sub-block s of 16: scale d * scales[s], levels q - 32
static void q6_K_levels(const void *row, int64_t k, int8_t *q, float *scale, float *offset, int64_t gs) {
    (void)offset;
    const block_q6_K *b = row; // (k / 256,)
    for (int64_t i = 0; i < k / QK_K; i++, q += QK_K) {
        const float d = ggml_fp16_to_fp32(b[i].d);
        for (int s = 0; s < QK_K / 16; s++) scale[(16 * i + s) * gs] = d * (float)b[i].scales[s];
        // quants.h's layout a half at a time (ggml_q6_K_level value by value did not vectorize)
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b[i].ql + 64 * h, *qh = b[i].qh + 32 * h;
            int8_t *qq = q + 128 * h; // (128,)
            for (int l = 0; l < 32; l++) {
                qq[l] = (int8_t)(((ql[l] & 0x0F) | (qh[l] & 3) << 4) - 32);
                qq[l + 32] = (int8_t)(((ql[l + 32] & 0x0F) | (qh[l] >> 2 & 3) << 4) - 32);
                qq[l + 64] = (int8_t)(((ql[l] >> 4) | (qh[l] >> 4 & 3) << 4) - 32);
                qq[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (qh[l] >> 6 & 3) << 4) - 32);
            }
        }
    }
}

static const struct levels_traits levels_table[GGML_TYPE_COUNT] = {
    [GGML_TYPE_Q4_0] = {32, false, q4_0_levels, q4_0_levels_avx2},
    [GGML_TYPE_Q4_1] = {32, true, q4_1_levels},
    [GGML_TYPE_Q5_0] = {32, false, q5_0_levels, q5_0_levels_avx2},
    [GGML_TYPE_Q8_0] = {32, false, q8_0_levels},
    [GGML_TYPE_MXFP4] = {32, false, mxfp4_levels},
    [GGML_TYPE_Q4_K] = {32, true, q4_K_levels, q4_K_levels_avx2},
    [GGML_TYPE_Q6_K] = {16, false, q6_K_levels, q6_K_levels_avx2},
};

const struct levels_traits *levels_traits_for(enum ggml_type type) {
    return type >= 0 && type < GGML_TYPE_COUNT && levels_table[type].row ? &levels_table[type] : NULL;
}

// ---------------------------------------------------------------------------------------------------
// panels of LEVELS_ROWS weight rows
// ---------------------------------------------------------------------------------------------------

static size_t align64(size_t n) {
    return (n + 63) & ~(size_t)63;
}

// the levels, the scales, the offsets and one row's levels as the type's row function writes them
size_t levels_panel_bytes(const struct levels_traits *lt, int64_t k) {
    const size_t per_group = align64((size_t)(k / lt->group) * LEVELS_ROWS * sizeof(float));
    return align64((size_t)LEVELS_ROWS * (size_t)k) + (lt->offset ? 2 : 1) * per_group + align64((size_t)k);
}

void levels_panel_fill(const struct levels_traits *lt, const char *w, size_t bw, int64_t rows, int64_t k, void *buf,
                       struct levels_panel *p) {
    const size_t per_group = align64((size_t)(k / lt->group) * LEVELS_ROWS * sizeof(float));
    const int G = lt->group;
    int8_t *levels = buf;
    float *scale = (float *)((char *)buf + align64((size_t)LEVELS_ROWS * (size_t)k));
    float *offset = lt->offset ? (float *)((char *)scale + per_group) : NULL;
    int8_t *row = (int8_t *)scale + (lt->offset ? 2 : 1) * per_group; // (k,)
    // the AVX2 rows where SIMD is on (a small batch unpacks every panel per call: the scalar Q5_0 rows had been
    // 10 % of a 128-token prompt)
    const levels_row_fn row_fn = lt->row_avx2 && ggml_quants_simd_in_use() ? lt->row_avx2 : lt->row;
    for (int64_t r = 0; r < LEVELS_ROWS; r++) {
        if (r < rows) {
            row_fn(w + r * (int64_t)bw, k, row, scale + r, offset ? offset + r : NULL, LEVELS_ROWS);
        } else {
            // the matrix's last rows: zero levels and scales, whose outputs the caller drops
            memset(row, 0, (size_t)k);
            for (int64_t g = 0; g < k / G; g++) {
                scale[g * LEVELS_ROWS + r] = 0.0f;
                if (offset) offset[g * LEVELS_ROWS + r] = 0.0f;
            }
        }
        for (int64_t g = 0; g < k / G; g++) memcpy(levels + (g * LEVELS_ROWS + r) * G, row + g * G, (size_t)G);
    }
    *p = (struct levels_panel){.levels = levels, .scale = scale, .offset = offset, .k = k, .group = G};
}

// ---------------------------------------------------------------------------------------------------
// activation columns in groups of LEVELS_COLS
// ---------------------------------------------------------------------------------------------------

size_t levels_x_group_bytes(int64_t k, bool sums, bool wide) {
    const int64_t nb = k / LEVELS_XBLOCK;
    return (size_t)nb * ((wide ? 2 : 1) * LEVELS_XBLOCK_BYTES + (sums ? 2 : 1) * LEVELS_COLS * sizeof(float));
}

bool levels_x_type_ok(enum ggml_type x_type) {
    return x_type == GGML_TYPE_Q8_0 || x_type == GGML_TYPE_Q8_1 || x_type == GGML_TYPE_Q8_K;
}

// block b of a column quantized to x_type (levels_x_type_ok): its 32 values, its scale and its sum times that scale
static const int8_t *x_block(enum ggml_type x_type, const char *col, int64_t b, float *d, float *s) {
    switch (x_type) {
    case GGML_TYPE_Q8_1: {
        const block_q8_1 *x = (const block_q8_1 *)col + b;
        *d = ggml_fp16_to_fp32(x->d);
        *s = ggml_fp16_to_fp32(x->s);
        return x->qs;
    }
    case GGML_TYPE_Q8_K: {
        const block_q8_K *x = (const block_q8_K *)col + b / (QK_K / LEVELS_XBLOCK);
        const int sub = (int)(b % (QK_K / LEVELS_XBLOCK));
        *d = x->d;
        *s = x->d * (float)(x->bsums[2 * sub] + x->bsums[2 * sub + 1]);
        return x->qs + LEVELS_XBLOCK * sub;
    }
    default: { // Q8_0
        const block_q8_0 *x = (const block_q8_0 *)col + b;
        *d = ggml_fp16_to_fp32(x->d);
        *s = 0.0f;
        return x->qs;
    }
    }
}

// block b of a column in 16-bit form (block_q16_K where x_type is Q8_K, else block_q16): its high bytes, with its
// low bytes in *lo, its scale and its sum times that scale
static const int8_t *x_block_wide(enum ggml_type x_type, const char *col, int64_t b, const int8_t **lo, float *d,
                                  float *s) {
    if (x_type == GGML_TYPE_Q8_K) {
        const block_q16_K *x = (const block_q16_K *)col + b / (QK_K / LEVELS_XBLOCK);
        const int sub = (int)(b % (QK_K / LEVELS_XBLOCK));
        *d = x->d;
        *s = x->d * (float)(x->bsums[2 * sub] + x->bsums[2 * sub + 1]);
        *lo = x->lo + LEVELS_XBLOCK * sub;
        return x->hi + LEVELS_XBLOCK * sub;
    }
    const block_q16 *x = (const block_q16 *)col + b;
    *d = x->d;
    *s = x->d * (float)x->sum;
    *lo = x->lo;
    return x->hi;
}

// a block's 32 values into its place in the group: row i of the tile holds column c's values 4i .. 4i + 3 at 4c
static void x_place(const int8_t *q, int c, int8_t *out) {
    for (int i = 0; i < LEVELS_XBLOCK / 4; i++) memcpy(out + i * 4 * LEVELS_COLS + 4 * c, q + 4 * i, 4);
}

void levels_x_pack(enum ggml_type x_type, bool wide, const char *cols, size_t stride, int64_t m, int64_t k, bool sums,
                   int64_t group, char *dst) {
    const int64_t nb = k / LEVELS_XBLOCK, planes = wide ? 2 : 1;
    float *d = (float *)(dst + nb * planes * LEVELS_XBLOCK_BYTES); // (nb, LEVELS_COLS)
    float *s = d + nb * LEVELS_COLS;                               // (nb, LEVELS_COLS) with sums
    memset(dst, 0, levels_x_group_bytes(k, sums, wide));
    for (int c = 0; c < LEVELS_COLS && group * LEVELS_COLS + c < m; c++) {
        const char *col = cols + (size_t)(group * LEVELS_COLS + c) * stride;
        for (int64_t b = 0; b < nb; b++) {
            float db, sb;
            int8_t *out = (int8_t *)dst + b * planes * LEVELS_XBLOCK_BYTES; // (planes, 8, LEVELS_COLS, 4)
            if (wide) {
                const int8_t *lo, *hi = x_block_wide(x_type, col, b, &lo, &db, &sb);
                x_place(hi, c, out);
                x_place(lo, c, out + LEVELS_XBLOCK_BYTES);
            } else {
                x_place(x_block(x_type, col, b, &db, &sb), c, out);
            }
            d[b * LEVELS_COLS + c] = db;
            if (sums) s[b * LEVELS_COLS + c] = sb;
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// the tile GEMM's oracle
// ---------------------------------------------------------------------------------------------------

// the int32 dot of weight row r's group g with column c of one plane of the activations
static int32_t plane_dot(const struct levels_panel *w, const int8_t *plane, int r, int c, int64_t g) {
    const int64_t G = w->group;
    int32_t dot = 0;
    for (int64_t j = g * G; j < (g + 1) * G; j++) {
        const int64_t i = (j % LEVELS_XBLOCK) / 4; // the value's row in its block's tile
        dot += w->levels[(g * LEVELS_ROWS + r) * G + j % G] * plane[(i * LEVELS_COLS + c) * 4 + j % 4];
    }
    return dot;
}

void levels_gemm_ref(const struct levels_panel *w, const char *xgroup, bool wide, float *out) {
    const int64_t k = w->k, nb = k / LEVELS_XBLOCK, G = w->group, planes = wide ? 2 : 1;
    const float *d = (const float *)(xgroup + nb * planes * LEVELS_XBLOCK_BYTES); // (nb, LEVELS_COLS)
    const float *s = d + nb * LEVELS_COLS;                                        // (nb, LEVELS_COLS)
    for (int r = 0; r < LEVELS_ROWS; r++)
        for (int c = 0; c < LEVELS_COLS; c++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < k / G; g++) {
                const int64_t b = g * G / LEVELS_XBLOCK;
                const int8_t *block = (const int8_t *)xgroup + b * planes * LEVELS_XBLOCK_BYTES;
                int32_t dot = plane_dot(w, block, r, c, g);
                if (wide) dot = 255 * dot + plane_dot(w, block + LEVELS_XBLOCK_BYTES, r, c, g);
                acc = fmaf((float)dot, d[b * LEVELS_COLS + c] * w->scale[g * LEVELS_ROWS + r], acc);
                if (w->offset) acc = fmaf(s[b * LEVELS_COLS + c], w->offset[g * LEVELS_ROWS + r], acc);
            }
            out[r * LEVELS_COLS + c] = acc;
        }
}
