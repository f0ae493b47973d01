// recurrent.cu: linear attention's recurrent ops (Qwen3.5's gated delta net), each carrying the sequence in a state
// leaf that it reads and overwrites in place. Both loop over the tokens inside the kernel (a prompt is one launch)
// and read pos[0] on the device (the graphs are captured: no copy to the host): 0 starts from zeros.
//   ssm_conv: one thread per channel, its K-1 previous inputs in registers.
//   delta_net: one warp per row of the transposed state (value head h, column j), the row in registers across
//   the tokens, the two dot products per token reduced by shuffles.
#include "common.cuh"

#define CONV_MAX_WINDOW 15 // K - 1 for K <= 16 (ggml_ssm_conv checks)
#define CONV_BLOCK 64      // a model's few thousand channels still spread over every SM
#define DN_WARPS 4         // rows per block: neighbouring rows share a head, so its q and k rows hit in L1
#define DN_MAX_PER_LANE 16 // D_k <= 512

// ---------------------------------------------------------------------------------------------------
// SSM_CONV: y[c, t] = sum_j w[j, c] * xx[c, t + j], xx the state's K-1 rows then x's n rows. The window is
// right-aligned in a register array of CONV_MAX_WINDOW (win[14] the latest input) so that every index is a
// constant; slots before the first of the K-1 live ones are skipped.
// ---------------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(CONV_BLOCK) ssm_conv_kernel(float *state, cuda_view x, const float *w,
                                                              const int32_t *pos, cuda_view dst, int K) {
    const int64_t C = x.ne[0], n = x.ne[1];
    const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int first = CONV_MAX_WINDOW - (K - 1); // the oldest live slot
    const bool fresh = pos[0] == 0;
    const float *taps = w + c * K; // (K), oldest first
    float win[CONV_MAX_WINDOW], tap[CONV_MAX_WINDOW];
#pragma unroll
    for (int i = 0; i < CONV_MAX_WINDOW; i++) {
        const bool live = i >= first;
        win[i] = live && !fresh ? state[(i - first) * C + c] : 0.0f;
        tap[i] = live ? taps[i - first] : 0.0f;
    }
    const float tap_now = taps[K - 1];
    for (int64_t t = 0; t < n; t++) {
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
#pragma unroll
    for (int i = 0; i < CONV_MAX_WINDOW; i++)
        if (i >= first) state[(i - first) * C + c] = win[i];
}

int cuda_op_ssm_conv(struct ggml_tensor *dst, cudaStream_t st) {
    struct ggml_tensor *state = dst->src[0];
    const struct ggml_tensor *x = dst->src[1], *w = dst->src[2], *pos = dst->src[3];
    const int64_t C = x->ne[0];
    ssm_conv_kernel<<<(unsigned)((C + CONV_BLOCK - 1) / CONV_BLOCK), CONV_BLOCK, 0, st>>>(
        (float *)state->data, cuda_view_of(x), (const float *)w->data, (const int32_t *)pos->data, cuda_view_of(dst),
        (int)w->ne[0]);
    return cuda_launch_status("ssm_conv");
}

// ---------------------------------------------------------------------------------------------------
// DELTA_NET: per value head h and column j of its state S (row r = h D_v + j of the transposed state, D_k
// floats), per token: s = exp(g) s; s += k beta (v[j] - s.k); out[j] = scale s.q. The rows are independent:
// a warp owns one for the whole sequence, lane l holding s[l + 32 i] for i < NPL (zeros past D_k, and k's
// and q's values there read as zeros, so those stay zero and add nothing to the dots).
// ---------------------------------------------------------------------------------------------------

template <int NPL>
__global__ void __launch_bounds__(DN_WARPS * 32) delta_net_kernel(float *state, cuda_view q, cuda_view k, cuda_view v,
                                                                  const float *g, const float *beta,
                                                                  const int32_t *pos, cuda_view dst, float scale) {
    const int dk = (int)k.ne[0], lane = threadIdx.x % 32;
    const int64_t hk = k.ne[1], dv = v.ne[0], H = v.ne[1], n = v.ne[2];
    const int64_t r = blockIdx.x * (int64_t)DN_WARPS + threadIdx.x / 32;
    if (r >= H * dv) return; // the whole warp: the shuffles below see all 32 lanes
    const int64_t h = r / dv, j = r % dv, hq = h % hk;
    float *srow = state + r * dk; // (dk)
    const bool fresh = pos[0] == 0;
    float s[NPL];
#pragma unroll
    for (int i = 0; i < NPL; i++) {
        const int d = lane + 32 * i;
        s[i] = d < dk && !fresh ? srow[d] : 0.0f;
    }
    for (int64_t t = 0; t < n; t++) {
        const float *kt = (const float *)(k.data + t * k.nb[2] + hq * k.nb[1]); // (dk)
        const float *qt = (const float *)(q.data + t * q.nb[2] + hq * q.nb[1]); // (dk)
        const float vt = ((const float *)(v.data + t * v.nb[2] + h * v.nb[1]))[j];
        const float decay = expf(g[t * H + h]), b = beta[t * H + h];
        float kr[NPL], qr[NPL], sk = 0.0f;
#pragma unroll
        for (int i = 0; i < NPL; i++) {
            const int d = lane + 32 * i;
            kr[i] = d < dk ? kt[d] : 0.0f;
            qr[i] = d < dk ? qt[d] : 0.0f;
            s[i] *= decay;
            sk += s[i] * kr[i];
        }
        const float delta = b * (vt - warp_sum(sk));
        float sq = 0.0f;
#pragma unroll
        for (int i = 0; i < NPL; i++) {
            s[i] += delta * kr[i];
            sq += s[i] * qr[i];
        }
        sq = warp_sum(sq);
        if (lane == 0) ((float *)(dst.data + t * dst.nb[2] + h * dst.nb[1]))[j] = scale * sq;
    }
#pragma unroll
    for (int i = 0; i < NPL; i++) {
        const int d = lane + 32 * i;
        if (d < dk) srow[d] = s[i];
    }
}

template <int NPL> static void delta_net_launch(struct ggml_tensor *dst, cudaStream_t st) {
    const struct ggml_tensor *v = dst->src[3];
    const unsigned blocks = (unsigned)((v->ne[0] * v->ne[1] + DN_WARPS - 1) / DN_WARPS);
    delta_net_kernel<NPL><<<blocks, DN_WARPS * 32, 0, st>>>(
        (float *)dst->src[0]->data, cuda_view_of(dst->src[1]), cuda_view_of(dst->src[2]), cuda_view_of(v),
        (const float *)dst->src[4]->data, (const float *)dst->src[5]->data, (const int32_t *)dst->src[6]->data,
        cuda_view_of(dst), ggml_op_param_f32(dst, 0));
}

int cuda_op_delta_net(struct ggml_tensor *dst, cudaStream_t st) {
    const struct ggml_tensor *q = dst->src[1], *k = dst->src[2], *v = dst->src[3];
    const int64_t dk = k->ne[0];
    if (dk > DN_MAX_PER_LANE * 32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "delta_net on CUDA: key heads of %lld values (at most %d)",
                              (long long)dk, DN_MAX_PER_LANE * 32);
    if (q->nb[0] != sizeof(float) || k->nb[0] != sizeof(float) || v->nb[0] != sizeof(float))
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "delta_net on CUDA: q, k and v rows must be contiguous");
    // the fewest registers per lane that hold a row (D_k = 128, the models': 4)
    if (dk <= 32) delta_net_launch<1>(dst, st);
    else if (dk <= 64) delta_net_launch<2>(dst, st);
    else if (dk <= 128) delta_net_launch<4>(dst, st);
    else if (dk <= 256) delta_net_launch<8>(dst, st);
    else delta_net_launch<16>(dst, st);
    return cuda_launch_status("delta_net");
}
