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

#define AXPY_ROWS 256 // candidate rows per block (one per thread): fewer blocks, fewer atomics

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

// values [32 sl, 32 sl + 32) of a row of d values (fewer at the end of a float row: the rest are 0)
template <int TYPE>
static __device__ __forceinline__ void slice32(const uint8_t *row, int64_t sl, int64_t d, float *f) {
    if constexpr (TYPE == GGML_TYPE_F32 || TYPE == GGML_TYPE_F16 || TYPE == GGML_TYPE_BF16) {
        constexpr int ES = TYPE == GGML_TYPE_F32 ? 4 : 2;
        const uint8_t *p = row + sl * 32 * ES;
        if (sl * 32 + 32 <= d && ((uintptr_t)p & 15) == 0) {
            uint32_t u[8 * ES];
            load_bytes<32 * ES>(p, u);
#pragma unroll
            for (int i = 0; i < 32; i++)
                f[i] = TYPE == GGML_TYPE_F32 ? __uint_as_float(u[i])
                       : TYPE == GGML_TYPE_F16 ? h2f(hw(u, 2 * i)) : bf2f(hw(u, 2 * i));
        } else {
#pragma unroll
            for (int i = 0; i < 32; i++) f[i] = sl * 32 + i < d ? cuda_dequant1(TYPE, row, sl * 32 + i) : 0.0f;
        }
    } else if constexpr (TYPE == GGML_TYPE_Q4_0 || TYPE == GGML_TYPE_Q4_1 || TYPE == GGML_TYPE_Q5_0) {
        constexpr int TS = TYPE == GGML_TYPE_Q4_0 ? 18 : TYPE == GGML_TYPE_Q4_1 ? 20 : 22;
        constexpr int QS = TYPE == GGML_TYPE_Q4_0 ? 2 : TYPE == GGML_TYPE_Q4_1 ? 4 : 6; // offset of the nibbles
        uint32_t u[(TS + 3) / 4];
        load_bytes<TS>(row + sl * TS, u);
        const float dd = h2f(hw(u, 0));
        const float mn = TYPE == GGML_TYPE_Q4_1 ? h2f(hw(u, 2)) : 0.0f;
        const uint32_t qh = TYPE == GGML_TYPE_Q5_0 ? wd(u, 2) : 0;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const int b = (int)((wd(u, QS + 4 * (i / 4)) >> (8 * (i % 4))) & 0xFF);
            int lo = b & 15, hi = b >> 4;
            if (TYPE == GGML_TYPE_Q5_0) {
                lo = (lo | (int)((qh >> i) & 1) << 4) - 16;
                hi = (hi | (int)((qh >> (i + 16)) & 1) << 4) - 16;
            } else if (TYPE == GGML_TYPE_Q4_0) {
                lo -= 8;
                hi -= 8;
            }
            f[i] = dd * (float)lo + mn;
            f[i + 16] = dd * (float)hi + mn;
        }
    } else if constexpr (TYPE == GGML_TYPE_Q8_0) {
        uint32_t u[9];
        load_bytes<34>(row + sl * 34, u);
        const float dd = h2f(hw(u, 0));
#pragma unroll
        for (int i = 0; i < 32; i++) f[i] = dd * (float)(int8_t)((wd(u, 2 + 4 * (i / 4)) >> (8 * (i % 4))) & 0xFF);
    } else if constexpr (TYPE == GGML_TYPE_Q4_K) {
        const uint8_t *blk = row + (sl / 8) * 144;
        const int s = (int)(sl % 8);
        uint32_t hd[4], q[8];
        load_bytes<16>(blk, hd);
        load_bytes<32>(blk + 16 + 32 * (s / 2), q);
        float sc, mn;
        q4k_scale_min(hd, 0, s, sc, mn);
        const float a = h2f(hw(hd, 0)) * sc, c = h2f(hw(hd, 2)) * mn;
        const int sh = (s & 1) * 4;
#pragma unroll
        for (int i = 0; i < 32; i++) f[i] = a * (float)((q[i / 4] >> (8 * (i % 4) + sh)) & 15) - c;
    } else { // Q6_K
        const uint8_t *blk = row + (sl / 8) * 210;
        const int s = (int)(sl % 8), h = s / 4, qq = s % 4;
        uint32_t ql[8], qh[8];
        load_bytes<32>(blk + 64 * h + 32 * (qq & 1), ql);
        load_bytes<32>(blk + 128 + 32 * h, qh);
        const uint32_t scw = __ldg((const uint16_t *)(blk + 192 + 8 * h + 2 * qq));
        const float dd = h2f(__ldg((const uint16_t *)(blk + 208)));
        const float s0 = dd * (float)(int8_t)(scw & 0xFF), s1 = dd * (float)(int8_t)(scw >> 8);
#pragma unroll
        for (int i = 0; i < 32; i++) {
            const int lo = (ql[i / 4] >> (8 * (i % 4) + (qq >= 2 ? 4 : 0))) & 15;
            const int hi = (qh[i / 4] >> (8 * (i % 4) + 2 * qq)) & 3;
            f[i] = (i < 16 ? s0 : s1) * (float)((lo | hi << 4) - 32);
        }
    }
}

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
#pragma unroll
    for (int i = 0; i < 32; i++) s_acc[warp][i * 32 + lane] = acc[i];
    __syncthreads();
    for (int e = tid; e < 32 * 32; e += CUDA_BLOCK) {
        const int ln = e % 32, v = e / 32;
        const int64_t di = ((int64_t)blockIdx.x * 32 + ln) * 32 + v;
        if (di >= p.d) continue;
        float sum = 0.0f;
        for (int w = 0; w < CUDA_BLOCK / 32; w++) sum += s_acc[w][e];
        atomicAdd(p.y + j * p.y_ld + di, sum);
    }
}

template <int TYPE>
static void axpy_launch(const axpy_params &p, dim3 grid, cudaStream_t st) {
    axpy_kernel<TYPE><<<grid, CUDA_BLOCK, 0, st>>>(p);
}

static int sel_mode_of(const struct ggml_tensor *dst) {
    const struct ggml_tensor *sel = dst->src[2];
    return !sel ? CUDA_SEL_ALL : sel->type == GGML_TYPE_F32 ? CUDA_SEL_MASK : CUDA_SEL_LIST;
}

size_t cuda_axpy_rows_wsize(const struct ggml_tensor *dst) {
    const struct ggml_tensor *wt = dst->src[0], *h = dst->src[1];
    return cuda_gemm_t_takes(wt, h, sel_mode_of(dst)) ? cuda_gemm_t_wsize(wt, h) : 0;
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
    switch (wt->type) {
    case GGML_TYPE_F32: axpy_launch<GGML_TYPE_F32>(p, grid, st); break;
    case GGML_TYPE_F16: axpy_launch<GGML_TYPE_F16>(p, grid, st); break;
    case GGML_TYPE_BF16: axpy_launch<GGML_TYPE_BF16>(p, grid, st); break;
    case GGML_TYPE_Q4_0: axpy_launch<GGML_TYPE_Q4_0>(p, grid, st); break;
    case GGML_TYPE_Q4_1: axpy_launch<GGML_TYPE_Q4_1>(p, grid, st); break;
    case GGML_TYPE_Q5_0: axpy_launch<GGML_TYPE_Q5_0>(p, grid, st); break;
    case GGML_TYPE_Q8_0: axpy_launch<GGML_TYPE_Q8_0>(p, grid, st); break;
    case GGML_TYPE_Q4_K: axpy_launch<GGML_TYPE_Q4_K>(p, grid, st); break;
    default: axpy_launch<GGML_TYPE_Q6_K>(p, grid, st); break;
    }
    return cuda_launch_status("axpy_rows");
}
