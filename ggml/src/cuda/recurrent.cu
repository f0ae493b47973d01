// recurrent.cu: linear attention's recurrent ops (Qwen3.5's gated delta net), each carrying the sequence in a state
// leaf that it reads and overwrites in place. A prompt is one launch of each; both read pos[0] on the device (the
// graphs are captured: no copy to the host): 0 starts from zeros.
//   ssm_conv: one thread per channel and chunk of tokens, its K-1 previous inputs in registers.
//   delta_net: one warp per four rows of the transposed state (value head h, columns j..j+3), the rows in registers
//   across the tokens, the two dot products per token and row reduced by shuffles.
#include "common.cuh"

#define CONV_MAX_WINDOW 15 // K - 1 for K <= 16 (ggml_ssm_conv checks)
#define CONV_BLOCK 64      // a model's few thousand channels still spread over every SM
#define CONV_TOKENS 16     // tokens a thread convolves: at least K - 1 (a prompt's chunks run side by side)
#define DN_WARPS 4         // warps per block: neighbouring rows share a head, so its q and k rows hit in L1
#define DN_AHEAD 4         // tokens whose inputs are in flight while one is computed (a step is shorter than a load)

// ---------------------------------------------------------------------------------------------------
// SSM_CONV: y[c, t] = sum_j w[j, c] * xx[c, t + j], xx the state's K-1 rows then x's n rows. A thread convolves
// one channel over a chunk of CONV_TOKENS tokens (a token's output needs only the K-1 inputs before it, so the
// chunks run side by side), its window right-aligned in a register array of CONV_MAX_WINDOW (win[14] the latest
// input) so that every index is a constant; slots before the first of the K-1 live ones are skipped. Chunks are
// at least K-1 tokens long, so only the first one's window reaches into the state: its thread alone reads and
// then rewrites the channel's state.
// ---------------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(CONV_BLOCK) ssm_conv_kernel(float *state, cuda_view x, const float *w,
                                                              const int32_t *pos, cuda_view dst, int K) {
    const int64_t C = x.ne[0], n = x.ne[1];
    const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int64_t t0 = blockIdx.y * (int64_t)CONV_TOKENS, t1 = min(n, t0 + CONV_TOKENS);
    const int first = CONV_MAX_WINDOW - (K - 1); // the oldest live slot
    const bool fresh = pos[0] == 0;
    const float *taps = w + c * K; // (K), oldest first
    float win[CONV_MAX_WINDOW], tap[CONV_MAX_WINDOW];
#pragma unroll
    for (int i = 0; i < CONV_MAX_WINDOW; i++) {
        const int64_t tt = t0 - (CONV_MAX_WINDOW - i); // the token whose input the slot holds (< 0: the state's)
        const bool live = i >= first;
        win[i] = !live ? 0.0f : tt >= 0 ? ((const float *)(x.data + tt * x.nb[1]))[c]
                                        : fresh ? 0.0f : state[(K - 1 + tt) * C + c];
        tap[i] = live ? taps[i - first] : 0.0f;
    }
    const float tap_now = taps[K - 1];
    for (int64_t t = t0; t < t1; t++) {
        const float xt = ((const float *)(x.data + t * x.nb[1]))[c];
        float acc = tap_now * xt;
#pragma unroll
        for (int i = 0; i < CONV_MAX_WINDOW; i++)
            if (i >= first) acc += tap[i] * win[i];
        ((float *)(dst.data + t * dst.nb[1]))[c] = acc;
#pragma unroll
        for (int i = 0; i < CONV_MAX_WINDOW - 1; i++) win[i] = win[i + 1];
        win[CONV_MAX_WINDOW - 1] = xt;
    }
    if (blockIdx.y != 0) return;
    // the new state, xx's last K-1 rows: this window when it ends the sequence, else x's last K-1 rows
#pragma unroll
    for (int i = 0; i < CONV_MAX_WINDOW; i++)
        if (i >= first)
            state[(i - first) * C + c] = gridDim.y == 1 ? win[i]
                : ((const float *)(x.data + (n - (CONV_MAX_WINDOW - i)) * x.nb[1]))[c];
}

int cuda_op_ssm_conv(struct ggml_tensor *dst, cudaStream_t st) {
    struct ggml_tensor *state = dst->src[0];
    const struct ggml_tensor *x = dst->src[1], *w = dst->src[2], *pos = dst->src[3];
    const int64_t C = x->ne[0], n = x->ne[1];
    const dim3 grid((unsigned)((C + CONV_BLOCK - 1) / CONV_BLOCK), (unsigned)((n + CONV_TOKENS - 1) / CONV_TOKENS));
    ssm_conv_kernel<<<grid, CONV_BLOCK, 0, st>>>((float *)state->data, cuda_view_of(x), (const float *)w->data,
                                                  (const int32_t *)pos->data, cuda_view_of(dst), (int)w->ne[0]);
    return cuda_launch_status("ssm_conv");
}

// ---------------------------------------------------------------------------------------------------
// DELTA_NET: per value head h and column j of its state S (row r = h D_v + j of the transposed state, D_k
// floats), per token: s = exp(g) s; s += k beta (v[j] - s.k); out[j] = scale s.q. The rows are independent: a
// warp owns ROWS consecutive rows of one head for the whole sequence (their reductions interleave, and they share
// each token's loads and norms), lane l holding s[l + 32 i] for i < NPL (zeros past D_k, and k's and q's values
// there read as zeros, so those stay zero and add nothing to the dots). The inputs of the DN_AHEAD tokens after the
// current one are in flight while it is computed: a prompt's tokens are a chain of dependent steps, each shorter
// than a load from global memory (loading only the next token's, a step still waited: 1.2 us a token on an H200).
// Four rows' sums go through one transposed butterfly (warp_sum4; 512 tokens of the Qwen3.5-9B shape's 32 heads:
// 323 -> 307 us, the same bits). The step is bound by what a warp issues, not by its chain: a row per 8 or 16
// lanes (fewer shuffles, more loads and norms per row) measured 397-636 us; the chunked form (matrix products over
// chunks of tokens, as llama.cpp's) is what would move a prompt's scan further.
// ---------------------------------------------------------------------------------------------------

template <int NPL> struct dn_token {
    float k[NPL], q[NPL], v, decay, beta;
};

template <int NPL, int ROWS>
static __device__ __forceinline__ void dn_load(dn_token<NPL> &in, const cuda_view &q, const cuda_view &k,
                                               const cuda_view &v, const float *g, const float *beta, int64_t t,
                                               int64_t h, int64_t hq, int64_t j0, int lane, int dk, int64_t H) {
    const float *kt = (const float *)(k.data + t * k.nb[2] + hq * k.nb[1]);
    const float *qt = (const float *)(q.data + t * q.nb[2] + hq * q.nb[1]);
#pragma unroll
    for (int i = 0; i < NPL; i++) {
        const int d = lane + 32 * i;
        in.k[i] = d < dk ? kt[d] : 0.0f;
        in.q[i] = d < dk ? qt[d] : 0.0f;
    }
    // lane i < ROWS holds row j0 + i's value; the others' are unused
    in.v = lane < ROWS ? ((const float *)(v.data + t * v.nb[2] + h * v.nb[1]))[j0 + lane] : 0.0f;
    in.decay = g[t * H + h];
    in.beta = beta[t * H + h];
}

// warp sums of values each lane holds for several rows, as a transposed butterfly: at each level a lane keeps half
// of its rows and sends the other half, so four rows take 6 shuffles where four warp_sums take 20. The adds are
// warp_sum's (partners lane ^ 16, 8, 4, 2, 1, in that order), so each row's sum has its bits.
// v[0..4) -> row (lane / 8) % 4's sum
static __device__ __forceinline__ float warp_sum4(const float v[4], int lane) {
    const bool upper = lane & 16, odd = lane & 8;
    float x0 = upper ? v[2] : v[0], x1 = upper ? v[3] : v[1];
    x0 += __shfl_xor_sync(0xffffffffu, upper ? v[0] : v[2], 16);
    x1 += __shfl_xor_sync(0xffffffffu, upper ? v[1] : v[3], 16);
    float z = odd ? x1 : x0;
    z += __shfl_xor_sync(0xffffffffu, odd ? x0 : x1, 8);
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
    return z;
}

// (a, b) -> their warp sums, in every lane
static __device__ __forceinline__ float2 warp_sum2(float a, float b, int lane) {
    const bool upper = lane & 16;
    float z = upper ? b : a;
    z += __shfl_xor_sync(0xffffffffu, upper ? a : b, 16);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
    return make_float2(__shfl_sync(0xffffffffu, z, 0), __shfl_sync(0xffffffffu, z, 16));
}

template <int NPL, int ROWS>
__global__ void __launch_bounds__(DN_WARPS * 32) delta_net_kernel(float *state, cuda_view q, cuda_view k, cuda_view v,
                                                                  const float *g, const float *beta,
                                                                  const int32_t *pos, cuda_view dst, float scale,
                                                                  float l2_eps) {
    static_assert(ROWS == 1 || ROWS == 4, "a warp's rows: one, or four summed by warp_sum4");
    const int dk = (int)k.ne[0], lane = threadIdx.x % 32;
    const int64_t hk = k.ne[1], dv = v.ne[0], H = v.ne[1], n = v.ne[2];
    const int64_t r0 = (blockIdx.x * (int64_t)DN_WARPS + threadIdx.x / 32) * ROWS; // the warp's first row
    if (r0 >= H * dv) return; // the whole warp: the shuffles below see all 32 lanes
    const int64_t h = r0 / dv, j0 = r0 % dv, hq = h % hk;
    const bool fresh = pos[0] == 0;
    float s[ROWS][NPL];
#pragma unroll
    for (int row = 0; row < ROWS; row++)
#pragma unroll
        for (int i = 0; i < NPL; i++) {
            const int d = lane + 32 * i;
            s[row][i] = d < dk && !fresh ? state[(r0 + row) * dk + d] : 0.0f;
        }
    // a ring of the next DN_AHEAD tokens' inputs: slot u is refilled DN_AHEAD tokens ahead right after its use
    dn_token<NPL> ring[DN_AHEAD];
#pragma unroll
    for (int u = 0; u < DN_AHEAD; u++)
        if (u < n) dn_load<NPL, ROWS>(ring[u], q, k, v, g, beta, u, h, hq, j0, lane, dk, H);
    for (int64_t t0 = 0; t0 < n; t0 += DN_AHEAD) {
#pragma unroll
        for (int u = 0; u < DN_AHEAD; u++) {
            const int64_t t = t0 + u;
            if (t >= n) break;
            const dn_token<NPL> cur = ring[u];
            if (t + DN_AHEAD < n) dn_load<NPL, ROWS>(ring[u], q, k, v, g, beta, t + DN_AHEAD, h, hq, j0, lane, dk, H);
            float k_scale = 1.0f, q_scale = scale;
            if (l2_eps > 0.0f) {
                float kk = 0.0f, qq = 0.0f;
#pragma unroll
                for (int i = 0; i < NPL; i++) {
                    kk += cur.k[i] * cur.k[i];
                    qq += cur.q[i] * cur.q[i];
                }
                const float2 norms = warp_sum2(kk, qq, lane);
                k_scale = rsqrtf(norms.x + l2_eps);
                q_scale = scale * rsqrtf(norms.y + l2_eps);
            }
            const float decay = expf(cur.decay);
            float sk[ROWS];
#pragma unroll
            for (int row = 0; row < ROWS; row++) {
                sk[row] = 0.0f;
#pragma unroll
                for (int i = 0; i < NPL; i++) {
                    s[row][i] *= decay;
                    sk[row] += s[row][i] * cur.k[i];
                }
            }
            if constexpr (ROWS == 4) {
                const float own = warp_sum4(sk, lane); // row lane / 8's
#pragma unroll
                for (int row = 0; row < ROWS; row++) sk[row] = __shfl_sync(0xffffffffu, own, 8 * row) * k_scale;
            } else {
#pragma unroll
                for (int row = 0; row < ROWS; row++) sk[row] = warp_sum(sk[row]) * k_scale;
            }
            float sq[ROWS];
#pragma unroll
            for (int row = 0; row < ROWS; row++) {
                const float delta = cur.beta * (__shfl_sync(0xffffffffu, cur.v, row) - sk[row]) * k_scale;
                sq[row] = 0.0f;
#pragma unroll
                for (int i = 0; i < NPL; i++) {
                    s[row][i] += delta * cur.k[i];
                    sq[row] += s[row][i] * cur.q[i];
                }
            }
            if constexpr (ROWS == 4) {
                const float own = warp_sum4(sq, lane); // row lane / 8's
                if (lane % 8 == 0) ((float *)(dst.data + t * dst.nb[2] + h * dst.nb[1]))[j0 + lane / 8] = q_scale * own;
            } else {
                const float out = warp_sum(sq[0]);
                if (lane == 0) ((float *)(dst.data + t * dst.nb[2] + h * dst.nb[1]))[j0] = q_scale * out;
            }
        }
    }
#pragma unroll
    for (int row = 0; row < ROWS; row++)
#pragma unroll
        for (int i = 0; i < NPL; i++) {
            const int d = lane + 32 * i;
            if (d < dk) state[(r0 + row) * dk + d] = s[row][i];
        }
}

template <int NPL, int ROWS> static void delta_net_launch(struct ggml_tensor *dst, cudaStream_t st) {
    const struct ggml_tensor *v = dst->src[3];
    const int64_t warps = v->ne[0] * v->ne[1] / ROWS;
    delta_net_kernel<NPL, ROWS><<<(unsigned)((warps + DN_WARPS - 1) / DN_WARPS), DN_WARPS * 32, 0, st>>>(
        (float *)dst->src[0]->data, cuda_view_of(dst->src[1]), cuda_view_of(dst->src[2]), cuda_view_of(v),
        (const float *)dst->src[4]->data, (const float *)dst->src[5]->data, (const int32_t *)dst->src[6]->data,
        cuda_view_of(dst), ggml_op_param_f32(dst, 0), ggml_op_param_f32(dst, 1));
}

// four rows a warp where a head's columns come in fours (the models': 128), else one
template <int NPL> static void delta_net_rows(struct ggml_tensor *dst, cudaStream_t st) {
    if (dst->src[3]->ne[0] % 4 == 0) delta_net_launch<NPL, 4>(dst, st);
    else delta_net_launch<NPL, 1>(dst, st);
}

int cuda_op_delta_net(struct ggml_tensor *dst, cudaStream_t st) {
    const int64_t dk = dst->src[2]->ne[0]; // <= GGML_DELTA_NET_MAX_DK (ggml_delta_net checks)
    static_assert(GGML_DELTA_NET_MAX_DK == 16 * 32, "the widest launch holds 16 values a lane");
    // the fewest registers per lane that hold a row (D_k = 128, the models': 4)
    if (dk <= 32) delta_net_rows<1>(dst, st);
    else if (dk <= 64) delta_net_rows<2>(dst, st);
    else if (dk <= 128) delta_net_rows<4>(dst, st);
    else if (dk <= 256) delta_net_rows<8>(dst, st);
    else delta_net_launch<16, 1>(dst, st); // 16 registers a row: one row a warp
    return cuda_launch_status("delta_net");
}
