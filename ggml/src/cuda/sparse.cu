// sparse.cu: the neuron-aware sparse ops.
//  - mul_mat_rows: the row kernel of gemv.cu with a selector (mask: each block compacts its selected
//    rows in shared memory and spends no thread on the others; index list: one grid row per column).
//  - axpy_rows: y[:, j] = sum over selected rows i of h[i, j] * Wt[i, :]; more than GEMV_MAX_COLS columns
//    (prompt batches) as GEMMs in gemm.cu, fewer with the kernel here. The grid splits d into slices of
//    1024 values (32 lanes x 32 values), the rows into chunks of AXPY_ROWS candidates and has one grid
//    layer per column; a block compacts the selected rows of its chunk, its 8 warps take the listed rows
//    round-robin (each lane dequantizes its 32 values of a row: coalesced, 16-byte loads where aligned),
//    the warps' sums are added in shared memory and then atomically into y, which is zeroed first.
#include "rowdot.cuh"

// candidate rows per block (one per thread of the first 128): 128 measured 9 % faster than 256 over F16 and Q4_0
// matrices of a 13B FFN at 25-100 % density (H200; 256 left the GPU's second wave of blocks mostly empty) and
// about equal to 64, ahead of 32 (more blocks, more atomics)
#define AXPY_ROWS 128

static int sel_check(const struct ggml_tensor *dst, int64_t n_rows, int64_t m, cuda_rows_sel *s) {
    const struct ggml_tensor *sel = dst->src[2];
    s->begin = dst->op_params[0];
    s->end = dst->op_params[1];
    if (s->begin < 0 || s->begin > s->end || s->end > n_rows)
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "row range [%lld, %lld) outside [0, %lld]", (long long)s->begin,
                              (long long)s->end, (long long)n_rows);
    s->mode = CUDA_SEL_ALL;
    s->sel = NULL;
    s->nb0 = s->nb1 = s->n_sel = 0;
    if (!sel) return GGML_STATUS_OK;
    s->sel = (const char *)sel->data;
    s->nb0 = (int64_t)sel->nb[0];
    s->nb1 = (int64_t)sel->nb[1];
    s->n_sel = sel->ne[0];
    if (sel->type == GGML_TYPE_F32 && sel->ne[0] == n_rows && sel->ne[1] == m) {
        s->mode = CUDA_SEL_MASK;
        return GGML_STATUS_OK;
    }
    if (sel->type == GGML_TYPE_I32 && sel->ne[0] <= n_rows && sel->ne[1] == m) {
        s->mode = CUDA_SEL_LIST;
        return GGML_STATUS_OK;
    }
    return ggml_set_error(GGML_STATUS_INVALID_ARG, "selector must be an F32 mask [n_rows, m] or an I32 list [<= n_rows, m]");
}

// ---------------------------------------------------------------------------------------------------
// MUL_MAT_ROWS
// ---------------------------------------------------------------------------------------------------

size_t cuda_mul_mat_rows_wsize(const struct ggml_tensor *dst) {
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    return cuda_xq_wsize(w->type, w->ne[0], x->ne[1]);
}

int cuda_op_mul_mat_rows(struct ggml_tensor *dst, void *wdata, cudaStream_t st, const cuda_gemv_extra &e) {
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    cuda_rows_sel s = {};
    int rc = sel_check(dst, w->ne[1], x->ne[1], &s);
    if (rc) return rc;
    if (s.mode == CUDA_SEL_LIST) {
        // lists write only their rows: the rest of dst must be zero
        rc = cuda_status(cudaMemsetAsync(dst->data, 0, ggml_nbytes(dst), st), "memset");
        if (rc) return rc;
    }
    return cuda_rows_dot(w, x, dst, s, wdata, st, e);
}

// ---------------------------------------------------------------------------------------------------
// AXPY_ROWS
// ---------------------------------------------------------------------------------------------------

struct axpy_params {
    const uint8_t *w;
    int64_t w_nb1, d, n_rows;
    const char *h;
    int64_t h_nb0, h_nb1;
    float *y;
    int64_t y_ld;
    cuda_rows_sel s = {};
};

template <int TYPE>
__global__ void __launch_bounds__(CUDA_BLOCK) axpy_kernel(axpy_params p) {
    __shared__ int s_rows[AXPY_ROWS];
    __shared__ int s_wcnt[CUDA_BLOCK / 32];
    __shared__ int s_term;
    __shared__ float s_acc[CUDA_BLOCK / 32][32 * 32]; // (warp, value * 32 + lane)
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int64_t j = blockIdx.z, c0 = (int64_t)blockIdx.y * AXPY_ROWS;
    const cuda_rows_sel &s = p.s;
    bool sel = false;
    int64_t row = -1;
    if (s.mode == CUDA_SEL_LIST) {
        const int term = list_end(s, c0 + AXPY_ROWS, (int)j, &s_term);
        if (tid < AXPY_ROWS && c0 + tid < term) {
            row = *(const int32_t *)(s.sel + (c0 + tid) * s.nb0 + j * s.nb1);
            sel = row >= s.begin && row < s.end && row < p.n_rows;
        }
    } else if (tid < AXPY_ROWS && c0 + tid < p.n_rows) {
        row = c0 + tid;
        sel = row >= s.begin && row < s.end &&
              (s.mode == CUDA_SEL_ALL || *(const float *)(s.sel + row * s.nb0 + j * s.nb1) > 0.0f);
    }
    const int total = block_compact_rows(sel, row, s_rows, s_wcnt);
    if (total == 0) return; // block-uniform: nothing to add

    const int64_t sl = (int64_t)blockIdx.x * 32 + lane; // this lane's 32-value slice of d
    const bool live = sl * 32 < p.d;
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; i++) acc[i] = 0.0f;
    for (int e = warp; e < total && live; e += CUDA_BLOCK / 32) {
        const int r = s_rows[e];
        const float hv = *(const float *)(p.h + r * p.h_nb0 + j * p.h_nb1);
        float f[32];
        slice32<TYPE>(p.w + r * p.w_nb1, sl, p.d, f);
#pragma unroll
        for (int i = 0; i < 32; i++) acc[i] += hv * f[i];
    }
    add_slices<CUDA_BLOCK / 32>(acc, s_acc, p.y + j * p.y_ld, p.d);
}

struct axpy_launch {
    const axpy_params &p;
    dim3 grid;
    cudaStream_t st;
    template <int TYPE> void run() const { axpy_kernel<TYPE><<<grid, CUDA_BLOCK, 0, st>>>(p); }
};

static int sel_mode_of(const struct ggml_tensor *dst) {
    const struct ggml_tensor *sel = dst->src[2];
    return !sel ? CUDA_SEL_ALL : sel->type == GGML_TYPE_F32 ? CUDA_SEL_MASK : CUDA_SEL_LIST;
}

size_t cuda_axpy_rows_wsize(const struct ggml_tensor *dst) {
    const struct ggml_tensor *wt = dst->src[0], *h = dst->src[1];
    // one token's act * up under a selector: it may end a fused sparse FFN (fusion.cu), whose scratch it holds
    if (h->ne[1] == 1 && dst->src[2] && h->op == GGML_OP_MUL) return cuda_sparse_ffn_wsize(wt);
    return cuda_gemm_t_takes(wt, h, sel_mode_of(dst)) ? cuda_gemm_t_wsize(wt, h, dst) : 0;
}

int cuda_op_axpy_rows(struct ggml_tensor *dst, void *wdata, cudaStream_t st) {
    const struct ggml_tensor *wt = dst->src[0], *h = dst->src[1];
    if (!cuda_type_is_weight(wt->type) || h->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "axpy_rows on CUDA cannot read %s", ggml_type_name(wt->type));
    const int64_t d = wt->ne[0], n_rows = wt->ne[1], m = h->ne[1];
    cuda_rows_sel s = {};
    int rc = sel_check(dst, n_rows, m, &s);
    if (rc) return rc;
    // a prompt batch: every selected row read once for all columns (the kernel below reads it per column)
    if (cuda_gemm_t_takes(wt, h, s.mode)) return cuda_gemm_t(wt, h, s, dst, wdata, st);
    if (m > 65535) return ggml_set_error(GGML_STATUS_UNSUPPORTED, "axpy_rows on CUDA: too many columns");
    rc = cuda_status(cudaMemsetAsync(dst->data, 0, ggml_nbytes(dst), st), "memset");
    if (rc) return rc;
    axpy_params p;
    p.w = (const uint8_t *)wt->data;
    p.w_nb1 = (int64_t)wt->nb[1];
    p.d = d;
    p.n_rows = n_rows;
    p.h = (const char *)h->data;
    p.h_nb0 = (int64_t)h->nb[0];
    p.h_nb1 = (int64_t)h->nb[1];
    p.y = (float *)dst->data;
    p.y_ld = (int64_t)dst->nb[1] / 4;
    p.s = s;
    const int64_t n_cand = s.mode == CUDA_SEL_LIST ? s.n_sel : n_rows;
    if (n_cand == 0) return GGML_STATUS_OK;
    const int64_t slices = (d + 31) / 32;
    const dim3 grid((unsigned)((slices + 31) / 32), (unsigned)((n_cand + AXPY_ROWS - 1) / AXPY_ROWS), (unsigned)m);
    if (grid.y > 65535) return ggml_set_error(GGML_STATUS_UNSUPPORTED, "axpy_rows on CUDA: too many rows");
    with_weight_type(wt->type, axpy_launch{p, grid, st});
    return cuda_launch_status("axpy_rows");
}
