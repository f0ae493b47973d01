// rope.cu: rotary embedding, normal (pairs 2i, 2i+1) and neox (pairs i, i + n_dims/2) modes; a block per token
// and ROPE_WARPS heads, a warp a head: the token's pairs' angles once a block, in double as the CPU kernel (positions
// reach thousands of radians), their sin and cos in float, each frequency divided by its factor where the model has
// them (Llama 3's rope_freqs), YaRN's blend (rope.h). Fused with a following kv_store, the rotated rows go straight
// into their cache slots; fused after an RMS norm of each head times a weight (Qwen3's and Gemma's q and k norms), a
// warp norms its head in registers first.
#include "common.cuh"
#include "../rope.h"

#define ROPE_WARPS 8
#define ROPE_MAX_HD 512 // heads of up to 512 values: 16 a lane

// where rope writes: dst's rows, or (store) the slot of the row's head and token in the cache dst
struct rope_out {
    cuda_view dst;
    bool store, f16;         // f16: an F16 cache
    const char *pos;         // store: the cache position of each token
    int64_t pos_nb0;
};

static __device__ __forceinline__ void rope_put(const rope_out &o, char *row, int64_t j, float v) {
    if (o.f16)
        ((__half *)row)[j] = __float2half_rn(v);
    else
        ((float *)row)[j] = v;
}

// one rope of x's rows into o; with n_dims 0 every value passes through (a copy, e.g. v into its cache)
struct rope_job {
    cuda_view x;
    const char *pos; // the position of each token
    int64_t pos_nb0;
    rope_out o;
    int n_dims;
    bool neox;
    double base, fscale, ext, mscale, lo, hi;
    const float *factors;
    const float *norm_w; // RMS-norm each head first, times this weight (of the head's size), or NULL
    float norm_eps;
};

// heads h0 .. h0 + ROPE_WARPS - 1 of token group g (token g % n_tok of batch g / n_tok): each warp's values loaded
// first, the token's angles meanwhile, then rotated and stored (a thread a pair, angles and 64-bit row indices found
// again for every head and pair, had run 9x below the HBM rate)
static __device__ __forceinline__ void rope_heads(const rope_job &a, int64_t g, int64_t h0) {
    constexpr int ITEMS = ROPE_MAX_HD / 32;
    __shared__ float sh_c[ROPE_MAX_HD / 2], sh_s[ROPE_MAX_HD / 2];
    const int64_t n_tok = a.x.ne[2], t = g % n_tok, b = g / n_tok, h = h0 + threadIdx.x / 32;
    const int hd = (int)a.x.ne[0], half = a.n_dims / 2, per_row = half + hd - a.n_dims; // pairs, values passed
    const int lane = threadIdx.x % 32;
    const bool mine = h < a.x.ne[1];
    const float *src = (const float *)(a.x.data + h * a.x.nb[1] + t * a.x.nb[2] + b * a.x.nb[3]); // (hd)
    float x0[ITEMS], x1[ITEMS]; // item i = lane + 32 j: pair i's two values, or value n_dims + i - half
#pragma unroll
    for (int j = 0; j < ITEMS; j++) {
        const int i = lane + 32 * j;
        x0[j] = x1[j] = 0.0f;
        if (!mine || i >= per_row) continue;
        if (i < half) {
            x0[j] = src[a.neox ? i : 2 * i];
            x1[j] = src[a.neox ? i + half : 2 * i + 1];
        } else {
            x0[j] = src[a.n_dims + i - half];
        }
    }
    if (a.norm_w && mine) { // warp-uniform: the head is this warp's (values past it are zeros)
        float s2 = 0.0f;
#pragma unroll
        for (int j = 0; j < ITEMS; j++) s2 += x0[j] * x0[j] + x1[j] * x1[j];
        const float inv = rsqrtf(warp_sum(s2) / (float)hd + a.norm_eps);
#pragma unroll
        for (int j = 0; j < ITEMS; j++) {
            const int i = lane + 32 * j;
            if (i >= per_row) break;
            if (i < half) {
                x0[j] = x0[j] * inv * a.norm_w[a.neox ? i : 2 * i];
                x1[j] = x1[j] * inv * a.norm_w[a.neox ? i + half : 2 * i + 1];
            } else {
                x0[j] = x0[j] * inv * a.norm_w[a.n_dims + i - half];
            }
        }
    }
    const double pt = (double)*(const int32_t *)(a.pos + t * a.pos_nb0);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const double theta = pt * ggml_rope_pair_freq(i, a.n_dims, a.base, a.fscale, a.factors ? a.factors[i] : 1.0,
                                                      a.ext, a.lo, a.hi);
        // sin and cos in float of the angle's fraction of a turn (reduced in double); double sin and cos made the
        // kernel twice as slow as a copy
        const double turns = theta * (0.5 / M_PI);
        float sn, cs;
        sincospif(2.0f * (float)(turns - floor(turns)), &sn, &cs);
        sh_c[i] = cs * (float)a.mscale;
        sh_s[i] = sn * (float)a.mscale;
    }
    __syncthreads();
    if (!mine) return;
    char *out = a.o.dst.data + h * a.o.dst.nb[1] + t * a.o.dst.nb[2] + b * a.o.dst.nb[3]; // (hd)
    if (a.o.store) { // the token's cache slot; a position outside the cache is skipped
        const int64_t p = *(const int32_t *)(a.o.pos + t * a.o.pos_nb0);
        if (p < 0 || p >= a.o.dst.ne[2]) return;
        out = a.o.dst.data + h * a.o.dst.nb[1] + p * a.o.dst.nb[2];
    }
#pragma unroll
    for (int j = 0; j < ITEMS; j++) {
        const int i = lane + 32 * j;
        if (i >= per_row) break;
        if (i >= half) {
            rope_put(a.o, out, a.n_dims + i - half, x0[j]);
            continue;
        }
        const float c = sh_c[i], sn = sh_s[i];
        rope_put(a.o, out, a.neox ? i : 2 * i, x0[j] * c - x1[j] * sn);
        rope_put(a.o, out, a.neox ? i + half : 2 * i + 1, x0[j] * sn + x1[j] * c);
    }
}

__global__ void rope_kernel(rope_job a) { rope_heads(a, blockIdx.x, (int64_t)blockIdx.y * ROPE_WARPS); }

// q rotated into its rows, k rotated and v copied into their cache slots, one job per blockIdx.z
__global__ void rope_qkv_kernel(rope_job q, rope_job k, rope_job v) {
    const rope_job &a = blockIdx.z == 0 ? q : blockIdx.z == 1 ? k : v;
    if (blockIdx.y * ROPE_WARPS < a.x.ne[1]) rope_heads(a, blockIdx.x, (int64_t)blockIdx.y * ROPE_WARPS);
}

static int rope_job_of(const struct ggml_tensor *rope, const rope_out &o, rope_job *a) {
    const struct ggml_tensor *x = rope->src[0], *pos = rope->src[1];
    const int n_dims = rope->op_params[0], mode = rope->op_params[1];
    if (n_dims <= 0 || n_dims % 2 || n_dims > x->ne[0] || x->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "rope: bad n_dims %d for head size %lld", n_dims,
                              (long long)x->ne[0]);
    if (x->ne[0] > ROPE_MAX_HD)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "rope on CUDA: head size %lld > %d", (long long)x->ne[0],
                              ROPE_MAX_HD);
    *a = rope_job{cuda_view_of(x), (const char *)pos->data, (int64_t)pos->nb[0], o, n_dims, mode == GGML_ROPE_NEOX,
                  (double)ggml_op_param_f32(rope, 2), (double)ggml_op_param_f32(rope, 3),
                  (double)ggml_op_param_f32(rope, 4), (double)ggml_op_param_f32(rope, 5),
                  (double)ggml_op_param_f32(rope, 6), (double)ggml_op_param_f32(rope, 7),
                  rope->src[2] ? (const float *)rope->src[2]->data : NULL};
    return GGML_STATUS_OK;
}

// where a kv_store writes: its cache's slots at its positions
static int store_out(const struct ggml_tensor *store, rope_out *o) {
    if (store->type != GGML_TYPE_F32 && store->type != GGML_TYPE_F16)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "kv_store takes F32 rows into an F32/F16 cache");
    const struct ggml_tensor *pos = store->src[2];
    *o = rope_out{cuda_view_of(store), true, store->type == GGML_TYPE_F16, (const char *)pos->data, (int64_t)pos->nb[0]};
    return GGML_STATUS_OK;
}

// a block a token and ROPE_WARPS heads (one at least: a grid is never empty)
static dim3 rope_grid(const rope_job &a) {
    const int64_t n = a.x.ne[2] * a.x.ne[3];
    return dim3((unsigned)(n > 0 ? n : 1), (unsigned)((a.x.ne[1] + ROPE_WARPS - 1) / ROPE_WARPS));
}

// the job's rows RMS-normed per head first: norm's input (the rope's shape) times the weight of the mul between
// them (the rope's input)
static void rope_job_normed(rope_job *a, const struct ggml_tensor *norm, const struct ggml_tensor *rope) {
    const struct ggml_tensor *mul = rope->src[0], *w = mul->src[0] == norm ? mul->src[1] : mul->src[0];
    a->x = cuda_view_of(norm->src[0]);
    a->norm_w = (const float *)w->data;
    a->norm_eps = ggml_op_param_f32(norm, 0);
}

// one rope into o, its heads RMS-normed first where norm is not NULL
static int rope_launch(const struct ggml_tensor *rope, const rope_out &o, const struct ggml_tensor *norm,
                       cudaStream_t st) {
    rope_job a = {};
    int rc = rope_job_of(rope, o, &a);
    if (rc) return rc;
    if (norm) rope_job_normed(&a, norm, rope);
    rope_kernel<<<rope_grid(a), ROPE_WARPS * 32, 0, st>>>(a);
    return cuda_launch_status("rope");
}

int cuda_op_rope(struct ggml_tensor *dst, cudaStream_t st) {
    return rope_launch(dst, rope_out{cuda_view_of(dst), false, false, NULL, 0}, NULL, st);
}

int cuda_rope_store(const struct ggml_tensor *rope, struct ggml_tensor *store, cudaStream_t st) {
    rope_out o = {};
    int rc = store_out(store, &o);
    return rc ? rc : rope_launch(rope, o, NULL, st);
}

int cuda_norm_rope(const struct ggml_tensor *norm, const struct ggml_tensor *rope, struct ggml_tensor *store,
                   cudaStream_t st) {
    rope_out o = {cuda_view_of(rope), false, false, NULL, 0};
    const int rc = store ? store_out(store, &o) : GGML_STATUS_OK;
    return rc ? rc : rope_launch(rope, o, norm, st);
}

int cuda_rope_qkv_store(const struct ggml_tensor *rope_q, const struct ggml_tensor *norm_q,
                        const struct ggml_tensor *rope_k, const struct ggml_tensor *norm_k,
                        const struct ggml_tensor *store_k, const struct ggml_tensor *store_v, cudaStream_t st) {
    rope_out ok = {}, ov = {};
    rope_job q = {}, k = {}, v;
    int rc = store_out(store_k, &ok);
    if (!rc) rc = store_out(store_v, &ov);
    if (!rc) rc = rope_job_of(rope_q, rope_out{cuda_view_of(rope_q), false, false, NULL, 0}, &q);
    if (!rc) rc = rope_job_of(rope_k, ok, &k);
    if (rc) return rc;
    if (norm_q) rope_job_normed(&q, norm_q, rope_q);
    if (norm_k) rope_job_normed(&k, norm_k, rope_k);
    const struct ggml_tensor *vx = store_v->src[1];
    v = rope_job{cuda_view_of(vx), ov.pos, ov.pos_nb0, ov, 0, false, 0, 0, 0, 0, 0, 0, NULL};
    dim3 grid = rope_grid(q);
    grid.y = std::max(grid.y, std::max(rope_grid(k).y, rope_grid(v).y));
    grid.z = 3;
    rope_qkv_kernel<<<grid, ROPE_WARPS * 32, 0, st>>>(q, k, v);
    return cuda_launch_status("rope q, k and v");
}
