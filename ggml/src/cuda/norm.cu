// norm.cu: rms_norm and layer_norm, one block per row, optionally times a weight row (the norm -> mul
// fusion). A decode step normalizes a single row, so the kernel is latency-bound: rows of 16-byte
// aligned float4s are read once into registers (NORM_VECS per thread) and every pass works from there;
// other rows take a strided loop that reads the row once per pass. Fused with the mul by the norm
// weight, the kernel can also leave its output quantized to Q8_1 for the GEMVs that read it.
#include "common.cuh"

#define NORM_VECS 4 // float4s a thread holds: rows up to 1024 * 4 * 4 = 16384 values take the fast kernel

// w: NULL, or the weight row the normalized row is multiplied by
__global__ void norm_kernel(cuda_view a, cuda_view dst, bool layer, float eps, const float *w) {
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
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) y[i] = w ? (x[i] - mean) * inv * w[i] : (x[i] - mean) * inv;
}

// xq, xds: NULL, or where the output goes as Q8_1 too (row r at xq + r * n, xds + r * n / 32; n % 32 == 0)
__global__ void norm_vec_kernel(cuda_view a, cuda_view dst, bool layer, float eps, const float *w, int8_t *xq,
                                float2 *xds) {
    __shared__ float sh[32];
    const int64_t n = a.ne[0], n4 = n / 4, r = blockIdx.x;
    const float4 *x = (const float4 *)cuda_row(a, r);
    float4 *y = (float4 *)cuda_row(dst, r);
    float4 v[NORM_VECS], g[NORM_VECS]; // the weight is loaded with x: in decoding it comes from DRAM
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_VECS; j++) {
        const int64_t i = threadIdx.x + j * (int64_t)blockDim.x;
        v[j] = i < n4 ? x[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        g[j] = w && i < n4 ? __ldg((const float4 *)w + i) : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
        s += v[j].x + v[j].y + v[j].z + v[j].w;
    }
    const float mean = layer ? block_sum(s, sh) / (float)n : 0.0f;
    float s2 = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_VECS; j++) {
        if (threadIdx.x + j * (int64_t)blockDim.x >= n4) break;
        const float4 d = make_float4(v[j].x - mean, v[j].y - mean, v[j].z - mean, v[j].w - mean);
        s2 += d.x * d.x + d.y * d.y + d.z * d.z + d.w * d.w;
    }
    const float inv = rsqrtf(block_sum(s2, sh) / (float)n + eps);
#pragma unroll
    for (int j = 0; j < NORM_VECS; j++) {
        const int64_t i = threadIdx.x + j * (int64_t)blockDim.x;
        if (i >= n4 && !xq) break;
        const bool in = i < n4; // with xq every lane stays for the shuffles (groups lie wholly in or out)
        float4 o = make_float4((v[j].x - mean) * inv, (v[j].y - mean) * inv, (v[j].z - mean) * inv, (v[j].w - mean) * inv);
        if (w) o = make_float4(o.x * g[j].x, o.y * g[j].y, o.z * g[j].z, o.w * g[j].w);
        if (in) y[i] = o;
        if (xq) { // a Q8_1 block is 32 values: 8 float4s of 8 neighbouring lanes (quantize_q8_1_kernel's rounding)
            float amax = fmaxf(fmaxf(fabsf(o.x), fabsf(o.y)), fmaxf(fabsf(o.z), fabsf(o.w)));
#pragma unroll
            for (int m = 1; m < 8; m <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
            const float d = amax / 127.0f;
            const int q0 = d > 0.0f ? (int)roundf(o.x / d) : 0, q1 = d > 0.0f ? (int)roundf(o.y / d) : 0;
            const int q2 = d > 0.0f ? (int)roundf(o.z / d) : 0, q3 = d > 0.0f ? (int)roundf(o.w / d) : 0;
            float sum = (float)(q0 + q1 + q2 + q3);
#pragma unroll
            for (int m = 1; m < 8; m <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
            if (in) {
                char4 packed = make_char4((signed char)q0, (signed char)q1, (signed char)q2, (signed char)q3);
                ((char4 *)(xq + r * n))[i] = packed;
                if (i % 8 == 0) xds[r * (n / 32) + i / 8] = make_float2(d, d * sum);
            }
        }
    }
}

static bool at16(const void *p, int64_t stride) { return (uintptr_t)p % 16 == 0 && stride % 16 == 0; }

// wdata: NULL, or the scratch where dst goes as Q8_1 too (as cuda_quantize_q8_1 lays it out)
static int norm_launch(const struct ggml_tensor *norm, const float *w, struct ggml_tensor *dst, void *wdata,
                       cudaStream_t st) {
    const struct ggml_tensor *a = norm->src[0];
    if (a->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "norms take F32 rows");
    const int64_t nrows = ggml_nrows(a), n = a->ne[0];
    if (nrows > INT32_MAX) return ggml_set_error(GGML_STATUS_UNSUPPORTED, "norm: too many rows");
    const bool layer = norm->op == GGML_OP_LAYER_NORM;
    const float eps = ggml_op_param_f32(norm, 0);
    bool vec = n % 4 == 0 && n <= 1024 * 4 * NORM_VECS && (!w || (uintptr_t)w % 16 == 0);
    for (int d = 1; d < 4 && vec; d++) vec = at16(a->data, (int64_t)a->nb[d]) && at16(dst->data, (int64_t)dst->nb[d]);
    const bool xq_here = wdata && vec && n % 32 == 0 && dst->nb[1] == (size_t)n * sizeof(float);
    int8_t *xq = NULL;
    float2 *xds = NULL;
    if (xq_here) cuda_xq_at(wdata, n, nrows, &xq, &xds);
    if (vec) {
        const int64_t per = (n / 4 + NORM_VECS - 1) / NORM_VECS; // threads that cover the row
        const unsigned threads = (unsigned)((per + 31) / 32 * 32);
        norm_vec_kernel<<<(unsigned)nrows, threads, 0, st>>>(cuda_view_of(a), cuda_view_of(dst), layer, eps, w, xq, xds);
    } else {
        norm_kernel<<<(unsigned)nrows, CUDA_BLOCK, 0, st>>>(cuda_view_of(a), cuda_view_of(dst), layer, eps, w);
    }
    int rc = cuda_launch_status("norm");
    if (rc || !wdata || xq_here) return rc;
    return cuda_quantize_q8_1((const float *)dst->data, (int64_t)dst->nb[1] / 4, n, nrows, wdata, st);
}

int cuda_op_norm(struct ggml_tensor *dst, cudaStream_t st) { return norm_launch(dst, NULL, dst, NULL, st); }

int cuda_norm_mul(const struct ggml_tensor *norm, const struct ggml_tensor *w, struct ggml_tensor *dst, void *wdata,
                  cudaStream_t st) {
    return norm_launch(norm, (const float *)w->data, dst, wdata, st);
}
