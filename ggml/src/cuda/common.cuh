// common.cuh: what every CUDA op file shares: error helpers, the tensor view passed to kernels, warp
// reductions, F16/BF16 loads and the per-type dequantization of one value or of 32 consecutive values.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../ggml-impl.h"
#include "cuda.h"
#include "../quants.h"

#define CUDA_BLOCK 256 // threads per block of the row kernels

// turns a CUDA error into a ggml status (with its message); `what` names the failing step
static inline int cuda_status(cudaError_t err, const char *what) {
    if (err == cudaSuccess) return GGML_STATUS_OK;
    return ggml_set_error(GGML_STATUS_BACKEND_ERROR, "CUDA %s: %s", what, cudaGetErrorString(err));
}

// after a launch: configuration errors show up here (asynchronous faults at the next sync)
static inline int cuda_launch_status(const char *what) { return cuda_status(cudaGetLastError(), what); }

// scratch parts start on 256-byte boundaries (what cudaMalloc gives the whole)
static inline size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// a tensor as the kernels see it: data on the device, shape and byte strides
struct cuda_view {
    char *data;
    int64_t ne[4];
    int64_t nb[4];
};

static inline cuda_view cuda_view_of(const struct ggml_tensor *t) {
    cuda_view v;
    v.data = (char *)t->data;
    for (int i = 0; i < 4; i++) {
        v.ne[i] = t->ne[i];
        v.nb[i] = (int64_t)t->nb[i];
    }
    return v;
}

// row r (counted over ne[1..3]) of v
static __device__ __forceinline__ char *cuda_row(const cuda_view &v, int64_t r) {
    const int64_t i1 = r % v.ne[1], i2 = (r / v.ne[1]) % v.ne[2], i3 = r / (v.ne[1] * v.ne[2]);
    return v.data + i1 * v.nb[1] + i2 * v.nb[2] + i3 * v.nb[3];
}

static __device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// sum over all threads of a block of CUDA_BLOCK; every thread gets the result (sh: 32 floats)
static __device__ __forceinline__ float block_sum(float v, float *sh) {
    v = warp_sum(v);
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    __syncthreads(); // sh may still be read by a previous call
    if (l == 0) sh[w] = v;
    __syncthreads();
    v = l < (int)(blockDim.x / 32) ? sh[l] : 0.0f;
    return warp_sum(v);
}

static __device__ __forceinline__ float block_max(float v, float *sh) {
    v = warp_max(v);
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    v = l < (int)(blockDim.x / 32) ? sh[l] : -INFINITY;
    return warp_max(v);
}

// the activation functions of unary ops and of fused GLUs (the CPU backend's formulas)
static __device__ __forceinline__ float cuda_act(int op, float x) {
    if (op == GGML_OP_SILU) return x / (1.0f + expf(-x));
    if (op == GGML_OP_GELU) return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    if (op == GGML_OP_GELU_ERF) return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
    if (op == GGML_OP_TANH) return tanhf(x);
    if (op == GGML_OP_ABS) return fabsf(x);
    if (op == GGML_OP_SIGMOID) return 1.0f / (1.0f + expf(-x));
    if (op == GGML_OP_SOFTPLUS) return x > 20.0f ? x : log1pf(expf(x)); // torch's threshold
    if (op == GGML_OP_STEP) return x > 0.0f ? 1.0f : 0.0f;
    return x < 0.0f ? 0.0f : x; // RELU; NaN stays NaN
}

static __device__ __forceinline__ float f16_at(const void *p) { return __half2float(*(const __half *)p); }
static __device__ __forceinline__ float h2f(uint32_t h) { return __half2float(__ushort_as_half((unsigned short)h)); }
static __device__ __forceinline__ float bf2f(uint32_t h) { return __uint_as_float(h << 16); }
static __device__ __forceinline__ uint16_t u16_at(const uint8_t *p) { return *(const uint16_t *)p; }

// MXFP4: the levels (ggml_mxfp4_kvalues) of four 4-bit indices, one in each byte of q, as four int8 (dp4a's
// operand): each magnitude picked by bits 0..2 from the eight packed in two words, negated where bit 3 is set
static __device__ __forceinline__ int mxfp4_levels4(uint32_t q) {
    const uint32_t m = q & 0x07070707;
    const uint32_t sel = (m & 0x7) | ((m >> 4) & 0x70) | ((m >> 8) & 0x700) | ((m >> 12) & 0x7000); // nibble k: byte k
    const uint32_t mag = __byte_perm(0x03020100u, 0x0C080604u, sel); // bytes 0..7 of the pair: 0 1 2 3 4 6 8 12
    const uint32_t neg = ((q >> 3) & 0x01010101) * 0xFF;           // 0xFF in the bytes whose bit 3 is set
    return (int)((mag & ~neg) | (__vneg4(mag) & neg));
}

// value i of a row of `type` (any type with a dequantization; F32, F16, BF16, the quants)
static __device__ float cuda_dequant1(int type, const uint8_t *row, int64_t i) {
    switch (type) {
    case GGML_TYPE_F32: return ((const float *)row)[i];
    case GGML_TYPE_F16: return h2f(((const uint16_t *)row)[i]);
    case GGML_TYPE_BF16: return bf2f(((const uint16_t *)row)[i]);
    case GGML_TYPE_Q4_0: {
        const uint8_t *b = row + (i / 32) * 18;
        const int j = (int)(i % 32);
        const int q = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
        return h2f(u16_at(b)) * (float)(q - 8);
    }
    case GGML_TYPE_Q4_1: {
        const uint8_t *b = row + (i / 32) * 20;
        const int j = (int)(i % 32);
        const int q = j < 16 ? (b[4 + j] & 15) : (b[4 + j - 16] >> 4);
        return h2f(u16_at(b)) * (float)q + h2f(u16_at(b + 2));
    }
    case GGML_TYPE_Q5_0: {
        const uint8_t *b = row + (i / 32) * 22;
        const int j = (int)(i % 32);
        const int lo = j < 16 ? (b[6 + j] & 15) : (b[6 + j - 16] >> 4);
        const int hi = (b[2 + j / 8] >> (j % 8)) & 1;
        return h2f(u16_at(b)) * (float)((lo | hi << 4) - 16);
    }
    case GGML_TYPE_MXFP4: {
        const uint8_t *b = row + (i / 32) * 17;
        const int j = (int)(i % 32);
        const int q = j < 16 ? (b[1 + j] & 15) : (b[1 + j - 16] >> 4);
        return ggml_e8m0_to_fp32_half(b[0]) * (float)(int8_t)mxfp4_levels4((uint32_t)q);
    }
    case GGML_TYPE_Q8_0: {
        const uint8_t *b = row + (i / 32) * 34;
        return h2f(u16_at(b)) * (float)(int8_t)b[2 + i % 32];
    }
    case GGML_TYPE_Q8_1: {
        const uint8_t *b = row + (i / 32) * 36;
        return h2f(u16_at(b)) * (float)(int8_t)b[4 + i % 32];
    }
    case GGML_TYPE_Q4_K: {
        const uint8_t *b = row + (i / 256) * 144;
        const int j = (int)(i % 256), s = j / 32, l = j % 32;
        uint8_t sc, m;
        ggml_q4_K_get_scale_min(b + 4, s, &sc, &m);
        const uint8_t byte = b[16 + 32 * (s / 2) + l];
        const int q = (s & 1) ? byte >> 4 : byte & 15;
        return h2f(u16_at(b)) * (float)sc * (float)q - h2f(u16_at(b + 2)) * (float)m;
    }
    case GGML_TYPE_Q6_K: {
        const uint8_t *b = row + (i / 256) * 210;
        const int j = (int)(i % 256), h = j / 128, r = j % 128, quarter = r / 32, l = r % 32;
        const uint8_t qlb = b[64 * h + l + 32 * (quarter & 1)];
        const int lo = quarter < 2 ? qlb & 15 : qlb >> 4;
        const int hi = (b[128 + 32 * h + l] >> (2 * quarter)) & 3;
        return h2f(u16_at(b + 208)) * (float)(int8_t)b[192 + j / 16] * (float)((lo | hi << 4) - 32);
    }
    case GGML_TYPE_Q8_K: {
        const uint8_t *b = row + (i / 256) * 292;
        return *(const float *)b * (float)(int8_t)b[4 + i % 256];
    }
    default: return __int_as_float(0x7fc00000); // unreachable: the host checks types first
    }
}

static inline bool cuda_type_dequantizes(enum ggml_type t) {
    switch (t) {
    case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16: case GGML_TYPE_Q4_0: case GGML_TYPE_Q4_1:
    case GGML_TYPE_Q5_0: case GGML_TYPE_Q8_0: case GGML_TYPE_Q8_1: case GGML_TYPE_Q4_K: case GGML_TYPE_Q6_K:
    case GGML_TYPE_Q8_K: case GGML_TYPE_MXFP4: return true;
    default: return false;
    }
}

// weights the GEMVs read as floats (the others are quantized, met by Q8_1 activations)
static inline bool cuda_type_is_float(enum ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16;
}

// the weight types of mul_mat, mul_mat_rows and axpy_rows
static inline bool cuda_type_is_weight(enum ggml_type t) {
    return t != GGML_TYPE_Q8_1 && t != GGML_TYPE_Q8_K && cuda_type_dequantizes(t);
}

// launch.template run<TYPE>() for a weight type known at run time only (kernels take it as a template argument)
template <typename Launch> static void with_weight_type(enum ggml_type type, const Launch &launch) {
    switch (type) {
    case GGML_TYPE_F32: launch.template run<GGML_TYPE_F32>(); break;
    case GGML_TYPE_F16: launch.template run<GGML_TYPE_F16>(); break;
    case GGML_TYPE_BF16: launch.template run<GGML_TYPE_BF16>(); break;
    case GGML_TYPE_Q4_0: launch.template run<GGML_TYPE_Q4_0>(); break;
    case GGML_TYPE_Q4_1: launch.template run<GGML_TYPE_Q4_1>(); break;
    case GGML_TYPE_Q5_0: launch.template run<GGML_TYPE_Q5_0>(); break;
    case GGML_TYPE_Q8_0: launch.template run<GGML_TYPE_Q8_0>(); break;
    case GGML_TYPE_Q4_K: launch.template run<GGML_TYPE_Q4_K>(); break;
    case GGML_TYPE_MXFP4: launch.template run<GGML_TYPE_MXFP4>(); break;
    default: launch.template run<GGML_TYPE_Q6_K>(); break;
    }
}

// --- per-family entry points (forward.cu dispatches) ---
int cuda_op_cpy(struct ggml_tensor *dst, cudaStream_t st);
int cuda_op_get_rows(struct ggml_tensor *dst, cudaStream_t st);
int cuda_op_binary(struct ggml_tensor *dst, cudaStream_t st);
// dst = pre(a) + b or pre(a) * b (b: a's shape or one row broadcast); pre: CUDA_PRE_NONE or a unary op whose
// function is cuda_act's (GGML_OP_SILU, GGML_OP_ABS, ...): the fused unary -> add/mul (fusion.cu)
enum { CUDA_PRE_NONE = -1 };
int cuda_binary(const struct ggml_tensor *a, int pre, const struct ggml_tensor *b, struct ggml_tensor *dst, bool add,
                cudaStream_t st);
int cuda_op_unary(struct ggml_tensor *dst, cudaStream_t st);
int cuda_op_norm(struct ggml_tensor *dst, cudaStream_t st);
// the norm node's rows times the weight row w (F32, the row length) into dst: the norm -> mul fusion;
// with wdata, dst also goes there as Q8_1 for the GEMVs that read it
int cuda_norm_mul(const struct ggml_tensor *norm, const struct ggml_tensor *w, struct ggml_tensor *dst, void *wdata,
                  cudaStream_t st);
int cuda_op_rope(struct ggml_tensor *dst, cudaStream_t st);
// rope's rows written into the cache slots of the kv_store that reads them (the rope -> kv_store fusion)
int cuda_rope_store(const struct ggml_tensor *rope, struct ggml_tensor *store, cudaStream_t st);
// rope of q into its rows, rope of k and v as they are into their kv_stores' cache slots, one kernel (q, k and v
// views of one projection: the rope -> kv_store fusion for all three); q's and k's heads RMS-normed first where
// norm_q / norm_k (the rms_norm whose output, times a weight, the rope reads) is not NULL
int cuda_rope_qkv_store(const struct ggml_tensor *rope_q, const struct ggml_tensor *norm_q,
                        const struct ggml_tensor *rope_k, const struct ggml_tensor *norm_k,
                        const struct ggml_tensor *store_k, const struct ggml_tensor *store_v, cudaStream_t st);
// rms_norm of each head of the rope's input times the mul's weight between them, then the rope, into store's cache
// slots unless store is NULL
int cuda_norm_rope(const struct ggml_tensor *norm, const struct ggml_tensor *rope, struct ggml_tensor *store,
                   cudaStream_t st);
int cuda_op_soft_max(struct ggml_tensor *dst, cudaStream_t st);
int cuda_op_kv_store(struct ggml_tensor *dst, cudaStream_t st);
int cuda_op_attention(struct ggml_tensor *dst, void *wdata, cudaStream_t st);
size_t cuda_attention_wsize(const struct ggml_tensor *dst);
// a prompt batch over an F16 cache on tensor cores (attention_mma.cu), where its shape allows
bool cuda_attention_mma_takes(const struct ggml_tensor *dst);
int cuda_attention_mma(struct ggml_tensor *dst, cudaStream_t st);
int cuda_op_mul_mat(struct ggml_tensor *dst, void *wdata, cudaStream_t st);
size_t cuda_mul_mat_wsize(const struct ggml_tensor *dst);
size_t cuda_mul_mat_rows_wsize(const struct ggml_tensor *dst);
int cuda_op_axpy_rows(struct ggml_tensor *dst, void *wdata, cudaStream_t st);
size_t cuda_axpy_rows_wsize(const struct ggml_tensor *dst);
int cuda_op_top_k(struct ggml_tensor *dst, cudaStream_t st);
int cuda_op_moe_ffn(struct ggml_tensor *dst, void *wdata, cudaStream_t st);
// moe_ffn into y, plus add (a fused add's other operand, [d, m]) unless NULL; x already quantized in wdata if xq_ready
int cuda_moe_ffn(const struct ggml_tensor *dst, float *y, const float *add, bool xq_ready, void *wdata,
                 cudaStream_t st);
size_t cuda_moe_ffn_wsize(const struct ggml_tensor *dst);
int cuda_op_ssm_conv(struct ggml_tensor *dst, cudaStream_t st);
int cuda_op_delta_net(struct ggml_tensor *dst, cudaStream_t st);

// --- shared between gemv.cu, sparse.cu and gemm.cu ---
#define GEMV_MAX_COLS 8 // mul_mat with at most this many columns runs as a GEMV, beyond as a GEMM
enum cuda_sel_mode { CUDA_SEL_ALL = 0, CUDA_SEL_MASK = 1, CUDA_SEL_LIST = 2 };
struct cuda_rows_sel {
    int mode;             // cuda_sel_mode
    const char *sel;      // F32 mask [n_rows, m] or I32 list [n_sel, m]
    int64_t nb0, nb1;     // its byte strides
    int64_t n_sel;        // entries per list column
    int64_t begin, end;   // rows considered
};
// entry e of list column col
static __device__ __forceinline__ int32_t list_at(const cuda_rows_sel &s, int64_t e, int col) {
    return *(const int32_t *)(s.sel + e * s.nb0 + col * s.nb1);
}

// a list column's entries count only before its first negative one: that index if it lies below lim,
// else n_sel (block-wide; s_term is one shared int)
static __device__ __forceinline__ int list_end(const cuda_rows_sel &s, int64_t lim, int col, int *s_term) {
    if (threadIdx.x == 0) *s_term = (int)s.n_sel;
    __syncthreads();
    if (lim > s.n_sel) lim = s.n_sel;
    for (int64_t e = threadIdx.x; e < lim; e += blockDim.x)
        if (list_at(s, e, col) < 0) atomicMin(s_term, (int)e);
    __syncthreads();
    return *s_term;
}
// bytes of x [k, m] as Q8_1 (int8 values, then (d, d*sum) per 32) for a quantized weight type
size_t cuda_xq_wsize(enum ggml_type wtype, int64_t k, int64_t m);
// where x [k, m] as Q8_1 lies in the scratch: (m, k) int8 values, then (m, k / 32) (d, d * sum)
void cuda_xq_at(void *wdata, int64_t k, int64_t m, int8_t **xq, float2 **xds);
// x [k, m] (columns x_ld floats apart) to Q8_1 in wdata
int cuda_quantize_q8_1(const float *x, int64_t x_ld, int64_t k, int64_t m, void *wdata, cudaStream_t st);
// what a GEMV may do besides y = W x (fusions, ggml/src/cuda/fusion.cu); {} is the plain GEMV
struct cuda_gemv_extra {
    const struct ggml_tensor *up; // GLU: y = act(W x) * (up x), up shaped and typed like W (one column)
    int act;                      // GGML_OP_SILU, _GELU, _GELU_ERF or _RELU: of the GLU's gate, or (no up) of W x
    const float *add;             // y += add[row] (one column)
    bool xq_ready;                // wdata already holds x as Q8_1 (the previous GEMV quantized the same x)
    const struct ggml_tensor *store; // a kv_store of the rows as (heads, head size): they go into its cache slot
};
// y[n_rows, m] = W x over the rows `s` selects (zeros elsewhere); x converted into wdata as needed
int cuda_rows_dot(const struct ggml_tensor *w, const struct ggml_tensor *x, struct ggml_tensor *y,
                  const cuda_rows_sel &s, void *wdata, cudaStream_t st, const cuda_gemv_extra &e = {});
// whether cuda_rows_dot can run W x with a cuda_gemv_extra epilogue (one column, supported layout)
bool cuda_gemv_takes_extra(const struct ggml_tensor *w, const struct ggml_tensor *x);
// MUL_MAT_ROWS (of e, only xq_ready applies)
int cuda_op_mul_mat_rows(struct ggml_tensor *dst, void *wdata, cudaStream_t st, const cuda_gemv_extra &e = {});
// GEMM path of mul_mat (m > GEMV_MAX_COLS): tensor cores through cuBLAS, or our WMMA kernel; F32 weights as TF32
// unless precise (a mul_mat_precise: a mixture's router, whose rounded logits could choose other experts)
int cuda_gemm(const struct ggml_tensor *w, const struct ggml_tensor *x, struct ggml_tensor *y, void *wdata,
              cudaStream_t st, bool precise = false);
// node: the matmul whose GEMM scratch (op_params[GGML_GEMM_SCRATCH_PARAM]) bounds the dequantized rows
size_t cuda_gemm_wsize(const struct ggml_tensor *w, const struct ggml_tensor *x, const struct ggml_tensor *node);
// AXPY_ROWS of many columns as GEMMs (every row read once): whether it applies (cuBLAS, a mask or no
// selector, contiguous rows), its scratch, the product y[m, d] = h[m, n] (selected entries) . wt[n, d]
bool cuda_gemm_t_takes(const struct ggml_tensor *wt, const struct ggml_tensor *h, int sel_mode);
size_t cuda_gemm_t_wsize(const struct ggml_tensor *wt, const struct ggml_tensor *h, const struct ggml_tensor *node);
int cuda_gemm_t(const struct ggml_tensor *wt, const struct ggml_tensor *h, const cuda_rows_sel &s, struct ggml_tensor *y,
                void *wdata, cudaStream_t st);
// loads cuBLAS at run time (once); false when it cannot be loaded
bool cuda_blas_load(void);
// device memory counted in ggml_cuda_allocated, without initialising the device (for init's own buffers)
int cuda_device_alloc(void **ptr, size_t size);
// the sparse FFN of one token, nodes[0..5) = gate rows, act, up rows, mul, axpy of down_t (sparse_ffn.cu;
// fusion.cu matches them), into y starting from add (the residual; NULL: 0); xq_ready: wdata already holds x
// as Q8_1
int cuda_sparse_ffn(struct ggml_tensor *const *nodes, struct ggml_tensor *y, const float *add, bool xq_ready,
                    void *wdata, cudaStream_t st);
// its scratch, from down_t [d, n] (d is also x's length)
size_t cuda_sparse_ffn_wsize(const struct ggml_tensor *wd);
// multiprocessors of the current device (asked once)
int64_t cuda_sm_count(void);
// rows [r0, r0 + nr) of w (k values each) dequantized to F16 [nr, k]
int cuda_dequant_rows_f16(const struct ggml_tensor *w, int64_t r0, int64_t nr, __half *out, cudaStream_t st);

// block-wide stream compaction: every thread with sel appends row to s_rows in thread order; returns how
// many rows the block selected (the same value in every thread). s_wcnt holds CUDA_BLOCK / 32 ints.
static __device__ __forceinline__ int block_compact_rows(bool sel, int64_t row, int *s_rows, int *s_wcnt) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const unsigned bal = __ballot_sync(0xffffffffu, sel);
    if (lane == 0) s_wcnt[warp] = __popc(bal);
    __syncthreads();
    int off = 0, total = 0;
    for (int w = 0; w < CUDA_BLOCK / 32; w++) {
        off += w < warp ? s_wcnt[w] : 0;
        total += s_wcnt[w];
    }
    if (sel) s_rows[off + __popc(bal & ((1u << lane) - 1))] = (int)row;
    __syncthreads();
    return total;
}
