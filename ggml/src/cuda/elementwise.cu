// elementwise.cu: cpy/convert, get_rows (every dequantizable type), add/mul with row broadcast (and, fused, of
// a unary op of a), scale, silu, gelu (tanh), relu, tanh, abs, sigmoid, softplus, step, and the dequantization of weight
// rows to F16 used by the GEMM.
// Sources may be views: rows are found through nb[1..3] (rows themselves are contiguous).
#include "common.cuh"

static unsigned grid_for(int64_t n) {
    int64_t b = (n + CUDA_BLOCK - 1) / CUDA_BLOCK;
    return (unsigned)(b < 65536 ? (b > 0 ? b : 1) : 65536); // grid-stride loops cover the rest
}

// ---------------------------------------------------------------------------------------------------
// CPY: same type copies bytes; otherwise any dequantizable type -> F32, F16 or BF16
// ---------------------------------------------------------------------------------------------------

__global__ void cpy_bytes_kernel(cuda_view src, cuda_view dst, int64_t row_bytes, int64_t nrows) {
    const int64_t n = row_bytes * nrows;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = e / row_bytes, b = e % row_bytes;
        cuda_row(dst, r)[b] = cuda_row(src, r)[b];
    }
}

__global__ void cpy_convert_kernel(cuda_view src, int stype, cuda_view dst, int dtype, int64_t nrows) {
    const int64_t n0 = src.ne[0], n = n0 * nrows;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = e / n0, i = e % n0;
        const float v = cuda_dequant1(stype, (const uint8_t *)cuda_row(src, r), i);
        char *d = cuda_row(dst, r);
        if (dtype == GGML_TYPE_F32)
            ((float *)d)[i] = v;
        else if (dtype == GGML_TYPE_F16)
            ((uint16_t *)d)[i] = ggml_fp32_to_fp16(v);
        else
            ((uint16_t *)d)[i] = ggml_fp32_to_bf16(v);
    }
}

int cuda_op_cpy(struct ggml_tensor *dst, cudaStream_t st) {
    const struct ggml_tensor *src = dst->src[0];
    const int64_t nrows = ggml_nrows(src);
    if (dst->ne[0] != src->ne[0] || ggml_nrows(dst) != nrows)
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "cpy: shapes differ");
    if (src->type == dst->type) {
        const int64_t rb = (int64_t)ggml_row_size(src->type, src->ne[0]);
        cpy_bytes_kernel<<<grid_for(rb * nrows), CUDA_BLOCK, 0, st>>>(cuda_view_of(src), cuda_view_of(dst), rb, nrows);
        return cuda_launch_status("cpy");
    }
    const bool dst_ok = dst->type == GGML_TYPE_F32 || dst->type == GGML_TYPE_F16 || dst->type == GGML_TYPE_BF16;
    if (!dst_ok || !cuda_type_dequantizes(src->type))
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "cpy on CUDA: no conversion %s -> %s",
                              ggml_type_name(src->type), ggml_type_name(dst->type));
    cpy_convert_kernel<<<grid_for(src->ne[0] * nrows), CUDA_BLOCK, 0, st>>>(cuda_view_of(src), src->type,
                                                                            cuda_view_of(dst), dst->type, nrows);
    return cuda_launch_status("cpy");
}

// ---------------------------------------------------------------------------------------------------
// GET_ROWS: dst [k, m] F32 = rows ids[0..m) of src [k, n]; an id outside [0, n) gives a NaN row (the host
// cannot check device-side ids without a sync)
// ---------------------------------------------------------------------------------------------------

__global__ void get_rows_kernel(cuda_view src, int type, const char *ids, int64_t ids_nb0, cuda_view dst, int64_t m) {
    const int64_t k = src.ne[0], n = k * m;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = e / k, i = e % k;
        const int32_t id = *(const int32_t *)(ids + r * ids_nb0);
        float v = __int_as_float(0x7fc00000);
        if (id >= 0 && id < src.ne[1]) v = cuda_dequant1(type, (const uint8_t *)src.data + id * src.nb[1], i);
        ((float *)cuda_row(dst, r))[i] = v;
    }
}

int cuda_op_get_rows(struct ggml_tensor *dst, cudaStream_t st) {
    const struct ggml_tensor *src = dst->src[0], *ids = dst->src[1];
    if (!cuda_type_dequantizes(src->type) || ids->type != GGML_TYPE_I32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "get_rows on CUDA cannot read %s", ggml_type_name(src->type));
    const int64_t m = ids->ne[0];
    get_rows_kernel<<<grid_for(src->ne[0] * m), CUDA_BLOCK, 0, st>>>(cuda_view_of(src), src->type,
                                                                     (const char *)ids->data, (int64_t)ids->nb[0],
                                                                     cuda_view_of(dst), m);
    return cuda_launch_status("get_rows");
}

// ---------------------------------------------------------------------------------------------------
// ADD, MUL (b is a's shape or one row broadcast over a's rows); SCALE and the unary ops of cuda_act
// ---------------------------------------------------------------------------------------------------

// Where rows hold whole 16-byte chunks, a thread moves four values a load (V = 4): one float a thread kept too
// few bytes in flight, ~650 GB/s of an H100's 3350 on a 512-token prompt's adds.
template <int V> struct vals;
template <> struct vals<1> { using type = float; };
template <> struct vals<4> { using type = float4; };

static __device__ __forceinline__ float binop(float x, float y, bool add) { return add ? x + y : x * y; }
static __device__ __forceinline__ float4 binop(float4 x, float4 y, bool add) {
    return make_float4(binop(x.x, y.x, add), binop(x.y, y.y, add), binop(x.z, y.z, add), binop(x.w, y.w, add));
}
static __device__ __forceinline__ float unop(int op, float s, float x) {
    return op == GGML_OP_SCALE ? x * s : cuda_act(op, x);
}
static __device__ __forceinline__ float4 unop(int op, float s, float4 x) {
    return make_float4(unop(op, s, x.x), unop(op, s, x.y), unop(op, s, x.z), unop(op, s, x.w));
}
// what a fused add/mul applies to its first operand first (fusion.cu): nothing, or a unary op
static __device__ __forceinline__ float preop(int pre, float x) { return pre == CUDA_PRE_NONE ? x : cuda_act(pre, x); }
static __device__ __forceinline__ float4 preop(int pre, float4 x) {
    return make_float4(preop(pre, x.x), preop(pre, x.y), preop(pre, x.z), preop(pre, x.w));
}

// whether t's rows are whole 16-byte chunks at 16-byte aligned addresses
static bool rows_of_chunks(const struct ggml_tensor *t) {
    return t->ne[0] % 4 == 0 && (uintptr_t)t->data % 16 == 0 && t->nb[1] % 16 == 0 && t->nb[2] % 16 == 0 &&
           t->nb[3] % 16 == 0;
}

template <int V>
__global__ void binary_kernel(cuda_view a, int pre, cuda_view b, cuda_view dst, bool broadcast, bool is_add,
                              int64_t nrows) {
    using T = typename vals<V>::type;
    const int64_t n0 = a.ne[0] / V, n = n0 * nrows;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = e / n0, i = e % n0;
        const T x = preop(pre, ((const T *)cuda_row(a, r))[i]);
        // b: one row for all (broadcast), a row each, or one value each (per_row: V = 1)
        const T y = ((const T *)(broadcast ? b.data : cuda_row(b, r)))[b.ne[0] == 1 ? 0 : i];
        ((T *)cuda_row(dst, r))[i] = binop(x, y, is_add);
    }
}

int cuda_binary(const struct ggml_tensor *a, int pre, const struct ggml_tensor *b, struct ggml_tensor *dst, bool add,
                cudaStream_t st) {
    if (a->type != GGML_TYPE_F32 || b->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "add/mul take F32 tensors");
    const int64_t nrows = ggml_nrows(a);
    const bool broadcast = ggml_nrows(b) == 1 && b->ne[0] == a->ne[0];
    if (rows_of_chunks(a) && rows_of_chunks(b) && rows_of_chunks(dst)) // never one value a row: ne[0] % 4 != 0
        binary_kernel<4><<<grid_for(a->ne[0] / 4 * nrows), CUDA_BLOCK, 0, st>>>(
            cuda_view_of(a), pre, cuda_view_of(b), cuda_view_of(dst), broadcast, add, nrows);
    else
        binary_kernel<1><<<grid_for(a->ne[0] * nrows), CUDA_BLOCK, 0, st>>>(
            cuda_view_of(a), pre, cuda_view_of(b), cuda_view_of(dst), broadcast, add, nrows);
    return cuda_launch_status("add/mul");
}

int cuda_op_binary(struct ggml_tensor *dst, cudaStream_t st) {
    return cuda_binary(dst->src[0], CUDA_PRE_NONE, dst->src[1], dst, dst->op == GGML_OP_ADD, st);
}

template <int V>
__global__ void unary_kernel(cuda_view a, cuda_view dst, int op, float s, int64_t nrows) {
    using T = typename vals<V>::type;
    const int64_t n0 = a.ne[0] / V, n = n0 * nrows;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = e / n0, i = e % n0;
        ((T *)cuda_row(dst, r))[i] = unop(op, s, ((const T *)cuda_row(a, r))[i]);
    }
}

int cuda_op_unary(struct ggml_tensor *dst, cudaStream_t st) {
    const struct ggml_tensor *a = dst->src[0];
    if (a->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "elementwise ops take F32 tensors");
    const float s = dst->op == GGML_OP_SCALE ? ggml_op_param_f32(dst, 0) : 0.0f;
    const int64_t nrows = ggml_nrows(a);
    if (rows_of_chunks(a) && rows_of_chunks(dst))
        unary_kernel<4><<<grid_for(a->ne[0] / 4 * nrows), CUDA_BLOCK, 0, st>>>(cuda_view_of(a), cuda_view_of(dst),
                                                                               (int)dst->op, s, nrows);
    else
        unary_kernel<1><<<grid_for(a->ne[0] * nrows), CUDA_BLOCK, 0, st>>>(cuda_view_of(a), cuda_view_of(dst),
                                                                           (int)dst->op, s, nrows);
    return cuda_launch_status("unary op");
}

// ---------------------------------------------------------------------------------------------------
// weight rows -> F16 (the GEMM's A operand)
// ---------------------------------------------------------------------------------------------------

// values i .. i + 7 (i a multiple of 8) of a row of TYPE into h: the types of the files users download (Q4_0, Q4_K,
// Q6_K) with their block's scale and their bytes found once for the eight (per value, the Q4_K_M prompt's
// dequantization took half its GPU time), the others value by value
template <enum ggml_type TYPE> static __device__ __forceinline__ void dequant8(const uint8_t *row, int64_t i, __half *h) {
    if constexpr (TYPE == GGML_TYPE_Q4_0) {
        const uint8_t *b = row + (i / 32) * 18;
        const int j = (int)(i % 32), shift = j < 16 ? 0 : 4;
        const float d = h2f(u16_at(b));
        const uint8_t *q = b + 2 + j % 16;
#pragma unroll
        for (int v = 0; v < 8; v++) h[v] = __float2half_rn(d * (float)(((q[v] >> shift) & 15) - 8));
    } else if constexpr (TYPE == GGML_TYPE_Q4_K) {
        const uint8_t *b = row + (i / 256) * 144;
        const int j = (int)(i % 256), sb = j / 32, l = j % 32;
        uint8_t sc, m;
        ggml_q4_K_get_scale_min(b + 4, sb, &sc, &m);
        const float d = h2f(u16_at(b)) * (float)sc, mn = h2f(u16_at(b + 2)) * (float)m;
        const uint2 q8 = *(const uint2 *)(b + 16 + 32 * (sb / 2) + l); // 8-byte aligned: blocks of 144, l of 8
        const uint8_t *q = (const uint8_t *)&q8;
        const int shift = (sb & 1) * 4;
#pragma unroll
        for (int v = 0; v < 8; v++) h[v] = __float2half_rn(d * (float)((q[v] >> shift) & 15) - mn);
    } else if constexpr (TYPE == GGML_TYPE_Q6_K) {
        const uint8_t *b = row + (i / 256) * 210;
        const int j = (int)(i % 256), half = j / 128, quarter = j % 128 / 32, l = j % 32;
        const float d = h2f(u16_at(b + 208)) * (float)(int8_t)b[192 + j / 16];
        const uint8_t *ql = b + 64 * half + l + 32 * (quarter & 1), *qh = b + 128 + 32 * half + l;
        const int lo_shift = quarter < 2 ? 0 : 4, hi_shift = 2 * quarter;
#pragma unroll
        for (int v = 0; v < 8; v++)
            h[v] = __float2half_rn(d * (float)((((ql[v] >> lo_shift) & 15) | ((qh[v] >> hi_shift) & 3) << 4) - 32));
    } else {
#pragma unroll
        for (int v = 0; v < 8; v++) h[v] = __float2half_rn(cuda_dequant1(TYPE, row, i + v));
    }
}

// V values a thread: with V = 8 (rows of a multiple of 8 values, the output 16-byte aligned) one 16-byte store of
// eight F16 values, as the add/mul kernels move four floats a thread (one value a thread ran 5x below HBM's rate);
// the type a template argument (chosen at run time, a switch per value had kept it at a quarter of HBM's rate)
template <int V, enum ggml_type TYPE>
__global__ void dequant_f16_kernel(const uint8_t *w, int64_t nb1, int64_t k, int64_t nr, __half *out) {
    const int64_t kv = k / V, n = kv * nr;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = e / kv, i = (e % kv) * V;
        const uint8_t *row = w + r * nb1;
        if constexpr (V == 1) {
            out[e] = __float2half_rn(cuda_dequant1(TYPE, row, i));
        } else {
            __align__(16) __half h[V];
            dequant8<TYPE>(row, i, h);
            *(uint4 *)(out + e * V) = *(const uint4 *)h;
        }
    }
}

struct dequant_launch {
    const uint8_t *rows;
    int64_t nb1, k, nr;
    __half *out;
    cudaStream_t st;
    template <enum ggml_type TYPE> void run() const {
        if (k % 8 == 0 && (uintptr_t)out % 16 == 0)
            dequant_f16_kernel<8, TYPE><<<grid_for(k / 8 * nr), CUDA_BLOCK, 0, st>>>(rows, nb1, k, nr, out);
        else
            dequant_f16_kernel<1, TYPE><<<grid_for(k * nr), CUDA_BLOCK, 0, st>>>(rows, nb1, k, nr, out);
    }
};

int cuda_dequant_rows_f16(const struct ggml_tensor *w, int64_t r0, int64_t nr, __half *out, cudaStream_t st) {
    if (!cuda_type_is_weight(w->type))
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "dequantize to F16: type %d is not a weight type", (int)w->type);
    with_weight_type(w->type, dequant_launch{(const uint8_t *)w->data + r0 * (int64_t)w->nb[1], (int64_t)w->nb[1],
                                             w->ne[0], nr, out, st});
    return cuda_launch_status("dequantize to F16");
}
