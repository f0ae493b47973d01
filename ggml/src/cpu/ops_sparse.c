// ops_sparse.c: neuron-aware sparse ops. mul_mat_rows computes only the selected rows of W x;
// axpy_rows sums h[i] * Wt[i] over the selected rows i. A selector is an F32 mask [n_rows, m]
// (row i selected for column j where > 0), an I32 index list [n_sel, m] (entries < 0 end a column's
// list), or NULL (every row); only rows in [begin, end) (op_params 0 and 1) count.
//
// Masks are compacted first: each thread lists the selected rows of its slice of [begin, end) into
// wdata, so that after the barrier the threads can split the *selected* rows evenly (hot-first neuron
// order puts most selected rows at the start, where an even split of the range would be unbalanced).
#include "ops_kernels.h"

#include <string.h>

struct sparse_sel {
    const struct ggml_tensor *sel; // NULL, F32 mask or I32 index list
    int64_t begin, end;            // row range considered
    int64_t n_rows, m;
    int32_t *list;                 // (end - begin) rows listed by the mask compaction, segment per thread
    int64_t *counts;               // (nth) rows each thread listed
};

static inline bool mask_at(const struct ggml_tensor *sel, int64_t i, int64_t j) {
    return *(const float *)((const char *)sel->data + i * (int64_t)sel->nb[0] + j * (int64_t)sel->nb[1]) > 0.0f;
}

static inline int32_t index_at(const struct ggml_tensor *sel, int64_t e, int64_t j) {
    return *(const int32_t *)((const char *)sel->data + e * (int64_t)sel->nb[0] + j * (int64_t)sel->nb[1]);
}

// entries of column j's index list before its terminator
static int64_t index_len(const struct ggml_tensor *sel, int64_t j) {
    int64_t e = 0;
    while (e < sel->ne[0] && index_at(sel, e, j) >= 0) e++;
    return e;
}

// bytes of the compaction buffers (masks only)
static size_t sel_wsize(const struct ggml_tensor *sel, int64_t n_rows, int n_threads) {
    if (!sel || sel->type != GGML_TYPE_F32) return 0;
    return ggml_cpu_align_up((size_t)n_rows * sizeof(int32_t)) + ggml_cpu_align_up((size_t)n_threads * sizeof(int64_t));
}

// checks the selector's values (every thread, all of them: the same status everywhere) and binds the
// compaction buffers at wdata + offset
static int sel_init(struct sparse_sel *s, const struct ggml_compute_params *p, const struct ggml_tensor *dst,
                    int64_t n_rows, int64_t m, size_t offset) {
    s->sel = dst->src[2];
    s->begin = dst->op_params[0];
    s->end = dst->op_params[1];
    s->n_rows = n_rows;
    s->m = m;
    s->list = (int32_t *)((char *)p->wdata + offset);
    s->counts = (int64_t *)((char *)p->wdata + offset + ggml_cpu_align_up((size_t)n_rows * sizeof(int32_t)));
    if (s->begin < 0 || s->begin > s->end || s->end > n_rows)
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "row range [%lld, %lld) outside [0, %lld]",
                              (long long)s->begin, (long long)s->end, (long long)n_rows);
    const struct ggml_tensor *sel = s->sel;
    if (!sel) return GGML_STATUS_OK;
    if (sel->type == GGML_TYPE_F32) {
        if (sel->ne[0] != n_rows || sel->ne[1] != m)
            return ggml_set_error(GGML_STATUS_INVALID_ARG, "mask must be [n_rows, m]");
        return GGML_STATUS_OK;
    }
    if (sel->type != GGML_TYPE_I32 || sel->ne[1] != m)
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "selector must be an F32 mask or an I32 index list");
    for (int64_t j = 0; j < m; j++) {
        const int64_t len = index_len(sel, j);
        for (int64_t e = 0; e < len; e++)
            if (index_at(sel, e, j) >= n_rows)
                return ggml_set_error(GGML_STATUS_INVALID_ARG, "index %d (entry %lld, column %lld) >= %lld rows",
                                      index_at(sel, e, j), (long long)e, (long long)j, (long long)n_rows);
    }
    return GGML_STATUS_OK;
}

// phase 1 of a mask: lists the rows of this thread's slice of [begin, end) selected in any column
static void sel_compact(const struct sparse_sel *s, int ith, int nth) {
    int64_t c0, c1;
    ggml_thread_range(s->end - s->begin, ith, nth, &c0, &c1);
    int32_t *out = s->list + c0;
    int64_t n = 0;
    for (int64_t i = s->begin + c0; i < s->begin + c1; i++) {
        bool any = false;
        for (int64_t j = 0; j < s->m && !any; j++) any = mask_at(s->sel, i, j);
        if (any) out[n++] = (int32_t)i;
    }
    s->counts[ith] = n;
}

// ---------------------------------------------------------------------------------------------------
// walking the selected rows. Selected rows are scattered over the weights, out of the hardware
// prefetchers' sight, so the walk names the row a few steps ahead for a software prefetch.
// ---------------------------------------------------------------------------------------------------

#define SPARSE_PREFETCH_AHEAD 4
#define SEL_CHUNK_ROWS 64

struct sel_walk {
    void (*visit)(void *ctx, int64_t row, int64_t col); // col < 0: every column whose selector picks row
    void (*prefetch)(void *ctx, int64_t row);
    void *ctx;
};

static int64_t sel_total(const struct sparse_sel *s, int nth) {
    int64_t total = 0;
    for (int t = 0; t < nth; t++) total += s->counts[t];
    return total;
}

// visits the listed rows [t0, t1) of the whole list (the segments of all threads, in order)
static void sel_visit_listed(const struct sparse_sel *s, int nth, int64_t t0, int64_t t1, const struct sel_walk *w) {
    int64_t seen = 0; // listed rows in the segments before segment t
    for (int t = 0; t < nth && seen < t1; t++) {
        int64_t c0, c1;
        ggml_thread_range(s->end - s->begin, t, nth, &c0, &c1);
        const int32_t *seg = s->list + c0;
        const int64_t a = t0 > seen ? t0 - seen : 0;
        const int64_t b = t1 - seen < s->counts[t] ? t1 - seen : s->counts[t];
        for (int64_t e = a; e < b; e++) {
            if (e + SPARSE_PREFETCH_AHEAD < b) w->prefetch(w->ctx, seg[e + SPARSE_PREFETCH_AHEAD]);
            w->visit(w->ctx, seg[e], -1);
        }
        seen += s->counts[t];
    }
}

// visits this thread's share of the selected rows after sel_compact's barrier: with a mask, chunks of
// SEL_CHUNK_ROWS listed rows taken first come, first served from *next (a thread the shared machine slows
// holds the other up by one chunk, not by half the rows); whole: all of them
static void sel_walk(const struct sparse_sel *s, int ith, int nth, bool whole, atomic_int *next,
                     const struct sel_walk *w) {
    int64_t t0, t1;
    if (!s->sel) {
        if (whole) t0 = 0, t1 = s->end - s->begin;
        else ggml_thread_range(s->end - s->begin, ith, nth, &t0, &t1);
        for (int64_t i = s->begin + t0; i < s->begin + t1; i++) {
            // axpy4 reads four rows at once, a pattern the hardware prefetchers follow less well than one row
            if (i + SPARSE_PREFETCH_AHEAD < s->begin + t1) w->prefetch(w->ctx, i + SPARSE_PREFETCH_AHEAD);
            w->visit(w->ctx, i, -1);
        }
        return;
    }
    if (s->sel->type == GGML_TYPE_F32) {
        const int64_t total = sel_total(s, nth);
        if (whole) {
            sel_visit_listed(s, nth, 0, total, w);
            return;
        }
        while (ggml_next_chunk(next, total, SEL_CHUNK_ROWS, &t0, &t1)) sel_visit_listed(s, nth, t0, t1, w);
        return;
    }
    for (int64_t j = 0; j < s->m; j++) {
        const int64_t len = index_len(s->sel, j);
        if (whole) t0 = 0, t1 = len;
        else ggml_thread_range(len, ith, nth, &t0, &t1);
        for (int64_t e = t0; e < t1; e++) {
            if (e + SPARSE_PREFETCH_AHEAD < t1) w->prefetch(w->ctx, index_at(s->sel, e + SPARSE_PREFETCH_AHEAD, j));
            const int64_t i = index_at(s->sel, e, j);
            if (i >= s->begin && i < s->end) w->visit(w->ctx, i, j);
        }
    }
}

// true when column j takes row i in a visit with col < 0
static inline bool sel_picks(const struct sparse_sel *s, int64_t i, int64_t j) {
    return !s->sel || s->m == 1 || mask_at(s->sel, i, j); // one column: the compaction already checked
}

// into L2 only (prefetcht2): a row is tens of lines, and L1 prefetches of them filled the L1 miss
// buffers that the demand loads of the current row need (SYNTHETIC 7B Q4_0, 2 cores, cold caches: gate + up
// rows at 10% took 0.63-0.77 ms a layer with L1 prefetches, 0.37-0.48 ms with these)
static inline void prefetch_bytes(const char *p, size_t n) {
    for (size_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 1);
}

// rows [r0, r1) of every column of dst [n, m] set to zero
static void zero_rows(struct ggml_tensor *dst, int64_t r0, int64_t r1) {
    for (int64_t j = 0; j < dst->ne[1] && r0 < r1; j++)
        memset((char *)dst->data + j * (int64_t)dst->nb[1] + r0 * (int64_t)sizeof(float), 0,
               (size_t)(r1 - r0) * sizeof(float));
}

// ---------------------------------------------------------------------------------------------------
// MUL_MAT_ROWS: w [k, n_rows], x [k, m] -> dst [n_rows, m], zero where not selected.
// Phase 1: x converted to vec_dot_type, dst zeroed, mask compacted; barrier; phase 2: the threads
// split the selected rows evenly, each row dotted with every column that selects it.
// ---------------------------------------------------------------------------------------------------

struct mmr_ctx {
    const struct ggml_tensor *w;
    const struct ggml_cpu_xcols *xc;
    struct ggml_tensor *dst;
    const struct sparse_sel *s;
    ggml_vec_dot_fn dot;
};

static void mmr_dot(const struct mmr_ctx *c, int64_t i, int64_t j) {
    float *y = (float *)((char *)c->dst->data + j * (int64_t)c->dst->nb[1]); // (n_rows) column j
    c->dot(c->w->ne[0], &y[i], (const char *)c->w->data + i * (int64_t)c->w->nb[1],
           c->xc->base + (size_t)j * c->xc->stride);
}

static void mmr_visit(void *vctx, int64_t i, int64_t col) {
    const struct mmr_ctx *c = vctx;
    if (col >= 0) {
        mmr_dot(c, i, col);
        return;
    }
    for (int64_t j = 0; j < c->s->m; j++)
        if (sel_picks(c->s, i, j)) mmr_dot(c, i, j);
}

static void mmr_prefetch(void *vctx, int64_t i) {
    const struct mmr_ctx *c = vctx;
    prefetch_bytes((const char *)c->w->data + i * (int64_t)c->w->nb[1], c->w->nb[1]);
}

size_t ggml_cpu_mul_mat_rows_wsize(const struct ggml_tensor *dst, int n_threads) {
    const struct ggml_tensor *w = dst->src[0];
    return ggml_cpu_xcols_wsize(w, dst->src[1]) + sel_wsize(dst->src[2], w->ne[1], n_threads);
}

int ggml_cpu_op_mul_mat_rows(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    struct sparse_sel s;
    int st = sel_init(&s, p, dst, w->ne[1], x->ne[1], ggml_cpu_xcols_wsize(w, x));
    if (st) return st;
    struct ggml_cpu_xcols xc;
    if ((st = ggml_cpu_xcols_prepare(p, w, x, &xc))) return st;
    int64_t r0, r1;
    ggml_thread_range(s.n_rows, p->ith, p->nth, &r0, &r1);
    zero_rows(dst, r0, r1);
    if (s.sel && s.sel->type == GGML_TYPE_F32) sel_compact(&s, p->ith, p->nth);
    ggml_barrier(p->tp);
    struct mmr_ctx c = {w, &xc, dst, &s, ggml_get_type_traits(w->type)->vec_dot};
    sel_walk(&s, p->ith, p->nth, false, p->chunk_next, &(struct sel_walk){mmr_visit, mmr_prefetch, &c});
    return GGML_STATUS_OK;
}

// ---------------------------------------------------------------------------------------------------
// AXPY_ROWS: wt [d, n_rows], h [n_rows, m] -> dst [d, m] = sum over selected i of h[i, j] * wt[i].
// Up to AXPY_PARTIAL_MAX_M columns: the threads split the selected rows, each summing whole rows into
// a private [d, m] buffer (contiguous reads the prefetchers follow), then split d to add the buffers
// up. More columns: the buffers would grow with m, so the threads split d into block-aligned slices
// instead, each owning its slice of dst and walking every selected row (work per row grows with m).
// With one column the rows are summed four at a time where the type has an axpy4 (the target is then
// loaded and stored once per four rows).
// ---------------------------------------------------------------------------------------------------

#define AXPY_PARTIAL_MAX_M 4

struct axpy_ctx {
    const struct ggml_tensor *wt, *h;
    const struct sparse_sel *s;
    ggml_axpy_fn axpy;
    float *y;          // column 0 of the target (dst or this thread's buffer), at value v0
    int64_t y_stride;  // floats from one target column to the next
    int64_t n;         // values per row handled (the slice, or d)
    size_t row_offs;   // byte offset of the first handled value in a row of wt
    size_t row_bytes;  // bytes of a row handled
    ggml_axpy4_fn axpy4; // NULL: every row on its own
    int n_held;          // rows held for the next axpy4 (column 0 only)
    float held_a[4];
    const void *held_row[4];
};

static inline void axpy_one(struct axpy_ctx *c, int64_t i, int64_t j) {
    const float hij = *(const float *)((const char *)c->h->data + i * (int64_t)c->h->nb[0] + j * (int64_t)c->h->nb[1]);
    const void *row = (const char *)c->wt->data + i * (int64_t)c->wt->nb[1] + c->row_offs;
    if (!c->axpy4) {
        c->axpy(c->n, c->y + j * c->y_stride, hij, row);
        return;
    }
    c->held_a[c->n_held] = hij;
    c->held_row[c->n_held++] = row;
    if (c->n_held == 4) {
        c->axpy4(c->n, c->y, c->held_a, c->held_row);
        c->n_held = 0;
    }
}

// the rows still held after the walk
static void axpy_flush(struct axpy_ctx *c) {
    for (int r = 0; r < c->n_held; r++) c->axpy(c->n, c->y, c->held_a[r], c->held_row[r]);
    c->n_held = 0;
}

static void axpy_visit(void *vctx, int64_t i, int64_t col) {
    struct axpy_ctx *c = vctx;
    if (col >= 0) {
        axpy_one(c, i, col);
        return;
    }
    for (int64_t j = 0; j < c->s->m; j++)
        if (sel_picks(c->s, i, j)) axpy_one(c, i, j);
}

static void axpy_prefetch(void *vctx, int64_t i) {
    const struct axpy_ctx *c = vctx;
    prefetch_bytes((const char *)c->wt->data + i * (int64_t)c->wt->nb[1] + c->row_offs, c->row_bytes);
}

static size_t axpy_partial_bytes(const struct ggml_tensor *dst) {
    return ggml_cpu_align_up((size_t)dst->ne[0] * (size_t)dst->ne[1] * sizeof(float)); // (m, d) per thread
}

size_t ggml_cpu_axpy_rows_wsize(const struct ggml_tensor *dst, int n_threads) {
    size_t partials = dst->ne[1] <= AXPY_PARTIAL_MAX_M ? (size_t)n_threads * axpy_partial_bytes(dst) : 0;
    return sel_wsize(dst->src[2], dst->src[0]->ne[1], n_threads) + partials;
}

int ggml_cpu_op_axpy_rows(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *wt = dst->src[0], *h = dst->src[1];
    const struct ggml_type_traits *tw = ggml_get_type_traits(wt->type);
    if (!tw->axpy || h->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "axpy_rows cannot read %s", ggml_type_name(wt->type));
    struct sparse_sel s;
    int st = sel_init(&s, p, dst, wt->ne[1], h->ne[1], 0);
    if (st) return st;
    const int ith = p->ith, nth = p->nth;
    if (s.sel && s.sel->type == GGML_TYPE_F32) {
        sel_compact(&s, ith, nth);
        ggml_barrier(p->tp);
    }
    const int64_t d = wt->ne[0], m = s.m;
    // slices of whole blocks, at least 16 values so that no two threads share a cache line of dst
    const int64_t gran = tw->blck_size > 16 ? tw->blck_size : 16;
    int64_t g0, g1;
    ggml_thread_range((d + gran - 1) / gran, ith, nth, &g0, &g1);
    const int64_t v0 = g0 * gran, v1 = g1 * gran < d ? g1 * gran : d;
    const int64_t dst_stride = (int64_t)(dst->nb[1] / sizeof(float));
    if (m > AXPY_PARTIAL_MAX_M) {
        if (v0 >= v1) return GGML_STATUS_OK;
        for (int64_t j = 0; j < m; j++) memset((float *)dst->data + j * dst_stride + v0, 0, (size_t)(v1 - v0) * sizeof(float));
        struct axpy_ctx c = {wt, h, &s, tw->axpy, (float *)dst->data + v0, dst_stride, v1 - v0,
                             (size_t)(v0 / tw->blck_size) * tw->type_size, ggml_row_size(wt->type, v1 - v0), .axpy4 = NULL};
        sel_walk(&s, ith, nth, true, p->chunk_next, &(struct sel_walk){axpy_visit, axpy_prefetch, &c});
        return GGML_STATUS_OK;
    }
    const size_t sel_bytes = sel_wsize(s.sel, s.n_rows, nth), part_bytes = axpy_partial_bytes(dst);
    float *mine = (float *)((char *)p->wdata + sel_bytes + (size_t)ith * part_bytes); // (m, d)
    memset(mine, 0, (size_t)(d * m) * sizeof(float));
    struct axpy_ctx c = {wt, h, &s, tw->axpy, mine, d, d, 0, wt->nb[1], .axpy4 = m == 1 ? tw->axpy4 : NULL};
    sel_walk(&s, ith, nth, false, p->chunk_next, &(struct sel_walk){axpy_visit, axpy_prefetch, &c});
    axpy_flush(&c);
    ggml_barrier(p->tp);
    for (int64_t j = 0; j < m; j++) {
        float *y = (float *)dst->data + j * dst_stride; // (d) column j
        const float *first = (const float *)((char *)p->wdata + sel_bytes) + j * d;
        for (int64_t v = v0; v < v1; v++) y[v] = first[v];
        for (int t = 1; t < nth; t++) {
            const float *part = (const float *)((char *)p->wdata + sel_bytes + (size_t)t * part_bytes) + j * d;
            for (int64_t v = v0; v < v1; v++) y[v] += part[v];
        }
    }
    return GGML_STATUS_OK;
}
