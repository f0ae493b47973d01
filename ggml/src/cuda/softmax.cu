// softmax.cu: softmax(scale * x) per row, columns j > pos[row] masked (zeros), one block per row.
#include "common.cuh"

__global__ void soft_max_kernel(cuda_view a, cuda_view dst, const char *pos, int64_t pos_nb0, float scale) {
    __shared__ float sh[32];
    const int64_t n = a.ne[0], r = blockIdx.x;
    const float *x = (const float *)cuda_row(a, r); // (n)
    float *y = (float *)cuda_row(dst, r);           // (n)
    int64_t nv = n; // columns kept
    if (pos) {
        const int64_t p = *(const int32_t *)(pos + r * pos_nb0);
        nv = p + 1 < n ? (p + 1 > 0 ? p + 1 : 0) : n;
    }
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) mx = fmaxf(mx, x[j] * scale);
    mx = block_max(mx, sh);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) sum += expf(x[j] * scale - mx);
    const float inv = 1.0f / block_sum(sum, sh); // a fully masked row (negative position) gives NaN
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) y[j] = j < nv ? expf(x[j] * scale - mx) * inv : 0.0f;
}

int cuda_op_soft_max(struct ggml_tensor *dst, cudaStream_t st) {
    const struct ggml_tensor *a = dst->src[0], *pos = dst->src[1];
    if (a->type != GGML_TYPE_F32) return ggml_set_error(GGML_STATUS_UNSUPPORTED, "soft_max takes F32");
    const int64_t nrows = ggml_nrows(a);
    if (nrows > INT32_MAX) return ggml_set_error(GGML_STATUS_UNSUPPORTED, "soft_max: too many rows");
    soft_max_kernel<<<(unsigned)nrows, CUDA_BLOCK, 0, st>>>(cuda_view_of(a), cuda_view_of(dst),
                                                            pos ? (const char *)pos->data : NULL,
                                                            pos ? (int64_t)pos->nb[0] : 0, ggml_op_param_f32(dst, 0));
    return cuda_launch_status("soft_max");
}
