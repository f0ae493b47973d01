// ops_sparse.c: neuron-aware sparse ops. mul_mat_rows computes only the selected rows of W x;
// axpy_rows sums h[i] * Wt[i] over the selected rows i; sparse_ffn does a whole FFN over the selected
// neurons of a bundle that keeps each neuron's rows together. A selector is an F32 mask [n_rows, m]
// (row i selected for column j where > 0), an I32 index list [n_sel, m] (entries < 0 end a column's
// list), or NULL (every row); only rows in [begin, end) (op_params 0 and 1) count.
//
// Masks are compacted first: each thread lists the selected rows of its slice of [begin, end) into
// wdata, so that after the barrier the threads can split the *selected* rows evenly (hot-first neuron
// order puts most selected rows at the start, where an even split of the range would be unbalanced).
#include "f32_rows.h"
#include "ops_kernels.h"

#include <string.h>

struct sparse_sel {
    const struct ggml_tensor *sel; // NULL, F32 mask or I32 index list
    int64_t begin, end;            // row range considered
    int64_t n_rows, m;
    int32_t *list;                 // (end - begin) rows listed by the mask compaction, segment per thread
    int64_t *counts;               // (nth) rows each thread listed
    int64_t min_chunk;             // fewest listed rows in a unit of work (sel_chunk_rows; set by the op)
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
    s->min_chunk = 1;
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
#define SEL_CHUNK_ROWS 64 // most listed rows in one unit of work, unless its fixed costs ask for more (below)
#define SEL_CHUNK_ALIGN 8 // units hold whole groups of the 8-row axpy kernels (a unit's last rows go one by one)
#define SEL_UNITS 64      // units a selection of up to SEL_UNITS * SEL_CHUNK_ROWS rows is cut into

struct sel_walk {
    void (*visit)(void *ctx, int64_t row, int64_t col); // col < 0: every column whose selector picks row
    void (*prefetch)(void *ctx, int64_t row);    // NULL: none
    void (*unit)(void *ctx, int64_t unit); // NULL, or called before the rows of each unit of work (below)
    void *ctx;
};

// listed rows per unit of work: a few hundred selected rows (a split layer's cold neurons) still make
// SEL_UNITS units, enough for every thread of a large pool, and a unit holds at least s->min_chunk; depends on
// the selection and the shapes only, not on the thread count, so the sums are added in the same order whatever
// the pool
static int64_t sel_chunk_rows(const struct sparse_sel *s, int64_t total) {
    const int64_t lo = s->min_chunk, hi = SEL_CHUNK_ROWS > lo ? SEL_CHUNK_ROWS : lo;
    int64_t c = (total + SEL_UNITS - 1) / SEL_UNITS;
    c = c < lo ? lo : c > hi ? hi : c;
    return (c + SEL_CHUNK_ALIGN - 1) / SEL_CHUNK_ALIGN * SEL_CHUNK_ALIGN;
}

// s->min_chunk of a walk whose units have sums of their own (n_sums floats each, rows of row_bytes read): enough
// rows that zeroing and adding up a unit's sums stays small beside reading its rows (Qwen2.5-Coder-0.5B's down_t,
// 4864 rows of 896 Q5_0 values at 32 %, 2 threads: 64 units of 25 rows took 138 us, 17 of 96 rows 118 us)
#define UNIT_READ_PER_SUM 16 // bytes of rows a unit reads per byte of its sums, at least
static int64_t unit_min_rows(int64_t n_sums, size_t row_bytes) {
    return (int64_t)((UNIT_READ_PER_SUM * (size_t)n_sums * sizeof(float) + row_bytes - 1) / row_bytes);
}

// units of work a walk of nth threads may hand out: a thread's share, or a chunk of a mask's listed rows
static int64_t sel_max_units(int64_t n_rows, int nth) {
    const int64_t chunks = (n_rows + SEL_CHUNK_ROWS - 1) / SEL_CHUNK_ROWS;
    const int64_t most = chunks > SEL_UNITS ? chunks : SEL_UNITS;
    return most > nth ? most : nth;
}

static int64_t sel_total(const struct sparse_sel *s, int nth) {
    int64_t total = 0;
    for (int t = 0; t < nth; t++) total += s->counts[t];
    return total;
}

// units handed out by a walk that is not whole (after sel_compact's barrier)
static int64_t sel_units(const struct sparse_sel *s, int nth) {
    if (!s->sel || s->sel->type != GGML_TYPE_F32) return nth;
    const int64_t total = sel_total(s, nth), chunk = sel_chunk_rows(s, total);
    return (total + chunk - 1) / chunk;
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
            if (w->prefetch && e + SPARSE_PREFETCH_AHEAD < b) w->prefetch(w->ctx, seg[e + SPARSE_PREFETCH_AHEAD]);
            w->visit(w->ctx, seg[e], -1);
        }
        seen += s->counts[t];
    }
}

// visits this thread's share of the selected rows after sel_compact's barrier, announcing each unit of
// work first: with a mask, chunks of sel_chunk_rows listed rows (unit k = listed rows [k * chunk, ...),
// whatever the thread count) taken first come, first served from *next (a thread the shared machine
// slows holds the other up by one chunk, not by half the rows); else a fixed share, unit ith. whole: all
// the rows, in one unit
static void sel_walk(const struct sparse_sel *s, int ith, int nth, bool whole, atomic_int *next,
                     const struct sel_walk *w) {
    int64_t t0, t1;
    if (w->unit && !(whole || (s->sel && s->sel->type == GGML_TYPE_F32))) w->unit(w->ctx, ith);
    if (!s->sel) {
        if (whole) t0 = 0, t1 = s->end - s->begin;
        else ggml_thread_range(s->end - s->begin, ith, nth, &t0, &t1);
        for (int64_t i = s->begin + t0; i < s->begin + t1; i++) {
            // axpy4 reads four rows at once, a pattern the hardware prefetchers follow less well than one row
            if (w->prefetch && i + SPARSE_PREFETCH_AHEAD < s->begin + t1) w->prefetch(w->ctx, i + SPARSE_PREFETCH_AHEAD);
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
        const int64_t chunk = sel_chunk_rows(s, total);
        while (ggml_next_chunk(next, total, chunk, &t0, &t1)) {
            if (w->unit) w->unit(w->ctx, t0 / chunk);
            sel_visit_listed(s, nth, t0, t1, w);
        }
        return;
    }
    for (int64_t j = 0; j < s->m; j++) {
        const int64_t len = index_len(s->sel, j);
        if (whole) t0 = 0, t1 = len;
        else ggml_thread_range(len, ith, nth, &t0, &t1);
        for (int64_t e = t0; e < t1; e++) {
            if (w->prefetch && e + SPARSE_PREFETCH_AHEAD < t1)
                w->prefetch(w->ctx, index_at(s->sel, e + SPARSE_PREFETCH_AHEAD, j));
            const int64_t i = index_at(s->sel, e, j);
            if (i >= s->begin && i < s->end) w->visit(w->ctx, i, j);
        }
    }
}

// true when column j takes row i in a visit with col < 0
static inline bool sel_picks(const struct sparse_sel *s, int64_t i, int64_t j) {
    return !s->sel || s->m == 1 || mask_at(s->sel, i, j); // one column: the compaction already checked
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
    ggml_cpu_prefetch((const char *)c->w->data + i * (int64_t)c->w->nb[1], c->w->nb[1]);
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
    sel_walk(&s, p->ith, p->nth, false, p->chunk_next, &(struct sel_walk){mmr_visit, mmr_prefetch, NULL, &c});
    return GGML_STATUS_OK;
}

// ---------------------------------------------------------------------------------------------------
// AXPY_ROWS: wt [d, n_rows], h [n_rows, m] -> dst [d, m] = sum over selected i of h[i, j] * wt[i].
// Up to UNIT_SUMS_MAX_M columns: the threads split the selected rows, summing whole rows (contiguous reads
// the prefetchers follow) into a [d, m] buffer per unit of work, then split d to add the buffers up. More
// columns, or rows longer than there are rows (a channel-major gate or up: n_embd rows of n_ff, where ~64
// buffers of d floats to zero and add up had cost as many bytes as the rows read): the threads split d into
// block-aligned slices instead, each owning its slice of dst and walking every selected row (with more columns
// under a mask or none, a chunk of rows at a time: the batch form below).
// ---------------------------------------------------------------------------------------------------

#define UNIT_SUMS_MAX_M 4 // columns up to which the sparse sums are kept per unit of work

// rows summed into one target several at a time where the type has a kernel for that (the target is then
// loaded and stored once per group), else one by one
#define AXPY_GROUP_MAX 8
struct axpy_batch {
    ggml_axpy_fn axpy;
    ggml_axpy_group_fn group; // NULL: every row on its own
    int width;           // rows per group call: 4 (axpy4) or 8 (axpy8_rounded)
    int64_t n;           // values per row
    int n_held;          // rows held for the next group
    float held_a[AXPY_GROUP_MAX];
    const void *held_row[AXPY_GROUP_MAX];
};

// the group kernel of axpy_rows with one column: coefficients rounded to 8 bits on the integer units unless
// the op is precise (op_params[2], ggml_axpy_rows_precise)
static struct axpy_batch axpy_batch_for(const struct ggml_tensor *dst, const struct ggml_type_traits *tw, int64_t m,
                                        int64_t n) {
    struct axpy_batch b = {.axpy = tw->axpy, .n = n};
    if (m != 1) return b;
    if (!dst->op_params[2] && tw->axpy8_rounded) b.group = tw->axpy8_rounded, b.width = 8;
    else if (tw->axpy4) b.group = tw->axpy4, b.width = 4;
    return b;
}

static inline void batch_add(struct axpy_batch *b, float *y, float a, const void *row) {
    if (!b->group) {
        b->axpy(b->n, y, a, row);
        return;
    }
    b->held_a[b->n_held] = a;
    b->held_row[b->n_held++] = row;
    if (b->n_held == b->width) {
        b->group(b->n, y, b->held_a, b->held_row);
        b->n_held = 0;
    }
}

// the rows still held after a walk
static void batch_flush(struct axpy_batch *b, float *y) {
    for (int r = 0; r < b->n_held; r++) b->axpy(b->n, y, b->held_a[r], b->held_row[r]);
    b->n_held = 0;
}

// sums per unit of work (see sel_walk): unit k's (m, d) buffer at base + k * stride floats, added up in
// unit order afterwards, so the result does not depend on which thread took which chunk: the same input
// gives the same output on every run (with a mask, at any thread count too)
struct unit_sums {
    float *base;
    size_t stride; // floats per buffer
    int64_t d, m;
};

static size_t unit_sum_bytes(int64_t d, int64_t m) { return ggml_cpu_align_up((size_t)(d * m) * sizeof(float)); }

static struct unit_sums unit_sums_at(const struct ggml_compute_params *p, size_t offset, int64_t d, int64_t m) {
    return (struct unit_sums){(float *)((char *)p->wdata + offset), unit_sum_bytes(d, m) / sizeof(float), d, m};
}

// after a barrier: values [v0, v1) of every column j of dst = the sum of units [0, n_units)
static void unit_sums_add(const struct unit_sums *u, int64_t n_units, struct ggml_tensor *dst, int64_t v0, int64_t v1) {
    for (int64_t j = 0; j < u->m; j++) {
        float *y = (float *)((char *)dst->data + j * (int64_t)dst->nb[1]); // (d) column j
        for (int64_t v = v0; v < v1; v++) y[v] = 0.0f;
        for (int64_t k = 0; k < n_units; k++) {
            const float *part = u->base + (size_t)k * u->stride + j * u->d;
            for (int64_t v = v0; v < v1; v++) y[v] += part[v];
        }
    }
}

// where a walk's rows are summed: y, the current unit's buffer of sums (or a slice of dst)
struct sum_target {
    struct axpy_batch batch; // groups only with one column
    struct unit_sums sums;
    float *y;                // column 0 of the target
};

// sel_walk's unit hook of a context whose first member is its sum_target
static void target_unit(void *vctx, int64_t k) {
    struct sum_target *t = vctx;
    batch_flush(&t->batch, t->y);
    t->y = t->sums.base + (size_t)k * t->sums.stride;
    memset(t->y, 0, (size_t)(t->sums.d * t->sums.m) * sizeof(float));
}

// values [*v0, *v1) of d that thread ith takes: whole blocks of `type`, at least 16 values so that no two
// threads share a cache line of dst
static void block_slice(enum ggml_type type, int64_t d, int ith, int nth, int64_t *v0, int64_t *v1) {
    const int64_t blck = ggml_get_type_traits(type)->blck_size, gran = blck > 16 ? blck : 16;
    int64_t g0, g1;
    ggml_thread_range((d + gran - 1) / gran, ith, nth, &g0, &g1);
    *v0 = g0 * gran;
    *v1 = g1 * gran < d ? g1 * gran : d;
}

// ---------------------------------------------------------------------------------------------------
// Many columns (a prompt batch), with a mask or every row: a thread owns a block-aligned slice [v0, v1) of d
// in every column (block_slice) and walks all the selected rows, BATCH_ROWS at a time: their slices are
// dequantized to floats once, then every column takes those it selects (f32_rows.h). Summing
// row by row into each column instead dequantized a row's slice again for every column that took it
// (a 128-token batch over 4864 rows of 896 Q5_0 values, 2 threads: 16x the dense GEMM's time).
// ---------------------------------------------------------------------------------------------------

#define BATCH_ROWS 64
#define BATCH_PIECE 128 // values of a slice dequantized at a time (a block where blocks are longer, QK_K at most):
                        // BATCH_ROWS x BATCH_PIECE floats (32 KB) stay in L1
#define BATCH_PIECE_MAX 256 // the longest block (QK_K)

struct batch_rows {
    const char *(*row)(const void *ctx, int64_t i);       // row i's bytes
    // column j's coefficients of rows[0..n) into c, 0 where j does not take the row
    void (*coefs_of)(const void *ctx, int64_t j, const int64_t *rows, int n, float *c);
    const void *ctx;
    const struct ggml_type_traits *tw;
    struct ggml_tensor *dst;
    int64_t v0, v1;
    int64_t piece; // values a row's piece: BATCH_PIECE or the type's block
    float *values; // BATCH_ROWS x piece dequantized
    float *coefs;  // (m, BATCH_ROWS): each column's nonzero coefficients in the chunk
    int32_t *at;   // (m, BATCH_ROWS): and their rows' places in it
    int32_t *taken; // (m): how many
    int64_t rows[BATCH_ROWS];
    int n;
};

static size_t batch_scratch_bytes(int64_t m) {
    return ggml_cpu_align_up(((size_t)BATCH_ROWS * BATCH_PIECE_MAX + (size_t)m * (2 * BATCH_ROWS + 1)) * sizeof(float));
}

// whether a walk over m columns with selector sel sums a batch (index lists keep the row-by-row sums)
static bool sums_batch(const struct ggml_tensor *sel, int64_t m) {
    return m > UNIT_SUMS_MAX_M && !(sel && sel->type == GGML_TYPE_I32);
}

// thread ith's batch over its slice [v0, v1) of dst, scratch at wdata + offset (nth x batch_scratch_bytes)
static struct batch_rows batch_rows_at(const struct ggml_compute_params *p, size_t offset, struct ggml_tensor *dst,
                                       enum ggml_type type, int64_t v0, int64_t v1) {
    const int64_t m = dst->ne[1];
    float *values = (float *)((char *)p->wdata + offset + (size_t)p->ith * batch_scratch_bytes(m));
    float *coefs = values + BATCH_ROWS * BATCH_PIECE_MAX;
    int32_t *at = (int32_t *)(coefs + m * BATCH_ROWS);
    const struct ggml_type_traits *tw = ggml_get_type_traits(type);
    const int64_t piece = tw->blck_size > BATCH_PIECE ? tw->blck_size : BATCH_PIECE;
    return (struct batch_rows){.tw = tw, .dst = dst, .v0 = v0, .v1 = v1, .piece = piece,
                               .values = values, .coefs = coefs, .at = at, .taken = at + m * BATCH_ROWS};
}

// the chunk's rows into every column: each column's nonzero coefficients listed once, then a piece of the slice
// at a time dequantized and added
static void batch_flush_rows(struct batch_rows *b) {
    const struct ggml_type_traits *tw = b->tw;
    const int64_t m = b->dst->ne[1];
    if (!b->n) return;
    for (int64_t j = 0; j < m; j++) {
        float *c = b->coefs + j * BATCH_ROWS;
        b->coefs_of(b->ctx, j, b->rows, b->n, c);
        b->taken[j] = ggml_f32_nonzero(c, b->n, b->at + j * BATCH_ROWS);
    }
    for (int64_t p0 = b->v0; p0 < b->v1; p0 += b->piece) {
        const int64_t len = b->v1 - p0 < b->piece ? b->v1 - p0 : b->piece;
        for (int r = 0; r < b->n; r++)
            tw->to_float(b->row(b->ctx, b->rows[r]) + (size_t)(p0 / tw->blck_size) * tw->type_size,
                         b->values + (size_t)r * b->piece, len);
        for (int64_t j = 0; j < m; j++) {
            float *y = (float *)((char *)b->dst->data + j * (int64_t)b->dst->nb[1]) + p0;
            if (b->taken[j])
                ggml_f32_rows_add(len, y, b->coefs + j * BATCH_ROWS, b->at + j * BATCH_ROWS, b->taken[j], b->values,
                                  b->piece);
        }
    }
    b->n = 0;
}

// sel_walk's visit of a batch (whole walks of a mask or of every row: col < 0)
static void batch_visit(void *vctx, int64_t i, int64_t col) {
    struct batch_rows *b = vctx;
    (void)col;
    b->rows[b->n++] = i;
    if (b->n == BATCH_ROWS) batch_flush_rows(b);
}

// all of this thread's slice of dst: zeroed, then the selected rows summed into it
static void batch_walk(const struct sparse_sel *s, const struct ggml_compute_params *p, struct batch_rows *b) {
    if (b->v0 >= b->v1) return;
    zero_rows(b->dst, b->v0, b->v1);
    sel_walk(s, p->ith, p->nth, true, p->chunk_next, &(struct sel_walk){batch_visit, NULL, NULL, b});
    batch_flush_rows(b);
}

struct axpy_ctx {
    struct sum_target t;  // first: target_unit
    const struct ggml_tensor *wt, *h;
    const struct sparse_sel *s;
    int64_t y_stride;  // floats from one target column to the next
    size_t row_offs;   // byte offset of the first handled value in a row of wt
    size_t row_bytes;  // bytes of a row handled
    size_t prefetch_bytes; // of them asked for ahead of the row's turn (AXPY_HEAD_BYTES below)
};

static inline void axpy_one(struct axpy_ctx *c, int64_t i, int64_t j) {
    const float hij = *(const float *)((const char *)c->h->data + i * (int64_t)c->h->nb[0] + j * (int64_t)c->h->nb[1]);
    batch_add(&c->t.batch, c->t.y + j * c->y_stride, hij, (const char *)c->wt->data + i * (int64_t)c->wt->nb[1] + c->row_offs);
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
    ggml_cpu_prefetch((const char *)c->wt->data + i * (int64_t)c->wt->nb[1] + c->row_offs, c->prefetch_bytes);
}

// the rows' bytes the walk asks for ahead: the integer kernels (width 8) ask for the rest of their rows
// themselves, a few steps ahead of their reads, and whole rows asked for at once had then cost more than they
// gave (a 1536 x 8960 Q4_K channel-major copy from memory, 2 threads: 1.29 -> 0.87 of a GEMV's time over the
// same bytes with only each row's head asked for here); the float kernels read what the walk asked for
#define AXPY_HEAD_BYTES 384
static size_t axpy_prefetch_bytes(const struct axpy_batch *b, size_t row_bytes) {
    return b->width == 8 && row_bytes > AXPY_HEAD_BYTES ? AXPY_HEAD_BYTES : row_bytes;
}

// whether the threads split d (each its slice of every selected row) rather than the rows (see above)
static bool axpy_slices_d(const struct ggml_tensor *wt, int64_t m) { return m > UNIT_SUMS_MAX_M || wt->ne[0] > wt->ne[1]; }

// a batch's row i, and column j's coefficients of its rows (batch_rows)
static const char *axpy_row(const void *vctx, int64_t i) {
    const struct axpy_ctx *c = vctx;
    return (const char *)c->wt->data + i * (int64_t)c->wt->nb[1];
}

static void axpy_coefs(const void *vctx, int64_t j, const int64_t *rows, int n, float *out) {
    const struct axpy_ctx *c = vctx;
    const char *hj = (const char *)c->h->data + j * (int64_t)c->h->nb[1];
    const struct ggml_tensor *sel = c->s->sel;
    const char *mj = sel ? (const char *)sel->data + j * (int64_t)sel->nb[1] : NULL;
    if (rows[n - 1] - rows[0] == n - 1 && c->h->nb[0] == sizeof(float) && (!sel || sel->nb[0] == sizeof(float))) {
        // a run of rows (a prompt's mask lists nearly all): the loops vectorize
        const float *restrict h = (const float *)hj + rows[0], *restrict m = mj ? (const float *)mj + rows[0] : NULL;
        float *restrict o = out;
        if (m)
            for (int r = 0; r < n; r++) {
                const float hr = h[r]; // read either way: a select, not a branch
                o[r] = m[r] > 0.0f ? hr : 0.0f;
            }
        else memcpy(o, h, (size_t)n * sizeof(float));
        return;
    }
    for (int r = 0; r < n; r++) out[r] = *(const float *)(hj + rows[r] * (int64_t)c->h->nb[0]);
    if (!sel) return;
    for (int r = 0; r < n; r++)
        if (!(*(const float *)(mj + rows[r] * (int64_t)sel->nb[0]) > 0.0f)) out[r] = 0.0f;
}

size_t ggml_cpu_axpy_rows_wsize(const struct ggml_tensor *dst, int n_threads) {
    const int64_t n_rows = dst->src[0]->ne[1], m = dst->ne[1];
    const struct ggml_tensor *sel = dst->src[2];
    size_t sums = !axpy_slices_d(dst->src[0], m) ? (size_t)sel_max_units(n_rows, n_threads) * unit_sum_bytes(dst->ne[0], m)
                  : sums_batch(sel, m)                  ? (size_t)n_threads * batch_scratch_bytes(m)
                                                        : 0;
    return sel_wsize(sel, n_rows, n_threads) + sums;
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
    int64_t v0, v1;
    block_slice(wt->type, d, ith, nth, &v0, &v1);
    const int64_t dst_stride = (int64_t)(dst->nb[1] / sizeof(float));
    if (sums_batch(s.sel, m)) {
        struct axpy_ctx c = {.wt = wt, .h = h, .s = &s};
        struct batch_rows b = batch_rows_at(p, sel_wsize(s.sel, s.n_rows, nth), dst, wt->type, v0, v1);
        b.row = axpy_row, b.coefs_of = axpy_coefs, b.ctx = &c;
        batch_walk(&s, p, &b);
        return GGML_STATUS_OK;
    }
    if (axpy_slices_d(wt, m)) {
        if (v0 >= v1) return GGML_STATUS_OK;
        zero_rows(dst, v0, v1);
        // one column: every row adds into the same slice, a group of rows a load and store of it
        struct axpy_ctx c = {{.batch = axpy_batch_for(dst, tw, m, v1 - v0),
                              .y = (float *)dst->data + v0}, wt, h, &s,
                             dst_stride, (size_t)(v0 / tw->blck_size) * tw->type_size, ggml_row_size(wt->type, v1 - v0), 0};
        c.prefetch_bytes = axpy_prefetch_bytes(&c.t.batch, c.row_bytes);
        sel_walk(&s, ith, nth, true, p->chunk_next, &(struct sel_walk){axpy_visit, axpy_prefetch, NULL, &c});
        batch_flush(&c.t.batch, c.t.y);
        return GGML_STATUS_OK;
    }
    s.min_chunk = unit_min_rows(d * m, wt->nb[1]);
    struct axpy_ctx c = {{axpy_batch_for(dst, tw, m, d),
                          unit_sums_at(p, sel_wsize(s.sel, s.n_rows, nth), d, m), NULL},
                         wt, h, &s, d, 0, wt->nb[1], 0};
    c.prefetch_bytes = axpy_prefetch_bytes(&c.t.batch, c.row_bytes);
    sel_walk(&s, ith, nth, false, p->chunk_next, &(struct sel_walk){axpy_visit, axpy_prefetch, target_unit, &c});
    batch_flush(&c.t.batch, c.t.y);
    ggml_barrier(p->tp);
    unit_sums_add(&c.t.sums, sel_units(&s, nth), dst, v0, v1);
    return GGML_STATUS_OK;
}

// ---------------------------------------------------------------------------------------------------
// SPARSE_FFN: bundle [d, r * n_ff], x [d, m] -> dst [d + n_ff, m]. A neuron's gate, up and down_t rows
// lie side by side, so a selected neuron is one contiguous read of r rows instead of r reads scattered
// over three matrices (SYNTHETIC 7B Q4_0 at 10 % density, 2 cores: 0.12-0.14 of the dense FFN's time
// instead of 0.14-0.19 for the same rows read by three ops).
// Phase 1: x converted to vec_dot_type, flag rows zeroed, mask compacted; barrier. Up to
// UNIT_SUMS_MAX_M columns, phase 2: chunks of selected neurons first come, first served, each neuron's
// rows dotted with / summed into every column that selects it, sums per unit; barrier; phase 3: the
// threads split d to add up the units. More columns (prompts) would need a unit of sums per column:
// phase 2 keeps each neuron's activations instead; barrier; phase 3: the threads split d, each summing
// its slice of every kept neuron's down row.
// ---------------------------------------------------------------------------------------------------

struct ffn_ctx {
    struct sum_target t; // first: target_unit
    const char *bundle;
    size_t row_bytes;    // one row of the bundle
    int rows;            // rows per neuron: 2 (relu) or 3 (gated)
    enum ggml_ffn_kind kind;
    float threshold;
    const struct ggml_cpu_xcols *xc;
    ggml_vec_dot_fn dot;
    int64_t d, n_ff;
    struct ggml_tensor *dst;
    const struct sparse_sel *s;
    float *act;          // (m, n_ff) kept activations, or NULL: summed at once
    int64_t v0, v1;      // phase 3 with act: the slice of d this thread sums (empty before)
    size_t slice_offs, slice_bytes; // where the slice lies in a row, its bytes
};

static inline float ffn_act(enum ggml_ffn_kind kind, float g, float u) {
    switch (kind) {
    case GGML_FFN_RELU: return u > 0.0f ? u : 0.0f;
    case GGML_FFN_REGLU: return g * u; // g > 0 here
    case GGML_FFN_DRELU: return u > 0.0f ? g * u : 0.0f;
    case GGML_FFN_SWIGLU: return ggml_silu_f32(g) * u;
    default: return ggml_gelu_f32(g) * u;
    }
}

static inline const char *ffn_rows(const struct ffn_ctx *c, int64_t i) {
    return c->bundle + (size_t)i * (size_t)c->rows * c->row_bytes;
}

static inline const char *ffn_down(const struct ffn_ctx *c, int64_t i) {
    return ffn_rows(c, i) + (size_t)(c->rows - 1) * c->row_bytes;
}

static inline float *ffn_flag(const struct ffn_ctx *c, int64_t i, int64_t j) {
    return (float *)((char *)c->dst->data + j * (int64_t)c->dst->nb[1]) + c->d + i;
}

static void ffn_neuron(struct ffn_ctx *c, int64_t i, int64_t j) {
    const char *rows = ffn_rows(c, i), *xj = c->xc->base + (size_t)j * c->xc->stride;
    float g = 0.0f, u;
    if (c->kind != GGML_FFN_RELU) {
        c->dot(c->d, &g, rows, xj);
        // relu(gate) = 0 turns the neuron off whatever up says: its up and down rows are not needed
        if ((c->kind == GGML_FFN_REGLU || c->kind == GGML_FFN_DRELU) && !(g > 0.0f)) return;
    }
    c->dot(c->d, &u, rows + (size_t)(c->rows - 2) * c->row_bytes, xj);
    const float a = ffn_act(c->kind, g, u);
    if (!(fabsf(a) > c->threshold)) return; // also drops exact zeros: they add nothing
    *ffn_flag(c, i, j) = 1.0f;
    if (c->act) c->act[j * c->n_ff + i] = a;
    else batch_add(&c->t.batch, c->t.y + j * c->d, a, ffn_down(c, i));
}

// phase 3 with kept activations: the slice of neuron i's down row, for a column that kept it
static void ffn_down_slice(struct ffn_ctx *c, int64_t i, int64_t j) {
    if (*ffn_flag(c, i, j) == 0.0f) return;
    float *y = (float *)((char *)c->dst->data + j * (int64_t)c->dst->nb[1]) + c->v0;
    c->t.batch.axpy(c->v1 - c->v0, y, c->act[j * c->n_ff + i], ffn_down(c, i) + c->slice_offs);
}

// phase 3 of a batch: neuron i's down row, and column j's kept activations of the chunk's neurons (batch_rows)
static const char *ffn_down_row(const void *vctx, int64_t i) { return ffn_down(vctx, i); }

static void ffn_down_coefs(const void *vctx, int64_t j, const int64_t *rows, int n, float *out) {
    const struct ffn_ctx *c = vctx;
    for (int r = 0; r < n; r++) out[r] = *ffn_flag(c, rows[r], j) != 0.0f ? c->act[j * c->n_ff + rows[r]] : 0.0f;
}

static void ffn_column(struct ffn_ctx *c, int64_t i, int64_t j) {
    if (c->v1 > c->v0) ffn_down_slice(c, i, j);
    else ffn_neuron(c, i, j);
}

static void ffn_visit(void *vctx, int64_t i, int64_t col) {
    struct ffn_ctx *c = vctx;
    if (col >= 0) {
        ffn_column(c, i, col);
        return;
    }
    for (int64_t j = 0; j < c->s->m; j++)
        if (sel_picks(c->s, i, j)) ffn_column(c, i, j);
}

static void ffn_prefetch(void *vctx, int64_t i) {
    const struct ffn_ctx *c = vctx;
    if (c->v1 > c->v0) ggml_cpu_prefetch(ffn_down(c, i) + c->slice_offs, c->slice_bytes);
    else ggml_cpu_prefetch(ffn_rows(c, i), (size_t)(c->act ? c->rows - 1 : c->rows) * c->row_bytes); // act: down later
}

static int ffn_rows_per_neuron(const struct ggml_tensor *dst) { return dst->op_params[2] == GGML_FFN_RELU ? 2 : 3; }

size_t ggml_cpu_sparse_ffn_wsize(const struct ggml_tensor *dst, int n_threads) {
    const struct ggml_tensor *bundle = dst->src[0], *x = dst->src[1];
    const int64_t n_ff = bundle->ne[1] / ffn_rows_per_neuron(dst), d = x->ne[0], m = x->ne[1];
    const size_t batch = sums_batch(dst->src[2], m) ? (size_t)n_threads * batch_scratch_bytes(m) : 0;
    const size_t sums = m <= UNIT_SUMS_MAX_M ? (size_t)sel_max_units(n_ff, n_threads) * unit_sum_bytes(d, m)
                                            : ggml_cpu_align_up((size_t)(n_ff * m) * sizeof(float)) + batch;
    return ggml_cpu_xcols_wsize(bundle, x) + sel_wsize(dst->src[2], n_ff, n_threads) + sums;
}

int ggml_cpu_op_sparse_ffn(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *bundle = dst->src[0], *x = dst->src[1];
    const struct ggml_type_traits *tw = ggml_get_type_traits(bundle->type);
    const int rows = ffn_rows_per_neuron(dst);
    const int64_t d = x->ne[0], m = x->ne[1], n_ff = bundle->ne[1] / rows;
    const size_t xbytes = ggml_cpu_xcols_wsize(bundle, x), sums_at = xbytes + sel_wsize(dst->src[2], n_ff, p->nth);
    struct sparse_sel s;
    int st = sel_init(&s, p, dst, n_ff, m, xbytes);
    if (st) return st;
    struct ggml_cpu_xcols xc;
    if ((st = ggml_cpu_xcols_prepare(p, bundle, x, &xc))) return st;
    int64_t r0, r1;
    ggml_thread_range(n_ff, p->ith, p->nth, &r0, &r1);
    zero_rows(dst, d + r0, d + r1);
    if (s.sel && s.sel->type == GGML_TYPE_F32) sel_compact(&s, p->ith, p->nth);
    ggml_barrier(p->tp);
    const bool keep = m > UNIT_SUMS_MAX_M;
    if (!keep) s.min_chunk = unit_min_rows(d * m, (size_t)rows * bundle->nb[1]);
    struct ffn_ctx c = {{{.axpy = tw->axpy, .group = m == 1 ? tw->axpy4 : NULL, .width = 4, .n = d}, unit_sums_at(p, sums_at, d, m), NULL},
                        bundle->data, bundle->nb[1], rows, (enum ggml_ffn_kind)dst->op_params[2],
                        ggml_op_param_f32(dst, 3), &xc, tw->vec_dot, d, n_ff, dst, &s,
                        keep ? (float *)((char *)p->wdata + sums_at) : NULL, 0, 0, 0, 0};
    sel_walk(&s, p->ith, p->nth, false, p->chunk_next, &(struct sel_walk){ffn_visit, ffn_prefetch, keep ? NULL : target_unit, &c});
    batch_flush(&c.t.batch, c.t.y);
    ggml_barrier(p->tp);
    int64_t v0, v1;
    block_slice(bundle->type, d, p->ith, p->nth, &v0, &v1);
    if (!keep) {
        unit_sums_add(&c.t.sums, sel_units(&s, p->nth), dst, v0, v1);
        return GGML_STATUS_OK;
    }
    if (sums_batch(s.sel, m)) {
        const size_t act_bytes = ggml_cpu_align_up((size_t)(n_ff * m) * sizeof(float));
        struct batch_rows b = batch_rows_at(p, sums_at + act_bytes, dst, bundle->type, v0, v1);
        b.row = ffn_down_row, b.coefs_of = ffn_down_coefs, b.ctx = &c;
        batch_walk(&s, p, &b);
        return GGML_STATUS_OK;
    }
    zero_rows(dst, v0, v1);
    c.v0 = v0, c.v1 = v1;
    c.slice_offs = (size_t)(v0 / tw->blck_size) * tw->type_size;
    c.slice_bytes = ggml_row_size(bundle->type, v1 - v0);
    if (v0 < v1) sel_walk(&s, p->ith, p->nth, true, p->chunk_next, &(struct sel_walk){ffn_visit, ffn_prefetch, NULL, &c});
    return GGML_STATUS_OK;
}
