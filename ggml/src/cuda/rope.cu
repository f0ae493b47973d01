// rope.cu: rotary embedding, normal (pairs 2i, 2i+1) and neox (pairs i, i + n_dims/2) modes; one thread
// per pair, angles in double as the CPU kernel (positions reach thousands of radians), their sin and cos in
// float, each frequency divided by its factor where the model has them (Llama 3's rope_freqs), YaRN's blend
// (rope.h). Fused with a following kv_store, the rotated rows go straight into their cache slots.
#include "common.cuh"
#include "../rope.h"

// where rope writes: dst's rows, or (store) the slot of the row's head and token in the cache dst
struct rope_out {
    cuda_view dst;
    bool store, f16;         // f16: an F16 cache
    const char *pos;         // store: the cache position of each token
    int64_t pos_nb0;
};

// row r of the output (NULL: a token whose cache position is outside the cache, skipped)
static __device__ __forceinline__ char *rope_row(const rope_out &o, int64_t r, int64_t n_head, int64_t n_tok) {
    if (!o.store) return cuda_row(o.dst, r);
    const int64_t h = r % n_head, t = (r / n_head) % n_tok;
    const int64_t p = *(const int32_t *)(o.pos + t * o.pos_nb0);
    return p < 0 || p >= o.dst.ne[2] ? NULL : o.dst.data + h * o.dst.nb[1] + p * o.dst.nb[2];
}

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
    int64_t nrows;
};

static __device__ __forceinline__ void rope_rows(const rope_job &a, int64_t first, int64_t step) {
    const int64_t hd = a.x.ne[0], half = a.n_dims / 2;
    const int64_t per_row = half + (hd - a.n_dims); // pairs, then the values passed through
    const int64_t n = per_row * a.nrows;
    for (int64_t e = first; e < n; e += step) {
        const int64_t r = e / per_row, i = e % per_row;
        const float *src = (const float *)cuda_row(a.x, r); // (hd)
        char *out = rope_row(a.o, r, a.x.ne[1], a.x.ne[2]);  // (hd)
        if (!out) continue;
        if (i >= half) {
            const int64_t j = a.n_dims + (i - half);
            rope_put(a.o, out, j, src[j]);
            continue;
        }
        const int64_t t = (r / a.x.ne[1]) % a.x.ne[2];
        const double pt = (double)*(const int32_t *)(a.pos + t * a.pos_nb0);
        const double theta = pt * ggml_rope_pair_freq((int)i, a.n_dims, a.base, a.fscale,
                                                      a.factors ? a.factors[i] : 1.0, a.ext, a.lo, a.hi);
        // sin and cos in float of the angle's fraction of a turn (reduced in double: positions reach thousands
        // of radians); double sin and cos made this latency-bound kernel twice as slow as a copy
        const double turns = theta * (0.5 / M_PI);
        float s, c;
        sincospif(2.0f * (float)(turns - floor(turns)), &s, &c);
        s *= (float)a.mscale;
        c *= (float)a.mscale;
        const int64_t i0 = a.neox ? i : 2 * i, i1 = a.neox ? i + half : 2 * i + 1;
        const float x0 = src[i0], x1 = src[i1];
        rope_put(a.o, out, i0, x0 * c - x1 * s);
        rope_put(a.o, out, i1, x0 * s + x1 * c);
    }
}

__global__ void rope_kernel(rope_job a) {
    rope_rows(a, blockIdx.x * (int64_t)blockDim.x + threadIdx.x, (int64_t)gridDim.x * blockDim.x);
}

// q rotated into its rows, k rotated and v copied into their cache slots, one job per blockIdx.y
__global__ void rope_qkv_kernel(rope_job q, rope_job k, rope_job v) {
    const int64_t first = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, step = (int64_t)gridDim.x * blockDim.x;
    if (blockIdx.y == 0)
        rope_rows(q, first, step);
    else if (blockIdx.y == 1)
        rope_rows(k, first, step);
    else
        rope_rows(v, first, step);
}

static int rope_job_of(const struct ggml_tensor *rope, const rope_out &o, rope_job *a) {
    const struct ggml_tensor *x = rope->src[0], *pos = rope->src[1];
    const int n_dims = rope->op_params[0], mode = rope->op_params[1];
    if (n_dims <= 0 || n_dims % 2 || n_dims > x->ne[0] || x->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "rope: bad n_dims %d for head size %lld", n_dims,
                              (long long)x->ne[0]);
    *a = rope_job{cuda_view_of(x), (const char *)pos->data, (int64_t)pos->nb[0], o, n_dims, mode == GGML_ROPE_NEOX,
                  (double)ggml_op_param_f32(rope, 2), (double)ggml_op_param_f32(rope, 3),
                  (double)ggml_op_param_f32(rope, 4), (double)ggml_op_param_f32(rope, 5),
                  (double)ggml_op_param_f32(rope, 6), (double)ggml_op_param_f32(rope, 7),
                  rope->src[2] ? (const float *)rope->src[2]->data : NULL, ggml_nrows(x)};
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

static unsigned rope_blocks(const rope_job &a) {
    const int64_t n = (a.n_dims / 2 + a.x.ne[0] - a.n_dims) * a.nrows, blocks = (n + CUDA_BLOCK - 1) / CUDA_BLOCK;
    return (unsigned)(blocks < 65536 ? (blocks ? blocks : 1) : 65536);
}

static int rope_launch(const struct ggml_tensor *rope, const rope_out &o, cudaStream_t st) {
    rope_job a = {};
    int rc = rope_job_of(rope, o, &a);
    if (rc) return rc;
    rope_kernel<<<rope_blocks(a), CUDA_BLOCK, 0, st>>>(a);
    return cuda_launch_status("rope");
}

int cuda_op_rope(struct ggml_tensor *dst, cudaStream_t st) {
    return rope_launch(dst, rope_out{cuda_view_of(dst), false, false, NULL, 0}, st);
}

int cuda_rope_store(const struct ggml_tensor *rope, struct ggml_tensor *store, cudaStream_t st) {
    rope_out o = {};
    int rc = store_out(store, &o);
    return rc ? rc : rope_launch(rope, o, st);
}

int cuda_rope_qkv_store(const struct ggml_tensor *rope_q, const struct ggml_tensor *rope_k,
                        const struct ggml_tensor *store_k, const struct ggml_tensor *store_v, cudaStream_t st) {
    rope_out ok = {}, ov = {};
    rope_job q = {}, k = {}, v;
    int rc = store_out(store_k, &ok);
    if (!rc) rc = store_out(store_v, &ov);
    if (!rc) rc = rope_job_of(rope_q, rope_out{cuda_view_of(rope_q), false, false, NULL, 0}, &q);
    if (!rc) rc = rope_job_of(rope_k, ok, &k);
    if (rc) return rc;
    const struct ggml_tensor *vx = store_v->src[1];
    v = rope_job{cuda_view_of(vx), ov.pos, ov.pos_nb0, ov, 0, false, 0, 0, 0, 0, 0, 0, NULL, ggml_nrows(vx)};
    unsigned blocks = rope_blocks(q);
    if (rope_blocks(k) > blocks) blocks = rope_blocks(k);
    if (rope_blocks(v) > blocks) blocks = rope_blocks(v);
    rope_qkv_kernel<<<dim3(blocks, 3), CUDA_BLOCK, 0, st>>>(q, k, v);
    return cuda_launch_status("rope q, k and v");
}
