// sparse_ffn.cu: the sparse FFN of one token as three kernels (fusion.cu's GGML_CUDA_FUSE_SPARSE_FFN).
// The graph spells it gate rows -> act -> up rows -> mul -> axpy of down_t under the predictor's mask;
// run node by node, each op rescans the mask, the activations go through memory and, with hot-first
// neurons, the blocks that hold the dense head of the mask do all the work while the rest idle. Here:
//  - select: the mask's positive rows into a list (each block compacts its candidates, one atomic a block);
//  - rows: warp w takes list entries w, w + W, ... (every warp about the same work however the selection
//    clusters), computes gate and up of the row together (they share the x loads) and stores
//    act(gate) * up, or 0 for a relu row whose gate is not positive;
//  - down: the listed rows with a nonzero value against down_t as axpy_rows does it (lanes take 32-value
//    slices of a row, warps take entries, two at a time), with as many blocks as the list's length needs;
//    down_t's type may differ from gate's and up's (which must match: they share the x loads).
// Scratch: [x as Q8_1 (the size of a quantized GEMV's)][count][list n ints][values n floats]; the Q8_1
// part is left alone for float weights, so a copy of x that a quantized GEMV made stays valid.
#include "rowdot.cuh"

#define FFN_WARPS 4       // warps per block of the rows kernel
#define DOWN_WARPS 8      // warps per block of the down kernel
#define DOWN_PER_WARP 4   // list entries per warp the down kernel aims for (fewer blocks, fewer atomics)

struct ffn_params {
    const uint8_t *wg, *wu; // gate and up [n, k], rows w_nb1 bytes apart
    int64_t w_nb1, k, n;
    const float *x;         // [k]
    const int8_t *xq;       // x as Q8_1 (quantized weights)
    const float2 *xds;
    const char *pred;       // F32 mask [n], pred_nb0 bytes apart: positive = computed
    int64_t pred_nb0;
    int act;                // GGML_OP_SILU, GGML_OP_GELU or GGML_OP_RELU (relu also drops rows with gate <= 0)
    int64_t W;              // warps in the rows kernel's grid
    int *count;             // list length (zeroed before the select kernel)
    int *list;              // [n] the selected rows
    float *vals;            // [n] their activations (0: nothing to add)
    const uint8_t *wd;      // down_t [n, d]
    int64_t wd_nb1, d;
    float *y;               // [d]
    const float *add;       // [d] what y starts from (the residual the graph adds next), NULL: 0
};

size_t cuda_sparse_ffn_wsize(const struct ggml_tensor *wd) {
    const int64_t d = wd->ne[0], n = wd->ne[1];
    return cuda_xq_wsize(GGML_TYPE_Q8_0, d, 1) + 256 + 2 * align256((size_t)n * 4);
}

__global__ void __launch_bounds__(CUDA_BLOCK) ffn_select_kernel(ffn_params p) {
    __shared__ int s_rows[CUDA_BLOCK], s_wcnt[CUDA_BLOCK / 32], s_base;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.d; i += (int64_t)gridDim.x * blockDim.x)
        p.y[i] = p.add ? p.add[i] : 0.0f; // the down kernel adds into y
    const int64_t row = (int64_t)blockIdx.x * CUDA_BLOCK + threadIdx.x;
    const bool sel = row < p.n && *(const float *)(p.pred + row * p.pred_nb0) > 0.0f;
    const int total = block_compact_rows(sel, row, s_rows, s_wcnt);
    if (total == 0) return; // block-uniform
    if (threadIdx.x == 0) s_base = atomicAdd(p.count, total);
    __syncthreads();
    if (threadIdx.x < total) p.list[s_base + threadIdx.x] = s_rows[threadIdx.x];
}

template <int TYPE, bool A16>
__global__ void __launch_bounds__(FFN_WARPS * 32) ffn_rows_kernel(ffn_params p) {
    const int lane = threadIdx.x % 32;
    const int count = *p.count;
    for (int64_t e = (int64_t)blockIdx.x * FFN_WARPS + threadIdx.x / 32; e < count; e += p.W) {
        const int64_t r = p.list[e];
        float g, u;
        if constexpr (TYPE == GGML_TYPE_F32 || TYPE == GGML_TYPE_F16 || TYPE == GGML_TYPE_BF16) {
            const int64_t rs = p.w_nb1 / 16;
            pair_partial_f<TYPE, 32>((const int4 *)p.wg + r * rs, (const int4 *)p.wu + r * rs, p.x, p.k, lane, &g, &u);
            g = warp_sum(g);
            u = warp_sum(u);
        } else {
            const uint8_t *wr[2] = {p.wg + r * p.w_nb1, p.wu + r * p.w_nb1};
            float acc[2][1] = {{0.0f}, {0.0f}};
            qrow_dots<TYPE, A16, 1, 2>(wr, p.xq, p.xds, p.k, 1, lane, acc);
            g = warp_sum(acc[0][0]);
            u = warp_sum(acc[1][0]);
        }
        if (lane == 0) p.vals[e] = p.act != GGML_OP_RELU || g > 0.0f ? cuda_act(p.act, g) * u : 0.0f;
    }
}

// grid (d slices of 1024 values, list groups): group blockIdx.y takes entries blockIdx.y * DOWN_WARPS + warp,
// strided by the groups the list's length needs (the grid's layers beyond those return at once)
template <int TYPE>
__global__ void __launch_bounds__(DOWN_WARPS * 32) ffn_down_kernel(ffn_params p) {
    __shared__ float s_acc[DOWN_WARPS][32 * 32]; // (warp, value * 32 + lane)
    const int count = *p.count;
    int64_t groups = (count + DOWN_WARPS * DOWN_PER_WARP - 1) / (DOWN_WARPS * DOWN_PER_WARP);
    if (groups > gridDim.y) groups = gridDim.y;
    if (blockIdx.y >= groups) return; // block-uniform
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t sl = (int64_t)blockIdx.x * 32 + lane; // this lane's 32-value slice of d
    const int64_t stride = groups * DOWN_WARPS;
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; i++) acc[i] = 0.0f;
    if (sl * 32 < p.d)
        for (int64_t e = (int64_t)blockIdx.y * DOWN_WARPS + warp; e < count; e += 2 * stride) {
            // two entries at once: their loads overlap (a zero value, a relu row that did not fire, adds nothing)
            const float a0 = p.vals[e], a1 = e + stride < count ? p.vals[e + stride] : 0.0f;
            float f0[32], f1[32];
            if (a0 != 0.0f) slice32<TYPE>(p.wd + (int64_t)p.list[e] * p.wd_nb1, sl, p.d, f0);
            if (a1 != 0.0f) slice32<TYPE>(p.wd + (int64_t)p.list[e + stride] * p.wd_nb1, sl, p.d, f1);
#pragma unroll
            for (int i = 0; i < 32; i++) acc[i] += (a0 != 0.0f ? a0 * f0[i] : 0.0f) + (a1 != 0.0f ? a1 * f1[i] : 0.0f);
        }
    add_slices<DOWN_WARPS>(acc, s_acc, p.y, p.d);
}

// select + rows for gate's and up's type
struct ffn_rows_launch {
    const ffn_params &p;
    bool a16; // only Q4_K loads differently from 16-byte aligned rows
    cudaStream_t st;
    template <int TYPE> void run() const {
        ffn_select_kernel<<<(unsigned)((p.n + CUDA_BLOCK - 1) / CUDA_BLOCK), CUDA_BLOCK, 0, st>>>(p);
        const unsigned row_blocks = (unsigned)(p.W / FFN_WARPS);
        if (a16)
            ffn_rows_kernel<TYPE, true><<<row_blocks, FFN_WARPS * 32, 0, st>>>(p);
        else
            ffn_rows_kernel<TYPE, false><<<row_blocks, FFN_WARPS * 32, 0, st>>>(p);
    }
};

// down for down_t's type
struct ffn_down_launch {
    const ffn_params &p;
    cudaStream_t st;
    template <int TYPE> void run() const {
        const int64_t slices = ((p.d + 31) / 32 + 31) / 32;
        int64_t groups = 4 * cuda_sm_count() / slices; // about a wave of blocks (a few per SM)
        const int64_t most = (p.n + DOWN_WARPS * DOWN_PER_WARP - 1) / (DOWN_WARPS * DOWN_PER_WARP);
        groups = groups < 1 ? 1 : groups > most ? most : groups;
        const dim3 grid((unsigned)slices, (unsigned)(groups < 65535 ? groups : 65535));
        ffn_down_kernel<TYPE><<<grid, DOWN_WARPS * 32, 0, st>>>(p);
    }
};

int cuda_sparse_ffn(struct ggml_tensor *const *nodes, struct ggml_tensor *y, const float *add, bool xq_ready,
                    void *wdata, cudaStream_t st) {
    const struct ggml_tensor *gate = nodes[0], *wg = gate->src[0], *x = gate->src[1], *pred = gate->src[2];
    const struct ggml_tensor *wu = nodes[2]->src[0], *wd = nodes[4]->src[0];
    const enum ggml_type type = wg->type;
    ffn_params p;
    p.wg = (const uint8_t *)wg->data;
    p.wu = (const uint8_t *)wu->data;
    p.w_nb1 = (int64_t)wg->nb[1];
    p.k = wg->ne[0];
    p.n = wg->ne[1];
    p.x = (const float *)x->data;
    p.xq = NULL;
    p.xds = NULL;
    p.pred = (const char *)pred->data;
    p.pred_nb0 = (int64_t)pred->nb[0];
    p.act = nodes[1]->op;
    // a warp per listed row up to 8 blocks per SM (the list's length is known on the device only)
    const int64_t warps = p.n < 32 * cuda_sm_count() ? p.n : 32 * cuda_sm_count();
    p.W = (warps + FFN_WARPS - 1) / FFN_WARPS * FFN_WARPS;
    char *after_xq = (char *)wdata + cuda_xq_wsize(GGML_TYPE_Q8_0, p.k, 1);
    p.count = (int *)after_xq;
    p.list = (int *)(after_xq + 256);
    p.vals = (float *)(after_xq + 256 + align256((size_t)p.n * 4));
    p.wd = (const uint8_t *)wd->data;
    p.wd_nb1 = (int64_t)wd->nb[1];
    p.d = wd->ne[0];
    p.y = (float *)y->data;
    p.add = add;
    if (!cuda_type_is_float(type)) {
        int rc = xq_ready ? GGML_STATUS_OK : cuda_quantize_q8_1(p.x, (int64_t)x->nb[1] / 4, p.k, 1, wdata, st);
        if (rc) return rc;
        int8_t *xq;
        float2 *xds;
        cuda_xq_at(wdata, p.k, 1, &xq, &xds);
        p.xq = xq;
        p.xds = xds;
    }
    int rc = cuda_status(cudaMemsetAsync(p.count, 0, sizeof(int), st), "memset");
    if (rc) return rc;
    const bool a16 = type == GGML_TYPE_Q4_K && (uintptr_t)p.wg % 16 == 0 && (uintptr_t)p.wu % 16 == 0 && p.w_nb1 % 16 == 0;
    with_weight_type(type, ffn_rows_launch{p, a16, st});
    // down_t may have a type of its own (llama.cpp's Q4_K_M keeps many ffn_down matrices in Q6_K)
    with_weight_type(wd->type, ffn_down_launch{p, st});
    return cuda_launch_status("sparse FFN");
}
