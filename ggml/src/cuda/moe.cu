// moe.cu: a mixture of experts on the GPU: the router's choice (top_k) and the routed experts' FFN (moe_ffn),
// with the CPU backend's semantics (ops_moe.c). The expert ids stay on the device, so the kernels read them:
//  - up: block (row group, pair): the pair's expert (through slots; a pair whose expert is held elsewhere
//    returns), a warp per row, gate and up dotted with the token's x together (they share the x loads),
//    act(gate) * up stored per pair;
//  - the activations quantized to Q8_1 where down is quantized;
//  - down: block (row group, pair): the pair's routing weight (softmax over the token's k or all logits), a warp
//    per row: weight * down_e[row] . act into the pair's part (0 where the expert is held elsewhere);
//  - sum: each token's k parts added in slot order (deterministic, no atomics). A token's 8 experts give 8x the
//    blocks a block per token would, which one decoded token needs to fill the GPU.
// Scratch: [x as Q8_1][act: (pairs, n_ff) floats][act as Q8_1][parts: (pairs, d) floats].
#include "rowdot.cuh"

#define MOE_WARPS 4       // warps per block; warp w takes rows w, w + MOE_WARPS, ... of the block's
#define MOE_ROWS 8        // rows per block: many blocks, so one token's few experts fill the GPU
#define MOE_MAX_K 64      // experts per token the kernels take

struct moe_params {
    const uint8_t *wg, *wu, *wd;     // gate, up [d, n_ff, n_local], down [n_ff, d, n_local]
    int64_t g_nb1, g_nb2, d_nb1, d_nb2;
    int64_t d, n_ff, n_expert, k, m, n_local;
    const float *x;                  // [d, m]
    const int8_t *xq;                // x as Q8_1 (quantized gate/up)
    const float2 *xds;
    const int32_t *ids;              // [k, m]
    const float *logits;             // [n_expert, m]
    const int32_t *slots;            // [n_expert] or NULL
    float *act;                      // [n_ff, k m]
    const int8_t *aq;                // act as Q8_1 (quantized down)
    const float2 *ads;
    float *part;                     // [d, k m] each pair's weighted down output
    float *y;                        // [d, m]
    int kind;                        // GGML_OP_SILU or GGML_OP_GELU
    bool norm;
};

static __device__ __forceinline__ int32_t moe_slot(const moe_params &p, int64_t pair) {
    const int32_t e = p.ids[pair];
    if (e < 0 || e >= p.n_expert) return -1; // (top_k never writes one; a kernel cannot fail the step)
    return p.slots ? p.slots[e] : e;
}

// this warp's dot product of a float row (F32, F16, BF16) with x, lanes strided over the values
template <int TYPE>
static __device__ __forceinline__ float float_row_dot(const uint8_t *row, const float *x, int64_t k, int lane) {
    float s = 0.0f;
    for (int64_t i = lane; i < k; i += 32) {
        const float w = TYPE == GGML_TYPE_F32 ? ((const float *)row)[i]
                        : TYPE == GGML_TYPE_F16 ? h2f(((const uint16_t *)row)[i]) : bf2f(((const uint16_t *)row)[i]);
        s += w * x[i];
    }
    return warp_sum(s);
}

template <int TYPE>
constexpr bool moe_float = TYPE == GGML_TYPE_F32 || TYPE == GGML_TYPE_F16 || TYPE == GGML_TYPE_BF16;

template <int TYPE>
__global__ void __launch_bounds__(MOE_WARPS * 32) moe_up_kernel(moe_params p) {
    for (int64_t pair = blockIdx.y; pair < p.k * p.m; pair += gridDim.y) {
    const int64_t j = pair / p.k;
    const int32_t e = moe_slot(p, pair);
    if (e < 0) continue;
    const int lane = threadIdx.x % 32;
    const uint8_t *wg = p.wg + e * p.g_nb2, *wu = p.wu + e * p.g_nb2;
    for (int64_t r = (int64_t)blockIdx.x * MOE_ROWS + threadIdx.x / 32; r < p.n_ff && r < (int64_t)(blockIdx.x + 1) * MOE_ROWS;
         r += MOE_WARPS) {
        float g, u;
        if constexpr (moe_float<TYPE>) {
            g = float_row_dot<TYPE>(wg + r * p.g_nb1, p.x + j * p.d, p.d, lane);
            u = float_row_dot<TYPE>(wu + r * p.g_nb1, p.x + j * p.d, p.d, lane);
        } else {
            const uint8_t *wr[2] = {wg + r * p.g_nb1, wu + r * p.g_nb1};
            float acc[2][1] = {{0.0f}, {0.0f}};
            qrow_dots<TYPE, false, 1, 2>(wr, p.xq + j * p.d, p.xds + j * (p.d / 32), p.d, 1, lane, acc);
            g = warp_sum(acc[0][0]);
            u = warp_sum(acc[1][0]);
        }
        if (lane == 0) p.act[pair * p.n_ff + r] = cuda_act(p.kind, g) * u;
    }
    }
}

// the routing weight of the token's s-th expert (warp 0 of the block computes it; every thread gets it)
static __device__ float moe_weight(const moe_params &p, int64_t j, int64_t s, float *s_w) {
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const float *l = p.logits + j * p.n_expert;
        const int32_t *ids = p.ids + j * p.k;
        const int64_t n = p.norm ? p.k : p.n_expert;
        float top = -INFINITY, z = 0.0f;
        for (int64_t i = lane; i < n; i += 32) {
            const int32_t e = p.norm ? ids[i] : (int32_t)i;
            if (e >= 0 && e < p.n_expert) top = fmaxf(top, l[e]);
        }
        top = warp_max(top);
        for (int64_t i = lane; i < n; i += 32) {
            const int32_t e = p.norm ? ids[i] : (int32_t)i;
            if (e >= 0 && e < p.n_expert) z += expf(l[e] - top);
        }
        z = warp_sum(z);
        if (lane == 0) {
            const int32_t e = ids[s];
            *s_w = e >= 0 && e < p.n_expert ? expf(l[e] - top) / z : 0.0f;
        }
    }
    __syncthreads();
    return *s_w;
}

// block (row group, pair): part[pair][r] = weight * down_e[r] . act[pair] (0 where the expert is held elsewhere)
template <int TYPE>
__global__ void __launch_bounds__(MOE_WARPS * 32) moe_down_kernel(moe_params p) {
    __shared__ float s_w;
    const int lane = threadIdx.x % 32;
    for (int64_t pair = blockIdx.y; pair < p.k * p.m; pair += gridDim.y) {
        const int32_t e = moe_slot(p, pair);
        const float w = e < 0 ? 0.0f : moe_weight(p, pair / p.k, pair % p.k, &s_w);
        for (int64_t r = (int64_t)blockIdx.x * MOE_ROWS + threadIdx.x / 32;
             r < p.d && r < (int64_t)(blockIdx.x + 1) * MOE_ROWS; r += MOE_WARPS) {
            float v = 0.0f;
            if (e >= 0) {
                const uint8_t *row = p.wd + e * p.d_nb2 + r * p.d_nb1;
                if constexpr (moe_float<TYPE>) {
                    v = float_row_dot<TYPE>(row, p.act + pair * p.n_ff, p.n_ff, lane);
                } else {
                    const uint8_t *wr[1] = {row};
                    float acc[1][1] = {{0.0f}};
                    qrow_dots<TYPE, false, 1, 1>(wr, p.aq + pair * p.n_ff, p.ads + pair * (p.n_ff / 32), p.n_ff, 1,
                                                 lane, acc);
                    v = warp_sum(acc[0][0]);
                }
            }
            if (lane == 0) p.part[pair * p.d + r] = w * v;
        }
        __syncthreads(); // s_w is the next pair's
    }
}

// y[j][r] = the sum of the token's k parts, in slot order (deterministic, no atomics)
__global__ void moe_sum_kernel(const float *part, int64_t d, int64_t k, int64_t m, float *y) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < d * m; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t j = i / d, r = i % d;
        float sum = 0.0f;
        for (int64_t s = 0; s < k; s++) sum += part[(j * k + s) * d + r];
        y[i] = sum;
    }
}

// --- TOP_K: a thread per column, insertion into a sorted list (k <= MOE_MAX_K) ---
__global__ void top_k_kernel(const float *a, int64_t n, int64_t a_ld, int k, int64_t m, int32_t *out) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= m) return;
    float best[MOE_MAX_K];
    int32_t idx[MOE_MAX_K];
    int have = 0;
    for (int64_t i = 0; i < n; i++) {
        float x = a[j * a_ld + i];
        if (isnan(x)) x = -INFINITY;
        if (have == k && !(x > best[k - 1])) continue; // an equal later value loses the tie
        int at = have < k ? have++ : k - 1;
        while (at > 0 && best[at - 1] < x) {
            best[at] = best[at - 1];
            idx[at] = idx[at - 1];
            at--;
        }
        best[at] = x;
        idx[at] = (int32_t)i;
    }
    for (int s = 0; s < k; s++) out[j * k + s] = idx[s];
}

int cuda_op_top_k(struct ggml_tensor *dst, cudaStream_t st) {
    const struct ggml_tensor *a = dst->src[0];
    const int k = dst->op_params[0];
    if (k > MOE_MAX_K) return ggml_set_error(GGML_STATUS_UNSUPPORTED, "top_k on the GPU takes k <= %d, not %d", MOE_MAX_K, k);
    const int64_t m = a->ne[1];
    if (m == 0) return GGML_STATUS_OK;
    top_k_kernel<<<(unsigned)((m + 127) / 128), 128, 0, st>>>((const float *)a->data, a->ne[0],
                                                             (int64_t)(a->nb[1] / sizeof(float)), k, m, (int32_t *)dst->data);
    return cuda_launch_status("top_k");
}

// --- MOE_FFN ---
struct moe_up_launch {
    const moe_params &p;
    dim3 grid;
    cudaStream_t st;
    template <int TYPE> void run() const { moe_up_kernel<TYPE><<<grid, MOE_WARPS * 32, 0, st>>>(p); }
};

struct moe_down_launch {
    const moe_params &p;
    dim3 grid;
    cudaStream_t st;
    template <int TYPE> void run() const { moe_down_kernel<TYPE><<<grid, MOE_WARPS * 32, 0, st>>>(p); }
};

struct moe_scratch {
    size_t xq, act, aq, part, end;
};

static moe_scratch moe_scratch_of(const struct ggml_tensor *dst) {
    const struct ggml_tensor *gate = dst->src[0], *down = dst->src[2], *x = dst->src[3], *ids = dst->src[4];
    const int64_t pairs = ggml_nelements(ids), n_ff = gate->ne[1];
    moe_scratch s;
    s.xq = 0;
    s.act = s.xq + align256(cuda_xq_wsize(gate->type, x->ne[0], x->ne[1]));
    s.aq = s.act + align256((size_t)(pairs * n_ff) * sizeof(float));
    s.part = s.aq + align256(cuda_xq_wsize(down->type, n_ff, pairs));
    s.end = s.part + align256((size_t)(pairs * x->ne[0]) * sizeof(float));
    return s;
}

size_t cuda_moe_ffn_wsize(const struct ggml_tensor *dst) { return moe_scratch_of(dst).end; }

int cuda_op_moe_ffn(struct ggml_tensor *dst, void *wdata, cudaStream_t st) {
    const struct ggml_tensor *gate = dst->src[0], *up = dst->src[1], *down = dst->src[2], *x = dst->src[3];
    const struct ggml_tensor *ids = dst->src[4], *logits = dst->src[5], *slots = dst->src[6];
    if (!cuda_type_is_weight(gate->type) || !cuda_type_is_weight(down->type))
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "moe_ffn on the GPU cannot read %s experts",
                              ggml_type_name(cuda_type_is_weight(gate->type) ? down->type : gate->type));
    if (ids->ne[0] > MOE_MAX_K)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "moe_ffn on the GPU takes at most %d experts a token", MOE_MAX_K);
    const moe_scratch sc = moe_scratch_of(dst);
    char *w = (char *)wdata;
    moe_params p = {};
    p.wg = (const uint8_t *)gate->data;
    p.wu = (const uint8_t *)up->data;
    p.wd = (const uint8_t *)down->data;
    p.g_nb1 = (int64_t)gate->nb[1], p.g_nb2 = (int64_t)gate->nb[2];
    p.d_nb1 = (int64_t)down->nb[1], p.d_nb2 = (int64_t)down->nb[2];
    p.d = x->ne[0], p.n_ff = gate->ne[1], p.n_expert = logits->ne[0], p.k = ids->ne[0], p.m = x->ne[1];
    p.n_local = gate->ne[2];
    p.x = (const float *)x->data;
    p.ids = (const int32_t *)ids->data;
    p.logits = (const float *)logits->data;
    p.slots = slots ? (const int32_t *)slots->data : NULL;
    p.act = (float *)(w + sc.act);
    p.part = (float *)(w + sc.part);
    p.y = (float *)dst->data;
    p.kind = dst->op_params[0] == GGML_FFN_SWIGLU ? GGML_OP_SILU : GGML_OP_GELU;
    p.norm = dst->op_params[1] != 0;
    const int64_t pairs = p.k * p.m;
    if (pairs == 0) return GGML_STATUS_OK;
    int rc;
    if (!cuda_type_is_float(gate->type)) {
        int8_t *xq;
        float2 *xds;
        cuda_xq_at(w + sc.xq, p.d, p.m, &xq, &xds);
        if ((rc = cuda_quantize_q8_1(p.x, p.d, p.d, p.m, w + sc.xq, st))) return rc;
        p.xq = xq, p.xds = xds;
    }
    const dim3 up_grid((unsigned)((p.n_ff + MOE_ROWS - 1) / MOE_ROWS), (unsigned)(pairs < 65535 ? pairs : 65535));
    with_weight_type(gate->type, moe_up_launch{p, up_grid, st});
    if ((rc = cuda_launch_status("moe_ffn gate and up"))) return rc;
    if (!cuda_type_is_float(down->type)) {
        int8_t *aq;
        float2 *ads;
        cuda_xq_at(w + sc.aq, p.n_ff, pairs, &aq, &ads);
        if ((rc = cuda_quantize_q8_1(p.act, p.n_ff, p.n_ff, pairs, w + sc.aq, st))) return rc;
        p.aq = aq, p.ads = ads;
    }
    with_weight_type(down->type, moe_down_launch{p, dim3((unsigned)((p.d + MOE_ROWS - 1) / MOE_ROWS), up_grid.y), st});
    if ((rc = cuda_launch_status("moe_ffn down"))) return rc;
    const int64_t n = p.d * p.m, blocks = (n + 255) / 256;
    moe_sum_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), 256, 0, st>>>(p.part, p.d, p.k, p.m, p.y);
    return cuda_launch_status("moe_ffn sum");
}
