// ggml-impl.h: the tensor struct, the per-type traits table and the error helpers shared by all of ggml/.
#pragma once
#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GGML_MAX_NAME 64
// op_params slot of a matmul's (mul_mat, axpy_rows) GEMM scratch in bytes (ggml_set_gemm_scratch; 0: the default)
#define GGML_GEMM_SCRATCH_PARAM 7

struct ggml_tensor {
    enum ggml_type type;
    enum ggml_op op;
    enum ggml_backend backend;  // where data lives (leaves) or where the node runs (ops)
    int64_t ne[GGML_MAX_DIMS];  // elements per dimension, ne[0] innermost
    size_t nb[GGML_MAX_DIMS];   // byte strides: nb[0] = type size, nb[1] = row bytes, ...
    int32_t op_params[GGML_MAX_OP_PARAMS]; // op arguments (ints, or floats stored bitwise)
    struct ggml_tensor *src[GGML_MAX_SRC];
    struct ggml_tensor *view_src;          // owner of the data for views
    size_t view_offs;
    void *data;                            // on the tensor's backend
    struct ggml_context *owner;
    bool is_output;                        // kept alive to the end of the graph
    char name[GGML_MAX_NAME];
};

// per-type conversion and dot-product kernels; NULL where a type has none
typedef void (*ggml_to_float_fn)(const void *src, float *dst, int64_t n);
typedef void (*ggml_from_float_fn)(const float *src, void *dst, int64_t n);
typedef void (*ggml_vec_dot_fn)(int64_t n, float *s, const void *w, const void *x);
// y[0..n) += a * row, row of `type` (used by axpy_rows)
typedef void (*ggml_axpy_fn)(int64_t n, float *y, float a, const void *row);
// y[0..n) += a[r] * rows[r] over a group of rows, y loaded and stored once (axpy_rows' groups: axpy4's 4 rows
// in turn, axpy8_rounded's 8 with their coefficients rounded to 8 bits per block of y)
typedef void (*ggml_axpy_group_fn)(int64_t n, float *y, const float *a, const void *const *rows);
// a GGML_GEMM_TILE_ROWS x GGML_GEMM_TILE_COLS tile of w . x: s[j * ss + r] = w[r] . x[j], rows of w
// bw bytes apart, columns of x (already in vec_dot_type) bx bytes apart, ss floats between output columns
typedef void (*ggml_gemm_tile_fn)(int64_t n, float *s, int64_t ss, const void *w, size_t bw, const void *x, size_t bx);
// rows of w (bw bytes apart, k values each) rewritten into the layout a tile reads, rows after one another in out
typedef void (*ggml_rows_rewrite_fn)(const void *w, size_t bw, int64_t rows, int64_t k, void *out);
// a decoded token's dots of 4 consecutive weight rows (bw bytes apart) with one column: s[r] = w[r] . x, each
// bit for bit what vec_dot gives it (the column's loads are shared, not the rows' arithmetic)
typedef void (*ggml_vec_dot4_fn)(int64_t n, float *s, const void *w, size_t bw, const void *x);
#define GGML_GEMM_TILE_ROWS 4
#define GGML_GEMM_TILE_COLS 4

struct ggml_type_traits {
    const char *name;
    int64_t blck_size;
    size_t type_size;
    bool is_quantized;
    ggml_to_float_fn to_float;
    ggml_from_float_fn from_float;       // the reference quantizer (bit-exact with gguf.quants)
    ggml_from_float_fn quantize_act;     // activations for vec_dot: equals from_float on finite input
    ggml_vec_dot_fn vec_dot;             // fastest available on this CPU (set at init)
    ggml_vec_dot_fn vec_dot_ref;         // scalar oracle
    ggml_vec_dot4_fn vec_dot4;           // SIMD only, NULL where absent; its oracle: vec_dot, bit for bit
    ggml_axpy_fn axpy;
    ggml_axpy_fn axpy_ref;
    ggml_axpy_group_fn axpy4;            // SIMD only, NULL where absent; its oracle: 4 axpy_ref calls
    ggml_axpy_group_fn axpy8_rounded;    // 8 rows on the integer units (axpy_rows unless precise); SIMD only,
                                         // NULL where absent; its oracle: float64 within the rounding's bound
    ggml_gemm_tile_fn gemm_tile;         // register-tiled m > 1 kernel, SIMD only (its oracle: vec_dot_ref);
                                         // NULL: mul_mat loops over vec_dot
    enum ggml_type vec_dot_type;         // activations are converted to this before vec_dot
    // precise mul_mat over 16-bit activations (block_q16, or block_q16_K for the K-quants): NULL where the type
    // has none (a precise mul_mat then dots x's 8-bit rounding and, again, what that rounding lost)
    ggml_from_float_fn quantize_q16;
    ggml_vec_dot_fn vec_dot_q16;
    ggml_vec_dot_fn vec_dot_q16_ref;     // scalar oracle
    ggml_gemm_tile_fn gemm_tile_q16;     // SIMD only, NULL where absent
    // a prompt's tile over rows that rewrite_rows has rewritten once per row tile, blocks of rewritten_block_size
    // bytes (Q6_K's levels as bytes on AVX2, where a tile over the packed rows ran at half vec_dot's rate); SIMD
    // only, NULL where absent; its oracle: vec_dot_ref
    ggml_gemm_tile_fn gemm_tile_rewritten;
    ggml_rows_rewrite_fn rewrite_rows;
    size_t rewritten_block_size;
};

const struct ggml_type_traits *ggml_get_type_traits(enum ggml_type type);
// fills the traits table; picks SIMD kernels when the CPU has them (idempotent)
void ggml_quants_init(void);
bool ggml_quants_simd_in_use(void); // false while ggml_cpu_set_simd(false) holds
bool ggml_quants_avx512_allowed(void); // false while ggml_cpu_set_simd(false) or ggml_cpu_set_avx512(false) holds
// SIMD kernels (defined in *_avx2.c; installed by ggml_quants_init when the CPU supports them)
// (avx512: also the AVX512 kernels where the CPU has them; false gives the AVX2 table ggml_cpu_set_avx512 offers)
void ggml_quants_install_avx2(struct ggml_type_traits *traits, bool avx512);
void ggml_quants_install_axpy_avx2(struct ggml_type_traits *traits); // quants_axpy_avx2.c
void ggml_quants_install_axpy_rounded_avx2(struct ggml_type_traits *traits, bool avx512); // quants_axpy_rounded_avx2.c
void ggml_quants_install_q16(struct ggml_type_traits *traits);      // quants_q16.c: the scalar kernels
void ggml_quants_install_q16_avx2(struct ggml_type_traits *traits); // quants_q16_avx2.c
// bytes of n values of 16-bit activations for weights of this type (0 where it has no vec_dot_q16)
size_t ggml_q16_row_bytes(const struct ggml_type_traits *tw, int64_t n);

// a device allocation owned by a context (freed with it)
int ggml_context_add_device_buffer(struct ggml_context *ctx, void *ptr);

// errors
int ggml_set_error(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static inline float ggml_op_param_f32(const struct ggml_tensor *t, int i) {
    float f;
    __builtin_memcpy(&f, &t->op_params[i], sizeof f);
    return f;
}
static inline void ggml_set_op_param_f32(struct ggml_tensor *t, int i, float f) {
    __builtin_memcpy(&t->op_params[i], &f, sizeof f);
}

#ifdef __cplusplus
}
#endif
