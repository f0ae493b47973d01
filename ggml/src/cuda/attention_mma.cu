// attention_mma.cu: causal attention of a prompt batch over an F16 cache on tensor cores (mma.sync m16n8k16, F16
// inputs, F32 accumulators), the flash-attention way: a block takes FA_ROWS tokens of one query head (16 a warp) and
// reads the cache's slots in tiles of KT through shared memory, once per FA_ROWS tokens where the per-token kernel
// (attention.cu) reads them once per token; scores, the online softmax and the output stay in registers. q is
// rounded to F16 (times the scale and log2 e: the softmax runs on exp2), the probabilities too before they meet V.
#include "common.cuh"

#define FA_WARPS 4
#define FA_ROWS (16 * FA_WARPS) // tokens of a block
#define FA_MIN_TOKENS 16        // fewer: the per-token kernel (a tile's rows would go mostly unused)

// the per-thread pieces of an m16n8k16 tile (PTX ISA "mma.m16n8k16"): with g = lane / 4, c = lane % 4, the
// accumulator holds rows g and g + 8 at columns 2c and 2c + 1; A (16 x 16) the same rows at columns 2c, 2c + 1 and
// 2c + 8, 2c + 9; B (16 x 8) column g at rows 2c, 2c + 1 and 2c + 8, 2c + 9
static __device__ __forceinline__ void mma_16816(float acc[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// B of an m16n8k16 from a row-major 16 x 8 block of halves (rows: the reduced dimension), transposed on the way:
// lanes 0-15 name the 16 rows
static __device__ __forceinline__ void ldmatrix_b_trans(uint32_t &b0, uint32_t &b1, const __half *row) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];" : "=r"(b0), "=r"(b1) : "r"(addr));
}

static __device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *(const uint32_t *)&h;
}

static __device__ __forceinline__ uint32_t shared_u32(const __half *p) { return *(const uint32_t *)p; }

// KT rows of D halves from a cache (rows s0.., columns c0..) into shared rows of stride `stride`; rows past `hi`
// are zeros (slots no token of the block may read: never written, maybe not even finite)
template <int D, int KT>
static __device__ __forceinline__ void load_tile(__half *dst, int stride, const char *base, int64_t nb_slot, int s0,
                                                 int hi, int c0) {
    for (int e = threadIdx.x; e < KT * (D / 8); e += FA_WARPS * 32) {
        const int r = e / (D / 8), ch = e % (D / 8);
        uint4 val = make_uint4(0, 0, 0, 0);
        if (s0 + r <= hi) val = *(const uint4 *)(base + (int64_t)(s0 + r) * nb_slot + (int64_t)(c0 + ch * 8) * 2);
        *(uint4 *)(dst + r * stride + ch * 8) = val;
    }
}

// D: head size; DV: the output columns a block writes (blockIdx.z picks which); KT: slots a tile
template <int D, int DV, int KT>
__global__ void __launch_bounds__(FA_WARPS * 32) attention_mma_kernel(cuda_view q, cuda_view k, cuda_view v,
                                                                      const char *pos, int64_t pos_nb0,
                                                                      const float *sinks, cuda_view dst, float scale,
                                                                      int window) {
    constexpr int QS = D + 8, KS = D + 8, VS = DV + 8; // row strides in halves: each row 4 banks past the last
    extern __shared__ __align__(16) unsigned char fa_shared[];
    __half *sq = (__half *)fa_shared;  // (FA_ROWS, QS) the block's q rows
    __half *sk = sq + FA_ROWS * QS;    // (KT, KS) a tile of keys
    __half *sv = sk + KT * KS;         // (KT, VS) a tile of values, the block's DV columns
    __shared__ int s_lo, s_hi;
    const int h = blockIdx.y, dv0 = blockIdx.z * DV, lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const int g = lane / 4, c = lane % 4;
    const int64_t t0 = (int64_t)blockIdx.x * FA_ROWS, n_tok = q.ne[2], n_ctx = k.ne[2];
    const int64_t kvh = h / (q.ne[1] / k.ne[1]);
    const float qscale = scale * 1.4426950408889634f; // log2 e

    // each thread's two rows (g and g + 8 of its warp's 16): the slots they read, [first, last] (empty past the batch)
    int first[2], last[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int64_t t = t0 + w * 16 + g + 8 * r;
        first[r] = INT32_MAX;
        last[r] = -1;
        if (t < n_tok) {
            last[r] = min(*(const int32_t *)(pos + t * pos_nb0), (int)n_ctx - 1);
            first[r] = window && last[r] >= window ? last[r] - window + 1 : 0;
        }
    }
    if (threadIdx.x == 0) {
        s_lo = INT32_MAX;
        s_hi = -1;
    }
    for (int e = threadIdx.x; e < FA_ROWS * D; e += FA_WARPS * 32) {
        const int r = e / D, d = e % D;
        const int64_t t = t0 + r;
        const float x = t < n_tok ? *(const float *)(q.data + h * q.nb[1] + t * q.nb[2] + d * 4) * qscale : 0.0f;
        sq[r * QS + d] = __float2half_rn(x);
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; r++)
        if (last[r] >= 0) {
            atomicMin(&s_lo, first[r]);
            atomicMax(&s_hi, last[r]);
        }
    __syncthreads();
    const int lo = s_lo, hi = s_hi;
    // the warp's own slot range: tiles outside it are loaded for the others and skipped
    int w_lo = min(first[0], first[1]), w_hi = max(last[0], last[1]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        w_lo = min(w_lo, __shfl_xor_sync(0xffffffffu, w_lo, o));
        w_hi = max(w_hi, __shfl_xor_sync(0xffffffffu, w_hi, o));
    }

    float out[DV / 8][4];
#pragma unroll
    for (int n = 0; n < DV / 8; n++) out[n][0] = out[n][1] = out[n][2] = out[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}; // running max (log2 units) and this thread's sum
    const char *kbase = k.data + kvh * k.nb[1], *vbase = v.data + kvh * v.nb[1];
    const __half *qw = sq + w * 16 * QS;

    for (int s0 = lo; s0 <= hi; s0 += KT) {
        __syncthreads(); // the last tile's readers are done
        load_tile<D, KT>(sk, KS, kbase, k.nb[2], s0, hi, 0);
        load_tile<DV, KT>(sv, VS, vbase, v.nb[2], s0, hi, dv0);
        __syncthreads();
        if (w_hi < s0 || w_lo > s0 + KT - 1) continue;

        float s[KT / 8][4]; // scores of rows g, g + 8 at slots s0 + 8n + 2c, + 1
#pragma unroll
        for (int n = 0; n < KT / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            const __half *qa = qw + g * QS + kk * 16 + 2 * c;
            const uint32_t a[4] = {shared_u32(qa), shared_u32(qa + 8 * QS), shared_u32(qa + 8),
                                   shared_u32(qa + 8 * QS + 8)};
#pragma unroll
            for (int n = 0; n < KT / 8; n++) {
                const __half *kb = sk + (n * 8 + g) * KS + kk * 16 + 2 * c;
                mma_16816(s[n], a, shared_u32(kb), shared_u32(kb + 8));
            }
        }
        float corr[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float mx = -INFINITY;
#pragma unroll
            for (int n = 0; n < KT / 8; n++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int slot = s0 + n * 8 + 2 * c + j;
                    float &x = s[n][2 * r + j];
                    x = slot >= first[r] && slot <= last[r] ? x : -INFINITY;
                    mx = fmaxf(mx, x);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mnew = fmaxf(m[r], mx);
            const float base = mnew == -INFINITY ? 0.0f : mnew; // a row with no slot yet: every p is 0
            corr[r] = exp2f(m[r] - base);
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < KT / 8; n++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    float &x = s[n][2 * r + j];
                    x = exp2f(x - base);
                    sum += x;
                }
            l[r] = l[r] * corr[r] + sum;
            m[r] = mnew;
        }
#pragma unroll
        for (int n = 0; n < DV / 8; n++) {
            out[n][0] *= corr[0];
            out[n][1] *= corr[0];
            out[n][2] *= corr[1];
            out[n][3] *= corr[1];
        }
#pragma unroll
        for (int kk = 0; kk < KT / 16; kk++) {
            const uint32_t a[4] = {pack_half2(s[2 * kk][0], s[2 * kk][1]), pack_half2(s[2 * kk][2], s[2 * kk][3]),
                                   pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                   pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            const __half *vrow = sv + (kk * 16 + lane % 16) * VS;
#pragma unroll
            for (int n = 0; n < DV / 8; n++) {
                uint32_t b0, b1;
                ldmatrix_b_trans(b0, b1, vrow + n * 8);
                mma_16816(out[n], a, b0, b1);
            }
        }
    }

#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        float corr = 1.0f;
        if (sinks) { // a sink counts in the softmax's sum, adds no value
            const float sink = sinks[h] * 1.4426950408889634f, mf = fmaxf(m[r], sink);
            corr = exp2f(m[r] - mf);
            l[r] = l[r] * corr + exp2f(sink - mf);
        }
        const int64_t t = t0 + w * 16 + g + 8 * r;
        if (t >= n_tok) continue;
        const float f = l[r] > 0.0f ? corr / l[r] : 0.0f;
        float *o = (float *)(dst.data + t * dst.nb[1]) + (int64_t)h * q.ne[0] + dv0 + 2 * c;
#pragma unroll
        for (int n = 0; n < DV / 8; n++) {
            o[n * 8] = out[n][2 * r] * f;
            o[n * 8 + 1] = out[n][2 * r + 1] * f;
        }
    }
}

template <int D> struct mma_shape {
    static constexpr int KT = D <= 128 ? 64 : 32;
    static constexpr int DV = D <= 256 ? D : 256;
    static constexpr size_t shared = (size_t)(FA_ROWS * (D + 8) + KT * (D + 8) + KT * (DV + 8)) * 2;
};

template <int D> static int launch_mma(struct ggml_tensor *dst, cudaStream_t st) {
    typedef mma_shape<D> shape;
    const struct ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *pos = dst->src[3];
    void (*kernel)(cuda_view, cuda_view, cuda_view, const char *, int64_t, const float *, cuda_view, float, int) =
        attention_mma_kernel<D, shape::DV, shape::KT>;
    static bool opted_in = false; // shared memory past 48 KiB is asked for once per kernel
    if (!opted_in) {
        const int err = cuda_status(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shape::shared),
            "attention's shared memory");
        if (err) return err;
        opted_in = true;
    }
    const dim3 grid((unsigned)((q->ne[2] + FA_ROWS - 1) / FA_ROWS), (unsigned)q->ne[1], D / shape::DV);
    const float *sinks = dst->src[4] ? (const float *)dst->src[4]->data : nullptr;
    kernel<<<grid, FA_WARPS * 32, shape::shared, st>>>(cuda_view_of(q), cuda_view_of(k), cuda_view_of(v),
                                                      (const char *)pos->data, (int64_t)pos->nb[0], sinks,
                                                      cuda_view_of(dst), ggml_op_param_f32(dst, 0), dst->op_params[1]);
    return cuda_launch_status("attention (tensor cores)");
}

bool cuda_attention_mma_takes(const struct ggml_tensor *dst) {
    const struct ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2];
    const int64_t hd = q->ne[0];
    const bool aligned = ((uintptr_t)k->data | (uintptr_t)v->data | k->nb[1] | k->nb[2] | v->nb[1] | v->nb[2]) % 16 == 0;
    return k->type == GGML_TYPE_F16 && q->ne[2] >= FA_MIN_TOKENS && aligned && q->ne[1] <= 65535 &&
           (hd == 16 || hd == 32 || hd == 64 || hd == 80 || hd == 96 || hd == 128 || hd == 256 || hd == 512);
}

int cuda_attention_mma(struct ggml_tensor *dst, cudaStream_t st) {
    switch (dst->src[0]->ne[0]) {
    case 16: return launch_mma<16>(dst, st);
    case 32: return launch_mma<32>(dst, st);
    case 64: return launch_mma<64>(dst, st);
    case 80: return launch_mma<80>(dst, st);
    case 96: return launch_mma<96>(dst, st);
    case 128: return launch_mma<128>(dst, st);
    case 256: return launch_mma<256>(dst, st);
    default: return launch_mma<512>(dst, st);
    }
}
