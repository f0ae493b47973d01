// moe_gemm.cu: a prompt batch's experts as grouped GEMMs on tensor cores. The batch's (token, expert) pairs are
// sorted by expert on the device (count, scan, scatter: the ids never leave it, so the step stays one CUDA
// graph); then block (row tile, expert, pair tile) takes GT_ROWS of the expert's rows and up to GT_COLS of its
// pairs: the rows are dequantized to F16 in shared memory GT_K values at a time (slice32: any weight type), the
// pairs' inputs rounded to F16 beside them, and WMMA multiplies with F32 accumulators. Each expert's rows are
// read once per tile of its pairs instead of once per pair. Up: gate and up tiles together, act(gate) * up into
// act; down: act's rows in, the pair's routing weight times the result into part. Blocks past an expert's
// pairs return at once (the grid has room for every token going to one expert: a token's experts are distinct).
#include <mma.h>

#include "moe.cuh"

using namespace nvcuda;

#define GT_ROWS 64  // weight rows per block: 4 warps of 16
#define GT_COLS 32  // pairs per block: 2 fragments of 16 per warp
#define GT_K 64     // values per step along k (two 32-value slices)
#define GT_LD (GT_K + 8) // shared rows padded against bank conflicts

struct moe_sort {
    int *first;  // [n_local + 1] where each expert's pairs start in list
    int *cursor; // [n_local] pairs placed so far
    int *list;   // [pairs] pair indices, grouped by expert
};

size_t moe_gemm_wsize(int64_t n_local, int64_t pairs) {
    return align256((size_t)(n_local + 1) * 4) + align256((size_t)n_local * 4) + align256((size_t)pairs * 4);
}

static moe_sort moe_sort_at(void *wdata, int64_t n_local) {
    char *w = (char *)wdata;
    moe_sort s;
    s.first = (int *)w;
    s.cursor = (int *)(w + align256((size_t)(n_local + 1) * 4));
    s.list = (int *)(w + align256((size_t)(n_local + 1) * 4) + align256((size_t)n_local * 4));
    return s;
}

__global__ void moe_count_kernel(moe_params p, moe_sort s) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.k * p.m; i += (int64_t)gridDim.x * blockDim.x) {
        const int32_t e = moe_slot(p, i);
        if (e >= 0) atomicAdd(&s.first[e + 1], 1);
    }
}

__global__ void moe_scan_kernel(int64_t n_local, moe_sort s) { // one thread: n_local is hundreds at most
    for (int64_t e = 0; e < n_local; e++) s.first[e + 1] += s.first[e];
}

__global__ void moe_scatter_kernel(moe_params p, moe_sort s) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.k * p.m; i += (int64_t)gridDim.x * blockDim.x) {
        const int32_t e = moe_slot(p, i);
        if (e >= 0) s.list[s.first[e] + atomicAdd(&s.cursor[e], 1)] = (int)i;
    }
}

// out[pair][row] for the block's tile: W rows (R of them, k values each, nb1 bytes apart) times the pairs' input
// rows (F32, in[x_row(pair)] with ld floats apart); GLU: W2 (up) too, out = act(W x) * (W2 x)
template <int TYPE, bool GLU>
__global__ void __launch_bounds__(128) moe_gemm_kernel(moe_params p, moe_sort s, const uint8_t *w, const uint8_t *w2,
                                                       int64_t nb1, int64_t nb2, int64_t R, int64_t K,
                                                       const float *in, int64_t ld, bool in_by_token, float *out) {
    __shared__ __align__(32) __half sw[GLU ? 2 : 1][GT_ROWS][GT_LD];
    __shared__ __align__(32) __half sx[GT_COLS][GT_LD];
    __shared__ __align__(32) float so[GLU ? 2 : 1][GT_ROWS][GT_COLS + 4];
    __shared__ int s_pair[GT_COLS];
    const int e = blockIdx.y, tid = threadIdx.x, warp = tid / 32;
    const int start = s.first[e], count = s.first[e + 1] - start, c0 = blockIdx.z * GT_COLS;
    if (c0 >= count) return; // block-uniform
    const int64_t r0 = (int64_t)blockIdx.x * GT_ROWS;
    if (tid < GT_COLS) s_pair[tid] = c0 + tid < count ? s.list[start + c0 + tid] : -1;
    const uint8_t *we = w + e * nb2, *we2 = GLU ? w2 + e * nb2 : nullptr;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[GLU ? 2 : 1][2];
    for (int g = 0; g < (GLU ? 2 : 1); g++)
        for (int c = 0; c < 2; c++) wmma::fill_fragment(acc[g][c], 0.0f);
    __syncthreads();
    for (int64_t k0 = 0; k0 < K; k0 += GT_K) {
        { // the weight tile: thread t dequantizes row t / 2's slice t % 2 (of each matrix), stored 16 bytes at a time
            // (32 stores of a half each had been a block's busiest work)
            const int64_t row = r0 + tid / 2, sl = k0 / 32 + tid % 2;
            float f[32];
            for (int g = 0; g < (GLU ? 2 : 1); g++) {
                if (row < R && sl * 32 < K)
                    slice32<TYPE>((g ? we2 : we) + row * nb1, sl, K, f);
                else
                    for (int i = 0; i < 32; i++) f[i] = 0.0f;
                uint4 *dst = (uint4 *)&sw[g][tid / 2][(tid % 2) * 32];
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    uint4 v;
                    __half2 *h = (__half2 *)&v;
#pragma unroll
                    for (int i = 0; i < 4; i++) h[i] = __floats2half2_rn(f[8 * q + 2 * i], f[8 * q + 2 * i + 1]);
                    dst[q] = v;
                }
            }
        }
        for (int i = tid; i < GT_COLS * GT_K / 4; i += 128) { // the pairs' inputs, four values a thread
            const int c = i / (GT_K / 4), kk = 4 * (i % (GT_K / 4));
            const int pair = s_pair[c];
            const float *src = in + (int64_t)(in_by_token ? pair / p.k : pair) * ld + k0 + kk;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (pair >= 0 && k0 + kk + 4 <= K && ((uintptr_t)src & 15) == 0)
                v = *(const float4 *)src;
            else if (pair >= 0)
                for (int j = 0; j < 4 && k0 + kk + j < K; j++) (&v.x)[j] = src[j];
            __half2 *h = (__half2 *)&sx[c][kk];
            h[0] = __floats2half2_rn(v.x, v.y);
            h[1] = __floats2half2_rn(v.z, v.w);
        }
        __syncthreads();
        for (int kk = 0; kk < GT_K; kk += 16) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b[2];
            for (int c = 0; c < 2; c++) wmma::load_matrix_sync(b[c], &sx[16 * c][kk], GT_LD);
            for (int g = 0; g < (GLU ? 2 : 1); g++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
                wmma::load_matrix_sync(a, &sw[g][16 * warp][kk], GT_LD);
                for (int c = 0; c < 2; c++) wmma::mma_sync(acc[g][c], a, b[c], acc[g][c]);
            }
        }
        __syncthreads();
    }
    for (int g = 0; g < (GLU ? 2 : 1); g++)
        for (int c = 0; c < 2; c++)
            wmma::store_matrix_sync(&so[g][16 * warp][16 * c], acc[g][c], GT_COLS + 4, wmma::mem_row_major);
    __syncthreads();
    for (int i = tid; i < GT_ROWS * GT_COLS; i += 128) {
        const int r = i % GT_ROWS, c = i / GT_ROWS; // neighbouring threads: neighbouring rows of one pair
        const int pair = s_pair[c];
        if (pair < 0 || r0 + r >= R) continue;
        const float *b = moe_bias(p, pair);
        const int64_t row = r0 + r;
        const float v = GLU ? moe_act(p.kind, so[0][r][c] + (b ? b[row] : 0.0f),
                                      so[GLU ? 1 : 0][r][c] + (b ? b[p.n_ff + row] : 0.0f))
                            : p.wts[pair] * (so[0][r][c] + (b ? b[2 * p.n_ff + row] : 0.0f));
        out[(int64_t)pair * R + r0 + r] = v;
    }
}

template <bool GLU>
struct moe_gemm_launch {
    const moe_params &p;
    const moe_sort &s;
    dim3 grid;
    const uint8_t *w, *w2;
    int64_t nb1, nb2, R, K;
    const float *in;
    int64_t ld;
    bool by_token;
    float *out;
    cudaStream_t st;
    template <int TYPE> void run() const {
        moe_gemm_kernel<TYPE, GLU><<<grid, 128, 0, st>>>(p, s, w, w2, nb1, nb2, R, K, in, ld, by_token, out);
    }
};

int moe_gemm(const moe_params &p, enum ggml_type gate_type, enum ggml_type down_type, void *wdata, cudaStream_t st) {
    if (p.n_local > 65535) return ggml_set_error(GGML_STATUS_UNSUPPORTED, "moe_ffn: more than 65535 experts");
    const moe_sort s = moe_sort_at(wdata, p.n_local);
    int rc;
    if ((rc = cuda_status(cudaMemsetAsync(wdata, 0, moe_gemm_wsize(p.n_local, 0), st), "moe_ffn sort"))) return rc;
    const int64_t pairs = p.k * p.m, blocks = (pairs + 255) / 256;
    const unsigned nb = (unsigned)(blocks < 1024 ? blocks : 1024);
    moe_count_kernel<<<nb, 256, 0, st>>>(p, s);
    moe_scan_kernel<<<1, 1, 0, st>>>(p.n_local, s);
    moe_scatter_kernel<<<nb, 256, 0, st>>>(p, s);
    if ((rc = cuda_launch_status("moe_ffn sort"))) return rc;
    const unsigned tiles = (unsigned)((p.m + GT_COLS - 1) / GT_COLS); // an expert takes each token at most once
    const dim3 up_grid((unsigned)((p.n_ff + GT_ROWS - 1) / GT_ROWS), (unsigned)p.n_local, tiles);
    with_weight_type(gate_type, moe_gemm_launch<true>{p, s, up_grid, p.wg, p.wu, p.g_nb1, p.g_nb2, p.n_ff, p.d, p.x,
                                                      p.d, true, p.act, st});
    if ((rc = cuda_launch_status("moe_ffn gate and up (batch)"))) return rc;
    const dim3 down_grid((unsigned)((p.d + GT_ROWS - 1) / GT_ROWS), (unsigned)p.n_local, tiles);
    with_weight_type(down_type, moe_gemm_launch<false>{p, s, down_grid, p.wd, nullptr, p.d_nb1, p.d_nb2, p.d,
                                                       p.n_ff, p.act, p.n_ff, false, p.part, st});
    return cuda_launch_status("moe_ffn down (batch)");
}
