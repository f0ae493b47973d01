// attention.cu: kv_store (F32 rows into an F32 or F16 cache) and causal attention over the cache with
// GQA (a sliding-window layer: slots (pos[t] - window, pos[t]] only). One block per (head, token); its 16
// warps split the slots [0, pos[t]] round-robin, two slots at a
// time (both slots' loads in flight before the math: short decode contexts are latency-bound), each warp
// keeping an online softmax (running max, sum, weighted V); the 16 partial states merge at the end.
#include "common.cuh"

#define ATT_WARPS 16
#define ATT_MAX_DPL 16 // head dims per lane: head_dim <= 512 (Gemma 4's global layers)
#define ATT_NARROW_DPL 8 // heads of up to 256, the others': half the registers

// ---------------------------------------------------------------------------------------------------
// KV_STORE: cache[:, h, pos[t]] = src[:, h, t]; a position outside [0, n_ctx) is skipped
// ---------------------------------------------------------------------------------------------------

__global__ void kv_store_kernel(cuda_view src, const char *pos, int64_t pos_nb0, cuda_view cache, bool f16) {
    const int64_t hd = src.ne[0], nh = src.ne[1], n = hd * nh * src.ne[2];
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = e % hd, h = (e / hd) % nh, t = e / (hd * nh);
        const int64_t p = *(const int32_t *)(pos + t * pos_nb0);
        if (p < 0 || p >= cache.ne[2]) continue;
        const float v = *(const float *)(src.data + i * 4 + h * src.nb[1] + t * src.nb[2]);
        char *slot = cache.data + h * cache.nb[1] + p * cache.nb[2];
        if (f16)
            ((__half *)slot)[i] = __float2half_rn(v);
        else
            ((float *)slot)[i] = v;
    }
}

int cuda_op_kv_store(struct ggml_tensor *dst, cudaStream_t st) {
    const struct ggml_tensor *src = dst->src[1], *pos = dst->src[2];
    if (src->type != GGML_TYPE_F32 || (dst->type != GGML_TYPE_F32 && dst->type != GGML_TYPE_F16))
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "kv_store takes F32 rows into an F32/F16 cache");
    const int64_t n = src->ne[0] * src->ne[1] * src->ne[2];
    int64_t blocks = (n + CUDA_BLOCK - 1) / CUDA_BLOCK;
    kv_store_kernel<<<(unsigned)(blocks < 65536 ? (blocks ? blocks : 1) : 65536), CUDA_BLOCK, 0, st>>>(
        cuda_view_of(src), (const char *)pos->data, (int64_t)pos->nb[0], cuda_view_of(dst), dst->type == GGML_TYPE_F16);
    return cuda_launch_status("kv_store");
}

// ---------------------------------------------------------------------------------------------------
// ATTENTION
// ---------------------------------------------------------------------------------------------------

template <bool F16>
static __device__ __forceinline__ float cache_at(const char *row, int d) {
    return F16 ? __half2float(((const __half *)row)[d]) : ((const float *)row)[d];
}

template <bool F16, int DPL>
__global__ void __launch_bounds__(ATT_WARPS * 32) attention_kernel(cuda_view q, cuda_view k, cuda_view v,
                                                                  const char *pos, int64_t pos_nb0, const float *sinks,
                                                                  cuda_view dst, float scale, int window) {
    __shared__ float sh_m[ATT_WARPS], sh_l[ATT_WARPS];
    __shared__ float sh_acc[ATT_WARPS][DPL * 32];
    const int hd = (int)q.ne[0], h = blockIdx.x, lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const int64_t t = blockIdx.y;
    const int64_t g = h / (q.ne[1] / k.ne[1]); // kv head of this query head
    const float *qrow = (const float *)(q.data + h * q.nb[1] + t * q.nb[2]); // (hd)
    float qr[DPL], acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; i++) {
        const int d = lane + 32 * i;
        qr[i] = d < hd ? qrow[d] * scale : 0.0f; // scale folded into q
        acc[i] = 0.0f;
    }
    int64_t last = *(const int32_t *)(pos + t * pos_nb0);
    if (last >= k.ne[2]) last = k.ne[2] - 1;
    const int64_t first = window && last >= window ? last - window + 1 : 0;
    const char *kbase = k.data + g * k.nb[1], *vbase = v.data + g * v.nb[1];
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t s = first + w; s <= last; s += 2 * ATT_WARPS) {
        const bool two = s + ATT_WARPS <= last;
        const int64_t s2 = two ? s + ATT_WARPS : s;
        const char *kr = kbase + s * k.nb[2], *vr = vbase + s * v.nb[2];
        const char *kr2 = kbase + s2 * k.nb[2], *vr2 = vbase + s2 * v.nb[2];
        float part = 0.0f, part2 = 0.0f, vv[DPL], vv2[DPL];
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            const int d = lane + 32 * i;
            vv[i] = d < hd ? cache_at<F16>(vr, d) : 0.0f;
            vv2[i] = d < hd ? cache_at<F16>(vr2, d) : 0.0f;
            if (d < hd) {
                part += qr[i] * cache_at<F16>(kr, d);
                part2 += qr[i] * cache_at<F16>(kr2, d);
            }
        }
        const float score = warp_sum(part), score2 = warp_sum(part2);
        const float mnew = fmaxf(mx, two ? fmaxf(score, score2) : score);
        const float c = expf(mx - mnew), p = expf(score - mnew), p2 = two ? expf(score2 - mnew) : 0.0f;
        sum = sum * c + p + p2;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[i] = acc[i] * c + p * vv[i] + p2 * vv2[i];
        mx = mnew;
    }
    if (lane == 0) {
        sh_m[w] = mx;
        sh_l[w] = sum;
    }
#pragma unroll
    for (int i = 0; i < DPL; i++) sh_acc[w][lane + 32 * i] = acc[i];
    __syncthreads();
    float m_all = sinks ? sinks[h] : -INFINITY; // a sink counts in the softmax's sum, adds no value
    for (int j = 0; j < ATT_WARPS; j++) m_all = fmaxf(m_all, sh_m[j]);
    float l_all = sinks ? expf(sinks[h] - m_all) : 0.0f, cw[ATT_WARPS];
    for (int j = 0; j < ATT_WARPS; j++) {
        cw[j] = sh_l[j] > 0.0f ? expf(sh_m[j] - m_all) : 0.0f; // a warp without slots adds nothing
        l_all += sh_l[j] * cw[j];
    }
    float *out = (float *)(dst.data + t * dst.nb[1]) + (int64_t)h * hd; // (hd)
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.0f;
        for (int j = 0; j < ATT_WARPS; j++) o += sh_acc[j][d] * cw[j];
        out[d] = o / l_all;
    }
}

int cuda_op_attention(struct ggml_tensor *dst, cudaStream_t st) {
    const struct ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *pos = dst->src[3];
    if (q->type != GGML_TYPE_F32 || k->type != v->type || (k->type != GGML_TYPE_F32 && k->type != GGML_TYPE_F16))
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "attention on CUDA: F32 q over an F32 or F16 cache");
    if (q->ne[0] > ATT_MAX_DPL * 32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "attention on CUDA: head size %lld > %d", (long long)q->ne[0],
                              ATT_MAX_DPL * 32);
    if (q->ne[1] > 65535 || q->ne[2] > 65535)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "attention on CUDA: too many heads or tokens");
    const dim3 grid((unsigned)q->ne[1], (unsigned)q->ne[2]);
    const float scale = ggml_op_param_f32(dst, 0);
    const int window = dst->op_params[1];
    const float *sinks = dst->src[4] ? (const float *)dst->src[4]->data : nullptr;
    const bool f16 = k->type == GGML_TYPE_F16, wide = q->ne[0] > ATT_NARROW_DPL * 32;
    void (*kernel)(cuda_view, cuda_view, cuda_view, const char *, int64_t, const float *, cuda_view, float, int) =
        f16 ? (wide ? attention_kernel<true, ATT_MAX_DPL> : attention_kernel<true, ATT_NARROW_DPL>)
            : (wide ? attention_kernel<false, ATT_MAX_DPL> : attention_kernel<false, ATT_NARROW_DPL>);
    kernel<<<grid, ATT_WARPS * 32, 0, st>>>(cuda_view_of(q), cuda_view_of(k), cuda_view_of(v), (const char *)pos->data,
                                           (int64_t)pos->nb[0], sinks, cuda_view_of(dst), scale, window);
    return cuda_launch_status("attention");
}
