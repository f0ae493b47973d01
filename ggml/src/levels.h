// levels.h: weight rows as int8 levels times a float scale (plus an offset) per group of 16 or 32 values, and
// activation columns repacked beside them: the operands of the int8 tile GEMM a prompt's mul_mat runs on AMX
// (quants_amx.c), whose scalar oracle is levels_gemm_ref (quants_levels.c).
#pragma once
#include "ggml-impl.h"

#define LEVELS_ROWS 16   // weight rows of a panel: an AMX tile's 16 rows
#define LEVELS_COLS 16   // activation columns of a group: an AMX tile's 16 int32 columns
#define LEVELS_XBLOCK 32 // activation values under one scale
// bytes of one activation block of a group: 8 rows of 64, row i holding column c's values 4i .. 4i + 3 at 4c
#define LEVELS_XBLOCK_BYTES (LEVELS_XBLOCK * LEVELS_COLS)

// one weight row of k values: levels[j] for each value, scale[g * gs] and (types with an offset) offset[g * gs]
// for each group g, so that value j = scale[g] * levels[j] + offset[g] exactly as the type's to_float computes it
typedef void (*levels_row_fn)(const void *row, int64_t k, int8_t *levels, float *scale, float *offset, int64_t gs);

struct levels_traits {
    int group;     // values under one scale: 16 or 32
    bool offset;   // an offset per group (the activations then carry their block sums)
    levels_row_fn row;
    levels_row_fn row_avx2; // the same bytes and scales with AVX2 (quants_avx2.c), taken while SIMD is in use; or NULL
};
// NULL where the type has no levels form
const struct levels_traits *levels_traits_for(enum ggml_type type);
// quants_avx2.c's rows
void q4_0_levels_avx2(const void *row, int64_t k, int8_t *q, float *scale, float *offset, int64_t gs);
void q5_0_levels_avx2(const void *row, int64_t k, int8_t *q, float *scale, float *offset, int64_t gs);
void q4_K_levels_avx2(const void *row, int64_t k, int8_t *q, float *scale, float *offset, int64_t gs);
void q6_K_levels_avx2(const void *row, int64_t k, int8_t *q, float *scale, float *offset, int64_t gs);

// LEVELS_ROWS weight rows, group-major: group g's levels of row r at levels + (g * LEVELS_ROWS + r) * group, so
// that a tile's 16 rows are contiguous bytes; scale and offset (g, r) at [g * LEVELS_ROWS + r] (offset NULL
// without one); rows past the matrix's end are zero
struct levels_panel {
    const int8_t *levels; // (k / group, LEVELS_ROWS, group)
    const float *scale;   // (k / group, LEVELS_ROWS)
    const float *offset;  // (k / group, LEVELS_ROWS) or NULL
    int64_t k;
    int group;
};
size_t levels_panel_bytes(const struct levels_traits *lt, int64_t k);
// rows [0, rows) of w (bw bytes apart) into buf (levels_panel_bytes, 64-byte aligned)
void levels_panel_fill(const struct levels_traits *lt, const char *w, size_t bw, int64_t rows, int64_t k, void *buf,
                       struct levels_panel *p);

// a group of LEVELS_COLS activation columns: per 32-value block b, LEVELS_XBLOCK_BYTES of values (as above), or
// for 16-bit activations (wide: a precise mul_mat's q = 255 hi + lo) the high bytes' LEVELS_XBLOCK_BYTES then the
// low bytes'; after all blocks d[b][c] (floats), then with sums s[b][c] = d * the sum of the block's values;
// columns past m are zero
size_t levels_x_group_bytes(int64_t k, bool sums, bool wide);
// group `group` of the m columns (stride bytes apart) into dst. The columns are already quantized to x_type (Q8_0,
// Q8_1 or Q8_K, the weight type's vec_dot_type) or, wide, to its 16-bit form (block_q16; block_q16_K where x_type
// is Q8_K)
bool levels_x_type_ok(enum ggml_type x_type);
void levels_x_pack(enum ggml_type x_type, bool wide, const char *cols, size_t stride, int64_t m, int64_t k, bool sums,
                   int64_t group, char *dst);

// out[r * LEVELS_COLS + c] = weight row r . column c of the group (sums: the group's sums, present when w has
// offsets). Per group g of w, in order: the int32 dot of the levels (wide: 255 times the high bytes' dot plus the
// low bytes', the exact dot of the 16-bit values), times (d of x's block * scale[g][r]), fused into the sum; then
// offset[g][r] * s of x's block, fused. The AMX kernel computes this bit for bit.
typedef void (*levels_gemm_fn)(const struct levels_panel *w, const char *xgroup, bool wide, float *out);
void levels_gemm_ref(const struct levels_panel *w, const char *xgroup, bool wide, float *out);

// quants_levels_vnni.c: rows [0, rows) (at most LEVELS_ROWS, bw bytes apart, straight from the weight type's blocks)
// times columns [0, ncols) of a group (levels_x_pack's) into y[c * y_stride + r]: levels_gemm_ref's arithmetic in
// its order, so the same bits as the tile GEMM, for the few columns a panel's unpacking would not repay
typedef void (*levels_direct_fn)(const char *w, size_t bw, int64_t rows, int64_t k, const char *xgroup, bool wide,
                                 int ncols, float *y, size_t y_stride);
// the direct kernel for `cols` columns of `type` where the tile kernel `gemm` would run, or NULL: the panels (too many
// columns, no kernel for the type or the CPU, or the oracle asked for)
levels_direct_fn levels_direct_for(levels_gemm_fn gemm, enum ggml_type type, int64_t cols, bool wide);

// quants_amx.c: which kernel a prompt's mul_mat takes (ggml_cpu_set_levels_gemm, set between computes): the AMX
// kernel, the oracle, or NULL for the 4 x 4 tiles; and, after the AMX kernel ran on a thread, the tiles' state
// handed back (else every context switch saves and restores its 8 KB)
levels_gemm_fn levels_gemm_current(void);
void levels_gemm_done(levels_gemm_fn gemm);
