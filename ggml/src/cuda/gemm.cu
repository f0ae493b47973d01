// gemm.cu: mul_mat with many columns on tensor cores. cuBLAS is loaded at run time (dlopen, no build-time
// dependency): F16 and BF16 weights go in as they are, F32 weights as TF32, quantized weights are
// dequantized to F16 in row chunks in wdata; x is converted to the weights' 16-bit type; F32 accumulate.
// Without cuBLAS, the same F16 operands go through our WMMA kernel (every weight type dequantized to F16).
#include <dlfcn.h>
#include <mma.h>

#include "common.cuh"

// --- the few cuBLAS declarations we use (values from cublas_api.h / library_types.h) ---
typedef struct cublasContext *cublas_handle;
typedef int (*cublas_create_fn)(cublas_handle *);
typedef int (*cublas_set_stream_fn)(cublas_handle, cudaStream_t);
typedef int (*cublas_set_workspace_fn)(cublas_handle, void *, size_t);
typedef int (*cublas_gemm_ex_fn)(cublas_handle, int transa, int transb, int m, int n, int k, const void *alpha,
                                 const void *A, int Atype, int lda, const void *B, int Btype, int ldb,
                                 const void *beta, void *C, int Ctype, int ldc, int compute, int algo);
enum { BLAS_OP_N = 0, BLAS_OP_T = 1 };
enum { BLAS_R_32F = 0, BLAS_R_16F = 2, BLAS_R_16BF = 14 };
enum { BLAS_COMPUTE_32F = 68, BLAS_COMPUTE_32F_FAST_TF32 = 77 };
enum { BLAS_GEMM_DEFAULT = -1 };

#define GEMM_CHUNK_BYTES ((size_t)64 << 20) // F16 scratch for dequantized weight rows, unless the node asks less
#define BLAS_WORKSPACE ((size_t)32 << 20)

static struct {
    bool tried, ok;
    cublas_handle handle;
    cublas_set_stream_fn set_stream;
    cublas_gemm_ex_fn gemm_ex;
} g_blas;

bool cuda_blas_load(void) {
    if (g_blas.tried) return g_blas.ok;
    g_blas.tried = true;
    if (getenv("PYINFER_NO_CUBLAS")) return false; // tests the WMMA fallback
    void *lib = dlopen("libcublas.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libcublas.so.12", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libcublas.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return false;
    cublas_create_fn create = (cublas_create_fn)dlsym(lib, "cublasCreate_v2");
    cublas_set_workspace_fn set_ws = (cublas_set_workspace_fn)dlsym(lib, "cublasSetWorkspace_v2");
    g_blas.set_stream = (cublas_set_stream_fn)dlsym(lib, "cublasSetStream_v2");
    g_blas.gemm_ex = (cublas_gemm_ex_fn)dlsym(lib, "cublasGemmEx");
    if (!create || !g_blas.set_stream || !g_blas.gemm_ex || create(&g_blas.handle) != 0) return false;
    // a fixed workspace: cuBLAS then allocates nothing while a CUDA graph is being captured
    void *ws = NULL;
    if (set_ws && cuda_device_alloc(&ws, BLAS_WORKSPACE) == GGML_STATUS_OK) set_ws(g_blas.handle, ws, BLAS_WORKSPACE);
    cudaGetLastError();
    g_blas.ok = true;
    return true;
}

// weight rows dequantized per chunk: the node's scratch (ggml_set_gemm_scratch: a tight VRAM budget gives weights
// the room), at least 128 rows
static int64_t gemm_chunk_rows(const struct ggml_tensor *w, const struct ggml_tensor *node) {
    const int64_t k = w->ne[0], n = w->ne[1];
    const int32_t asked = node->op_params[GGML_GEMM_SCRATCH_PARAM];
    int64_t r = (int64_t)((asked > 0 ? (size_t)asked : GEMM_CHUNK_BYTES) / (2 * (size_t)k));
    r = r < 128 ? 128 : r / 128 * 128;
    return r < n ? r : n;
}

size_t cuda_gemm_wsize(const struct ggml_tensor *w, const struct ggml_tensor *x, const struct ggml_tensor *node) {
    const int64_t k = w->ne[0], m = x->ne[1];
    // (m, k) x in 16 bits, then (chunk, k) F16 weight rows (F16 weights are used in place)
    size_t bytes = align256((size_t)(m * k) * 2);
    if (w->type != GGML_TYPE_F16) bytes += align256((size_t)gemm_chunk_rows(w, node) * (size_t)k * 2);
    return bytes;
}

static __device__ __forceinline__ uint16_t to_16(float v, bool bf16) {
    return bf16 ? ggml_fp32_to_bf16(v) : __half_as_ushort(__float2half_rn(v));
}

// x's columns in 16 bits; with V = 4 (k and x_ld multiples of 4, x 16-byte aligned) four values a thread, one
// 16-byte load and one 8-byte store, as the elementwise kernels do (elementwise.cu)
template <int V>
__global__ void x_to_16_kernel(const float *x, int64_t x_ld, int64_t k, int64_t m, uint16_t *out, bool bf16) {
    const int64_t kv = k / V, n = kv * m;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t c = e / kv, i = (e % kv) * V;
        if constexpr (V == 1) {
            out[e] = to_16(x[c * x_ld + i], bf16);
        } else {
            const float4 v = *(const float4 *)(x + c * x_ld + i);
            *(ushort4 *)(out + c * k + i) = make_ushort4(to_16(v.x, bf16), to_16(v.y, bf16), to_16(v.z, bf16),
                                                         to_16(v.w, bf16));
        }
    }
}

// --- fallback: C[n, m] (column j at y + j * ldy) = A[n, k] (F16 rows) . B[m, k] (F16 rows), 32x32 tiles ---
#define WM_TILE 32
#define WM_K 16

__global__ void __launch_bounds__(128) wmma_gemm_kernel(const __half *A, const __half *B, float *y, int64_t ldy,
                                                        int64_t n, int64_t m, int64_t k) {
    using namespace nvcuda;
    __shared__ __align__(32) __half sa[WM_TILE * WM_K]; // (32 rows, 16 k)
    __shared__ __align__(32) __half sb[WM_TILE * WM_K]; // (32 cols, 16 k)
    __shared__ __align__(32) float sc[WM_TILE * WM_TILE]; // (32 cols, 32 rows)
    const int warp = threadIdx.x / 32, wr = warp % 2, wc = warp / 2;
    const int64_t r0 = (int64_t)blockIdx.x * WM_TILE, j0 = (int64_t)blockIdx.y * WM_TILE;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int64_t k0 = 0; k0 < k; k0 += WM_K) {
        for (int e = threadIdx.x; e < WM_TILE * WM_K; e += blockDim.x) {
            const int r = e / WM_K, kk = e % WM_K;
            const bool in_k = k0 + kk < k;
            sa[e] = in_k && r0 + r < n ? A[(r0 + r) * k + k0 + kk] : __float2half(0.0f);
            sb[e] = in_k && j0 + r < m ? B[(j0 + r) * k + k0 + kk] : __float2half(0.0f);
        }
        __syncthreads();
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb;
        wmma::load_matrix_sync(fa, sa + wr * 16 * WM_K, WM_K);
        wmma::load_matrix_sync(fb, sb + wc * 16 * WM_K, WM_K);
        wmma::mma_sync(acc, fa, fb, acc);
        __syncthreads();
    }
    wmma::store_matrix_sync(sc + wc * 16 * WM_TILE + wr * 16, acc, WM_TILE, wmma::mem_col_major);
    __syncthreads();
    for (int e = threadIdx.x; e < WM_TILE * WM_TILE; e += blockDim.x) {
        const int c = e / WM_TILE, r = e % WM_TILE;
        if (r0 + r < n && j0 + c < m) y[(j0 + c) * ldy + r0 + r] = sc[e];
    }
}

int cuda_gemm(const struct ggml_tensor *w, const struct ggml_tensor *x, struct ggml_tensor *y, void *wdata,
              cudaStream_t st, bool precise) {
    const enum ggml_type type = w->type;
    const int64_t k = w->ne[0], n = w->ne[1], m = x->ne[1];
    const int64_t ldy = (int64_t)y->nb[1] / 4, x_ld = (int64_t)x->nb[1] / 4;
    if (!cuda_type_is_weight(type) || x->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "CUDA GEMM cannot read %s", ggml_type_name(type));
    if (k > INT32_MAX || n > INT32_MAX || m > INT32_MAX || (int64_t)w->nb[1] != (int64_t)ggml_row_size(type, k))
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "CUDA GEMM takes contiguous weights of int sizes");
    const bool blas = cuda_blas_load();
    const float one = 1.0f, zero = 0.0f;
    uint16_t *x16 = (uint16_t *)wdata; // (m, k)
    __half *wchunk = (__half *)((char *)wdata + align256((size_t)(m * k) * 2)); // (chunk, k)
    if (blas && type == GGML_TYPE_F32) {
        if (g_blas.set_stream(g_blas.handle, st) ||
            g_blas.gemm_ex(g_blas.handle, BLAS_OP_T, BLAS_OP_N, (int)n, (int)m, (int)k, &one, w->data, BLAS_R_32F,
                           (int)k, x->data, BLAS_R_32F, (int)x_ld, &zero, y->data, BLAS_R_32F, (int)ldy,
                           precise ? BLAS_COMPUTE_32F : BLAS_COMPUTE_32F_FAST_TF32, BLAS_GEMM_DEFAULT))
            return ggml_set_error(GGML_STATUS_BACKEND_ERROR, "cublasGemmEx (F32) failed");
        return GGML_STATUS_OK;
    }
    const bool bf16 = blas && type == GGML_TYPE_BF16;
    const bool four = k % 4 == 0 && x_ld % 4 == 0 && (uintptr_t)x->data % 16 == 0;
    const int64_t nx = m * k / (four ? 4 : 1), blocks = (nx + CUDA_BLOCK - 1) / CUDA_BLOCK;
    const unsigned grid = (unsigned)(blocks < 65536 ? blocks : 65536);
    if (four)
        x_to_16_kernel<4><<<grid, CUDA_BLOCK, 0, st>>>((const float *)x->data, x_ld, k, m, x16, bf16);
    else
        x_to_16_kernel<1><<<grid, CUDA_BLOCK, 0, st>>>((const float *)x->data, x_ld, k, m, x16, bf16);
    int rc = cuda_launch_status("convert activations");
    if (rc) return rc;
    if (blas && (type == GGML_TYPE_F16 || type == GGML_TYPE_BF16)) {
        const int t16 = bf16 ? BLAS_R_16BF : BLAS_R_16F;
        if (g_blas.set_stream(g_blas.handle, st) ||
            g_blas.gemm_ex(g_blas.handle, BLAS_OP_T, BLAS_OP_N, (int)n, (int)m, (int)k, &one, w->data, t16, (int)k,
                           x16, t16, (int)k, &zero, y->data, BLAS_R_32F, (int)ldy, BLAS_COMPUTE_32F, BLAS_GEMM_DEFAULT))
            return ggml_set_error(GGML_STATUS_BACKEND_ERROR, "cublasGemmEx (16-bit) failed");
        return GGML_STATUS_OK;
    }
    const int64_t chunk = gemm_chunk_rows(w, y);
    for (int64_t r0 = 0; r0 < n; r0 += chunk) {
        const int64_t nr = n - r0 < chunk ? n - r0 : chunk;
        const __half *a = (const __half *)w->data + r0 * k;
        if (type != GGML_TYPE_F16) { // F16 rows are used in place
            if ((rc = cuda_dequant_rows_f16(w, r0, nr, wchunk, st))) return rc;
            a = wchunk;
        }
        float *yc = (float *)y->data + r0;
        if (blas) {
            if (g_blas.set_stream(g_blas.handle, st) ||
                g_blas.gemm_ex(g_blas.handle, BLAS_OP_T, BLAS_OP_N, (int)nr, (int)m, (int)k, &one, a, BLAS_R_16F, (int)k,
                               x16, BLAS_R_16F, (int)k, &zero, yc, BLAS_R_32F, (int)ldy, BLAS_COMPUTE_32F,
                               BLAS_GEMM_DEFAULT))
                return ggml_set_error(GGML_STATUS_BACKEND_ERROR, "cublasGemmEx (dequantized) failed");
        } else {
            const dim3 grid((unsigned)((nr + WM_TILE - 1) / WM_TILE), (unsigned)((m + WM_TILE - 1) / WM_TILE));
            wmma_gemm_kernel<<<grid, 128, 0, st>>>(a, (const __half *)x16, yc, ldy, nr, m, k);
            if ((rc = cuda_launch_status("WMMA GEMM"))) return rc;
        }
    }
    return GGML_STATUS_OK;
}

// ---------------------------------------------------------------------------------------------------
// AXPY_ROWS with many columns: y[m, d] = h[m, n] (unselected entries zeroed) . wt[n, d] as one GEMM per row
// chunk, so that each weight row is read once for all the columns, not once per column
// ---------------------------------------------------------------------------------------------------

// h's selected entries into out[j * n + i] (16-bit, or F32 for F32 weights), zeros elsewhere
__global__ void h_selected_kernel(const char *h, int64_t h_nb0, int64_t h_nb1, cuda_rows_sel s, int64_t n, int64_t m,
                                  void *out, int type) {
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n * m; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = e % n, j = e / n;
        const bool on = i >= s.begin && i < s.end &&
                        (s.mode == CUDA_SEL_ALL || *(const float *)(s.sel + i * s.nb0 + j * s.nb1) > 0.0f);
        const float v = on ? *(const float *)(h + i * h_nb0 + j * h_nb1) : 0.0f;
        if (type == GGML_TYPE_F32) ((float *)out)[e] = v;
        else ((uint16_t *)out)[e] = type == GGML_TYPE_BF16 ? ggml_fp32_to_bf16(v) : __half_as_ushort(__float2half_rn(v));
    }
}

static int gemm_t_h_type(enum ggml_type wt) { return wt == GGML_TYPE_F32 || wt == GGML_TYPE_BF16 ? wt : GGML_TYPE_F16; }

bool cuda_gemm_t_takes(const struct ggml_tensor *wt, const struct ggml_tensor *h, int sel_mode) {
    return h->ne[1] > GEMV_MAX_COLS && sel_mode != CUDA_SEL_LIST && wt->ne[0] <= INT32_MAX && wt->ne[1] <= INT32_MAX &&
           h->ne[1] <= INT32_MAX && (int64_t)wt->nb[1] == (int64_t)ggml_row_size(wt->type, wt->ne[0]) && cuda_blas_load();
}

size_t cuda_gemm_t_wsize(const struct ggml_tensor *wt, const struct ggml_tensor *h, const struct ggml_tensor *node) {
    const int64_t n = wt->ne[1], m = h->ne[1];
    const enum ggml_type ht = (enum ggml_type)gemm_t_h_type(wt->type);
    size_t bytes = align256((size_t)(n * m) * (ht == GGML_TYPE_F32 ? 4 : 2));
    if (ht == GGML_TYPE_F16 && wt->type != GGML_TYPE_F16)
        bytes += align256((size_t)gemm_chunk_rows(wt, node) * (size_t)wt->ne[0] * 2);
    return bytes;
}

int cuda_gemm_t(const struct ggml_tensor *wt, const struct ggml_tensor *h, const cuda_rows_sel &s, struct ggml_tensor *y,
                void *wdata, cudaStream_t st) {
    const int64_t d = wt->ne[0], n = wt->ne[1], m = h->ne[1];
    const int ht = gemm_t_h_type(wt->type);
    const int64_t ldy = (int64_t)y->nb[1] / 4;
    const int64_t blocks = (n * m + CUDA_BLOCK - 1) / CUDA_BLOCK;
    h_selected_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), CUDA_BLOCK, 0, st>>>(
        (const char *)h->data, (int64_t)h->nb[0], (int64_t)h->nb[1], s, n, m, wdata, ht);
    int rc = cuda_launch_status("select h");
    if (rc) return rc;
    const float one = 1.0f, zero = 0.0f;
    if (g_blas.set_stream(g_blas.handle, st)) return ggml_set_error(GGML_STATUS_BACKEND_ERROR, "cublasSetStream failed");
    if (ht != GGML_TYPE_F16 || wt->type == GGML_TYPE_F16) { // the weights as they are: one GEMM
        const int t = ht == GGML_TYPE_F32 ? BLAS_R_32F : ht == GGML_TYPE_BF16 ? BLAS_R_16BF : BLAS_R_16F;
        if (g_blas.gemm_ex(g_blas.handle, BLAS_OP_N, BLAS_OP_N, (int)d, (int)m, (int)n, &one, wt->data, t, (int)d, wdata,
                           t, (int)n, &zero, y->data, BLAS_R_32F, (int)ldy,
                           ht == GGML_TYPE_F32 ? BLAS_COMPUTE_32F_FAST_TF32 : BLAS_COMPUTE_32F, BLAS_GEMM_DEFAULT))
            return ggml_set_error(GGML_STATUS_BACKEND_ERROR, "cublasGemmEx (axpy rows) failed");
        return GGML_STATUS_OK;
    }
    // quantized rows: dequantized chunk by chunk, each chunk's product added to y
    const __half *h16 = (const __half *)wdata;
    __half *wchunk = (__half *)((char *)wdata + align256((size_t)(n * m) * 2));
    const int64_t chunk = gemm_chunk_rows(wt, y);
    for (int64_t r0 = 0; r0 < n; r0 += chunk) {
        const int64_t nr = n - r0 < chunk ? n - r0 : chunk;
        if ((rc = cuda_dequant_rows_f16(wt, r0, nr, wchunk, st))) return rc;
        if (g_blas.gemm_ex(g_blas.handle, BLAS_OP_N, BLAS_OP_N, (int)d, (int)m, (int)nr, &one, wchunk, BLAS_R_16F, (int)d,
                           h16 + r0, BLAS_R_16F, (int)n, r0 ? &one : &zero, y->data, BLAS_R_32F, (int)ldy,
                           BLAS_COMPUTE_32F, BLAS_GEMM_DEFAULT))
            return ggml_set_error(GGML_STATUS_BACKEND_ERROR, "cublasGemmEx (axpy rows, dequantized) failed");
    }
    return GGML_STATUS_OK;
}
