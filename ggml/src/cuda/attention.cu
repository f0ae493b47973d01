// attention.cu: kv_store (F32 rows into an F32 or F16 cache) and causal attention over the cache with
// GQA (a sliding-window layer: slots (pos[t] - window, pos[t]] only). One block per (head, token, split); its 16
// warps take the split's slots round-robin, two slots at a time (both slots' loads in flight before the math:
// short decode contexts are latency-bound), each warp keeping an online softmax (running max, sum, weighted V);
// the 16 partial states merge at the end. A decode step over a long cache splits the slots over several blocks
// (a block a head alone kept a few SMs busy: 2 MB of a 13B's cache a head at depth 4096) and a second kernel merges
// the splits' states from the scratch. Prompt batches over an F16 cache run on tensor cores (attention_mma.cu).
#include "common.cuh"

#define ATT_WARPS 16
#define ATT_SPLIT_SLOTS 256     // slots a split takes at least: shorter contexts run as one block a head
#define ATT_MAX_SPLITS 16
#define ATT_SPLIT_MAX_TOKENS 8  // batches of more tokens fill the GPU without splits
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

// the slots token t reads, [first, last], and the chunk of them a split takes: n_active splits take one each, the
// others none (a short context is one block's, whatever the grid)
struct att_range {
    int64_t first, last, chunk;
    int n_active;
};

static __device__ __forceinline__ att_range attention_range(const char *pos, int64_t pos_nb0, int64_t t, int64_t n_ctx,
                                                           int window, int n_split) {
    att_range r;
    r.last = *(const int32_t *)(pos + t * pos_nb0);
    if (r.last >= n_ctx) r.last = n_ctx - 1;
    r.first = window && r.last >= window ? r.last - window + 1 : 0;
    const int64_t len = r.last - r.first + 1;
    r.chunk = max((int64_t)ATT_SPLIT_SLOTS, (len + n_split - 1) / n_split);
    r.n_active = (int)((len + r.chunk - 1) / r.chunk);
    return r;
}

// a block's n partial states of (head h, token t) (running max, sum and weighted values, row j of sh_acc with
// `stride` floats) merged into the output, or into the split's state (max, sum, values not yet divided) where the
// slots are split; sh_cw: n floats of scratch
static __device__ void attention_finish(const float *sh_m, const float *sh_l, const float *sh_acc, float *sh_cw, int n,
                                        int stride, const cuda_view &q, int h, int64_t t, const float *sinks,
                                        const cuda_view &dst, float *state) {
    const int hd = (int)q.ne[0];
    float m_all = sinks && !state ? sinks[h] : -INFINITY; // a sink counts in the softmax's sum, adds no value
    for (int j = 0; j < n; j++) m_all = fmaxf(m_all, sh_m[j]);
    for (int j = threadIdx.x; j < n; j += blockDim.x)
        sh_cw[j] = sh_l[j] > 0.0f ? expf(sh_m[j] - m_all) : 0.0f; // a state without slots adds nothing
    __syncthreads();
    float l_all = sinks && !state ? expf(sinks[h] - m_all) : 0.0f;
    for (int j = 0; j < n; j++) l_all += sh_l[j] * sh_cw[j];
    float *out = (float *)(dst.data + t * dst.nb[1]) + (int64_t)h * hd; // (hd)
    float div = 1.0f / l_all;
    if (state) {
        out = state + ((blockIdx.z * q.ne[2] + t) * q.ne[1] + h) * (hd + 2);
        if (threadIdx.x == 0) {
            out[0] = m_all;
            out[1] = l_all;
        }
        out += 2;
        div = 1.0f;
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.0f;
        for (int j = 0; j < n; j++) o += sh_acc[j * stride + d] * sh_cw[j];
        out[d] = o * div;
    }
}

template <bool F16, int DPL>
__global__ void __launch_bounds__(ATT_WARPS * 32) attention_kernel(cuda_view q, cuda_view k, cuda_view v,
                                                                  const char *pos, int64_t pos_nb0, const float *sinks,
                                                                  cuda_view dst, float scale, int window, float *state) {
    __shared__ float sh_m[ATT_WARPS], sh_l[ATT_WARPS], sh_cw[ATT_WARPS];
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
    const att_range range = attention_range(pos, pos_nb0, t, k.ne[2], window, gridDim.z);
    if ((int)blockIdx.z >= range.n_active) return; // the whole block: a split past the context
    if (range.n_active == 1) state = nullptr; // one split: the output itself
    const int64_t first = range.first + blockIdx.z * range.chunk, last = min(range.last, first + range.chunk - 1);
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
    attention_finish(sh_m, sh_l, &sh_acc[0][0], sh_cw, ATT_WARPS, DPL * 32, q, h, t, sinks, dst, state);
}

// over an F16 cache, 16-byte loads: a row's D values over D / 8 lanes (at most 32), a warp taking 32 / that rows
// at a time, each lane group with its own online softmax (what the lane-per-value kernel above kept in flight left
// the HBM two thirds idle at depth 4096); two blocks an SM where 64 registers hold it (D = 64 and 512 spilled)
template <int D>
__global__ void __launch_bounds__(ATT_WARPS * 32, D == 64 || D == 512 ? 1 : 2)
    attention_f16_kernel(cuda_view q, cuda_view k, cuda_view v, const char *pos, int64_t pos_nb0, const float *sinks,
                         cuda_view dst, float scale, int window, float *state) {
    constexpr int CH = D / 8, LPR = CH < 32 ? CH : 32, RPW = 32 / LPR, CPL = CH / LPR, NS = ATT_WARPS * RPW;
    __shared__ float sh_m[NS], sh_l[NS], sh_cw[NS];
    __shared__ float sh_acc[NS][D];
    const int h = blockIdx.x, lane = threadIdx.x % 32, w = threadIdx.x / 32, sub = lane % LPR, row = lane / LPR;
    const int64_t t = blockIdx.y;
    const int64_t g = h / (q.ne[1] / k.ne[1]); // kv head of this query head
    const att_range range = attention_range(pos, pos_nb0, t, k.ne[2], window, gridDim.z);
    if ((int)blockIdx.z >= range.n_active) return;
    if (range.n_active == 1) state = nullptr;
    const int64_t first = range.first + blockIdx.z * range.chunk, last = min(range.last, first + range.chunk - 1);
    const float *qrow = (const float *)(q.data + h * q.nb[1] + t * q.nb[2]);
    float qr[CPL][8], acc[CPL][8];
#pragma unroll
    for (int c = 0; c < CPL; c++)
#pragma unroll
        for (int i = 0; i < 8; i++) {
            qr[c][i] = qrow[(c * LPR + sub) * 8 + i] * scale;
            acc[c][i] = 0.0f;
        }
    const char *kbase = k.data + g * k.nb[1] + sub * 16, *vbase = v.data + g * v.nb[1] + sub * 16;
    float mx = -INFINITY, sum = 0.0f;
    // the warp's rows, two steps of NS slots at a time (all four loads in flight before the math); every lane runs
    // every step (the shuffles), a slot past the split counts nothing
    for (int64_t base = first + w * RPW; base <= last; base += 2 * NS) {
        const int64_t s1 = base + row, s2 = s1 + NS;
        const bool ok1 = s1 <= last, ok2 = s2 <= last;
        uint4 k1[CPL], k2[CPL], v1[CPL], v2[CPL];
#pragma unroll
        for (int c = 0; c < CPL; c++) {
            const uint4 zero = make_uint4(0, 0, 0, 0);
            k1[c] = ok1 ? *(const uint4 *)(kbase + s1 * k.nb[2] + c * LPR * 16) : zero;
            k2[c] = ok2 ? *(const uint4 *)(kbase + s2 * k.nb[2] + c * LPR * 16) : zero;
            v1[c] = ok1 ? *(const uint4 *)(vbase + s1 * v.nb[2] + c * LPR * 16) : zero;
            v2[c] = ok2 ? *(const uint4 *)(vbase + s2 * v.nb[2] + c * LPR * 16) : zero;
        }
        float d1 = 0.0f, d2 = 0.0f;
#pragma unroll
        for (int c = 0; c < CPL; c++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float2 a = __half22float2(((const __half2 *)&k1[c])[i]);
                const float2 b = __half22float2(((const __half2 *)&k2[c])[i]);
                d1 += qr[c][2 * i] * a.x + qr[c][2 * i + 1] * a.y;
                d2 += qr[c][2 * i] * b.x + qr[c][2 * i + 1] * b.y;
            }
#pragma unroll
        for (int o = LPR / 2; o > 0; o >>= 1) {
            d1 += __shfl_xor_sync(0xffffffffu, d1, o);
            d2 += __shfl_xor_sync(0xffffffffu, d2, o);
        }
        const float score1 = ok1 ? d1 : -INFINITY, score2 = ok2 ? d2 : -INFINITY;
        const float mnew = fmaxf(mx, fmaxf(score1, score2));
        if (mnew == -INFINITY) continue; // no slot of this lane group yet
        const float cf = expf(mx - mnew), p1 = expf(score1 - mnew), p2 = expf(score2 - mnew);
        sum = sum * cf + p1 + p2;
#pragma unroll
        for (int c = 0; c < CPL; c++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float2 a = __half22float2(((const __half2 *)&v1[c])[i]);
                const float2 b = __half22float2(((const __half2 *)&v2[c])[i]);
                acc[c][2 * i] = acc[c][2 * i] * cf + p1 * a.x + p2 * b.x;
                acc[c][2 * i + 1] = acc[c][2 * i + 1] * cf + p1 * a.y + p2 * b.y;
            }
        mx = mnew;
    }
    const int j = w * RPW + row;
    if (sub == 0) {
        sh_m[j] = mx;
        sh_l[j] = sum;
    }
#pragma unroll
    for (int c = 0; c < CPL; c++)
#pragma unroll
        for (int i = 0; i < 8; i++) sh_acc[j][(c * LPR + sub) * 8 + i] = acc[c][i];
    __syncthreads();
    attention_finish(sh_m, sh_l, &sh_acc[0][0], sh_cw, NS, D, q, h, t, sinks, dst, state);
}

// the splits' states of one (head, token) merged into its output; a block each
__global__ void attention_merge_kernel(const float *states, const char *pos, int64_t pos_nb0, const float *sinks,
                                       cuda_view dst, int64_t n_ctx, int window, int n_split, int hd) {
    const int64_t h = blockIdx.x, t = blockIdx.y, nh = gridDim.x, stride = nh * gridDim.y * (hd + 2);
    const int n_active = attention_range(pos, pos_nb0, t, n_ctx, window, n_split).n_active;
    if (n_active == 1) return; // its split wrote the output
    const float *first = states + (t * nh + h) * (hd + 2);
    float m = sinks ? sinks[h] : -INFINITY;
    for (int z = 0; z < n_active; z++) m = fmaxf(m, first[z * stride]);
    float l = sinks ? expf(sinks[h] - m) : 0.0f;
    for (int z = 0; z < n_active; z++) l += first[z * stride + 1] * expf(first[z * stride] - m);
    float *out = (float *)(dst.data + t * dst.nb[1]) + h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.0f;
        for (int z = 0; z < n_active; z++) o += first[z * stride + 2 + d] * expf(first[z * stride] - m);
        out[d] = o / l;
    }
}

// splits of a decode step's slots: fixed by the cache's size, not the depth (a captured graph replays its grid)
static int attention_splits(const struct ggml_tensor *dst) {
    const struct ggml_tensor *q = dst->src[0], *k = dst->src[1];
    if (q->ne[2] > ATT_SPLIT_MAX_TOKENS) return 1;
    const int64_t n = k->ne[2] / (2 * ATT_SPLIT_SLOTS);
    return (int)(n < 1 ? 1 : n > ATT_MAX_SPLITS ? ATT_MAX_SPLITS : n);
}

size_t cuda_attention_wsize(const struct ggml_tensor *dst) {
    const struct ggml_tensor *q = dst->src[0];
    const int n_split = attention_splits(dst);
    return n_split > 1 ? (size_t)n_split * q->ne[2] * q->ne[1] * (q->ne[0] + 2) * sizeof(float) : 0;
}

int cuda_op_attention(struct ggml_tensor *dst, void *wdata, cudaStream_t st) {
    const struct ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *pos = dst->src[3];
    if (q->type != GGML_TYPE_F32 || k->type != v->type || (k->type != GGML_TYPE_F32 && k->type != GGML_TYPE_F16))
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "attention on CUDA: F32 q over an F32 or F16 cache");
    if (q->ne[0] > ATT_MAX_DPL * 32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "attention on CUDA: head size %lld > %d", (long long)q->ne[0],
                              ATT_MAX_DPL * 32);
    if (q->ne[1] > 65535 || q->ne[2] > 65535)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "attention on CUDA: too many heads or tokens");
    if (cuda_attention_mma_takes(dst)) return cuda_attention_mma(dst, st);
    const int n_split = attention_splits(dst);
    const dim3 grid((unsigned)q->ne[1], (unsigned)q->ne[2], (unsigned)n_split);
    const float scale = ggml_op_param_f32(dst, 0);
    const int window = dst->op_params[1];
    const float *sinks = dst->src[4] ? (const float *)dst->src[4]->data : nullptr;
    float *states = n_split > 1 ? (float *)wdata : nullptr;
    const bool f16 = k->type == GGML_TYPE_F16, wide = q->ne[0] > ATT_NARROW_DPL * 32;
    void (*kernel)(cuda_view, cuda_view, cuda_view, const char *, int64_t, const float *, cuda_view, float, int,
                   float *) = f16 ? (wide ? attention_kernel<true, ATT_MAX_DPL> : attention_kernel<true, ATT_NARROW_DPL>)
                                  : (wide ? attention_kernel<false, ATT_MAX_DPL> : attention_kernel<false, ATT_NARROW_DPL>);
    const bool aligned = ((uintptr_t)k->data | (uintptr_t)v->data | k->nb[1] | k->nb[2] | v->nb[1] | v->nb[2]) % 16 == 0;
    if (f16 && aligned) switch (q->ne[0]) { // head sizes of whole 16-byte chunks that share a warp evenly
        case 16: kernel = attention_f16_kernel<16>; break;
        case 32: kernel = attention_f16_kernel<32>; break;
        case 64: kernel = attention_f16_kernel<64>; break;
        case 128: kernel = attention_f16_kernel<128>; break;
        case 256: kernel = attention_f16_kernel<256>; break;
        case 512: kernel = attention_f16_kernel<512>; break;
        default: break;
        }
    kernel<<<grid, ATT_WARPS * 32, 0, st>>>(cuda_view_of(q), cuda_view_of(k), cuda_view_of(v), (const char *)pos->data,
                                           (int64_t)pos->nb[0], sinks, cuda_view_of(dst), scale, window, states);
    if (n_split > 1) {
        const int err = cuda_launch_status("attention");
        if (err) return err;
        attention_merge_kernel<<<dim3((unsigned)q->ne[1], (unsigned)q->ne[2]), 128, 0, st>>>(
            states, (const char *)pos->data, (int64_t)pos->nb[0], sinks, cuda_view_of(dst), k->ne[2], window, n_split,
            (int)q->ne[0]);
    }
    return cuda_launch_status("attention");
}
