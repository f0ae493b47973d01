// norm.cu: rms_norm and layer_norm, one block per row (two passes over the row, sums in F32 per thread
// then reduced across the block).
#include "common.cuh"

__global__ void norm_kernel(cuda_view a, cuda_view dst, bool layer, float eps) {
    __shared__ float sh[32];
    const int64_t n = a.ne[0], r = blockIdx.x;
    const float *x = (const float *)cuda_row(a, r); // (n)
    float *y = (float *)cuda_row(dst, r);           // (n)
    float mean = 0.0f;
    if (layer) {
        float s = 0.0f;
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
        mean = block_sum(s, sh) / (float)n;
    }
    float s2 = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float d = x[i] - mean;
        s2 += d * d;
    }
    const float inv = rsqrtf(block_sum(s2, sh) / (float)n + eps);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) y[i] = (x[i] - mean) * inv;
}

int cuda_op_norm(struct ggml_tensor *dst, cudaStream_t st) {
    const struct ggml_tensor *a = dst->src[0];
    if (a->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "norms take F32 rows");
    const int64_t nrows = ggml_nrows(a);
    if (nrows > INT32_MAX) return ggml_set_error(GGML_STATUS_UNSUPPORTED, "norm: too many rows");
    norm_kernel<<<(unsigned)nrows, CUDA_BLOCK, 0, st>>>(cuda_view_of(a), cuda_view_of(dst),
                                                        dst->op == GGML_OP_LAYER_NORM, ggml_op_param_f32(dst, 0));
    return cuda_launch_status("norm");
}
