// ops_kernels.h: the CPU kernel of each op (dispatched by ops.c) and the helpers the op files share.
// Every kernel runs in every thread; checks of run-time values (ids, positions) are done identically
// by all threads before the first barrier, so all of them return the same status and none deadlocks.
// Rows are contiguous in every tensor (ggml_view sets only the outer strides nb[1..3]), so kernels index
// within a row directly and reach rows through nb[1..3].
#pragma once
#include "ops.h"

#include <math.h>

#define GGML_CPU_ALIGN 64

static inline size_t ggml_cpu_align_up(size_t n) { return (n + GGML_CPU_ALIGN - 1) / GGML_CPU_ALIGN * GGML_CPU_ALIGN; }

// row r (counted over ne[1..3]) of t
static inline char *ggml_cpu_row_ptr(const struct ggml_tensor *t, int64_t r) {
    int64_t i1 = r % t->ne[1];
    int64_t i2 = (r / t->ne[1]) % t->ne[2];
    int64_t i3 = r / (t->ne[1] * t->ne[2]);
    return (char *)t->data + i1 * (int64_t)t->nb[1] + i2 * (int64_t)t->nb[2] + i3 * (int64_t)t->nb[3];
}

// each cache line of [p, p + bytes) into L2 only (prefetcht2), for a weight row a kernel reads soon: a row is tens
// of lines, and L1 prefetches of them filled the L1 miss buffers that the demand loads of the current row need
// (SYNTHETIC 7B Q4_0, 2 cores, cold caches: sparse gate + up rows at 10 % took 0.63-0.77 ms a layer with L1
// prefetches, 0.37-0.48 ms with these)
static inline void ggml_cpu_prefetch(const char *p, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 1);
}

// per-thread scratch slice ith of slices of `bytes` each
static inline void *ggml_cpu_thread_scratch(const struct ggml_compute_params *p, size_t bytes) {
    return (char *)p->wdata + (size_t)p->ith * ggml_cpu_align_up(bytes);
}

static inline float ggml_silu_f32(float x) { return x / (1.0f + expf(-x)); }

static inline float ggml_gelu_erf_f32(float x) {
    return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f)); // x * Phi(x)
}

#define GGML_GELU_C 0.7978845608028654f // sqrt(2 / pi)

// tanh approximation, as llama.cpp
static inline float ggml_gelu_f32(float x) {
    return 0.5f * x * (1.0f + tanhf(GGML_GELU_C * (x + 0.044715f * x * x * x)));
}

// --- ops_elementwise.c ---
int ggml_cpu_op_cpy(const struct ggml_compute_params *p, struct ggml_tensor *dst);
size_t ggml_cpu_cpy_wsize(const struct ggml_tensor *dst, int n_threads);
int ggml_cpu_op_get_rows(const struct ggml_compute_params *p, struct ggml_tensor *dst);
int ggml_cpu_op_binary(const struct ggml_compute_params *p, struct ggml_tensor *dst);
int ggml_cpu_op_unary(const struct ggml_compute_params *p, struct ggml_tensor *dst);

// --- ops_norm.c ---
int ggml_cpu_op_norm(const struct ggml_compute_params *p, struct ggml_tensor *dst);

// --- ops_matmul.c ---
// the activations x [k, m] as the columns a weight type's vec_dot takes
struct ggml_cpu_xcols {
    const char *base; // column 0
    size_t stride;    // bytes from one column to the next
    const char *residual; // precise mul_mat: what converting x lost, converted the same way (else NULL)
};
size_t ggml_cpu_xcols_wsize(const struct ggml_tensor *w, const struct ggml_tensor *x);
// converts this thread's share of x into wdata (no barrier: the caller syncs before use)
int ggml_cpu_xcols_prepare(const struct ggml_compute_params *p, const struct ggml_tensor *w,
                           const struct ggml_tensor *x, struct ggml_cpu_xcols *xc);
int ggml_cpu_op_mul_mat(const struct ggml_compute_params *p, struct ggml_tensor *dst);
size_t ggml_cpu_mul_mat_wsize(const struct ggml_tensor *dst, int n_threads);

// --- ops_attention.c ---
int ggml_cpu_op_rope(const struct ggml_compute_params *p, struct ggml_tensor *dst);
size_t ggml_cpu_rope_wsize(const struct ggml_tensor *dst, int n_threads);
int ggml_cpu_op_soft_max(const struct ggml_compute_params *p, struct ggml_tensor *dst);
int ggml_cpu_op_kv_store(const struct ggml_compute_params *p, struct ggml_tensor *dst);
int ggml_cpu_op_attention(const struct ggml_compute_params *p, struct ggml_tensor *dst);
size_t ggml_cpu_attention_wsize(const struct ggml_tensor *dst, int n_threads);

// --- ops_recurrent.c ---
int ggml_cpu_op_ssm_conv(const struct ggml_compute_params *p, struct ggml_tensor *dst);
int ggml_cpu_op_delta_net(const struct ggml_compute_params *p, struct ggml_tensor *dst);
size_t ggml_cpu_delta_net_wsize(const struct ggml_tensor *dst, int n_threads);

// --- ops_sparse.c ---
int ggml_cpu_op_mul_mat_rows(const struct ggml_compute_params *p, struct ggml_tensor *dst);
size_t ggml_cpu_mul_mat_rows_wsize(const struct ggml_tensor *dst, int n_threads);
int ggml_cpu_op_axpy_rows(const struct ggml_compute_params *p, struct ggml_tensor *dst);
size_t ggml_cpu_axpy_rows_wsize(const struct ggml_tensor *dst, int n_threads);
int ggml_cpu_op_sparse_ffn(const struct ggml_compute_params *p, struct ggml_tensor *dst);
size_t ggml_cpu_sparse_ffn_wsize(const struct ggml_tensor *dst, int n_threads);

// --- ops_moe.c ---
int ggml_cpu_op_top_k(const struct ggml_compute_params *p, struct ggml_tensor *dst);
int ggml_cpu_op_moe_ffn(const struct ggml_compute_params *p, struct ggml_tensor *dst);
size_t ggml_cpu_moe_ffn_wsize(const struct ggml_tensor *dst, int n_threads);
