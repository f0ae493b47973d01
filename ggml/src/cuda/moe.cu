// moe.cu: a mixture of experts on the GPU: the router's choice (top_k) and the routed experts' FFN (moe_ffn),
// with the CPU backend's semantics (ops_moe.c). The expert ids stay on the device, so the kernels read them:
//  - up: block (32 rows, pair): the pair's expert (through slots; a pair whose expert is held elsewhere
//    returns), a warp per 4 rows, their gate and up rows dotted with the token's x at once, act(gate) * up stored
//    per pair, and as one Q8_1 block where down is quantized;
//  - down and sum: block (8 output rows, token): a warp per pair, its routing weight * down_e[row] . act for the 8
//    rows at once (their loads in flight together), then each row's parts added in rank order (deterministic, no
//    atomics), plus the residual where the add after the op is fused into it.
// The up kernel's blocks (row group, pair) and the down kernel's warps per pair give one decoded token's few
// experts enough blocks to fill the GPU. Its op is a few microseconds of work in each kernel, so launches are what
// it saves: the up kernel computes its pairs' routing weights (softmax over the token's k or all logits) and
// quantizes the activations, x comes quantized from the norm before the router where the graph allows (fusion.cu),
// and the sum is the down kernel's.
// Prompts (more than GEMV_MAX_COLS tokens) take moe_gemm.cu's grouped GEMMs, which leave each pair's weighted
// down output as a part; a sum kernel adds them.
// Scratch: [x as Q8_1][act: (pairs, n_ff) floats][act as Q8_1][parts: (pairs, d) floats][weights][the batch's].
#include "moe.cuh"

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

// a warp's routing softmax of token j: the largest logit and the sum of exps over its k chosen (norm) or all experts
static __device__ __forceinline__ float2 moe_softmax_of(const moe_params &p, int64_t j, int lane) {
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
    return make_float2(top, warp_sum(z));
}

// the routing weight of token j's s-th pair: its softmax share, times the expert's scale where there are scales
static __device__ __forceinline__ float moe_weight(const moe_params &p, int64_t j, int64_t s, float2 top_z) {
    const int32_t e = p.ids[j * p.k + s];
    return e >= 0 && e < p.n_expert
               ? expf(p.logits[j * p.n_expert + e] - top_z.x) / top_z.y * (p.scales ? p.scales[e] : 1.0f)
               : 0.0f;
}

// block (MOE_UP_ROWS rows, pair): a warp per MOE_UP_WARP_ROWS rows, their gate and up rows dotted with the pair's x
// at once (all their loads in flight together); act(gate) * up stored per pair and, where down is quantized, the
// block's 32 values as one Q8_1 block (quantize_q8_1_kernel's rounding: the activations need no kernel of their own)
template <int TYPE>
__global__ void __launch_bounds__(MOE_UP_WARPS * 32) moe_up_kernel(moe_params p) {
    __shared__ float s_act[MOE_UP_ROWS];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t rb = (int64_t)blockIdx.x * MOE_UP_ROWS, r0 = rb + warp * MOE_UP_WARP_ROWS;
    for (int64_t pair = blockIdx.y; pair < p.k * p.m; pair += gridDim.y) {
        const int64_t j = pair / p.k;
        const int32_t e = moe_slot(p, pair);
        if (e < 0) continue; // block-uniform
        if (blockIdx.x == 0 && warp == 0) { // the pair's first block: its routing weight
            const float2 top_z = moe_softmax_of(p, j, lane);
            if (lane == 0) p.wts[pair] = moe_weight(p, j, pair % p.k, top_z);
        }
        const uint8_t *wr[2 * MOE_UP_WARP_ROWS]; // gate's rows, then up's (past the end: the last row again, unused)
#pragma unroll
        for (int i = 0; i < MOE_UP_WARP_ROWS; i++) {
            const int64_t r = min(r0 + i, p.n_ff - 1);
            wr[i] = p.wg + e * p.g_nb2 + r * p.g_nb1;
            wr[MOE_UP_WARP_ROWS + i] = p.wu + e * p.g_nb2 + r * p.g_nb1;
        }
        float v[2 * MOE_UP_WARP_ROWS];
        if constexpr (moe_float<TYPE>) {
#pragma unroll
            for (int i = 0; i < 2 * MOE_UP_WARP_ROWS; i++) v[i] = float_row_dot<TYPE>(wr[i], p.x + j * p.d, p.d, lane);
        } else {
            float acc[2 * MOE_UP_WARP_ROWS][1] = {};
            qrow_dots<TYPE, false, 1, 2 * MOE_UP_WARP_ROWS>(wr, p.xq + j * p.d, p.xds + j * (p.d / 32), p.d, 1, lane,
                                                              acc);
#pragma unroll
            for (int i = 0; i < 2 * MOE_UP_WARP_ROWS; i++) v[i] = warp_sum(acc[i][0]);
        }
        const float *b = moe_bias(p, pair);
        if (lane == 0)
#pragma unroll
            for (int i = 0; i < MOE_UP_WARP_ROWS; i++) {
                const int64_t r = r0 + i;
                if (r >= p.n_ff) break;
                const float g = v[i], u = v[MOE_UP_WARP_ROWS + i];
                const float a = b ? moe_act(p.kind, g + b[r], u + b[p.n_ff + r]) : moe_act(p.kind, g, u);
                p.act[pair * p.n_ff + r] = a;
                s_act[r - rb] = a;
            }
        if (!p.aq) continue; // down reads the float activations
        __syncthreads();
        if (warp == 0) { // n_ff % 32 == 0 where down is quantized: the block's rows are one Q8_1 block
            const float a = s_act[lane];
            const float d = warp_max(fabsf(a)) / 127.0f;
            const int q = d > 0.0f ? (int)roundf(a / d) : 0;
            p.aq[pair * p.n_ff + rb + lane] = (int8_t)q;
            const int sum = (int)warp_sum((float)q); // |sum| <= 32 * 127: exact in F32
            if (lane == 0) p.ads[(pair * p.n_ff + rb) / 32] = make_float2(d, d * (float)sum);
        }
        __syncthreads(); // s_act is the next pair's
    }
}

// a warp per token: its pairs' routing weights, the softmax of their logits over the k chosen (norm) or all experts,
// times the expert's scale where there are scales
__global__ void moe_weights_kernel(moe_params p) {
    const int64_t j = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (j >= p.m) return;
    const float2 top_z = moe_softmax_of(p, j, lane);
    for (int64_t s = lane; s < p.k; s += 32) p.wts[j * p.k + s] = moe_weight(p, j, s, top_z);
}

// y[i] of token j: its held experts' parts (part s at parts[s * stride]) added in rank order (deterministic, no
// atomics), then plus the fused add's operand (as the add computes it)
static __device__ __forceinline__ void moe_put_sum(const moe_params &p, int64_t j, const float *parts, int64_t stride,
                                                   int64_t i) {
    float sum = 0.0f;
    for (int64_t s = 0; s < p.k; s++)
        if (moe_slot(p, j * p.k + s) >= 0) sum += parts[s * stride];
    p.y[i] = p.add ? p.add[i] + sum : sum;
}

// block (MOE_DOWN_ROWS output rows, token j), a warp per pair s (w, w + warps, ...): weight * (down_e[r] . act + bias)
// for the block's rows into shared memory; then each row's held parts in rank order (as moe_sum_kernel adds a
// prompt's), plus the fused add's operand
template <int TYPE>
__global__ void __launch_bounds__(MOE_DOWN_WARPS * 32) moe_down_sum_kernel(moe_params p) {
    __shared__ float part[GGML_TOP_K_MAX][MOE_DOWN_ROWS];
    const int64_t j = blockIdx.y, r0 = (int64_t)blockIdx.x * MOE_DOWN_ROWS;
    const int lane = threadIdx.x % 32;
    for (int64_t s = threadIdx.x / 32; s < p.k; s += blockDim.x / 32) {
        const int64_t pair = j * p.k + s;
        const int32_t e = moe_slot(p, pair);
        if (e < 0) continue; // the sum skips it
        const uint8_t *wr[MOE_DOWN_ROWS]; // rows past the end: the last one again, unused
#pragma unroll
        for (int i = 0; i < MOE_DOWN_ROWS; i++) wr[i] = p.wd + e * p.d_nb2 + min(r0 + i, p.d - 1) * p.d_nb1;
        float v[MOE_DOWN_ROWS];
        if constexpr (moe_float<TYPE>) {
#pragma unroll
            for (int i = 0; i < MOE_DOWN_ROWS; i++) v[i] = float_row_dot<TYPE>(wr[i], p.act + pair * p.n_ff, p.n_ff, lane);
        } else {
            float acc[MOE_DOWN_ROWS][1] = {};
            qrow_dots<TYPE, false, 1, MOE_DOWN_ROWS>(wr, p.aq + pair * p.n_ff, p.ads + pair * (p.n_ff / 32), p.n_ff, 1,
                                                     lane, acc);
#pragma unroll
            for (int i = 0; i < MOE_DOWN_ROWS; i++) v[i] = warp_sum(acc[i][0]);
        }
        const float w = p.wts[pair];
        const float *b = moe_bias(p, pair);
        if (lane == 0)
#pragma unroll
            for (int i = 0; i < MOE_DOWN_ROWS; i++)
                if (r0 + i < p.d) part[s][i] = w * (b ? v[i] + b[2 * p.n_ff + r0 + i] : v[i]);
    }
    __syncthreads();
    const int64_t r = r0 + threadIdx.x;
    if (threadIdx.x < MOE_DOWN_ROWS && r < p.d) moe_put_sum(p, j, &part[0][threadIdx.x], MOE_DOWN_ROWS, j * p.d + r);
}

// a prompt's y[j][r] from the grouped GEMMs' parts
__global__ void moe_sum_kernel(moe_params p) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.d * p.m; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t j = i / p.d, r = i % p.d;
        moe_put_sum(p, j, p.part + j * p.k * p.d + r, p.d, i);
    }
}

// --- TOP_K: a warp per row (n <= TOP_K_WARP_MAX): the row's values in registers as order-preserving keys, k rounds
// of the warp's largest key not yet taken (__reduce_max_sync), the lowest index holding it (__reduce_min_sync), which
// its lane then takes (key 0, below every value); the input's NaNs enter as -inf, -0 as +0 (they tie, as values).
// Longer rows: a thread per row, insertion into a sorted list. Both: largest first, ties to the lower index ---
#define TOP_K_WARP_MAX 512

static __device__ __forceinline__ uint32_t top_k_key(float x) {
    if (isnan(x)) x = -INFINITY;
    if (x == 0.0f) x = 0.0f;
    const uint32_t u = __float_as_uint(x);
    return u & 0x80000000u ? ~u : u | 0x80000000u; // -inf -> 0x007fffff: every value's key is above 0
}

__global__ void __launch_bounds__(128) top_k_warp_kernel(const float *a, int64_t n, int64_t a_ld, int k, int64_t m,
                                                         int32_t *out) {
    constexpr int ITEMS = TOP_K_WARP_MAX / 32;
    const int lane = threadIdx.x % 32;
    const int64_t j = (int64_t)blockIdx.x * 4 + threadIdx.x / 32;
    if (j >= m) return; // warp-uniform
    uint32_t key[ITEMS]; // value lane + 32 t
#pragma unroll
    for (int t = 0; t < ITEMS; t++) key[t] = lane + 32 * t < n ? top_k_key(a[j * a_ld + lane + 32 * t]) : 0u;
    for (int s = 0; s < k; s++) {
        uint32_t best = 0u;
        int at = INT_MAX;
#pragma unroll
        for (int t = 0; t < ITEMS; t++) // a lane's own values ascend: the first best keeps the lower index
            if (key[t] > best) best = key[t], at = lane + 32 * t;
        const uint32_t top = __reduce_max_sync(0xffffffffu, best);
        const int idx = __reduce_min_sync(0xffffffffu, best == top ? at : INT_MAX);
        if (lane == 0) out[j * k + s] = idx;
#pragma unroll
        for (int t = 0; t < ITEMS; t++)
            if (lane + 32 * t == idx) key[t] = 0u;
    }
}

__global__ void top_k_kernel(const float *a, int64_t n, int64_t a_ld, int k, int64_t m, int32_t *out) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= m) return;
    float best[GGML_TOP_K_MAX];
    int32_t idx[GGML_TOP_K_MAX];
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
    const int64_t m = a->ne[1], n = a->ne[0], ld = (int64_t)(a->nb[1] / sizeof(float));
    if (m == 0) return GGML_STATUS_OK;
    if (n <= TOP_K_WARP_MAX) {
        top_k_warp_kernel<<<(unsigned)((m + 3) / 4), 128, 0, st>>>((const float *)a->data, n, ld, k, m,
                                                                   (int32_t *)dst->data);
    } else {
        top_k_kernel<<<(unsigned)((m + 127) / 128), 128, 0, st>>>((const float *)a->data, n, ld, k, m,
                                                                 (int32_t *)dst->data);
    }
    return cuda_launch_status("top_k");
}

// --- MOE_FFN ---
struct moe_up_launch {
    const moe_params &p;
    dim3 grid;
    cudaStream_t st;
    template <int TYPE> void run() const { moe_up_kernel<TYPE><<<grid, MOE_UP_WARPS * 32, 0, st>>>(p); }
};

struct moe_down_sum_launch {
    const moe_params &p;
    dim3 grid;
    unsigned threads;
    cudaStream_t st;
    template <int TYPE> void run() const { moe_down_sum_kernel<TYPE><<<grid, threads, 0, st>>>(p); }
};

struct moe_scratch {
    size_t xq, act, aq, part, wts, batch, end;
};

static moe_scratch moe_scratch_of(const struct ggml_tensor *dst) {
    const struct ggml_tensor *gate = dst->src[0], *down = dst->src[2], *x = dst->src[3], *ids = dst->src[4];
    const int64_t pairs = ggml_nelements(ids), n_ff = gate->ne[1];
    moe_scratch s;
    s.xq = 0;
    s.act = s.xq + align256(cuda_xq_wsize(gate->type, x->ne[0], x->ne[1]));
    s.aq = s.act + align256((size_t)(pairs * n_ff) * sizeof(float));
    s.part = s.aq + align256(cuda_xq_wsize(down->type, n_ff, pairs));
    s.wts = s.part + align256((size_t)(pairs * x->ne[0]) * sizeof(float));
    s.batch = s.wts + align256((size_t)pairs * sizeof(float));
    s.end = s.batch + (x->ne[1] > GEMV_MAX_COLS ? moe_gemm_wsize(gate->ne[2], pairs) : 0);
    return s;
}

size_t cuda_moe_ffn_wsize(const struct ggml_tensor *dst) { return moe_scratch_of(dst).end; }

// a few tokens: GEMVs per pair (x quantized to Q8_1 for quantized gate and up, unless xq_ready; the activations by
// the up kernel for a quantized down)
static int moe_gemv(moe_params p, enum ggml_type gate_type, enum ggml_type down_type, char *xq_at, bool xq_ready,
                    char *aq_at, cudaStream_t st) {
    const int64_t pairs = p.k * p.m;
    int rc;
    if (!cuda_type_is_float(gate_type)) {
        int8_t *xq;
        float2 *xds;
        cuda_xq_at(xq_at, p.d, p.m, &xq, &xds);
        if (!xq_ready && (rc = cuda_quantize_q8_1(p.x, p.d, p.d, p.m, xq_at, st))) return rc;
        p.xq = xq, p.xds = xds;
    }
    if (!cuda_type_is_float(down_type)) cuda_xq_at(aq_at, p.n_ff, pairs, &p.aq, &p.ads);
    const unsigned pair_blocks = (unsigned)(pairs < 65535 ? pairs : 65535);
    with_weight_type(gate_type, moe_up_launch{p, dim3((unsigned)((p.n_ff + MOE_UP_ROWS - 1) / MOE_UP_ROWS), pair_blocks), st});
    if ((rc = cuda_launch_status("moe_ffn gate and up"))) return rc;
    const dim3 down_grid((unsigned)((p.d + MOE_DOWN_ROWS - 1) / MOE_DOWN_ROWS), (unsigned)p.m);
    const unsigned warps = (unsigned)(p.k < MOE_DOWN_WARPS ? p.k : MOE_DOWN_WARPS);
    with_weight_type(down_type, moe_down_sum_launch{p, down_grid, warps * 32, st});
    return cuda_launch_status("moe_ffn down");
}

int cuda_moe_ffn(const struct ggml_tensor *dst, float *y, const float *add, bool xq_ready, void *wdata,
                 cudaStream_t st) {
    const struct ggml_tensor *gate = dst->src[0], *up = dst->src[1], *down = dst->src[2], *x = dst->src[3];
    const struct ggml_tensor *ids = dst->src[4], *logits = dst->src[5], *slots = dst->src[6], *biases = dst->src[7];
    const struct ggml_tensor *scales = dst->src[8];
    if (!cuda_type_is_weight(gate->type) || !cuda_type_is_weight(down->type))
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "moe_ffn on the GPU cannot read %s experts",
                              ggml_type_name(cuda_type_is_weight(gate->type) ? down->type : gate->type));
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
    p.wts = (float *)(w + sc.wts);
    p.y = y;
    p.add = add;
    p.biases = biases ? (const float *)biases->data : NULL;
    p.scales = scales ? (const float *)scales->data : NULL;
    p.kind = dst->op_params[0];
    p.norm = dst->op_params[1] != 0;
    const int64_t pairs = p.k * p.m;
    if (pairs == 0) return GGML_STATUS_OK;
    int rc;
    if (p.m <= GEMV_MAX_COLS) return moe_gemv(p, gate->type, down->type, w + sc.xq, xq_ready, w + sc.aq, st);
    // a prompt: each expert's rows read once per tile of its tokens
    moe_weights_kernel<<<(unsigned)((p.m + 3) / 4), 128, 0, st>>>(p);
    if ((rc = cuda_launch_status("moe_ffn weights"))) return rc;
    if ((rc = moe_gemm(p, gate->type, down->type, w + sc.batch, st))) return rc;
    const int64_t n = p.d * p.m, blocks = (n + 255) / 256;
    moe_sum_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), 256, 0, st>>>(p);
    return cuda_launch_status("moe_ffn sum");
}

int cuda_op_moe_ffn(struct ggml_tensor *dst, void *wdata, cudaStream_t st) {
    return cuda_moe_ffn(dst, (float *)dst->data, NULL, false, wdata, st);
}
