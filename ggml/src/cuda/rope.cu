// rope.cu: rotary embedding, normal (pairs 2i, 2i+1) and neox (pairs i, i + n_dims/2) modes; one thread
// per pair, angles in double as the CPU kernel (positions reach thousands of radians), each frequency divided
// by its factor where the model has them (Llama 3's rope_freqs), YaRN's blend (rope.h). Fused with a
// following kv_store, the rotated rows go straight into their cache slots.
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

__global__ void rope_kernel(cuda_view x, const char *pos, int64_t pos_nb0, rope_out o, int n_dims, bool neox,
                            double base, double fscale, double ext, double mscale, double lo, double hi,
                            const float *factors, int64_t nrows) {
    const int64_t hd = x.ne[0], half = n_dims / 2;
    const int64_t per_row = half + (hd - n_dims); // pairs, then the values passed through
    const int64_t n = per_row * nrows;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = e / per_row, i = e % per_row;
        const float *src = (const float *)cuda_row(x, r); // (hd)
        char *out = rope_row(o, r, x.ne[1], x.ne[2]);     // (hd)
        if (!out) continue;
        if (i >= half) {
            const int64_t j = n_dims + (i - half);
            rope_put(o, out, j, src[j]);
            continue;
        }
        const int64_t t = (r / x.ne[1]) % x.ne[2];
        const double pt = (double)*(const int32_t *)(pos + t * pos_nb0);
        const double theta =
            pt * ggml_rope_pair_freq((int)i, n_dims, base, fscale, factors ? factors[i] : 1.0, ext, lo, hi);
        const float c = (float)(cos(theta) * mscale), s = (float)(sin(theta) * mscale);
        const int64_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        const float a = src[i0], b = src[i1];
        rope_put(o, out, i0, a * c - b * s);
        rope_put(o, out, i1, a * s + b * c);
    }
}

static int rope_launch(const struct ggml_tensor *rope, const rope_out &o, cudaStream_t st) {
    const struct ggml_tensor *x = rope->src[0], *pos = rope->src[1];
    const int n_dims = rope->op_params[0], mode = rope->op_params[1];
    if (n_dims <= 0 || n_dims % 2 || n_dims > x->ne[0] || x->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "rope: bad n_dims %d for head size %lld", n_dims,
                              (long long)x->ne[0]);
    const int64_t nrows = ggml_nrows(x), n = (n_dims / 2 + x->ne[0] - n_dims) * nrows;
    int64_t blocks = (n + CUDA_BLOCK - 1) / CUDA_BLOCK;
    rope_kernel<<<(unsigned)(blocks < 65536 ? (blocks ? blocks : 1) : 65536), CUDA_BLOCK, 0, st>>>(
        cuda_view_of(x), (const char *)pos->data, (int64_t)pos->nb[0], o, n_dims, mode == GGML_ROPE_NEOX,
        (double)ggml_op_param_f32(rope, 2), (double)ggml_op_param_f32(rope, 3), (double)ggml_op_param_f32(rope, 4),
        (double)ggml_op_param_f32(rope, 5), (double)ggml_op_param_f32(rope, 6), (double)ggml_op_param_f32(rope, 7),
        rope->src[2] ? (const float *)rope->src[2]->data : NULL, nrows);
    return cuda_launch_status("rope");
}

int cuda_op_rope(struct ggml_tensor *dst, cudaStream_t st) {
    return rope_launch(dst, rope_out{cuda_view_of(dst), false, false, NULL, 0}, st);
}

int cuda_rope_store(const struct ggml_tensor *rope, struct ggml_tensor *store, cudaStream_t st) {
    const struct ggml_tensor *pos = store->src[2];
    if (store->type != GGML_TYPE_F32 && store->type != GGML_TYPE_F16)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "kv_store takes F32 rows into an F32/F16 cache");
    return rope_launch(rope, rope_out{cuda_view_of(store), true, store->type == GGML_TYPE_F16, (const char *)pos->data,
                                      (int64_t)pos->nb[0]}, st);
}
