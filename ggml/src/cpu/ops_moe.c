// ops_moe.c: a mixture of experts on the CPU: the router's choice (top_k) and the routed experts' FFN (moe_ffn).
// moe_ffn groups a batch's (token, expert) pairs by expert, so each expert's rows are read once per batch and
// dotted with every token routed to it while they are in cache. Phase 1: x converted to the experts'
// vec_dot_type, ids checked (every thread, identically), thread 0 sorts the pairs by expert and computes their
// weights; barrier. Phase 2: chunks of an expert's gate and up rows, first come, first served: act(gate x) * up x
// per pair; barrier. Phase 3: the activations converted to down's vec_dot_type; barrier. Phase 4: chunks of the
// output rows: each expert's down rows dotted with its pairs' activations, weighted, summed per token. An expert's
// pairs go 4 at a time through the type's 4 x 4 gemm tiles where it has them (a prompt's), or, an expert with 4 pairs
// or more on a CPU with AMX, through int8 tile GEMMs over its rows' levels (levels.h), as a dense prompt's mul_mat:
// its pairs' x (and later their activations) packed in groups of 16 columns once (phases 1b and 3b, each with a
// barrier), each panel of 16 rows unpacked once and multiplied by every group, or, with at most 64 pairs (a prompt's
// expert mostly has a few), its rows straight from their blocks by the direct kernels (levels_direct_for: the same
// bits). Biases (gpt-oss) are found by expert: thread 0 also lists which expert each matrix holds.
#include "ops_kernels.h"
#include "../levels.h"
#include "../swiglu_oai.h"

#include <string.h>

#define MOE_ROWS 32 // gate/up rows (phase 2) and down rows (phase 4) per chunk: two panels of LEVELS_ROWS
#define MOE_LEVELS_MIN_PAIRS GGML_GEMM_TILE_COLS // an expert's pairs from which its rows go through levels GEMMs

// ---------------------------------------------------------------------------------------------------
// TOP_K: a [n, m] -> [k, m] I32, largest first, ties to the lower index, NaN below everything
// ---------------------------------------------------------------------------------------------------

int ggml_cpu_op_top_k(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *a = dst->src[0];
    const int k = dst->op_params[0];
    const int64_t n = a->ne[0];
    float best[k];
    int64_t j0, j1;
    ggml_thread_range(a->ne[1], p->ith, p->nth, &j0, &j1);
    for (int64_t j = j0; j < j1; j++) {
        const float *v = (const float *)((const char *)a->data + j * (int64_t)a->nb[1]);
        int32_t *out = (int32_t *)((char *)dst->data + j * (int64_t)dst->nb[1]);
        int have = 0;
        for (int64_t i = 0; i < n; i++) {
            const float x = isnan(v[i]) ? -INFINITY : v[i];
            if (have == k && !(x > best[k - 1])) continue; // an equal later value loses the tie
            int at = have < k ? have++ : k - 1;
            while (at > 0 && best[at - 1] < x) {
                best[at] = best[at - 1];
                out[at] = out[at - 1];
                at--;
            }
            best[at] = x;
            out[at] = (int32_t)i;
        }
    }
    return GGML_STATUS_OK;
}

// ---------------------------------------------------------------------------------------------------
// MOE_FFN: gate, up [d, n_ff, n_local], down [n_ff, d, n_local], x [d, m], ids [k, m], logits [n_expert, m],
// slots [n_expert] or NULL -> [d, m]
// ---------------------------------------------------------------------------------------------------

// the pairs this op computes, grouped by expert (in wdata, written by thread 0 in phase 1)
struct moe_pairs {
    int32_t *first;    // [n_local + 1] where each matrix's pairs start
    int32_t *token;    // [k m] each pair's token
    float *weight;     // [k m] each pair's routing weight
    int32_t *expert;   // [n_local] the expert each matrix holds
};

struct moe_layout { // scratch offsets in wdata
    size_t xq, pairs, act, actq, xgroups, agroups, tiles, tile_bytes, panels, panel_bytes, end;
    size_t xgroup_bytes, agroup_bytes; // one group of 16 packed columns of x (gate's levels) and of act (down's)
    size_t gate_panel_bytes;           // one panel of gate's (or up's) rows: up's lies this far after gate's
};

// the levels form of w for a batch's experts, or NULL (the tiles and dots). The scratch is laid out for it whether or
// not a levels kernel runs at compute time (tests switch it between planning and computing, as for a mul_mat)
static const struct levels_traits *moe_levels_for(const struct ggml_tensor *w, const struct ggml_tensor *x) {
    const struct levels_traits *lt = levels_traits_for(w->type);
    const bool x_ok = levels_x_type_ok(ggml_get_type_traits(w->type)->vec_dot_type);
    return lt && x_ok && x->ne[1] >= MOE_LEVELS_MIN_PAIRS ? lt : NULL;
}

static struct moe_layout moe_layout_of(const struct ggml_tensor *dst, int n_threads) {
    const struct ggml_tensor *gate = dst->src[0], *down = dst->src[2], *x = dst->src[3], *ids = dst->src[4];
    const int64_t n_pairs = ggml_nelements(ids), n_local = gate->ne[2], n_ff = gate->ne[1], d = x->ne[0];
    const enum ggml_type vdt = ggml_get_type_traits(down->type)->vec_dot_type;
    const struct levels_traits *lg = moe_levels_for(gate, x), *ld = moe_levels_for(down, x);
    const int64_t groups = n_pairs / LEVELS_COLS + n_local; // an expert's last group may be partial
    struct moe_layout l;
    l.xq = 0;
    l.pairs = l.xq + ggml_cpu_xcols_wsize(gate, x);
    l.act = l.pairs + ggml_cpu_align_up(sizeof(int32_t) * (size_t)(2 * n_local + 1 + 2 * n_pairs));
    l.actq = l.act + ggml_cpu_align_up(sizeof(float) * (size_t)(n_pairs * n_ff));
    l.xgroups = l.actq + (vdt == GGML_TYPE_F32 ? 0 : ggml_cpu_align_up((size_t)n_pairs * ggml_row_size(vdt, n_ff)));
    l.xgroup_bytes = lg ? ggml_cpu_align_up(levels_x_group_bytes(d, lg->offset, false)) : 0;
    l.agroups = l.xgroups + (size_t)groups * l.xgroup_bytes;
    l.agroup_bytes = ld ? ggml_cpu_align_up(levels_x_group_bytes(n_ff, ld->offset, false)) : 0;
    l.tiles = l.agroups + (size_t)groups * l.agroup_bytes;
    // per thread: the tokens' x gathered for gate's and up's gemm tiles (4) or a levels group (16)
    const enum ggml_type xdt = ggml_get_type_traits(gate->type)->vec_dot_type;
    l.tile_bytes = ggml_cpu_align_up((lg ? LEVELS_COLS : GGML_GEMM_TILE_COLS) * ggml_row_size(xdt, d));
    l.panels = l.tiles + (size_t)n_threads * l.tile_bytes;
    // per thread: gate's and up's panels of 16 rows, or down's
    l.gate_panel_bytes = lg ? ggml_cpu_align_up(levels_panel_bytes(lg, d)) : 0;
    const size_t down_panel = ld ? ggml_cpu_align_up(levels_panel_bytes(ld, n_ff)) : 0;
    l.panel_bytes = 2 * l.gate_panel_bytes > down_panel ? 2 * l.gate_panel_bytes : down_panel;
    l.end = l.panels + (size_t)n_threads * l.panel_bytes;
    return l;
}

size_t ggml_cpu_moe_ffn_wsize(const struct ggml_tensor *dst, int n_threads) {
    return moe_layout_of(dst, n_threads).end;
}

static struct moe_pairs moe_pairs_at(void *wdata, const struct moe_layout *l, int64_t n_local, int64_t n_pairs) {
    int32_t *ints = (int32_t *)((char *)wdata + l->pairs);
    return (struct moe_pairs){ints, ints + n_local + 1, (float *)(ints + n_local + 1 + n_pairs),
                              ints + n_local + 1 + 2 * n_pairs};
}

// the matrix that holds expert e here, or -1
static inline int32_t moe_slot(const struct ggml_tensor *slots, int32_t e) {
    return slots ? ((const int32_t *)slots->data)[e] : e;
}

// thread 0: the pairs (token j, its s-th expert) whose expert this op holds, counted by expert, with weights
static void moe_sort_pairs(const struct ggml_tensor *dst, struct moe_pairs *mp) {
    const struct ggml_tensor *ids = dst->src[4], *logits = dst->src[5], *slots = dst->src[6];
    const float *scales = dst->src[8] ? (const float *)dst->src[8]->data : NULL; // by expert
    const int64_t k = ids->ne[0], m = ids->ne[1], n_local = dst->src[0]->ne[2], n_expert = logits->ne[0];
    const bool norm = dst->op_params[1];
    int32_t *count = mp->first + 1; // counts per matrix, then running starts
    memset(mp->first, 0, sizeof(int32_t) * (size_t)(n_local + 1));
    for (int32_t e = 0; e < n_expert; e++)
        if (moe_slot(slots, e) >= 0) mp->expert[moe_slot(slots, e)] = e;
    for (int64_t j = 0; j < m; j++)
        for (int64_t s = 0; s < k; s++) {
            const int32_t e = moe_slot(slots, ((const int32_t *)ids->data)[j * k + s]);
            if (e >= 0) count[e]++;
        }
    for (int64_t e = 0; e < n_local; e++) mp->first[e + 1] += mp->first[e];
    // first[e] is where matrix e's pairs start: fill them by advancing it, then shift the ends back by one
    int32_t *next = mp->first;
    for (int64_t j = 0; j < m; j++) {
        const float *l = (const float *)((const char *)logits->data + j * (int64_t)logits->nb[1]);
        const int32_t *row = (const int32_t *)ids->data + j * k;
        float top = -INFINITY, z = 0.0f;
        if (norm)
            for (int64_t s = 0; s < k; s++) top = fmaxf(top, l[row[s]]);
        else
            for (int64_t e = 0; e < n_expert; e++) top = fmaxf(top, l[e]);
        if (norm)
            for (int64_t s = 0; s < k; s++) z += expf(l[row[s]] - top);
        else
            for (int64_t e = 0; e < n_expert; e++) z += expf(l[e] - top);
        for (int64_t s = 0; s < k; s++) {
            const int32_t e = moe_slot(slots, row[s]);
            if (e < 0) continue;
            const int32_t at = next[e]++;
            mp->token[at] = (int32_t)j;
            mp->weight[at] = expf(l[row[s]] - top) / z * (scales ? scales[row[s]] : 1.0f);
        }
    }
    // after filling, next[e] is where expert e's pairs end, i.e. where e + 1's start: shift by one
    for (int64_t e = n_local; e > 0; e--) mp->first[e] = mp->first[e - 1];
    mp->first[0] = 0;
}

// the rows a pair's dots ask for ahead, as a decode GEMV's (ops_matmul.c): an expert's matrices come from memory
#define MOE_PREFETCH_ROWS 2
#define TILE_R GGML_GEMM_TILE_ROWS
#define TILE_C GGML_GEMM_TILE_COLS

// token j's output row
static inline float *moe_out(struct ggml_tensor *dst, int32_t j) {
    return (float *)((char *)dst->data + j * (int64_t)dst->nb[1]);
}

static inline float moe_act(enum ggml_ffn_kind kind, float g, float u) {
    if (kind == GGML_FFN_SWIGLU_OAI) return ggml_swiglu_oai(g, u);
    return (kind == GGML_FFN_SWIGLU ? ggml_silu_f32(g) : ggml_gelu_f32(g)) * u;
}

// one expert's matrices as a chunk of phase 2 or 4 reads them
struct moe_rows {
    const char *w, *w2;  // gate and up (phase 2), or down (w2 NULL)
    size_t nb1;
    int64_t k;           // values a row
    const struct ggml_type_traits *t;
    const float *b, *b2; // the expert's biases of w and w2, or NULL
};

// phase 2, one pair whose x (in vec_dot_type) is at xq: act[r] = act(gate[r] . x) * (up[r] . x), rows [r0, r1)
static void moe_up_rows(const struct moe_rows *m, enum ggml_ffn_kind kind, const char *xq, float *act, int64_t r0,
                        int64_t r1) {
    int64_t r = r0;
    for (; m->t->vec_dot4 && r + 4 <= r1; r += 4) { // 4 rows a call where the type has it, as a decode GEMV's
        float g[4], u[4];
        m->t->vec_dot4(m->k, g, m->w + r * (int64_t)m->nb1, m->nb1, xq);
        m->t->vec_dot4(m->k, u, m->w2 + r * (int64_t)m->nb1, m->nb1, xq);
        for (int i = 0; i < 4; i++)
            act[r + i] = m->b ? moe_act(kind, g[i] + m->b[r + i], u[i] + m->b2[r + i]) : moe_act(kind, g[i], u[i]);
    }
    for (; r < r1; r++) {
        float g, u;
        if (r + MOE_PREFETCH_ROWS < r1) {
            ggml_cpu_prefetch(m->w + (r + MOE_PREFETCH_ROWS) * (int64_t)m->nb1, m->nb1);
            ggml_cpu_prefetch(m->w2 + (r + MOE_PREFETCH_ROWS) * (int64_t)m->nb1, m->nb1);
        }
        m->t->vec_dot(m->k, &g, m->w + r * (int64_t)m->nb1, xq);
        m->t->vec_dot(m->k, &u, m->w2 + r * (int64_t)m->nb1, xq);
        act[r] = m->b ? moe_act(kind, g + m->b[r], u + m->b2[r]) : moe_act(kind, g, u);
    }
}

// phase 4, one pair whose activations (in vec_dot_type) are at aq: y[r] += weight * down[r] . act, rows [r0, r1)
static void moe_down_rows(const struct moe_rows *m, const char *aq, float weight, float *y, int64_t r0, int64_t r1) {
    int64_t r = r0;
    for (; m->t->vec_dot4 && r + 4 <= r1; r += 4) {
        float v[4];
        m->t->vec_dot4(m->k, v, m->w + r * (int64_t)m->nb1, m->nb1, aq);
        for (int i = 0; i < 4; i++) y[r + i] += weight * (m->b ? v[i] + m->b[r + i] : v[i]);
    }
    for (; r < r1; r++) {
        float v;
        if (r + MOE_PREFETCH_ROWS < r1) ggml_cpu_prefetch(m->w + (r + MOE_PREFETCH_ROWS) * (int64_t)m->nb1, m->nb1);
        m->t->vec_dot(m->k, &v, m->w + r * (int64_t)m->nb1, aq);
        y[r] += weight * (m->b ? v + m->b[r] : v);
    }
}

// the levels GEMMs' groups: those of the matrices with MOE_LEVELS_MIN_PAIRS pairs or more, in matrix order, each
// matrix's pairs LEVELS_COLS a group (its last one partial); every thread lays them out alike from the sorted pairs
struct moe_groups {
    int64_t *first; // [n_local] a matrix's first group, or -1 (its pairs take the tiles and dots)
    int64_t n;      // groups in all
};

static void moe_groups_of(const struct moe_pairs *mp, const int32_t *active, int64_t n_active, int64_t n_local,
                          struct moe_groups *gr) {
    for (int64_t e = 0; e < n_local; e++) gr->first[e] = -1;
    gr->n = 0;
    for (int64_t a = 0; a < n_active; a++) {
        const int32_t e = active[a], pairs = mp->first[e + 1] - mp->first[e];
        if (pairs < MOE_LEVELS_MIN_PAIRS) continue;
        gr->first[e] = gr->n;
        gr->n += (pairs + LEVELS_COLS - 1) / LEVELS_COLS;
    }
}

// group u's matrix and its place among that matrix's groups
static int32_t moe_group_at(const struct moe_groups *gr, const int32_t *active, int64_t n_active, int64_t u, int64_t *g) {
    int32_t e = -1;
    for (int64_t a = 0; a < n_active; a++)
        if (gr->first[active[a]] >= 0 && gr->first[active[a]] <= u) e = active[a];
    *g = u - gr->first[e];
    return e;
}

// group g of matrix e's pairs: its first pair (q0) and how many
static inline int64_t moe_group_pairs(const struct moe_pairs *mp, int32_t e, int64_t g, int64_t *q0) {
    *q0 = mp->first[e] + g * LEVELS_COLS;
    const int64_t left = mp->first[e + 1] - *q0;
    return left < LEVELS_COLS ? left : LEVELS_COLS;
}

// how matrix e's pairs meet its rows on levels: its group's panel of levels through the tile kernel, or with few
// pairs the rows straight from their blocks (levels_direct_for: the same bits, no panel unpacked per batch); a
// group's output holds row i, column c at [i * rs + c * cs] (the tiles' (row, column), the direct kernel's (column,
// row))
struct moe_levels {
    levels_gemm_fn gemm;
    levels_direct_fn direct; // NULL: panels
    const struct levels_traits *lt;
    int64_t rs, cs;
};

static struct moe_levels moe_levels_of(levels_gemm_fn gemm, const struct levels_traits *lt, enum ggml_type type,
                                       int64_t pairs) {
    const levels_direct_fn direct = levels_direct_for(gemm, type, pairs, false);
    return (struct moe_levels){gemm, direct, lt, direct ? 1 : LEVELS_COLS, direct ? LEVELS_ROWS : 1};
}

// rows [0, rows) of w (a panel's, filled into panel unless direct) times group xg's cnt columns into out
static void moe_levels_group(const struct moe_levels *lv, const char *w, size_t nb1, int64_t rows, int64_t k,
                             const struct levels_panel *panel, const char *xg, int cnt, float *out) {
    if (lv->direct)
        lv->direct(w, nb1, rows, k, xg, false, cnt, out, LEVELS_ROWS);
    else
        lv->gemm(panel, xg, false, out);
}

// phase 2 on levels: rows [r0, r1) of matrix e's gate and up, a panel of 16 of each at a time, times each group of its
// pairs' x (packed in phase 1b); panels: this thread's two panel buffers, panel_bytes apart
static void moe_up_levels(const struct moe_levels *lv, const struct moe_rows *m, enum ggml_ffn_kind kind,
                          const struct moe_pairs *mp, int32_t e, int64_t first_group, const char *groups,
                          size_t group_bytes, char *panels, size_t panel_bytes, float *act, int64_t n_ff, int64_t r0,
                          int64_t r1) {
    for (int64_t rr = r0; rr < r1; rr += LEVELS_ROWS) {
        const int64_t rows = r1 - rr < LEVELS_ROWS ? r1 - rr : LEVELS_ROWS;
        const char *wg = m->w + rr * (int64_t)m->nb1, *wu = m->w2 + rr * (int64_t)m->nb1;
        struct levels_panel pg, pu;
        if (!lv->direct) {
            levels_panel_fill(lv->lt, wg, m->nb1, rows, m->k, panels, &pg);
            levels_panel_fill(lv->lt, wu, m->nb1, rows, m->k, panels + panel_bytes, &pu);
        }
        int64_t q0, cnt;
        for (int64_t g = 0; (cnt = moe_group_pairs(mp, e, g, &q0)) > 0; g++) {
            const char *xg = groups + (first_group + g) * group_bytes;
            float og[LEVELS_ROWS * LEVELS_COLS], ou[LEVELS_ROWS * LEVELS_COLS];
            moe_levels_group(lv, wg, m->nb1, rows, m->k, &pg, xg, (int)cnt, og);
            moe_levels_group(lv, wu, m->nb1, rows, m->k, &pu, xg, (int)cnt, ou);
            for (int64_t c = 0; c < cnt; c++)
                for (int64_t i = 0; i < rows; i++) {
                    const int64_t at = i * lv->rs + c * lv->cs;
                    act[(q0 + c) * n_ff + rr + i] = moe_act(kind, og[at] + (m->b ? m->b[rr + i] : 0.0f),
                                                            ou[at] + (m->b ? m->b2[rr + i] : 0.0f));
                }
        }
    }
}

// phase 4 on levels: y[token][r] += weight * (down_e[r] . act + bias) for rows [r0, r1) of matrix e, a panel of 16 at
// a time, times each group of its pairs' activations (packed in phase 3b)
static void moe_down_levels(const struct moe_levels *lv, const struct moe_rows *m, const struct moe_pairs *mp,
                            int32_t e, int64_t first_group, const char *groups, size_t group_bytes, char *panel,
                            struct ggml_tensor *dst, int64_t r0, int64_t r1) {
    for (int64_t rr = r0; rr < r1; rr += LEVELS_ROWS) {
        const int64_t rows = r1 - rr < LEVELS_ROWS ? r1 - rr : LEVELS_ROWS;
        const char *wd = m->w + rr * (int64_t)m->nb1;
        struct levels_panel pd;
        if (!lv->direct) levels_panel_fill(lv->lt, wd, m->nb1, rows, m->k, panel, &pd);
        int64_t q0, cnt;
        for (int64_t g = 0; (cnt = moe_group_pairs(mp, e, g, &q0)) > 0; g++) {
            float out[LEVELS_ROWS * LEVELS_COLS];
            moe_levels_group(lv, wd, m->nb1, rows, m->k, &pd, groups + (first_group + g) * group_bytes, (int)cnt, out);
            for (int64_t c = 0; c < cnt; c++) {
                float *y = moe_out(dst, mp->token[q0 + c]);
                for (int64_t i = 0; i < rows; i++)
                    y[rr + i] += mp->weight[q0 + c] * (out[i * lv->rs + c * lv->cs] + (m->b ? m->b[rr + i] : 0.0f));
            }
        }
    }
}

int ggml_cpu_op_moe_ffn(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *gate = dst->src[0], *up = dst->src[1], *down = dst->src[2], *x = dst->src[3];
    const struct ggml_tensor *ids = dst->src[4], *slots = dst->src[6], *biases = dst->src[7];
    const int64_t d = x->ne[0], n_ff = gate->ne[1], n_local = gate->ne[2], n_expert = dst->src[5]->ne[0];
    const int64_t n_pairs = ggml_nelements(ids);
    const enum ggml_ffn_kind kind = (enum ggml_ffn_kind)dst->op_params[0];
    for (int64_t i = 0; i < n_pairs; i++) { // every thread checks all of them: all fail alike, before any barrier
        const int32_t e = ((const int32_t *)ids->data)[i];
        if (e < 0 || e >= n_expert)
            return ggml_set_error(GGML_STATUS_INVALID_ARG, "moe_ffn: expert id %d outside [0, %lld)", e, (long long)n_expert);
    }
    if (slots)
        for (int64_t e = 0; e < n_expert; e++) {
            const int32_t s = ((const int32_t *)slots->data)[e];
            if (s < -1 || s >= n_local)
                return ggml_set_error(GGML_STATUS_INVALID_ARG, "moe_ffn: expert %lld's slot %d outside [-1, %lld)",
                                      (long long)e, s, (long long)n_local);
        }
    const struct moe_layout l = moe_layout_of(dst, p->nth);
    struct moe_pairs mp = moe_pairs_at(p->wdata, &l, n_local, n_pairs);
    struct ggml_cpu_xcols xc;
    int st = ggml_cpu_xcols_prepare(p, gate, x, &xc);
    if (st) return st;
    if (p->ith == 0) moe_sort_pairs(dst, &mp);
    ggml_barrier(p->tp);
    int32_t active[n_local]; // the matrices with pairs, ascending
    int64_t n_active = 0;
    for (int64_t e = 0; e < n_local; e++)
        if (mp.first[e + 1] > mp.first[e]) active[n_active++] = (int32_t)e;
    const struct ggml_type_traits *tw = ggml_get_type_traits(gate->type), *td = ggml_get_type_traits(down->type);
    const levels_gemm_fn gemm = levels_gemm_current();
    const struct levels_traits *lg = gemm ? moe_levels_for(gate, x) : NULL, *ld = gemm ? moe_levels_for(down, x) : NULL;
    int64_t group_first[n_local];
    struct moe_groups gr = {group_first, 0};
    if (lg || ld) moe_groups_of(&mp, active, n_active, n_local, &gr); // (read only where a levels path runs)
    char *xgroups = (char *)p->wdata + l.xgroups, *agroups = (char *)p->wdata + l.agroups;
    char *panels = (char *)p->wdata + l.panels + (size_t)p->ith * l.panel_bytes; // this thread's
    char *xt = (char *)p->wdata + l.tiles + (size_t)p->ith * l.tile_bytes;      // this thread's gathered x

    // phase 1b: the levels experts' x, their tokens' columns gathered and packed a group at a time
    if (lg && gr.n) {
        for (int64_t u = p->ith; u < gr.n; u += p->nth) {
            int64_t g, q0;
            const int32_t e = moe_group_at(&gr, active, n_active, u, &g);
            const int64_t cnt = moe_group_pairs(&mp, e, g, &q0);
            for (int64_t c = 0; c < cnt; c++)
                memcpy(xt + c * xc.stride, xc.base + (size_t)mp.token[q0 + c] * xc.stride, xc.stride);
            levels_x_pack(tw->vec_dot_type, false, xt, xc.stride, cnt, d, lg->offset, 0, xgroups + u * l.xgroup_bytes);
        }
        ggml_barrier(p->tp);
    }

    // phase 2: act[pair][r] = act(gate_e[r] . x_j) * (up_e[r] . x_j)
    float *act = (float *)((char *)p->wdata + l.act);
    const int64_t chunks = (n_ff + MOE_ROWS - 1) / MOE_ROWS;
    int64_t u0, u1;
    while (ggml_next_chunk(p->chunk_next, n_active * chunks, 1, &u0, &u1)) {
        const int32_t e = active[u0 / chunks];
        const int64_t r0 = u0 % chunks * MOE_ROWS, r1 = r0 + MOE_ROWS < n_ff ? r0 + MOE_ROWS : n_ff;
        const float *b = biases ? (const float *)biases->data + (2 * n_ff + d) * (int64_t)mp.expert[e] : NULL;
        const struct moe_rows m = {(const char *)gate->data + e * (int64_t)gate->nb[2],
                                   (const char *)up->data + e * (int64_t)up->nb[2], gate->nb[1], d, tw, b,
                                   b ? b + n_ff : NULL};
        if (lg && gr.first[e] >= 0) {
            const struct moe_levels lv = moe_levels_of(gemm, lg, gate->type, mp.first[e + 1] - mp.first[e]);
            moe_up_levels(&lv, &m, kind, &mp, e, gr.first[e], xgroups, l.xgroup_bytes, panels, l.gate_panel_bytes, act,
                          n_ff, r0, r1);
            continue;
        }
        int32_t q = mp.first[e];
        // the expert's pairs 4 at a time through 4 x 4 tiles (their x gathered side by side), the rest one by one
        for (; tw->gemm_tile && q + TILE_C <= mp.first[e + 1]; q += TILE_C) {
            for (int c = 0; c < TILE_C; c++)
                memcpy(xt + c * xc.stride, xc.base + (size_t)mp.token[q + c] * xc.stride, xc.stride);
            int64_t r = r0;
            for (; r + TILE_R <= r1; r += TILE_R) {
                float g[TILE_C * TILE_R], u[TILE_C * TILE_R];
                tw->gemm_tile(d, g, TILE_R, m.w + r * (int64_t)m.nb1, m.nb1, xt, xc.stride);
                tw->gemm_tile(d, u, TILE_R, m.w2 + r * (int64_t)m.nb1, m.nb1, xt, xc.stride);
                for (int c = 0; c < TILE_C; c++)
                    for (int i = 0; i < TILE_R; i++)
                        act[(q + c) * n_ff + r + i] = moe_act(kind, g[c * TILE_R + i] + (b ? b[r + i] : 0.0f),
                                                              u[c * TILE_R + i] + (b ? b[n_ff + r + i] : 0.0f));
            }
            for (int c = 0; c < TILE_C; c++) moe_up_rows(&m, kind, xt + c * xc.stride, act + (q + c) * n_ff, r, r1);
        }
        for (; q < mp.first[e + 1]; q++)
            moe_up_rows(&m, kind, xc.base + (size_t)mp.token[q] * xc.stride, act + q * n_ff, r0, r1);
    }
    ggml_barrier(p->tp);

    // phase 3: the activations as down's vec_dot takes them (the counter is free again: reset before the barrier)
    if (p->ith == 0) atomic_store_explicit(p->chunk_next, 0, memory_order_relaxed);
    const char *aq = (const char *)act;
    size_t aq_row = sizeof(float) * (size_t)n_ff;
    if (td->vec_dot_type != GGML_TYPE_F32) {
        const struct ggml_type_traits *tv = ggml_get_type_traits(td->vec_dot_type);
        aq_row = ggml_row_size(td->vec_dot_type, n_ff);
        aq = (const char *)p->wdata + l.actq;
        int64_t q0, q1;
        ggml_thread_range(n_pairs, p->ith, p->nth, &q0, &q1);
        for (int64_t q = q0; q < q1 && q < mp.first[n_local]; q++)
            tv->quantize_act(act + q * n_ff, (char *)aq + (size_t)q * aq_row, n_ff);
    }
    ggml_barrier(p->tp);

    // phase 3b: the levels experts' activations packed a group at a time (each expert's lie side by side)
    if (ld && gr.n) {
        for (int64_t u = p->ith; u < gr.n; u += p->nth) {
            int64_t g;
            const int32_t e = moe_group_at(&gr, active, n_active, u, &g);
            levels_x_pack(td->vec_dot_type, false, aq + (size_t)mp.first[e] * aq_row, aq_row,
                          mp.first[e + 1] - mp.first[e], n_ff, ld->offset, g, agroups + u * l.agroup_bytes);
        }
        ggml_barrier(p->tp);
    }

    // phase 4: y[j][r] = sum over j's pairs q of weight[q] * down_e[r] . act[q]
    const int64_t out_chunks = (d + MOE_ROWS - 1) / MOE_ROWS;
    while (ggml_next_chunk(p->chunk_next, out_chunks, 1, &u0, &u1)) {
        const int64_t r0 = u0 * MOE_ROWS, r1 = r0 + MOE_ROWS < d ? r0 + MOE_ROWS : d;
        for (int64_t j = 0; j < x->ne[1]; j++)
            memset((char *)dst->data + j * (int64_t)dst->nb[1] + r0 * (int64_t)sizeof(float), 0,
                   sizeof(float) * (size_t)(r1 - r0));
        for (int64_t a = 0; a < n_active; a++) {
            const int32_t e = active[a];
            const float *b = biases ? (const float *)biases->data + (2 * n_ff + d) * (int64_t)mp.expert[e] + 2 * n_ff
                                    : NULL;
            const struct moe_rows m = {(const char *)down->data + e * (int64_t)down->nb[2], NULL, down->nb[1], n_ff, td,
                                       b, NULL};
            if (ld && gr.first[e] >= 0) {
                const struct moe_levels lv = moe_levels_of(gemm, ld, down->type, mp.first[e + 1] - mp.first[e]);
                moe_down_levels(&lv, &m, &mp, e, gr.first[e], agroups, l.agroup_bytes, panels, dst, r0, r1);
                continue;
            }
            int32_t q = mp.first[e];
            for (; td->gemm_tile && q + TILE_C <= mp.first[e + 1]; q += TILE_C) { // the act rows lie side by side
                int64_t r = r0;
                for (; r + TILE_R <= r1; r += TILE_R) {
                    float v[TILE_C * TILE_R];
                    td->gemm_tile(n_ff, v, TILE_R, m.w + r * (int64_t)m.nb1, m.nb1, aq + (size_t)q * aq_row, aq_row);
                    for (int c = 0; c < TILE_C; c++)
                        for (int i = 0; i < TILE_R; i++)
                            moe_out(dst, mp.token[q + c])[r + i] +=
                                mp.weight[q + c] * (v[c * TILE_R + i] + (b ? b[r + i] : 0.0f));
                }
                for (int c = 0; c < TILE_C; c++)
                    moe_down_rows(&m, aq + (size_t)(q + c) * aq_row, mp.weight[q + c], moe_out(dst, mp.token[q + c]), r,
                                  r1);
            }
            for (; q < mp.first[e + 1]; q++)
                moe_down_rows(&m, aq + (size_t)q * aq_row, mp.weight[q], moe_out(dst, mp.token[q]), r0, r1);
        }
    }
    if (lg || ld) levels_gemm_done(gemm);
    return GGML_STATUS_OK;
}
