// rope.cu: rotary embedding, normal (pairs 2i, 2i+1) and neox (pairs i, i + n_dims/2) modes; one thread
// per pair, angles in double as the CPU kernel (positions reach thousands of radians).
#include "common.cuh"

__global__ void rope_kernel(cuda_view x, const char *pos, int64_t pos_nb0, cuda_view dst, int n_dims, bool neox,
                            double base, double fscale, int64_t nrows) {
    const int64_t hd = x.ne[0], half = n_dims / 2;
    const int64_t per_row = half + (hd - n_dims); // pairs, then the values passed through
    const int64_t n = per_row * nrows;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = e / per_row, i = e % per_row;
        const float *src = (const float *)cuda_row(x, r); // (hd)
        float *out = (float *)cuda_row(dst, r);           // (hd)
        if (i >= half) {
            const int64_t j = n_dims + (i - half);
            out[j] = src[j];
            continue;
        }
        const int64_t t = (r / x.ne[1]) % x.ne[2];
        const double pt = (double)*(const int32_t *)(pos + t * pos_nb0) * fscale;
        const double theta = pt * pow(base, -2.0 * (double)i / n_dims);
        const float c = (float)cos(theta), s = (float)sin(theta);
        const int64_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        const float a = src[i0], b = src[i1];
        out[i0] = a * c - b * s;
        out[i1] = a * s + b * c;
    }
}

int cuda_op_rope(struct ggml_tensor *dst, cudaStream_t st) {
    const struct ggml_tensor *x = dst->src[0], *pos = dst->src[1];
    const int n_dims = dst->op_params[0], mode = dst->op_params[1];
    if (n_dims <= 0 || n_dims % 2 || n_dims > x->ne[0] || x->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "rope: bad n_dims %d for head size %lld", n_dims,
                              (long long)x->ne[0]);
    const int64_t nrows = ggml_nrows(x), n = (n_dims / 2 + x->ne[0] - n_dims) * nrows;
    int64_t blocks = (n + CUDA_BLOCK - 1) / CUDA_BLOCK;
    rope_kernel<<<(unsigned)(blocks < 65536 ? (blocks ? blocks : 1) : 65536), CUDA_BLOCK, 0, st>>>(
        cuda_view_of(x), (const char *)pos->data, (int64_t)pos->nb[0], cuda_view_of(dst), n_dims,
        mode == GGML_ROPE_NEOX, (double)ggml_op_param_f32(dst, 2), (double)ggml_op_param_f32(dst, 3), nrows);
    return cuda_launch_status("rope");
}
