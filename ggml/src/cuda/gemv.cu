// gemv.cu: mul_mat with few columns (m <= GEMV_MAX_COLS) as a memory-bound GEMV, and the row-selecting
// variant behind mul_mat_rows (sparse.cu). Two kernels, both selecting rows the same way (dense: all
// rows; mask: rows selected in any column; index list: list entries of one column), writing zeros for
// the unselected ones and compacting the selected ones into a shared-memory list, so that no thread is
// spent on a skipped row:
//  - F32/F16/BF16 weights, one column, all rows or a mask's, 16-byte aligned rows (gemv_f_kernel): a
//    block of 128 threads streams two rows at once (they share each x load), with many small blocks;
//  - other F32/F16/BF16 cases (rows_kernel): groups of `tpr` threads (a power of two <= 32, sized to the
//    row's length) take one listed row each, stream it with 16-byte loads, 4 in flight per thread, and
//    meet x as F32 (L1/L2-resident, float4 loads);
//  - quantized weights (qrows_kernel): x is quantized to Q8_1 once per op (int8 + (d, d*sum) per 32, d in
//    F32, a small buffer that stays in L1/L2); a warp takes NR listed rows at once, its lanes take
//    neighbouring items of the rows (rowdot.cuh: a block, or a 16-byte chunk of a K-quant super-block),
//    U items per lane in flight, straight from global memory, and multiply with dp4a; the NR rows share
//    the activation loads; one shuffle reduction per row at the end. The grid is sized to one wave of
//    resident blocks (each block taking as many row groups per warp as that needs), so no second,
//    partly filled wave trails behind.
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
    int R, tpr;       // candidates per block (per round of qrows_kernel), threads per row (rows_kernel)
    const uint8_t *w2; // GLU (dense, m = 1): y = act(w x) * (w2 x), w2 laid out like w
    int act;           // GLU's activation; without w2 (dense, m = 1) y = act(w x); 0: none
    const float *add; // (m = 1) y[row] += add[row]
    cuda_view kv;     // (m = 1) where kv.data, a fused kv_store of v: row r goes into this cache's slot as value
                      // r % head size of head r / head size, not into y
    const char *kv_pos; // the slot: the token's cache position
    bool kv_f16;
};

// a row's output from its dot product (and the up row's, for GLU) with the fused epilogue
static __device__ __forceinline__ float row_out(const rows_params &p, int64_t row, float dot, float up) {
    const float v = p.w2 ? cuda_act(p.act, dot) * up : p.act ? cuda_act(p.act, dot) : dot;
    return p.add ? v + p.add[row] : v;
}

// writes a dense one-column GEMV's row: into y, or into its cache slot (a position outside the cache is skipped)
static __device__ __forceinline__ void row_put(const rows_params &p, int64_t row, float v) {
    if (!p.kv.data) {
        p.y[row] = v;
        return;
    }
    const int64_t slot = *(const int32_t *)p.kv_pos, hd = p.kv.ne[0];
    if (slot < 0 || slot >= p.kv.ne[2]) return;
    char *at = p.kv.data + row / hd * p.kv.nb[1] + slot * p.kv.nb[2];
    if (p.kv_f16)
        ((__half *)at)[row % hd] = __float2half_rn(v);
    else
        ((float *)at)[row % hd] = v;
}

static __device__ __forceinline__ bool mask_on(const cuda_rows_sel &s, int64_t i, int64_t j) {
    return *(const float *)(s.sel + i * s.nb0 + j * s.nb1) > 0.0f;
}

// ---------------------------------------------------------------------------------------------------
// F32/F16/BF16: per-thread part of one row's dot products
// ---------------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------------
// F32/F16/BF16: select and compact candidate rows, then one thread group per listed row
// ---------------------------------------------------------------------------------------------------

template <int TYPE, bool ALIGNED>
__global__ void __launch_bounds__(CUDA_BLOCK, 4) rows_kernel(rows_params p) {
    __shared__ int s_rows[CUDA_BLOCK];   // (total) listed rows of this block
    __shared__ int s_wcnt[CUDA_BLOCK / 32];
    __shared__ int s_term;               // list mode: first terminator of the column
    const int tid = threadIdx.x;
    const int col = blockIdx.y;          // list mode: the column
    const int64_t c0 = (int64_t)blockIdx.x * p.R;
    const cuda_rows_sel &s = p.s;
    bool sel = false;
    int64_t row = -1;
    if (s.mode == CUDA_SEL_LIST) {
        const int term = list_end(s, c0 + p.R, col, &s_term);
        if (tid < p.R && c0 + tid < term) {
            row = list_at(s, c0 + tid, col);
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
    const int total = block_compact_rows(sel, row, s_rows, s_wcnt);

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
        if (active) row_dot_f<TYPE, ALIGNED>(p, p.w + r * p.w_nb1, xoff, mm, sl, acc);
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
// F32/F16/BF16, every row of one column (decoding, 16-byte aligned rows)
// ---------------------------------------------------------------------------------------------------

#define GEMV_F_THREADS 128
#define GEMV_F_MASK_ROWS 16 // mask mode: candidate rows per block (~2 selected at 10% density)

// the block's dot products of rows w0 and w1 with x (in thread 0; w1 may repeat w0): the two rows share
// every x load
template <int TYPE>
static __device__ __forceinline__ void pair_dot(const rows_params &p, const int4 *w0, const int4 *w1, float *s0, float *s1) {
    __shared__ float sh[GEMV_F_THREADS / 32][2];
    float a0, a1;
    pair_partial_f<TYPE, GEMV_F_THREADS>(w0, w1, p.xf, p.k, threadIdx.x, &a0, &a1);
    a0 = warp_sum(a0);
    a1 = warp_sum(a1);
    const int warp = threadIdx.x / 32;
    __syncthreads(); // sh may still be read by thread 0 from the previous pair
    if (threadIdx.x % 32 == 0) {
        sh[warp][0] = a0;
        sh[warp][1] = a1;
    }
    __syncthreads();
    *s0 = *s1 = 0.0f;
    if (threadIdx.x != 0) return;
#pragma unroll
    for (int w = 0; w < GEMV_F_THREADS / 32; w++) {
        *s0 += sh[w][0];
        *s1 += sh[w][1];
    }
}

// One column, every row (dense), or the rows a mask selects. Dense: two rows per block (GLU: row
// blockIdx.x of w and of w2), so thousands of short blocks keep the last wave's tail short (rows_kernel's
// 8-row blocks left 1/4 of a wave idle). Mask: GEMV_F_MASK_ROWS candidates per block, the selected ones
// taken two at a time by the whole block.
template <int TYPE>
__global__ void __launch_bounds__(GEMV_F_THREADS) gemv_f_kernel(rows_params p) {
    const int64_t rs = p.w_nb1 / 16; // row stride in 16-byte chunks
    float s0, s1;
    if (p.s.mode == CUDA_SEL_ALL) {
        const bool glu = p.w2 != nullptr;
        const int64_t r0 = glu ? (int64_t)blockIdx.x : 2 * (int64_t)blockIdx.x;
        const bool two = !glu && r0 + 1 < p.n_rows;
        const int4 *w0 = (const int4 *)p.w + r0 * rs;
        pair_dot<TYPE>(p, w0, glu ? (const int4 *)p.w2 + r0 * rs : two ? w0 + rs : w0, &s0, &s1);
        if (threadIdx.x != 0) return;
        row_put(p, r0, row_out(p, r0, s0, s1));
        if (two) row_put(p, r0 + 1, row_out(p, r0 + 1, s1, 0.0f));
        return;
    }
    __shared__ int s_rows[GEMV_F_MASK_ROWS], s_cnt;
    const int64_t c = (int64_t)blockIdx.x * GEMV_F_MASK_ROWS + threadIdx.x;
    if (threadIdx.x == 0) s_cnt = 0;
    __syncthreads();
    if (threadIdx.x < GEMV_F_MASK_ROWS && c < p.n_rows) {
        if (c >= p.s.begin && c < p.s.end && mask_on(p.s, c, 0))
            s_rows[atomicAdd(&s_cnt, 1)] = (int)c;
        else
            p.y[c] = 0.0f;
    }
    __syncthreads();
    const int cnt = s_cnt;
    for (int g = 0; g < cnt; g += 2) {
        const int r0 = s_rows[g], r1 = g + 1 < cnt ? s_rows[g + 1] : r0;
        pair_dot<TYPE>(p, (const int4 *)p.w + r0 * rs, (const int4 *)p.w + r1 * rs, &s0, &s1);
        if (threadIdx.x == 0) {
            p.y[r0] = s0;
            if (g + 1 < cnt) p.y[r1] = s1;
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// quantized weights: select and compact candidate rows, then NR listed rows per warp
// ---------------------------------------------------------------------------------------------------

#define QROWS_WARPS 4     // warps per block of qrows_kernel
#define QROWS_MAX 1024    // candidates per block and round at most (the shared row list)

// rows a warp takes at once: NC = 1 (one column) shares x over the type's NR rows, NC = 8 over columns
template <int TYPE, int NC>
constexpr int qrows_nr = NC == 1 ? qrow<TYPE>::NR : 1;

// blocks per SM that __launch_bounds__ asks registers for (64 registers a thread at 8, 80 at 6, 96 at 5):
// as many as the type's loads in flight fit in without spilling
template <int TYPE>
constexpr int qrows_min_blocks = TYPE == GGML_TYPE_Q6_K ? 5 : TYPE == GGML_TYPE_Q8_0 ? 6 : 8;

// Grid (blocks, 1) or, for index lists, (blocks, columns). Each round a block takes R candidates,
// lists the selected rows (zeros for the others), and its warps take NR listed rows at a time.
template <int TYPE, bool A16, int NC>
__global__ void __launch_bounds__(QROWS_WARPS * 32, qrows_min_blocks<TYPE>) qrows_kernel(rows_params p) {
    constexpr int NR = qrows_nr<TYPE, NC>;
    __shared__ int s_rows[QROWS_MAX]; // (s_cnt) selected rows of this round
    __shared__ int s_cnt, s_term;     // list mode: s_term = first negative entry of the column seen so far
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int col = blockIdx.y;
    const cuda_rows_sel &s = p.s;
    const bool list = s.mode == CUDA_SEL_LIST;
    const int mm = list ? 1 : p.m;
    const int64_t n_cand = list ? s.n_sel : p.n_rows;
    const int8_t *xq = p.xq + (list ? col : 0) * p.k;
    const float2 *xds = p.xds + (list ? col : 0) * (p.k / 32);
    int64_t scanned = 0; // list entries [0, scanned) searched for a negative one
    if (tid == 0) s_term = (int)s.n_sel;
    for (int64_t c0 = (int64_t)blockIdx.x * p.R; c0 < n_cand; c0 += (int64_t)gridDim.x * p.R) {
        const int64_t lim = c0 + p.R < n_cand ? c0 + p.R : n_cand;
        if (tid == 0) s_cnt = 0;
        if (list) { // an entry counts only before the column's first negative entry
            __syncthreads();
            for (int64_t e = scanned + tid; e < lim; e += blockDim.x)
                if (list_at(s, e, col) < 0) atomicMin(&s_term, (int)e);
            scanned = lim;
        }
        __syncthreads();
        for (int64_t c = c0 + tid; c < lim; c += blockDim.x) {
            int64_t row;
            bool sel;
            if (list) {
                row = c < s_term ? list_at(s, c, col) : -1;
                sel = row >= s.begin && row < s.end && row < p.n_rows;
            } else {
                row = c;
                sel = row >= s.begin && row < s.end;
                if (sel && s.mode == CUDA_SEL_MASK) {
                    bool any = false;
                    for (int j = 0; j < mm && !any; j++) any = mask_on(s, row, j);
                    sel = any;
                }
                if (!sel)
                    for (int j = 0; j < mm; j++) p.y[row + j * p.y_ld] = 0.0f;
            }
            if (sel) s_rows[atomicAdd(&s_cnt, 1)] = (int)row;
        }
        __syncthreads();
        const int total = s_cnt;
        // GLU: a warp's NR = 2 rows are one row of w (gate) and the same row of w2 (up)
        const bool glu = NC == 1 && p.w2;
        const int per = glu ? 1 : NR; // listed rows a warp takes at once
        for (int g = warp * per; g < total; g += QROWS_WARPS * per) {
            int r_of[NR];
            const uint8_t *wr[NR]; // rows past the list repeat row g: loaded, never written
#pragma unroll
            for (int r = 0; r < NR; r++) {
                r_of[r] = s_rows[g + r < total && !glu ? g + r : g];
                wr[r] = (glu && r == 1 ? p.w2 : p.w) + (int64_t)r_of[r] * p.w_nb1;
            }
            float acc[NR][NC];
#pragma unroll
            for (int r = 0; r < NR; r++)
#pragma unroll
                for (int j = 0; j < NC; j++) acc[r][j] = 0.0f;
            qrow_dots<TYPE, A16, NC, NR>(wr, xq, xds, p.k, mm, lane, acc);
            if constexpr (NC == 1 && NR == 2) {
                if (glu) {
                    const float gate = warp_sum(acc[0][0]), up = warp_sum(acc[1][0]);
                    if (lane == 0) row_put(p, r_of[0], row_out(p, r_of[0], gate, up));
                    continue;
                }
            }
#pragma unroll
            for (int r = 0; r < NR; r++) {
#pragma unroll
                for (int j = 0; j < NC; j++) {
                    if (j >= mm) break;
                    const float v = warp_sum(acc[r][j]);
                    if (lane != 0 || g + r >= total) continue;
                    if (list)
                        p.y[r_of[r] + col * p.y_ld] = v;
                    else if (p.add || p.act || p.kv.data)
                        row_put(p, r_of[r], row_out(p, r_of[r], v, 0.0f)); // m = 1, dense
                    else
                        p.y[r_of[r] + j * p.y_ld] = s.mode != CUDA_SEL_MASK || mm == 1 || mask_on(s, r_of[r], j) ? v : 0.0f;
                }
            }
        }
        __syncthreads(); // s_rows and s_cnt are refilled next round
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

size_t cuda_xq_wsize(enum ggml_type wtype, int64_t k, int64_t m) {
    if (cuda_type_is_float(wtype)) return 0;
    // (m, k) int8 values, then (m, k / 32) float2 scales
    return align256((size_t)(m * k)) + align256((size_t)(m * (k / 32)) * sizeof(float2));
}

void cuda_xq_at(void *wdata, int64_t k, int64_t m, int8_t **xq, float2 **xds) {
    *xq = (int8_t *)wdata;
    *xds = (float2 *)((char *)wdata + align256((size_t)(m * k)));
}

int cuda_quantize_q8_1(const float *x, int64_t x_ld, int64_t k, int64_t m, void *wdata, cudaStream_t st) {
    int8_t *xq;
    float2 *xds;
    cuda_xq_at(wdata, k, m, &xq, &xds);
    const int64_t blocks = (m * (k / 32) * 32 + CUDA_BLOCK - 1) / CUDA_BLOCK; // a warp per 32 values
    quantize_q8_1_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), CUDA_BLOCK, 0, st>>>(x, x_ld, k, m, xq, xds);
    return cuda_launch_status("quantize activations");
}

template <int TYPE>
static void rows_launch(const rows_params &p, dim3 grid, bool aligned, cudaStream_t st) {
    if (aligned)
        rows_kernel<TYPE, true><<<grid, CUDA_BLOCK, 0, st>>>(p);
    else
        rows_kernel<TYPE, false><<<grid, CUDA_BLOCK, 0, st>>>(p);
}

// 16-byte chunks (or values, unaligned) each thread of a float row's group takes at once
static int64_t row_units(enum ggml_type t, int64_t k, bool aligned) {
    if (!aligned) return k;
    return k / (t == GGML_TYPE_F32 ? 4 : 8) / GEMV_FLOAT_UNROLL;
}

// blocks of one qrows_kernel instance the whole device holds at once (asked once per instance)
template <int TYPE, bool A16, int NC>
static int64_t qrows_capacity(void) {
    static const int64_t n = [] {
        int per_sm = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, qrows_kernel<TYPE, A16, NC>, QROWS_WARPS * 32, 0) !=
            cudaSuccess)
            (void)cudaGetLastError();
        return (int64_t)(per_sm > 0 ? per_sm : 1) * cuda_sm_count();
    }();
    return n;
}

// one wave of blocks (per grid row gy), each warp taking as many groups of NR rows as that needs
template <int TYPE, bool A16, int NC>
static void qrows_launch_as(rows_params p, int64_t n_cand, unsigned gy, cudaStream_t st) {
    const int64_t rg = QROWS_WARPS * qrows_nr<TYPE, NC>; // rows of one round of a block, one group per warp
    int64_t cap = qrows_capacity<TYPE, A16, NC>() / gy;
    if (cap < 1) cap = 1;
    const int64_t rounds = (n_cand + cap * rg - 1) / (cap * rg);
    p.R = (int)(rounds * rg < QROWS_MAX ? rounds * rg : QROWS_MAX);
    const int64_t blocks = (n_cand + p.R - 1) / p.R;
    qrows_kernel<TYPE, A16, NC><<<dim3((unsigned)(blocks < cap ? blocks : cap), gy), QROWS_WARPS * 32, 0, st>>>(p);
}

template <int TYPE>
static void qrows_launch(const rows_params &p, int64_t n_cand, unsigned gy, bool aligned, cudaStream_t st) {
    const bool one_col = p.m == 1 || p.s.mode == CUDA_SEL_LIST; // lists: one column per block
    // only Q4_K loads differently from 16-byte aligned rows (its chunks then need no realignment)
    if constexpr (TYPE == GGML_TYPE_Q4_K) {
        if (aligned) {
            if (one_col) qrows_launch_as<TYPE, true, 1>(p, n_cand, gy, st);
            else qrows_launch_as<TYPE, true, GEMV_MAX_COLS>(p, n_cand, gy, st);
            return;
        }
    }
    if (one_col) qrows_launch_as<TYPE, false, 1>(p, n_cand, gy, st);
    else qrows_launch_as<TYPE, false, GEMV_MAX_COLS>(p, n_cand, gy, st);
}

// one launch of the row dot products for a weight type: float rows by thread groups, quantized by warps
struct any_rows_launch {
    const rows_params &p;
    dim3 grid;      // float rows
    int64_t n_cand; // quantized rows: candidates, grid rows
    unsigned gy;
    bool aligned;
    cudaStream_t st;
    template <int TYPE> void run() const {
        if constexpr (TYPE == GGML_TYPE_F32 || TYPE == GGML_TYPE_F16 || TYPE == GGML_TYPE_BF16)
            rows_launch<TYPE>(p, grid, aligned, st);
        else
            qrows_launch<TYPE>(p, n_cand, gy, aligned, st);
    }
};

// 16-byte loads of w's rows and of x are possible (the float kernels' fast path)
static bool float_rows_aligned(const struct ggml_tensor *w, const struct ggml_tensor *x) {
    return (uintptr_t)w->data % 16 == 0 && w->nb[1] % 16 == 0 && (uintptr_t)x->data % 16 == 0 && x->nb[1] % 16 == 0;
}

bool cuda_gemv_takes_extra(const struct ggml_tensor *w, const struct ggml_tensor *x) {
    if (x->ne[1] != 1 || x->type != GGML_TYPE_F32 || !cuda_type_is_weight(w->type) || w->ne[1] > INT32_MAX) return false;
    return !cuda_type_is_float(w->type) || float_rows_aligned(w, x);
}

template <int TYPE>
static void gemv_f_launch(const rows_params &p, cudaStream_t st) {
    const int64_t blocks = p.s.mode == CUDA_SEL_MASK ? (p.n_rows + GEMV_F_MASK_ROWS - 1) / GEMV_F_MASK_ROWS
                           : p.w2                    ? p.n_rows
                                                     : (p.n_rows + 1) / 2;
    gemv_f_kernel<TYPE><<<(unsigned)blocks, GEMV_F_THREADS, 0, st>>>(p);
}

int cuda_rows_dot(const struct ggml_tensor *w, const struct ggml_tensor *x, struct ggml_tensor *y,
                  const cuda_rows_sel &s, void *wdata, cudaStream_t st, const cuda_gemv_extra &e) {
    const enum ggml_type type = w->type;
    const int64_t k = w->ne[0], n = w->ne[1], m = x->ne[1];
    if (!cuda_type_is_weight(type) || x->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "CUDA GEMV cannot read %s", ggml_type_name(type));
    if (n > INT32_MAX || k % ggml_blck_size(type))
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "CUDA GEMV: bad shape");
    if (s.mode == CUDA_SEL_LIST && m > 65535)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "CUDA GEMV: too many list columns");
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
    p.R = p.tpr = 0;
    p.w2 = e.up ? (const uint8_t *)e.up->data : NULL;
    p.act = e.act;
    p.add = e.add;
    p.kv = e.store ? cuda_view_of(e.store) : cuda_view{};
    p.kv_pos = e.store ? (const char *)e.store->src[2]->data : NULL;
    p.kv_f16 = e.store && e.store->type == GGML_TYPE_F16;
    if ((p.w2 || p.add || p.act || e.store) && (s.mode != CUDA_SEL_ALL || !cuda_gemv_takes_extra(w, x)))
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "CUDA GEMV: fused epilogue on an unsupported shape");
    const bool is_float = cuda_type_is_float(type);
    bool aligned = ((uintptr_t)p.w % 16 == 0) && p.w_nb1 % 16 == 0;
    if (is_float) {
        aligned = float_rows_aligned(w, x);
        if (aligned && m == 1 && s.mode != CUDA_SEL_LIST) { // decoding: every row or a mask's, one column
            switch (type) {
            case GGML_TYPE_F32: gemv_f_launch<GGML_TYPE_F32>(p, st); break;
            case GGML_TYPE_F16: gemv_f_launch<GGML_TYPE_F16>(p, st); break;
            default: gemv_f_launch<GGML_TYPE_BF16>(p, st); break;
            }
            return cuda_launch_status("GEMV");
        }
    } else { // x as Q8_1 in wdata, unless the previous GEMV or the norm that made x left it there
        int8_t *xq;
        float2 *xds;
        cuda_xq_at(wdata, k, m, &xq, &xds);
        int rc = e.xq_ready ? GGML_STATUS_OK : cuda_quantize_q8_1(p.xf, p.x_ld, k, m, wdata, st);
        if (rc) return rc;
        p.xq = xq;
        p.xds = xds;
    }
    const int64_t n_cand = s.mode == CUDA_SEL_LIST ? s.n_sel : n;
    if (n_cand == 0) return GGML_STATUS_OK;
    const unsigned gy = s.mode == CUDA_SEL_LIST ? (unsigned)m : 1u;
    dim3 grid;
    if (is_float) {
        const int64_t units = row_units(type, k, aligned);
        int tpr = 32;
        while (tpr > 1 && tpr / 2 >= units) tpr /= 2;
        p.tpr = tpr;
        const int slots = CUDA_BLOCK / tpr;
        // dense and lists: one row per thread group; masks: 4x candidates, most of them skipped when sparse
        p.R = s.mode == CUDA_SEL_MASK ? (4 * slots < CUDA_BLOCK ? 4 * slots : CUDA_BLOCK) : slots;
        grid = dim3((unsigned)((n_cand + p.R - 1) / p.R), gy);
    }
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
        with_weight_type(type, any_rows_launch{p, grid, n_cand, gy, aligned, st});
    }
    return cuda_launch_status("row dot products");
}

// ---------------------------------------------------------------------------------------------------
// MUL_MAT: GEMV up to GEMV_MAX_COLS columns, GEMM beyond
// ---------------------------------------------------------------------------------------------------

size_t cuda_mul_mat_wsize(const struct ggml_tensor *dst) {
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    if (x->ne[1] > GEMV_MAX_COLS) return cuda_gemm_wsize(w, x, dst);
    return cuda_xq_wsize(w->type, w->ne[0], x->ne[1]);
}

int cuda_op_mul_mat(struct ggml_tensor *dst, void *wdata, cudaStream_t st) {
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    if (ggml_nrows(w) != w->ne[1] || ggml_nrows(x) != x->ne[1])
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "mul_mat takes matrices");
    if (x->ne[1] > GEMV_MAX_COLS) return cuda_gemm(w, x, dst, wdata, st, dst->op_params[0] != 0);
    cuda_rows_sel s = {CUDA_SEL_ALL, NULL, 0, 0, 0, 0, w->ne[1]};
    return cuda_rows_dot(w, x, dst, s, wdata, st);
}
