// gemv.cu: mul_mat with few columns (m <= GEMV_MAX_COLS) as a memory-bound GEMV, and the row-selecting
// variant behind mul_mat_rows (sparse.cu). One kernel serves both:
//  - each block takes R candidate rows (dense: all rows; mask: rows selected in any column; index list:
//    R list entries of one column), writes zeros for the unselected ones, and compacts the selected ones
//    into a shared-memory list with a warp ballot, so no thread is spent on a skipped row;
//  - groups of `tpr` threads (a power of two <= 32, sized to the row's length) then take one listed row
//    each, stream its weights with 16-byte loads (a unit of G blocks per thread, so each lane has a
//    whole aligned unit in flight) and reduce with warp shuffles; the weight bytes are read once for all
//    m columns.
// Activations: quantized weights use x quantized to Q8_1 on the device first (int8 + (d, d*sum) per 32,
// d kept in F32) and dp4a; F32/F16/BF16 weights read x as F32 (L1/L2-resident, float4 loads).
#include "rowdot.cuh"

struct rows_params {
    const uint8_t *w;
    int64_t w_nb1, k, n_rows;
    const float *xf;  // F32 x [k, m], column stride x_ld floats
    int64_t x_ld;
    const int8_t *xq; // Q8_1 x: (m, k) int8 values
    const float2 *xds; // (m, k / 32) (d, d * sum)
    float *y;         // [n_rows, m], column stride y_ld floats
    int64_t y_ld;
    int m;
    cuda_rows_sel s;
    int R, tpr;
};

static __device__ __forceinline__ bool mask_on(const cuda_rows_sel &s, int64_t i, int64_t j) {
    return *(const float *)(s.sel + i * s.nb0 + j * s.nb1) > 0.0f;
}

// ---------------------------------------------------------------------------------------------------
// per-thread part of one row's dot products
// ---------------------------------------------------------------------------------------------------

template <int TYPE, bool ALIGNED>
static __device__ __forceinline__ void row_dot_q(const rows_params &p, const uint8_t *wr, int64_t xoff, int mm, int sl,
                                                 float *acc) {
    using T = wq<TYPE>;
    const int64_t nblk = p.k / T::QK, kb = p.k / 32; // weight blocks, x blocks per column
    const int8_t *xq = p.xq + xoff * p.k;
    const float2 *xds = p.xds + xoff * kb;
    constexpr int UB = T::G * T::TS; // bytes of a unit
    // units staged through shared memory where they fit: coalesced 16-byte loads by the whole group
    constexpr bool STAGE = UB % 16 == 0 && UB * CUDA_BLOCK + 16 <= 46 * 1024;
    int64_t b0 = 0;
    if constexpr (ALIGNED && STAGE) {
        constexpr int NV = UB / 16;
        __shared__ uint4 stage[CUDA_BLOCK * NV + 1]; // (threads, NV) one unit per thread, + 1 read past the end
        uint4 *region = stage + (threadIdx.x - sl) * NV; // (tpr, NV) this group's units
        const int tpr = p.tpr;
        const unsigned gmask = tpr == 32 ? 0xffffffffu : ((1u << tpr) - 1) << ((threadIdx.x % 32) & ~(tpr - 1));
        const int64_t nunits = nblk / T::G;
        for (int64_t base = 0; base < nunits; base += tpr) {
            const int nv = (int)(nunits - base < tpr ? nunits - base : tpr) * NV;
            const uint4 *src = (const uint4 *)wr + base * NV;
#pragma unroll
            for (int i = 0; i < NV; i++)
                if (sl + tpr * i < nv) region[sl + tpr * i] = __ldg(src + sl + tpr * i);
            __syncwarp(gmask);
            // blocks of the staged span go round-robin over the lanes, so that neighbouring lanes read
            // neighbouring activation blocks (coalesced) rather than blocks a whole unit apart
            const uint32_t *rw = (const uint32_t *)region; // (nv * 4) staged words
            const int span = nv / NV * T::G;                // blocks staged
#pragma unroll
            for (int g = 0; g < T::G; g++) {
                const int blk = g * tpr + sl;
                if (blk >= span) break;
                const int B = blk * T::TS;
                const uint32_t sel = (B & 2) ? 0x5432 : 0x3210; // blocks start 2-byte aligned
                const uint32_t *w = rw + (B >> 2);
                uint32_t u[(T::TS + 3) / 4];
#pragma unroll
                for (int i = 0; i < (T::TS + 3) / 4; i++) u[i] = __byte_perm(w[i], w[i + 1], sel);
                const int64_t bi = (base * T::G + blk) * (T::QK / 32);
#pragma unroll
                for (int j = 0; j < GEMV_MAX_COLS; j++)
                    if (j < mm) acc[j] += T::dot(u, 0, xq + j * p.k, xds + j * kb, bi);
            }
            __syncwarp(gmask); // the region is refilled next
        }
        b0 = nunits * T::G;
    } else if constexpr (ALIGNED && T::G > 1) {
        const int64_t nunits = nblk / T::G;
        for (int64_t un = sl; un < nunits; un += p.tpr) {
            uint32_t u[UB / 4];
            load_bytes<UB>(wr + un * UB, u);
#pragma unroll
            for (int b = 0; b < T::G; b++) {
                const int64_t bi = (un * T::G + b) * (T::QK / 32);
#pragma unroll
                for (int j = 0; j < GEMV_MAX_COLS; j++)
                    if (j < mm) acc[j] += T::dot(u, b * T::TS, xq + j * p.k, xds + j * kb, bi);
            }
        }
        b0 = nunits * T::G;
    }
    for (int64_t b = b0 + sl; b < nblk; b += p.tpr) {
        uint32_t u[(T::TS + 3) / 4];
        load_bytes<T::TS>(wr + b * T::TS, u);
        const int64_t bi = b * (T::QK / 32);
#pragma unroll
        for (int j = 0; j < GEMV_MAX_COLS; j++)
            if (j < mm) acc[j] += T::dot(u, 0, xq + j * p.k, xds + j * kb, bi);
    }
}

// 8 consecutive weights of a float type from one 16-byte chunk (F32: 4, the rest zero)
template <int TYPE>
static __device__ __forceinline__ void chunk_vals(const int4 v, float *f) {
    if (TYPE == GGML_TYPE_F32) {
        f[0] = __int_as_float(v.x); f[1] = __int_as_float(v.y); f[2] = __int_as_float(v.z); f[3] = __int_as_float(v.w);
    } else {
        const uint32_t a[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            f[2 * i] = TYPE == GGML_TYPE_F16 ? h2f(a[i] & 0xFFFF) : bf2f(a[i] & 0xFFFF);
            f[2 * i + 1] = TYPE == GGML_TYPE_F16 ? h2f(a[i] >> 16) : bf2f(a[i] >> 16);
        }
    }
}

#define GEMV_FLOAT_UNROLL 4 // 16-byte chunks in flight per thread

template <int TYPE, bool ALIGNED>
static __device__ __forceinline__ void row_dot_f(const rows_params &p, const uint8_t *wr, int64_t xoff, int mm, int sl,
                                                 float *acc) {
    constexpr int VE = TYPE == GGML_TYPE_F32 ? 4 : 8; // values per 16-byte chunk
    const float *x = p.xf + xoff * p.x_ld;
    if constexpr (ALIGNED) {
        const int64_t nch = p.k / VE;
        const int4 *wv = (const int4 *)wr;
        for (int64_t c0 = sl; c0 < nch; c0 += GEMV_FLOAT_UNROLL * p.tpr) {
            int4 v[GEMV_FLOAT_UNROLL];
#pragma unroll
            for (int u = 0; u < GEMV_FLOAT_UNROLL; u++) {
                const int64_t c = c0 + u * p.tpr;
                v[u] = c < nch ? __ldg(wv + c) : make_int4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < GEMV_FLOAT_UNROLL; u++) {
                const int64_t c = c0 + u * p.tpr;
                if (c >= nch) break;
                float f[8];
                chunk_vals<TYPE>(v[u], f);
#pragma unroll
                for (int j = 0; j < GEMV_MAX_COLS; j++) {
                    if (j >= mm) break;
                    const float4 *xp = (const float4 *)(x + j * p.x_ld + c * VE);
                    const float4 xa = __ldg(xp);
                    float s = f[0] * xa.x + f[1] * xa.y + f[2] * xa.z + f[3] * xa.w;
                    if (VE == 8) {
                        const float4 xb = __ldg(xp + 1);
                        s += f[4] * xb.x + f[5] * xb.y + f[6] * xb.z + f[7] * xb.w;
                    }
                    acc[j] += s;
                }
            }
        }
    } else {
    for (int64_t i = sl; i < p.k; i += p.tpr) {
        const float wv = TYPE == GGML_TYPE_F32 ? ((const float *)wr)[i]
                         : TYPE == GGML_TYPE_F16 ? h2f(((const uint16_t *)wr)[i])
                                                 : bf2f(((const uint16_t *)wr)[i]);
#pragma unroll
        for (int j = 0; j < GEMV_MAX_COLS; j++)
            if (j < mm) acc[j] += wv * x[j * p.x_ld + i];
    }
    }
}

template <int TYPE>
constexpr bool is_float_type = TYPE == GGML_TYPE_F32 || TYPE == GGML_TYPE_F16 || TYPE == GGML_TYPE_BF16;

template <int TYPE, bool ALIGNED>
static __device__ __forceinline__ void row_dot(const rows_params &p, const uint8_t *wr, int64_t xoff, int mm, int sl,
                                               float *acc) {
    if constexpr (is_float_type<TYPE>)
        row_dot_f<TYPE, ALIGNED>(p, wr, xoff, mm, sl, acc);
    else
        row_dot_q<TYPE, ALIGNED>(p, wr, xoff, mm, sl, acc);
}

// ---------------------------------------------------------------------------------------------------
// the kernel: select and compact candidate rows, then one thread group per listed row
// ---------------------------------------------------------------------------------------------------

// blocks per SM the register budget aims at: 4 where the decode is light, 2 for Q8_0 and the K-quants
template <int TYPE>
constexpr int rows_min_blocks = TYPE == GGML_TYPE_Q8_0 || TYPE == GGML_TYPE_Q4_K || TYPE == GGML_TYPE_Q6_K ? 2 : 4;

template <int TYPE, bool ALIGNED>
__global__ void __launch_bounds__(CUDA_BLOCK, rows_min_blocks<TYPE>) rows_kernel(rows_params p) {
    __shared__ int s_rows[CUDA_BLOCK];   // (total) listed rows of this block
    __shared__ int s_wcnt[CUDA_BLOCK / 32];
    __shared__ int s_term;               // list mode: first terminator of the column
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int col = blockIdx.y;          // list mode: the column
    const int64_t c0 = (int64_t)blockIdx.x * p.R;
    const cuda_rows_sel &s = p.s;
    bool sel = false;
    int64_t row = -1;
    if (s.mode == CUDA_SEL_LIST) {
        // an entry counts only before the column's first negative entry
        if (tid == 0) s_term = (int)s.n_sel;
        __syncthreads();
        const int64_t lim = c0 + p.R < s.n_sel ? c0 + p.R : s.n_sel;
        for (int64_t e = tid; e < lim; e += blockDim.x)
            if (*(const int32_t *)(s.sel + e * s.nb0 + col * s.nb1) < 0) atomicMin(&s_term, (int)e);
        __syncthreads();
        if (tid < p.R && c0 + tid < s_term) {
            row = *(const int32_t *)(s.sel + (c0 + tid) * s.nb0 + col * s.nb1);
            sel = row >= s.begin && row < s.end && row < p.n_rows;
        }
    } else if (tid < p.R && c0 + tid < p.n_rows) {
        row = c0 + tid;
        sel = row >= s.begin && row < s.end;
        if (sel && s.mode == CUDA_SEL_MASK) {
            bool any = false;
            for (int j = 0; j < p.m && !any; j++) any = mask_on(s, row, j);
            sel = any;
        }
        if (!sel)
            for (int j = 0; j < p.m; j++) p.y[row + j * p.y_ld] = 0.0f;
    }
    const unsigned bal = __ballot_sync(0xffffffffu, sel);
    if (lane == 0) s_wcnt[warp] = __popc(bal);
    __syncthreads();
    int off = 0, total = 0;
    for (int w = 0; w < CUDA_BLOCK / 32; w++) {
        off += w < warp ? s_wcnt[w] : 0;
        total += s_wcnt[w];
    }
    if (sel) s_rows[off + __popc(bal & ((1u << lane) - 1))] = (int)row;
    __syncthreads();

    const int tpr = p.tpr, slots = CUDA_BLOCK / tpr, slot = tid / tpr, sl = tid % tpr;
    const bool list = s.mode == CUDA_SEL_LIST;
    const int mm = list ? 1 : p.m;
    const int64_t xoff = list ? col : 0;
    for (int base = 0; base < total; base += slots) { // the same trip count in every thread: shuffles below
        const int idx = base + slot;
        const bool active = idx < total;
        const int r = active ? s_rows[idx] : 0;
        float acc[GEMV_MAX_COLS];
#pragma unroll
        for (int j = 0; j < GEMV_MAX_COLS; j++) acc[j] = 0.0f;
        if (active) row_dot<TYPE, ALIGNED>(p, p.w + r * p.w_nb1, xoff, mm, sl, acc);
#pragma unroll
        for (int j = 0; j < GEMV_MAX_COLS; j++) {
            if (j >= mm) break;
            for (int o = tpr / 2; o > 0; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o, tpr);
        }
        if (active && sl == 0) {
            if (list) {
                p.y[r + col * p.y_ld] = acc[0];
            } else {
#pragma unroll
                for (int j = 0; j < GEMV_MAX_COLS; j++) {
                    if (j >= mm) break;
                    const bool on = s.mode != CUDA_SEL_MASK || p.m == 1 || mask_on(s, r, j);
                    p.y[r + j * p.y_ld] = on ? acc[j] : 0.0f;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// activations -> Q8_1: one warp per 32 values
// ---------------------------------------------------------------------------------------------------

__global__ void quantize_q8_1_kernel(const float *x, int64_t x_ld, int64_t k, int64_t m, int8_t *xq, float2 *xds) {
    const int64_t kb = k / 32, nb = kb * m;
    const int lane = threadIdx.x % 32;
    for (int64_t b = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32; b < nb;
         b += (int64_t)gridDim.x * blockDim.x / 32) {
        const int64_t j = b / kb, i = (b % kb) * 32 + lane;
        const float v = x[j * x_ld + i];
        const float amax = warp_max(fabsf(v));
        const float d = amax / 127.0f;
        const int q = d > 0.0f ? (int)roundf(v / d) : 0;
        xq[j * k + i] = (int8_t)q;
        const int sum = (int)warp_sum((float)q); // |sum| <= 32 * 127: exact in F32
        if (lane == 0) xds[b] = make_float2(d, d * (float)sum);
    }
}

// ---------------------------------------------------------------------------------------------------
// host side
// ---------------------------------------------------------------------------------------------------

static size_t align256(size_t n) { return (n + 255) / 256 * 256; }

size_t cuda_xq_wsize(enum ggml_type wtype, int64_t k, int64_t m) {
    if (wtype == GGML_TYPE_F32 || wtype == GGML_TYPE_F16 || wtype == GGML_TYPE_BF16) return 0;
    // (m, k) int8 values, then (m, k / 32) float2 scales
    return align256((size_t)(m * k)) + align256((size_t)(m * (k / 32)) * sizeof(float2));
}

template <int TYPE>
static void rows_launch(const rows_params &p, dim3 grid, bool aligned, cudaStream_t st) {
    if (aligned)
        rows_kernel<TYPE, true><<<grid, CUDA_BLOCK, 0, st>>>(p);
    else
        rows_kernel<TYPE, false><<<grid, CUDA_BLOCK, 0, st>>>(p);
}

// blocks or 16-byte chunks each thread of a row's group takes at once
static int64_t row_units(enum ggml_type t, int64_t k, bool aligned) {
    switch (t) {
    case GGML_TYPE_F32: return aligned ? k / 4 / GEMV_FLOAT_UNROLL : k;
    case GGML_TYPE_F16:
    case GGML_TYPE_BF16: return aligned ? k / 8 / GEMV_FLOAT_UNROLL : k;
    case GGML_TYPE_Q4_0: case GGML_TYPE_Q5_0: case GGML_TYPE_Q8_0: return aligned ? k / 256 : k / 32;
    case GGML_TYPE_Q4_1: return aligned ? k / 128 : k / 32;
    default: return k / 256; // K-quants: one super-block
    }
}

int cuda_rows_dot(const struct ggml_tensor *w, const struct ggml_tensor *x, struct ggml_tensor *y,
                  const cuda_rows_sel &s, void *wdata, cudaStream_t st) {
    const enum ggml_type type = w->type;
    const int64_t k = w->ne[0], n = w->ne[1], m = x->ne[1];
    if (!cuda_type_is_weight(type) || x->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "CUDA GEMV cannot read %s", ggml_type_name(type));
    if (n > INT32_MAX || k % ggml_blck_size(type))
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "CUDA GEMV: bad shape");
    rows_params p;
    p.w = (const uint8_t *)w->data;
    p.w_nb1 = (int64_t)w->nb[1];
    p.k = k;
    p.n_rows = n;
    p.xf = (const float *)x->data;
    p.x_ld = (int64_t)x->nb[1] / 4;
    p.xq = NULL;
    p.xds = NULL;
    p.y = (float *)y->data;
    p.y_ld = (int64_t)y->nb[1] / 4;
    p.m = (int)m;
    p.s = s;
    const bool is_float = type == GGML_TYPE_F32 || type == GGML_TYPE_F16 || type == GGML_TYPE_BF16;
    bool aligned = ((uintptr_t)p.w % 16 == 0) && p.w_nb1 % 16 == 0;
    if (is_float) {
        aligned = aligned && ((uintptr_t)p.xf % 16 == 0) && p.x_ld % 4 == 0;
    } else {
        // activations to Q8_1 in wdata: (m, k) int8, then (m, k / 32) float2
        int8_t *xq = (int8_t *)wdata;
        float2 *xds = (float2 *)((char *)wdata + align256((size_t)(m * k)));
        const int64_t warps = m * (k / 32);
        int64_t blocks = (warps * 32 + CUDA_BLOCK - 1) / CUDA_BLOCK;
        quantize_q8_1_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), CUDA_BLOCK, 0, st>>>(p.xf, p.x_ld, k, m, xq,
                                                                                                 xds);
        int rc = cuda_launch_status("quantize activations");
        if (rc) return rc;
        p.xq = xq;
        p.xds = xds;
    }
    const int64_t units = row_units(type, k, aligned);
    int tpr = 32;
    while (tpr > 1 && tpr / 2 >= units) tpr /= 2;
    p.tpr = tpr;
    const int slots = CUDA_BLOCK / tpr;
    // dense and lists: one row per thread group; masks: 4x candidates, most of them skipped when sparse
    p.R = s.mode == CUDA_SEL_MASK ? (4 * slots < CUDA_BLOCK ? 4 * slots : CUDA_BLOCK) : slots;
    const int64_t n_cand = s.mode == CUDA_SEL_LIST ? s.n_sel : n;
    if (n_cand == 0) return GGML_STATUS_OK;
    const dim3 grid((unsigned)((n_cand + p.R - 1) / p.R), s.mode == CUDA_SEL_LIST ? (unsigned)m : 1u);
    // dense and masks: groups of up to GEMV_MAX_COLS columns per launch (lists take one column per grid row)
    const int64_t group = s.mode == CUDA_SEL_LIST ? m : GEMV_MAX_COLS;
    const rows_params p0 = p;
    for (int64_t j0 = 0; j0 < m; j0 += group) {
        p.m = (int)(m - j0 < group ? m - j0 : group);
        p.xf = p0.xf + j0 * p.x_ld;
        p.xq = p0.xq ? p0.xq + j0 * k : NULL;
        p.xds = p0.xds ? p0.xds + j0 * (k / 32) : NULL;
        p.y = p0.y + j0 * p.y_ld;
        p.s.sel = s.mode == CUDA_SEL_MASK ? s.sel + j0 * s.nb1 : s.sel;
        switch (type) {
        case GGML_TYPE_F32: rows_launch<GGML_TYPE_F32>(p, grid, aligned, st); break;
        case GGML_TYPE_F16: rows_launch<GGML_TYPE_F16>(p, grid, aligned, st); break;
        case GGML_TYPE_BF16: rows_launch<GGML_TYPE_BF16>(p, grid, aligned, st); break;
        case GGML_TYPE_Q4_0: rows_launch<GGML_TYPE_Q4_0>(p, grid, aligned, st); break;
        case GGML_TYPE_Q4_1: rows_launch<GGML_TYPE_Q4_1>(p, grid, aligned, st); break;
        case GGML_TYPE_Q5_0: rows_launch<GGML_TYPE_Q5_0>(p, grid, aligned, st); break;
        case GGML_TYPE_Q8_0: rows_launch<GGML_TYPE_Q8_0>(p, grid, aligned, st); break;
        case GGML_TYPE_Q4_K: rows_launch<GGML_TYPE_Q4_K>(p, grid, aligned, st); break;
        default: rows_launch<GGML_TYPE_Q6_K>(p, grid, aligned, st); break;
        }
    }
    return cuda_launch_status("row dot products");
}

// ---------------------------------------------------------------------------------------------------
// MUL_MAT: GEMV up to GEMV_MAX_COLS columns, GEMM beyond
// ---------------------------------------------------------------------------------------------------

size_t cuda_mul_mat_wsize(const struct ggml_tensor *dst) {
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    if (x->ne[1] > GEMV_MAX_COLS) return cuda_gemm_wsize(w, x);
    return cuda_xq_wsize(w->type, w->ne[0], x->ne[1]);
}

int cuda_op_mul_mat(struct ggml_tensor *dst, void *wdata, cudaStream_t st) {
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    if (ggml_nrows(w) != w->ne[1] || ggml_nrows(x) != x->ne[1])
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "mul_mat takes matrices");
    if (x->ne[1] > GEMV_MAX_COLS) return cuda_gemm(w, x, dst, wdata, st);
    cuda_rows_sel s = {CUDA_SEL_ALL, NULL, 0, 0, 0, 0, w->ne[1]};
    return cuda_rows_dot(w, x, dst, s, wdata, st);
}
