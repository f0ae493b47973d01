// ops_matmul.c: mul_mat. Phase 1: the threads convert x's columns to the weight type's vec_dot_type
// (Q8_0, Q8_1, Q8_K, F16...) into wdata; barrier; phase 2: the threads split the weight rows.
// A precise mul_mat (ggml_mul_mat_precise) converts x to 16-bit levels instead (block_q16, quants_q16.c) where the
// weight type has kernels for them: two byte products a weight under one scale, W.x to ~1e-5 relative instead of
// ~4e-3. Elsewhere it also quantizes what the 8-bit rounding lost, x - dequant(quant(x)), and adds that dot too.
// A batch of 4+ columns on a CPU with AMX runs as int8 tile GEMMs over the weights' levels (levels.h).
#include "ops_kernels.h"
#include "../levels.h"
#include "../quants.h"

#include <string.h>

// weight rows per tile: 16 rows of a 4096-wide Q4_0 matrix are 37 KB and stay in L2 across columns
#define MUL_MAT_ROW_TILE 16
#define GEMV_CHUNK_BYTES (64 << 10)  // weight bytes a thread takes at a time in a large GEMV
#define GEMV_CHUNKED_BYTES (4 << 20) // GEMVs over at least this many weight bytes take chunks

#define GEMV_PREFETCH_ROWS 2          // rows of a GEMV asked for ahead of the one being dotted

// x is used in place when the dot product takes F32
static bool xcols_in_place(const struct ggml_tensor *w) {
    return ggml_get_type_traits(w->type)->vec_dot_type == GGML_TYPE_F32;
}

static bool precise(const struct ggml_tensor *dst) {
    return dst->op == GGML_OP_MUL_MAT && dst->op_params[0];
}

size_t ggml_cpu_xcols_wsize(const struct ggml_tensor *w, const struct ggml_tensor *x) {
    if (xcols_in_place(w)) return 0;
    enum ggml_type vdt = ggml_get_type_traits(w->type)->vec_dot_type;
    // (m, row_size(vdt, k)) the converted columns
    return ggml_cpu_align_up((size_t)ggml_nrows(x) * ggml_row_size(vdt, x->ne[0]));
}

// the rounding residual of x's columns, converted as ggml_cpu_xcols_prepare converts x; it lies right after
// xc's columns in wdata (the caller sized wdata twice), and this thread does the blocks it converted there
static void xcols_residual(const struct ggml_compute_params *p, const struct ggml_tensor *w,
                           const struct ggml_tensor *x, struct ggml_cpu_xcols *xc) {
    const enum ggml_type vdt = ggml_get_type_traits(w->type)->vec_dot_type;
    const struct ggml_type_traits *tv = ggml_get_type_traits(vdt);
    const int64_t k = x->ne[0], m = ggml_nrows(x), bpr = k / tv->blck_size;
    xc->residual = xc->base + ggml_cpu_xcols_wsize(w, x);
    float back[256]; // one block dequantized (Q8_K's 256 values are the largest)
    int64_t b0, b1;
    ggml_thread_range(m * bpr, p->ith, p->nth, &b0, &b1);
    for (int64_t b = b0; b < b1; b++) {
        const int64_t j = b / bpr, off = (b % bpr) * tv->blck_size;
        const size_t at = (size_t)j * xc->stride + (size_t)(b % bpr) * tv->type_size;
        const float *xj = (const float *)ggml_cpu_row_ptr(x, j) + off;
        tv->to_float(xc->base + at, back, tv->blck_size);
        for (int64_t i = 0; i < tv->blck_size; i++) back[i] = xj[i] - back[i];
        tv->quantize_act(back, (char *)xc->residual + at, tv->blck_size);
        if (vdt == GGML_TYPE_Q8_1) {
            // Q4_1's minimum multiplies the block sum s, which Q8_1 keeps in f16: the residual's s takes
            // what that rounding lost too, so the two sums add up to x's own
            const block_q8_1 *q = (const block_q8_1 *)(xc->base + at);
            block_q8_1 *r = (block_q8_1 *)(xc->residual + at);
            float sum = 0.0f;
            for (int64_t i = 0; i < QK8_1; i++) sum += xj[i];
            r->s = ggml_fp32_to_fp16(sum - ggml_fp16_to_fp32(q->s));
        }
    }
}

// this thread's share of x's blocks converted by `convert` (blck values -> block_bytes) into wdata, a column every
// `stride` bytes: blocks are independent, so the threads split all m * k / blck of them and one column is parallel too
static void xcols_convert(const struct ggml_compute_params *p, const struct ggml_tensor *x, ggml_from_float_fn convert,
                          int64_t blck, size_t block_bytes, size_t stride) {
    const int64_t bpr = x->ne[0] / blck;
    int64_t b0, b1;
    ggml_thread_range(ggml_nrows(x) * bpr, p->ith, p->nth, &b0, &b1);
    while (b0 < b1) {
        const int64_t j = b0 / bpr, b = b0 % bpr;
        const int64_t nb = bpr - b < b1 - b0 ? bpr - b : b1 - b0;
        convert((const float *)ggml_cpu_row_ptr(x, j) + b * blck,
                (char *)p->wdata + (size_t)j * stride + (size_t)b * block_bytes, nb * blck);
        b0 += nb;
    }
}

// what every conversion of x needs: F32 activations as long as the weights' rows, whole blocks of them
static int xcols_check(const struct ggml_tensor *w, const struct ggml_tensor *x) {
    if (x->type != GGML_TYPE_F32) return ggml_set_error(GGML_STATUS_UNSUPPORTED, "mul_mat takes F32 activations");
    if (w->ne[0] != x->ne[0] || w->ne[0] % ggml_get_type_traits(w->type)->blck_size)
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "mul_mat: inner sizes %lld and %lld", (long long)w->ne[0],
                              (long long)x->ne[0]);
    return GGML_STATUS_OK;
}

int ggml_cpu_xcols_prepare(const struct ggml_compute_params *p, const struct ggml_tensor *w,
                           const struct ggml_tensor *x, struct ggml_cpu_xcols *xc) {
    const struct ggml_type_traits *tw = ggml_get_type_traits(w->type);
    if (!tw->vec_dot) return ggml_set_error(GGML_STATUS_UNSUPPORTED, "no dot product for %s", ggml_type_name(w->type));
    int st = xcols_check(w, x);
    if (st) return st;
    const int64_t k = x->ne[0];
    xc->residual = NULL;
    if (xcols_in_place(w)) {
        // 2-D x (the constructors' contract): columns are its rows
        xc->base = x->data;
        xc->stride = x->nb[1];
        return GGML_STATUS_OK;
    }
    const enum ggml_type vdt = tw->vec_dot_type;
    const struct ggml_type_traits *tv = ggml_get_type_traits(vdt);
    if (!tv->quantize_act)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "cannot convert activations to %s", ggml_type_name(vdt));
    if (k % tv->blck_size)
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "mul_mat: %lld is not a multiple of %s's block",
                              (long long)k, ggml_type_name(vdt));
    xc->base = p->wdata;
    xc->stride = ggml_row_size(vdt, k);
    xcols_convert(p, x, tv->quantize_act, tv->blck_size, tv->type_size, xc->stride);
    return GGML_STATUS_OK;
}

// y = w . x, plus w . residual when the mul_mat dots x's rounding residual too (the residual's columns at x's offsets)
static inline void dot_row(ggml_vec_dot_fn dot, const struct ggml_cpu_xcols *xc, int64_t k, float *y, const void *w,
                           const char *x) {
    dot(k, y, w, x);
    if (xc->residual) {
        float lost;
        dot(k, &lost, w, xc->residual + (x - xc->base));
        *y += lost;
    }
}

// a gemm tile of w . x (s[j * ss + r]), plus the tile of w . residual as dot_row
static inline void gemm_tile(ggml_gemm_tile_fn tile, const struct ggml_cpu_xcols *xc, int64_t k, float *s, int64_t ss,
                             const void *w, size_t bw, const char *x) {
    tile(k, s, ss, w, bw, x, xc->stride);
    if (xc->residual) {
        float lost[GGML_GEMM_TILE_COLS * GGML_GEMM_TILE_ROWS];
        tile(k, lost, GGML_GEMM_TILE_ROWS, w, bw, xc->residual + (x - xc->base), xc->stride);
        for (int j = 0; j < GGML_GEMM_TILE_COLS; j++)
            for (int r = 0; r < GGML_GEMM_TILE_ROWS; r++) s[j * ss + r] += lost[j * GGML_GEMM_TILE_ROWS + r];
    }
}

// the kernels one mul_mat runs
struct mul_mat_kernels {
    bool q16;                  // x as 16-bit activations (a precise mul_mat whose weight type has them)
    ggml_vec_dot_fn dot;       // a weight row . a column
    ggml_vec_dot4_fn dot4;     // 4 rows . a column (what dot gives each), or NULL
    ggml_gemm_tile_fn tile;    // 4 x 4 tiles of a batch of 4 or more columns, or NULL
    size_t tile_row_bytes;     // a row as the tile reads it
    ggml_rows_rewrite_fn rewrite; // the tile reads rows rewritten by this once per row tile, or NULL
};

// a tile over one kind of activations, the rewrite of the rows it reads (or NULL) and a row's bytes as it reads them
struct tile_choice {
    ggml_gemm_tile_fn tile;
    ggml_rows_rewrite_fn rewrite;
    size_t row_bytes;
};

static void q5_0_rows_as_q8_0(const void *w, size_t bw, int64_t rows, int64_t k, void *out) {
    const int64_t nb = k / QK5_0;
    for (int64_t r = 0; r < rows; r++) {
        const block_q5_0 *src = (const block_q5_0 *)((const char *)w + r * (int64_t)bw);
        block_q8_0 *dst = (block_q8_0 *)out + r * nb;
        for (int64_t b = 0; b < nb; b++) {
            uint32_t qh;
            memcpy(&qh, src[b].qh, sizeof qh);
            dst[b].d = src[b].d;
            for (int j = 0; j < QK5_0 / 2; j++) {
                dst[b].qs[j] = (int8_t)(((src[b].qs[j] & 15) | ((qh >> j) & 1) << 4) - 16);
                dst[b].qs[j + QK5_0 / 2] = (int8_t)(((src[b].qs[j] >> 4) | ((qh >> (j + QK5_0 / 2)) & 1) << 4) - 16);
            }
        }
    }
}

// Q5_0 weights under a prompt: the tile would unpack their nibbles and fifth bits again for every 4 columns,
// so each row tile is rewritten once as Q8_0 (exact: the same levels less 16, the same scale) and goes
// through Q8_0's tile, which takes Q5_0's activations (a 896 x 4864 matmul of 512 columns: 194 -> 247
// GFLOP/s on 2 threads); likewise Q6_K's rows as levels a byte each where the type has that tile and no other
// (AVX2).
static struct tile_choice tile_for(const struct ggml_tensor *w, bool q16) {
    const struct ggml_type_traits *tw = ggml_get_type_traits(w->type), *t8 = ggml_get_type_traits(GGML_TYPE_Q8_0);
    const ggml_gemm_tile_fn q8_0_tile = q16 ? t8->gemm_tile_q16 : t8->gemm_tile;
    if (w->type == GGML_TYPE_Q5_0 && q8_0_tile)
        return (struct tile_choice){q8_0_tile, q5_0_rows_as_q8_0, ggml_row_size(GGML_TYPE_Q8_0, w->ne[0])};
    const ggml_gemm_tile_fn own = q16 ? tw->gemm_tile_q16 : tw->gemm_tile;
    if (!own && !q16 && tw->gemm_tile_rewritten)
        return (struct tile_choice){tw->gemm_tile_rewritten, tw->rewrite_rows,
                                    (size_t)(w->ne[0] / tw->blck_size) * tw->rewritten_block_size};
    return (struct tile_choice){own, NULL, w->nb[1]};
}

// A precise mul_mat takes 16-bit activations unless only the 8-bit ones have a tile here (a VNNI host's Q4_0, any
// host's Q6_K): there it dots x's rounding and its residual through that tile.
static struct mul_mat_kernels mul_mat_kernels_for(const struct ggml_tensor *dst) {
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    const struct ggml_type_traits *tw = ggml_get_type_traits(w->type);
    const struct tile_choice tile8 = tile_for(w, false), tile16 = tile_for(w, true);
    const bool tiles = x->ne[1] >= GGML_GEMM_TILE_COLS;
    const bool q16 = precise(dst) && tw->vec_dot_q16 && !(tiles && tile8.tile && !tile16.tile);
    const struct tile_choice *c = q16 ? &tile16 : &tile8;
    struct mul_mat_kernels k = {.q16 = q16, .dot = q16 ? tw->vec_dot_q16 : tw->vec_dot, .dot4 = q16 ? NULL : tw->vec_dot4,
                                .tile_row_bytes = w->nb[1]};
    if (tiles && c->tile) k.tile = c->tile, k.rewrite = c->rewrite, k.tile_row_bytes = c->row_bytes;
    return k;
}

// a thread's scratch for a row tile rewritten for a tile (Q5_0's rows as Q8_0 take 34 / 22 of their bytes, Q6_K's
// levels 274 / 210), counted for any quantized weights under a batch: which tile runs depends on the SIMD in use,
// which tests switch between planning and computing
static size_t rewritten_tile_bytes(const struct ggml_tensor *dst) {
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    return ggml_get_type_traits(w->type)->is_quantized && x->ne[1] >= GGML_GEMM_TILE_COLS
               ? ggml_cpu_align_up((size_t)MUL_MAT_ROW_TILE * 2 * w->nb[1])
               : 0;
}


// dst[r, j] = w[r] . x[j] for rows [r0, r1) and all m columns, weight rows tiled so they stay in cache;
// inside a tile, 4 x 4 blocks of outputs go through the kernels' tile where there is one, the rest through dot.
// rewritten: this thread's scratch for a row tile rewritten for the tile (the kernels' rewrite), or NULL
static void mul_mat_rows_dense(const struct ggml_tensor *w, const struct ggml_cpu_xcols *xc, struct ggml_tensor *dst,
                               const struct mul_mat_kernels *kn, int64_t r0, int64_t r1, void *rewritten) {
    const int64_t k = w->ne[0], m = dst->ne[1];
    const size_t bw = w->nb[1], bt = kn->tile_row_bytes;
    const char *wd = w->data;
    char *dd = dst->data;
    if (m == 1) {
        float *y = (float *)dd; // (n)
        int64_t r = r0;
        // 4 rows at a time where the type has it (the column's loads shared; it asks for the next 4 rows itself)
        for (; kn->dot4 && !xc->residual && r + 4 <= r1; r += 4) kn->dot4(k, &y[r], wd + r * (int64_t)bw, bw, xc->base);
        // else the row two ahead is asked for while this one is dotted: a decoded token reads each weight once
        // from memory, and the hardware's prefetchers alone left most of the bandwidth unused: a 7B Q4_0 file on 8
        // of a 16-core server's threads 11.5 -> 14.2 tokens/s; on a 2-core Xeon a 3 MB Q5_0 matrix 5.6 -> 17 GB/s
        for (; r < r1; r++) {
            if (r + GEMV_PREFETCH_ROWS < r1) ggml_cpu_prefetch(wd + (r + GEMV_PREFETCH_ROWS) * (int64_t)bw, bw);
            dot_row(kn->dot, xc, k, &y[r], wd + r * (int64_t)bw, xc->base);
        }
        return;
    }
    const int64_t ss = (int64_t)(dst->nb[1] / sizeof(float)); // floats between output columns
    // columns done by tiles: all of them from 4 on, the last tile overlapping the one before it where 4 does not
    // divide m (a column's tile arithmetic does not depend on its neighbours, so its outputs are written again
    // unchanged). A token's result then does not depend on where its batch starts: leftover columns through
    // vec_dot had made a prompt evaluated after a cached prefix answer otherwise than the same prompt in one batch.
    const int64_t mt = kn->tile ? m : 0;
    for (int64_t t0 = r0; t0 < r1; t0 += MUL_MAT_ROW_TILE) {
        const int64_t t1 = t0 + MUL_MAT_ROW_TILE < r1 ? t0 + MUL_MAT_ROW_TILE : r1;
        const int64_t tt = kn->tile ? t1 - (t1 - t0) % GGML_GEMM_TILE_ROWS : t0; // rows done by tiles
        const char *tile_w = wd + t0 * (int64_t)bw; // the tile's rows as the tiles read them
        if (rewritten && tt > t0) {
            kn->rewrite(tile_w, bw, tt - t0, k, rewritten);
            tile_w = rewritten;
        }
        for (int64_t j0 = 0; j0 < mt; j0 += GGML_GEMM_TILE_COLS) {
            const int64_t j = j0 + GGML_GEMM_TILE_COLS <= m ? j0 : m - GGML_GEMM_TILE_COLS;
            const char *xj = xc->base + (size_t)j * xc->stride;
            float *yj = (float *)(dd + j * (int64_t)dst->nb[1]); // (n) column j of the output
            for (int64_t r = t0; r < tt; r += GGML_GEMM_TILE_ROWS)
                gemm_tile(kn->tile, xc, k, &yj[r], ss, tile_w + (r - t0) * (int64_t)bt, bt, xj);
        }
        for (int64_t j = 0; j < m; j++) {
            const char *xj = xc->base + (size_t)j * xc->stride;
            float *yj = (float *)(dd + j * (int64_t)dst->nb[1]); // (n) column j of the output
            for (int64_t r = j < mt ? tt : t0; r < t1; r++) dot_row(kn->dot, xc, k, &yj[r], wd + r * (int64_t)bw, xj);
        }
    }
}

// x's columns as 16-bit activations into wdata (this thread's share of the blocks; the caller syncs)
static void xcols_q16(const struct ggml_compute_params *p, const struct ggml_tensor *w, const struct ggml_tensor *x,
                      struct ggml_cpu_xcols *xc) {
    const struct ggml_type_traits *tw = ggml_get_type_traits(w->type);
    xc->base = p->wdata;
    xc->stride = ggml_q16_row_bytes(tw, x->ne[0]);
    xc->residual = NULL;
    xcols_convert(p, x, tw->quantize_q16, tw->blck_size, ggml_q16_row_bytes(tw, tw->blck_size), xc->stride);
}

// the converted columns' bytes: a precise mul_mat's are either kind (the kernels' choice depends on the SIMD in
// use, which tests switch between planning and computing)
static size_t xcols_bytes(const struct ggml_tensor *dst) {
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    const size_t plain = ggml_cpu_xcols_wsize(w, x);
    if (!precise(dst)) return plain;
    const size_t row16 = ggml_q16_row_bytes(ggml_get_type_traits(w->type), x->ne[0]);
    const size_t q16 = ggml_cpu_align_up((size_t)ggml_nrows(x) * row16);
    return q16 > 2 * plain ? q16 : 2 * plain;
}

// ---------------------------------------------------------------------------------------------------
// prompts as int8 tile GEMMs over the weights' levels (levels.h; AMX)
// ---------------------------------------------------------------------------------------------------

// the levels form of this mul_mat's weights when it can run as a tile GEMM: 4+ columns (where the 4 x 4 tiles
// would start, so a token's result does not depend on its batch's size past that); a precise one where the type
// has 16-bit activations (they run as two planes of bytes)
static const struct levels_traits *levels_for(const struct ggml_tensor *dst) {
    const struct ggml_type_traits *tw = ggml_get_type_traits(dst->src[0]->type);
    const struct levels_traits *lt = levels_traits_for(dst->src[0]->type);
    return lt && (!precise(dst) || tw->quantize_q16) && dst->src[1]->ne[1] >= GGML_GEMM_TILE_COLS &&
                   levels_x_type_ok(tw->vec_dot_type)
               ? lt
               : NULL;
}

static size_t levels_groups_bytes(const struct ggml_tensor *dst, const struct levels_traits *lt) {
    const int64_t groups = (dst->ne[1] + LEVELS_COLS - 1) / LEVELS_COLS;
    return ggml_cpu_align_up((size_t)groups * levels_x_group_bytes(dst->src[0]->ne[0], lt->offset, precise(dst)));
}

// after phase 1 (x's columns in the weight type's vec_dot_type, or a precise mul_mat's in their 16-bit form): the
// threads repack x's columns in groups of 16, barrier, then take panels of 16 weight rows, each unpacked once to
// levels in this thread's scratch and multiplied by every group (the kernel writes a 16 x 16 block; rows and columns
// past the matrix are dropped), or, for a few columns, read straight from their blocks by the direct kernel
static void mul_mat_levels(const struct ggml_compute_params *p, struct ggml_tensor *dst,
                           const struct levels_traits *lt, levels_gemm_fn gemm, const struct ggml_cpu_xcols *xc) {
    const struct ggml_tensor *w = dst->src[0];
    const int64_t k = w->ne[0], n = w->ne[1], m = dst->ne[1];
    const enum ggml_type x_type = ggml_get_type_traits(w->type)->vec_dot_type;
    const bool wide = precise(dst);
    const size_t group_bytes = levels_x_group_bytes(k, lt->offset, wide);
    char *groups = (char *)p->wdata + xcols_bytes(dst);
    int64_t g0, g1;
    ggml_thread_range((m + LEVELS_COLS - 1) / LEVELS_COLS, p->ith, p->nth, &g0, &g1);
    for (int64_t g = g0; g < g1; g++)
        levels_x_pack(x_type, wide, xc->base, xc->stride, m, k, lt->offset, g, groups + g * group_bytes);
    ggml_barrier(p->tp);
    void *panel_buf = groups + levels_groups_bytes(dst, lt) + (size_t)p->ith * levels_panel_bytes(lt, k);
    int64_t t0, t1;
    ggml_thread_range((n + LEVELS_ROWS - 1) / LEVELS_ROWS, p->ith, p->nth, &t0, &t1);
    const levels_direct_fn direct = levels_direct_for(gemm, w->type, m, wide);
    if (direct) { // a few columns: the rows straight from their blocks, no panel (the same bits)
        for (int64_t t = t0; t < t1; t++) {
            const int64_t r0 = t * LEVELS_ROWS, rows = n - r0 < LEVELS_ROWS ? n - r0 : LEVELS_ROWS;
            for (int64_t g = 0; g * LEVELS_COLS < m; g++) {
                const int cols = m - g * LEVELS_COLS < LEVELS_COLS ? (int)(m - g * LEVELS_COLS) : LEVELS_COLS;
                direct((const char *)w->data + r0 * (int64_t)w->nb[1], w->nb[1], rows, k, groups + g * group_bytes,
                       wide, cols, (float *)((char *)dst->data + g * LEVELS_COLS * (int64_t)dst->nb[1]) + r0,
                       dst->nb[1] / sizeof(float));
            }
        }
        return;
    }
    float out[LEVELS_ROWS * LEVELS_COLS]; // (row, column)
    for (int64_t t = t0; t < t1; t++) {
        const int64_t r0 = t * LEVELS_ROWS, rows = n - r0 < LEVELS_ROWS ? n - r0 : LEVELS_ROWS;
        struct levels_panel panel;
        levels_panel_fill(lt, (const char *)w->data + r0 * (int64_t)w->nb[1], w->nb[1], rows, k, panel_buf, &panel);
        for (int64_t g = 0; g * LEVELS_COLS < m; g++) {
            gemm(&panel, groups + g * group_bytes, wide, out);
            for (int64_t c = 0; c < LEVELS_COLS && g * LEVELS_COLS + c < m; c++) {
                float *y = (float *)((char *)dst->data + (g * LEVELS_COLS + c) * (int64_t)dst->nb[1]) + r0; // (n)
                for (int64_t r = 0; r < rows; r++) y[r] = out[r * LEVELS_COLS + c];
            }
        }
    }
    levels_gemm_done(gemm);
}

size_t ggml_cpu_mul_mat_wsize(const struct ggml_tensor *dst, int n_threads) {
    const struct levels_traits *lt = levels_for(dst);
    // the levels path's bytes whether or not it will run: tests switch it between planning and computing
    const size_t levels = lt ? levels_groups_bytes(dst, lt) +
                                   (size_t)n_threads * levels_panel_bytes(lt, dst->src[0]->ne[0])
                             : 0;
    return xcols_bytes(dst) + (size_t)n_threads * rewritten_tile_bytes(dst) + levels;
}

int ggml_cpu_op_mul_mat(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    if (ggml_nrows(w) != w->ne[1] || ggml_nrows(x) != x->ne[1])
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "mul_mat takes matrices");
    const struct mul_mat_kernels kn = mul_mat_kernels_for(dst);
    const struct levels_traits *lt = levels_for(dst);
    const levels_gemm_fn levels_gemm = lt ? levels_gemm_current() : NULL;
    const bool q16 = kn.q16 || (levels_gemm && precise(dst)); // x in 16-bit form
    struct ggml_cpu_xcols xc;
    int st = q16 ? xcols_check(w, x) : ggml_cpu_xcols_prepare(p, w, x, &xc);
    if (st) return st;
    if (q16) xcols_q16(p, w, x, &xc);
    else if (precise(dst) && !xcols_in_place(w)) xcols_residual(p, w, x, &xc);
    ggml_barrier(p->tp);
    if (levels_gemm) {
        mul_mat_levels(p, dst, lt, levels_gemm, &xc);
        return GGML_STATUS_OK;
    }
    if (x->ne[1] == 1 && ggml_nbytes(w) >= GEMV_CHUNKED_BYTES) {
        // a large GEMV is one long pass over the weights: threads take chunks of rows as they come free, so
        // a thread the (shared, noisy) machine slows down holds the others up by one chunk, not by half the
        // matrix. Small ones keep fixed halves: there the atomic's round trips cost more than they save.
        const int64_t rows = (GEMV_CHUNK_BYTES + (int64_t)w->nb[1] - 1) / (int64_t)w->nb[1];
        int64_t r0, r1;
        while (ggml_next_chunk(p->chunk_next, w->ne[1], rows, &r0, &r1))
            mul_mat_rows_dense(w, &xc, dst, &kn, r0, r1, NULL);
        return GGML_STATUS_OK;
    }
    // threads take whole row tiles when there are several columns, so no thread is left a ragged edge
    const int64_t unit = x->ne[1] > 1 ? GGML_GEMM_TILE_ROWS : 1;
    int64_t r0, r1;
    ggml_thread_range((w->ne[1] + unit - 1) / unit, p->ith, p->nth, &r0, &r1);
    r1 = r1 * unit < w->ne[1] ? r1 * unit : w->ne[1];
    void *rewritten = kn.rewrite ? (char *)p->wdata + xcols_bytes(dst) + (size_t)p->ith * rewritten_tile_bytes(dst) : NULL;
    mul_mat_rows_dense(w, &xc, dst, &kn, r0 * unit, r1, rewritten);
    return GGML_STATUS_OK;
}
