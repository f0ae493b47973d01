// ops_attention.c: rope, soft_max, kv_store and attention over the KV cache.
#include "exp_avx2.h"
#include "ops_kernels.h"
#include "../quants.h"
#include "../rope.h"

#include <math.h>
#include <string.h>

static inline int32_t pos_at(const struct ggml_tensor *pos, int64_t i) {
    return *(const int32_t *)((const char *)pos->data + i * (int64_t)pos->nb[0]);
}

// every position in [lo, hi); checked by every thread before any work so all return the same status
static int check_positions(const struct ggml_tensor *pos, int64_t lo, int64_t hi, const char *op) {
    for (int64_t t = 0; t < pos->ne[0]; t++) {
        int32_t v = pos_at(pos, t);
        if (v < lo || v >= hi)
            return ggml_set_error(GGML_STATUS_INVALID_ARG, "%s: position %d of token %lld outside [%lld, %lld)", op,
                                  v, (long long)t, (long long)lo, (long long)hi);
    }
    return GGML_STATUS_OK;
}

// ---------------------------------------------------------------------------------------------------
// ROPE: x [head_dim, n_head, n_tokens]; pairs rotated by theta_i = pos * freq_scale * base^(-2i/n_dims)
// (divided by freq_factors[i] when src[2] holds them; YaRN's blend, see rope.h), cos and sin times mscale
// ---------------------------------------------------------------------------------------------------

size_t ggml_cpu_rope_wsize(const struct ggml_tensor *dst, int n_threads) {
    // (n_threads, n_dims) cos and sin of one token's angles per thread
    return (size_t)n_threads * ggml_cpu_align_up((size_t)dst->op_params[0] * sizeof(float));
}

int ggml_cpu_op_rope(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *x = dst->src[0], *pos = dst->src[1];
    const float *factors = dst->src[2] ? (const float *)dst->src[2]->data : NULL; // (n_dims/2) or none
    const int n_dims = dst->op_params[0], mode = dst->op_params[1];
    const double base = ggml_op_param_f32(dst, 2), fscale = ggml_op_param_f32(dst, 3);
    const double ext = ggml_op_param_f32(dst, 4), mscale = ggml_op_param_f32(dst, 5);
    const double lo = ggml_op_param_f32(dst, 6), hi = ggml_op_param_f32(dst, 7);
    const int64_t hd = x->ne[0], n_head = x->ne[1], nrows = ggml_nrows(x);
    if (n_dims <= 0 || n_dims % 2 || n_dims > hd || x->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "rope: bad n_dims %d for head size %lld", n_dims, (long long)hd);
    const int half = n_dims / 2;
    float *cs = ggml_cpu_thread_scratch(p, (size_t)n_dims * sizeof(float)); // (half) cos, then (half) sin
    int64_t r0, r1;
    ggml_thread_range(nrows, p->ith, p->nth, &r0, &r1);
    int64_t cached_token = -1;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t t = (r / n_head) % x->ne[2];
        if (t != cached_token) {
            // angles in double: positions reach thousands of radians, where float loses digits
            const double pt = (double)pos_at(pos, t);
            for (int i = 0; i < half; i++) {
                const double theta =
                    pt * ggml_rope_pair_freq(i, n_dims, base, fscale, factors ? factors[i] : 1.0, ext, lo, hi);
                cs[i] = (float)(cos(theta) * mscale);
                cs[half + i] = (float)(sin(theta) * mscale);
            }
            cached_token = t;
        }
        const float *src = (const float *)ggml_cpu_row_ptr(x, r); // (hd)
        float *out = (float *)ggml_cpu_row_ptr(dst, r);           // (hd)
        for (int i = 0; i < half; i++) {
            const int64_t i0 = mode == GGML_ROPE_NEOX ? i : 2 * i;
            const int64_t i1 = mode == GGML_ROPE_NEOX ? i + half : 2 * i + 1;
            const float a = src[i0], b = src[i1], c = cs[i], s = cs[half + i];
            out[i0] = a * c - b * s;
            out[i1] = a * s + b * c;
        }
        for (int64_t i = n_dims; i < hd; i++) out[i] = src[i];
    }
    return GGML_STATUS_OK;
}

// ---------------------------------------------------------------------------------------------------
// SOFT_MAX: per row, softmax(scale * x) with columns j > pos[row] masked out
// ---------------------------------------------------------------------------------------------------

int ggml_cpu_op_soft_max(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *a = dst->src[0], *pos = dst->src[1];
    const float scale = ggml_op_param_f32(dst, 0);
    const int64_t n = a->ne[0], nrows = ggml_nrows(a);
    if (pos) {
        // a negative position would mask a whole row, which has no softmax
        int st = check_positions(pos, 0, INT32_MAX, "soft_max");
        if (st) return st;
    }
    int64_t r0, r1;
    ggml_thread_range(nrows, p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float *x = (const float *)ggml_cpu_row_ptr(a, r); // (n)
        float *y = (float *)ggml_cpu_row_ptr(dst, r);           // (n)
        const int64_t nv = pos && pos_at(pos, r) + 1 < n ? pos_at(pos, r) + 1 : n; // columns kept
        float mx = -INFINITY;
        for (int64_t j = 0; j < nv; j++) {
            y[j] = x[j] * scale;
            mx = y[j] > mx ? y[j] : mx;
        }
        double sum = 0.0;
        for (int64_t j = 0; j < nv; j++) {
            y[j] = expf(y[j] - mx);
            sum += y[j];
        }
        const float inv = (float)(1.0 / sum);
        for (int64_t j = 0; j < nv; j++) y[j] *= inv;
        for (int64_t j = nv; j < n; j++) y[j] = 0.0f;
    }
    return GGML_STATUS_OK;
}

// ---------------------------------------------------------------------------------------------------
// KV_STORE: cache[:, :, pos[t]] = src[:, :, t], converted to the cache type, in place
// ---------------------------------------------------------------------------------------------------

int ggml_cpu_op_kv_store(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *src = dst->src[1], *pos = dst->src[2];
    const struct ggml_type_traits *tc = ggml_get_type_traits(dst->type);
    const int64_t hd = dst->ne[0], n_kv_head = dst->ne[1], n_ctx = dst->ne[2];
    if (src->type != GGML_TYPE_F32 || (dst->type != GGML_TYPE_F32 && !tc->from_float))
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "kv_store takes F32 rows into an F32/F16 cache");
    int st = check_positions(pos, 0, n_ctx, "kv_store");
    if (st) return st;
    int64_t r0, r1;
    ggml_thread_range(n_kv_head * src->ne[2], p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t h = r % n_kv_head, t = r / n_kv_head;
        const float *row = (const float *)((const char *)src->data + h * (int64_t)src->nb[1] + t * (int64_t)src->nb[2]);
        char *slot = (char *)dst->data + h * (int64_t)dst->nb[1] + pos_at(pos, t) * (int64_t)dst->nb[2];
        if (dst->type == GGML_TYPE_F32)
            memcpy(slot, row, (size_t)hd * sizeof(float));
        else
            tc->from_float(row, slot, hd);
    }
    return GGML_STATUS_OK;
}

// ---------------------------------------------------------------------------------------------------
// ATTENTION: out[:, h, t] = softmax_s(scale * q[:, h, t] . k[:, g, s]) . v[:, g, s] over s in [0, pos[t]]
// (in (pos[t] - window, pos[t]] for a sliding-window layer), g = h / (n_head / n_kv_head); with sinks, head h's
// softmax counts exp(sinks[h]) beside its keys'. A work unit is one KV head and up to ATTN_ROWS query rows that
// read it (some of its query heads, times consecutive tokens): each key and value row is read, and converted from
// F16, once for all of them (a unit of one head had converted every row once per head of its group, and called
// three functions per slot and head: a 2048-deep decode ran at 0.92x llama.cpp). Scores go to a buffer, then one
// max, one vectorised exp pass and one weighted sum of the value rows per row (no running rescale).
// ---------------------------------------------------------------------------------------------------

#define ATTN_ROWS 16 // query rows of a work unit
#define ATTN_PASS 8  // rows the AVX2 score kernel keeps in registers at once

// y[i] = exp(y[i] - mx) for i < n; returns the sum
typedef float (*attn_exp_fn)(float *y, int64_t n, float mx);
// out[j * stride] = scale * (row . q[j]) for j < nq; row: hd values of the cache (F16 or F32)
typedef void (*attn_dots_fn)(const void *row, bool f16, const float *const *q, int nq, int64_t hd, float scale,
                             float *out, int64_t stride);
// acc[j] += w[j] * row for j < nq
typedef void (*attn_axpys_fn)(const void *row, bool f16, const float *w, float *const *acc, int nq, int64_t hd);

static inline float attn_cache_value(const void *row, bool f16, int64_t d) {
    return f16 ? ggml_fp16_to_fp32(((const uint16_t *)row)[d]) : ((const float *)row)[d];
}

static float attn_exp_scalar(float *y, int64_t n, float mx) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        y[i] = expf(y[i] - mx);
        sum += y[i];
    }
    return (float)sum;
}

static void attn_dots_scalar(const void *row, bool f16, const float *const *q, int nq, int64_t hd, float scale,
                             float *out, int64_t stride) {
    for (int j = 0; j < nq; j++) {
        float sum = 0.0f;
        for (int64_t d = 0; d < hd; d++) sum += attn_cache_value(row, f16, d) * q[j][d];
        out[j * stride] = scale * sum;
    }
}

static void attn_axpys_scalar(const void *row, bool f16, const float *w, float *const *acc, int nq, int64_t hd) {
    for (int64_t d = 0; d < hd; d++) {
        const float x = attn_cache_value(row, f16, d);
        for (int j = 0; j < nq; j++) acc[j][d] += w[j] * x;
    }
}

#if defined(__x86_64__)
#define ATTN_AVX2 __attribute__((target("avx2,fma,f16c")))

ATTN_AVX2 static float attn_exp_avx2(float *y, int64_t n, float mx) {
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = ggml_exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(y + i), vmx));
        _mm256_storeu_ps(y + i, v);
        acc = _mm256_add_ps(acc, v);
    }
    return ggml_hsum_avx2(acc) + attn_exp_scalar(y + i, n - i, mx);
}

ATTN_AVX2 static inline __m256 attn_load8(const void *row, bool f16, int64_t d) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d)))
               : _mm256_loadu_ps((const float *)row + d);
}

// n (a constant where inlined) rows' dots, their sums in n registers
ATTN_AVX2 __attribute__((always_inline)) static inline void attn_dots_n(const void *row, bool f16, const float *const *q,
                                                                        int n, int64_t hd, float scale, float *out,
                                                                        int64_t stride) {
    __m256 acc[ATTN_PASS];
    for (int j = 0; j < n; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) {
        const __m256 x = attn_load8(row, f16, d);
        for (int j = 0; j < n; j++) acc[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(q[j] + d), acc[j]);
    }
    for (int j = 0; j < n; j++) out[j * stride] = scale * ggml_hsum_avx2(acc[j]);
}

// (hd a multiple of 8)
ATTN_AVX2 static void attn_dots_avx2(const void *row, bool f16, const float *const *q, int nq, int64_t hd, float scale,
                                     float *out, int64_t stride) {
    for (int j0 = 0; j0 < nq; j0 += ATTN_PASS) {
        const float *const *qj = q + j0;
        float *o = out + j0 * stride;
        switch (nq - j0 < ATTN_PASS ? nq - j0 : ATTN_PASS) {
        case 1: attn_dots_n(row, f16, qj, 1, hd, scale, o, stride); break;
        case 2: attn_dots_n(row, f16, qj, 2, hd, scale, o, stride); break;
        case 3: attn_dots_n(row, f16, qj, 3, hd, scale, o, stride); break;
        case 4: attn_dots_n(row, f16, qj, 4, hd, scale, o, stride); break;
        case 5: attn_dots_n(row, f16, qj, 5, hd, scale, o, stride); break;
        case 6: attn_dots_n(row, f16, qj, 6, hd, scale, o, stride); break;
        case 7: attn_dots_n(row, f16, qj, 7, hd, scale, o, stride); break;
        default: attn_dots_n(row, f16, qj, 8, hd, scale, o, stride); break;
        }
    }
}

ATTN_AVX2 static void attn_axpys_avx2(const void *row, bool f16, const float *w, float *const *acc, int nq, int64_t hd) {
    for (int64_t d = 0; d < hd; d += 8) {
        const __m256 x = attn_load8(row, f16, d);
        for (int j = 0; j < nq; j++)
            _mm256_storeu_ps(acc[j] + d, _mm256_fmadd_ps(_mm256_set1_ps(w[j]), x, _mm256_loadu_ps(acc[j] + d)));
    }
}
#endif

struct attn_kernels {
    attn_exp_fn exp_sum;
    attn_dots_fn dots;
    attn_axpys_fn axpys;
};

static struct attn_kernels attn_kernels_pick(int64_t hd) {
#if defined(__x86_64__)
    if (ggml_cpu_has_avx2_fma() && __builtin_cpu_supports("f16c") && hd % 8 == 0)
        return (struct attn_kernels){attn_exp_avx2, attn_dots_avx2, attn_axpys_avx2};
    if (ggml_cpu_has_avx2_fma()) return (struct attn_kernels){attn_exp_avx2, attn_dots_scalar, attn_axpys_scalar};
#endif
    return (struct attn_kernels){attn_exp_scalar, attn_dots_scalar, attn_axpys_scalar};
}

// a row's record: its unnormalised output (hd floats), then its largest score and its exp-sum
static size_t attn_record_floats(int64_t hd) { return (size_t)hd + 2; }

// per thread: (ATTN_ROWS, n_ctx) scores, ATTN_ROWS records
static size_t attn_scratch_floats(int64_t hd, int64_t n_ctx) {
    return (size_t)ATTN_ROWS * (size_t)n_ctx + (size_t)ATTN_ROWS * attn_record_floats(hd);
}

// how the rows split into units: heads of a KV head's group a unit (fewer where that leaves threads idle), tokens
struct attn_units {
    int64_t heads, tokens, n_head_chunks, n_token_chunks, count;
};

static struct attn_units attn_units_of(int64_t group, int64_t n_kv_head, int64_t n_tokens, int n_threads) {
    struct attn_units u;
    u.heads = group < ATTN_ROWS ? group : ATTN_ROWS;
    u.tokens = ATTN_ROWS / u.heads < n_tokens ? ATTN_ROWS / u.heads : n_tokens;
    u.n_token_chunks = (n_tokens + u.tokens - 1) / u.tokens;
    const int64_t others = n_kv_head * u.n_token_chunks, wanted = (n_threads + others - 1) / others; // head chunks
    if (wanted > 1) {
        const int64_t heads = (group + wanted - 1) / wanted;
        u.heads = heads < u.heads ? heads : u.heads;
    }
    u.n_head_chunks = (group + u.heads - 1) / u.heads;
    u.count = others * u.n_head_chunks;
    return u;
}

// A decoded token's units are few (one a KV head, or a few heads of one): 3 KV heads on 2 threads left one thread a
// third of the time idle, one KV head (Gemma 3) the other thread all of it. There each unit's slots split into
// segments, the threads take (unit, segment) items and keep each row's max, exp-sum and unnormalised output; after a
// barrier the segments merge. A segment spans at least this many slots.
#define ATTN_SEGMENT_MIN 256

static int64_t attn_gcd(int64_t a, int64_t b) { return b ? attn_gcd(b, a % b) : a; }

// segments a unit (1: none): enough for the items to deal evenly over the threads, where a token chunk is the
// whole batch and the slots allow
static int64_t attn_segments(const struct attn_units *u, int n_threads, int64_t slots) {
    if (u->n_token_chunks != 1 || u->count % n_threads == 0) return 1;
    const int64_t even = n_threads / attn_gcd(u->count, n_threads), most = slots / ATTN_SEGMENT_MIN;
    const int64_t segs = even < most ? even : most;
    return segs > 1 ? segs : 1;
}

// the segments' records, shared: (units, segments, rows of a unit) records, at most a segment a thread per unit
static size_t attn_parts_bytes(const struct attn_units *u, int n_threads, int64_t hd) {
    if (u->n_token_chunks != 1) return 0;
    return ggml_cpu_align_up((size_t)u->count * (size_t)n_threads * (size_t)(u->heads * u->tokens) *
                             attn_record_floats(hd) * sizeof(float));
}

size_t ggml_cpu_attention_wsize(const struct ggml_tensor *dst, int n_threads) {
    const struct ggml_tensor *q = dst->src[0], *k = dst->src[1];
    const struct attn_units u = attn_units_of(q->ne[1] / k->ne[1], k->ne[1], q->ne[2], n_threads);
    const size_t floats = attn_scratch_floats(q->ne[0], k->ne[2]);
    return attn_parts_bytes(&u, n_threads, q->ne[0]) + (size_t)n_threads * ggml_cpu_align_up(floats * sizeof(float));
}

// what every item of one attention op reads
struct attn_op {
    const struct ggml_tensor *q, *k, *v, *pos;
    struct ggml_tensor *dst;
    const float *sinks; // (n_head) or NULL
    float scale;
    int64_t window, hd, n_ctx, n_kv_head, group, n_tokens;
    bool f16;
    struct attn_kernels kern;
    struct attn_units units;
};

// the query rows of one unit and their slot ranges
struct attn_rows {
    int64_t g, h0, t0;                                     // KV head, first head, first token
    int nh, nq;                                            // heads, rows (row j: token t0 + j / nh, head h0 + j % nh)
    int64_t first[ATTN_ROWS], last[ATTN_ROWS], smin, smax; // by token
    const float *qrow[ATTN_ROWS];                          // (hd) each
};

static void attn_rows_of(const struct attn_op *a, int64_t u, struct attn_rows *r) {
    const struct attn_units *un = &a->units;
    const int64_t hc = u / a->n_kv_head % un->n_head_chunks;
    r->g = u % a->n_kv_head;
    r->h0 = r->g * a->group + hc * un->heads;
    r->t0 = u / (a->n_kv_head * un->n_head_chunks) * un->tokens;
    r->nh = (int)(a->group - hc * un->heads < un->heads ? a->group - hc * un->heads : un->heads);
    const int nt = (int)(a->n_tokens - r->t0 < un->tokens ? a->n_tokens - r->t0 : un->tokens);
    r->nq = nt * r->nh;
    r->smin = a->n_ctx, r->smax = 0;
    for (int i = 0; i < nt; i++) {
        r->last[i] = pos_at(a->pos, r->t0 + i);
        r->first[i] = a->window && r->last[i] >= a->window ? r->last[i] - a->window + 1 : 0;
        r->smax = r->last[i] > r->smax ? r->last[i] : r->smax;
        r->smin = r->first[i] < r->smin ? r->first[i] : r->smin;
    }
    for (int j = 0; j < r->nq; j++)
        r->qrow[j] = (const float *)((const char *)a->q->data + (r->h0 + j % r->nh) * (int64_t)a->q->nb[1] +
                                     (r->t0 + j / r->nh) * (int64_t)a->q->nb[2]);
}

// the rows over slots [lo, hi] of their ranges into their records (rec[j * stride]: row j's unnormalised output,
// largest score and exp-sum; a row with no slot there: zeros, -inf, 0). Scores go to `scores` ((ATTN_ROWS, n_ctx)),
// then one max, one vectorised exp pass and one weighted sum of the value rows per row (no running rescale)
static void attn_span(const struct attn_op *a, const struct attn_rows *r, int64_t lo, int64_t hi, float *scores,
                      float *rec, size_t stride) {
    const int64_t hd = a->hd, n_ctx = a->n_ctx;
    float *acc[ATTN_ROWS];
    for (int j = 0; j < r->nq; j++) {
        acc[j] = rec + j * stride;
        memset(acc[j], 0, (size_t)hd * sizeof(float));
    }
    // every row's score at every slot of the span (a slot past a row's own range is never read)
    const char *kbase = (const char *)a->k->data + r->g * (int64_t)a->k->nb[1];
    for (int64_t s = lo; s <= hi; s++)
        a->kern.dots(kbase + s * (int64_t)a->k->nb[2], a->f16, r->qrow, r->nq, hd, a->scale, scores + s, n_ctx);
    int64_t rlo[ATTN_ROWS], rhi[ATTN_ROWS]; // row j's slots within the span
    for (int j = 0; j < r->nq; j++) {
        rlo[j] = r->first[j / r->nh] > lo ? r->first[j / r->nh] : lo;
        rhi[j] = r->last[j / r->nh] < hi ? r->last[j / r->nh] : hi;
        float *sc = scores + j * n_ctx + rlo[j]; // (rhi - rlo + 1) this row's scores, then weights
        float mx = -INFINITY;
        for (int64_t s = 0; s <= rhi[j] - rlo[j]; s++) mx = sc[s] > mx ? sc[s] : mx;
        acc[j][hd] = mx;
        acc[j][hd + 1] = rlo[j] <= rhi[j] ? a->kern.exp_sum(sc, rhi[j] - rlo[j] + 1, mx) : 0.0f;
    }
    const char *vbase = (const char *)a->v->data + r->g * (int64_t)a->v->nb[1];
    for (int64_t s = lo; s <= hi; s++) {
        float w[ATTN_ROWS];
        for (int j = 0; j < r->nq; j++) w[j] = s >= rlo[j] && s <= rhi[j] ? scores[j * n_ctx + s] : 0.0f;
        a->kern.axpys(vbase + s * (int64_t)a->v->nb[2], a->f16, w, acc, r->nq, hd);
    }
}

// row j's output from its n records (`apart` floats apart), rescaled to their largest max, the sink (a logit
// without a value) counted once
static void attn_finish_row(const struct attn_op *a, const struct attn_rows *r, int j, const float *rec, int64_t n,
                            size_t apart) {
    const int64_t hd = a->hd, h = r->h0 + j % r->nh;
    float m = a->sinks ? a->sinks[h] : -INFINITY;
    for (int64_t i = 0; i < n; i++) m = rec[i * apart + hd] > m ? rec[i * apart + hd] : m;
    float *out = (float *)((char *)a->dst->data + (r->t0 + j / r->nh) * (int64_t)a->dst->nb[1]) + h * hd;
    float l = a->sinks ? expf(a->sinks[h] - m) : 0.0f;
    memset(out, 0, (size_t)hd * sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        const float *p = rec + i * apart;
        if (p[hd + 1] == 0.0f) continue; // none of the row's slots in this segment
        const float e = expf(p[hd] - m);
        l += p[hd + 1] * e;
        for (int64_t d = 0; d < hd; d++) out[d] += p[d] * e;
    }
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < hd; d++) out[d] *= inv;
}

int ggml_cpu_op_attention(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2];
    struct attn_op a = {.q = q, .k = k, .v = v, .pos = dst->src[3], .dst = dst,
                        .sinks = dst->src[4] ? (const float *)dst->src[4]->data : NULL,
                        .scale = ggml_op_param_f32(dst, 0), .window = dst->op_params[1], .hd = q->ne[0],
                        .n_ctx = k->ne[2], .n_kv_head = k->ne[1], .group = q->ne[1] / k->ne[1], .n_tokens = q->ne[2],
                        .f16 = k->type == GGML_TYPE_F16};
    if ((k->type != GGML_TYPE_F32 && k->type != GGML_TYPE_F16) || v->type != k->type || q->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "attention: cache of %s/%s not readable",
                              ggml_type_name(k->type), ggml_type_name(v->type));
    int st = check_positions(a.pos, 0, a.n_ctx, "attention");
    if (st) return st;
    a.kern = attn_kernels_pick(a.hd);
    a.units = attn_units_of(a.group, a.n_kv_head, a.n_tokens, p->nth);
    const size_t parts = attn_parts_bytes(&a.units, p->nth, a.hd), stride = attn_record_floats(a.hd);
    float *scores = (float *)((char *)p->wdata + parts +
                              (size_t)p->ith * ggml_cpu_align_up(attn_scratch_floats(a.hd, a.n_ctx) * sizeof(float)));
    float *own = scores + ATTN_ROWS * a.n_ctx; // this thread's ATTN_ROWS records
    struct attn_rows r;
    int64_t segs = 1;
    if (parts) { // one token chunk: every unit's slots are the whole batch's
        attn_rows_of(&a, 0, &r);
        segs = attn_segments(&a.units, p->nth, r.smax - r.smin + 1);
    }
    // (unit, segment) items dealt round robin, units first: with causal masks later tokens cost more, so contiguous
    // ranges would not balance. A whole unit is finished at once; segments after a barrier, by unit
    const size_t rows = (size_t)(a.units.heads * a.units.tokens);
    float *shared = (float *)p->wdata; // (units, segs, rows) records
    for (int64_t i = p->ith; i < a.units.count * segs; i += p->nth) {
        const int64_t u = i % a.units.count, seg = i / a.units.count;
        attn_rows_of(&a, u, &r);
        const int64_t len = r.smax - r.smin + 1;
        float *rec = segs == 1 ? own : shared + ((size_t)u * (size_t)segs + (size_t)seg) * rows * stride;
        attn_span(&a, &r, r.smin + seg * len / segs, r.smin + (seg + 1) * len / segs - 1, scores, rec, stride);
        if (segs == 1)
            for (int j = 0; j < r.nq; j++) attn_finish_row(&a, &r, j, rec + j * stride, 1, stride);
    }
    if (segs == 1) return GGML_STATUS_OK;
    ggml_barrier(p->tp);
    for (int64_t u = p->ith; u < a.units.count; u += p->nth) {
        attn_rows_of(&a, u, &r);
        for (int j = 0; j < r.nq; j++)
            attn_finish_row(&a, &r, j, shared + (size_t)u * (size_t)segs * rows * stride + (size_t)j * stride, segs,
                            rows * stride);
    }
    return GGML_STATUS_OK;
}
