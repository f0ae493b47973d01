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

// per thread: (ATTN_ROWS, n_ctx) scores, (ATTN_ROWS, hd) output accumulators
static size_t attn_scratch_floats(int64_t hd, int64_t n_ctx) {
    return (size_t)ATTN_ROWS * (size_t)n_ctx + (size_t)ATTN_ROWS * (size_t)hd;
}

size_t ggml_cpu_attention_wsize(const struct ggml_tensor *dst, int n_threads) {
    const size_t floats = attn_scratch_floats(dst->src[0]->ne[0], dst->src[1]->ne[2]);
    return (size_t)n_threads * ggml_cpu_align_up(floats * sizeof(float));
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

int ggml_cpu_op_attention(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *pos = dst->src[3];
    const float *sinks = dst->src[4] ? (const float *)dst->src[4]->data : NULL;
    const float scale = ggml_op_param_f32(dst, 0);
    const int64_t window = dst->op_params[1];
    const int64_t hd = q->ne[0], n_head = q->ne[1], n_tokens = q->ne[2];
    const int64_t n_kv_head = k->ne[1], n_ctx = k->ne[2], group = n_head / n_kv_head;
    if ((k->type != GGML_TYPE_F32 && k->type != GGML_TYPE_F16) || v->type != k->type || q->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "attention: cache of %s/%s not readable",
                              ggml_type_name(k->type), ggml_type_name(v->type));
    int st = check_positions(pos, 0, n_ctx, "attention");
    if (st) return st;
    const bool f16 = k->type == GGML_TYPE_F16;
    const struct attn_kernels kern = attn_kernels_pick(hd);
    const struct attn_units units = attn_units_of(group, n_kv_head, n_tokens, p->nth);
    float *scores = ggml_cpu_thread_scratch(p, attn_scratch_floats(hd, n_ctx) * sizeof(float)); // (rows, n_ctx)
    float *acc = scores + ATTN_ROWS * n_ctx;                                                    // (rows, hd)
    // units dealt round robin: with causal masks later tokens cost more, so contiguous ranges would not balance
    for (int64_t u = p->ith; u < units.count; u += p->nth) {
        const int64_t g = u % n_kv_head, hc = u / n_kv_head % units.n_head_chunks;
        const int64_t h0 = g * group + hc * units.heads, t0 = u / (n_kv_head * units.n_head_chunks) * units.tokens;
        const int nh = (int)(group - hc * units.heads < units.heads ? group - hc * units.heads : units.heads);
        const int nt = (int)(n_tokens - t0 < units.tokens ? n_tokens - t0 : units.tokens), nq = nt * nh;
        int64_t first[ATTN_ROWS], last[ATTN_ROWS], smin = n_ctx, smax = 0; // by token
        const float *qrow[ATTN_ROWS]; // row j: token t0 + j / nh, head h0 + j % nh; (hd) each
        float *accrow[ATTN_ROWS];
        for (int i = 0; i < nt; i++) {
            last[i] = pos_at(pos, t0 + i);
            first[i] = window && last[i] >= window ? last[i] - window + 1 : 0;
            smax = last[i] > smax ? last[i] : smax;
            smin = first[i] < smin ? first[i] : smin;
        }
        for (int j = 0; j < nq; j++) {
            qrow[j] = (const float *)((const char *)q->data + (h0 + j % nh) * (int64_t)q->nb[1] +
                                      (t0 + j / nh) * (int64_t)q->nb[2]);
            accrow[j] = acc + j * hd;
            memset(accrow[j], 0, (size_t)hd * sizeof(float));
        }
        // every row's score at every slot of the unit's range (a slot past a row's own range is never read)
        const char *kbase = (const char *)k->data + g * (int64_t)k->nb[1];
        for (int64_t s = smin; s <= smax; s++) kern.dots(kbase + s * (int64_t)k->nb[2], f16, qrow, nq, hd, scale,
                                                         scores + s, n_ctx);
        float inv[ATTN_ROWS];
        for (int j = 0; j < nq; j++) {
            const int64_t lo = first[j / nh], hi = last[j / nh], h = h0 + j % nh;
            float *sc = scores + j * n_ctx + lo; // (hi - lo + 1) this row's scores, then weights
            float mx = sinks ? sinks[h] : -INFINITY;
            for (int64_t s = 0; s <= hi - lo; s++) mx = sc[s] > mx ? sc[s] : mx;
            inv[j] = 1.0f / (kern.exp_sum(sc, hi - lo + 1, mx) + (sinks ? expf(sinks[h] - mx) : 0.0f));
        }
        const char *vbase = (const char *)v->data + g * (int64_t)v->nb[1];
        for (int64_t s = smin; s <= smax; s++) {
            float w[ATTN_ROWS];
            for (int j = 0; j < nq; j++) w[j] = s >= first[j / nh] && s <= last[j / nh] ? scores[j * n_ctx + s] : 0.0f;
            kern.axpys(vbase + s * (int64_t)v->nb[2], f16, w, accrow, nq, hd);
        }
        for (int j = 0; j < nq; j++) {
            float *out = (float *)((char *)dst->data + (t0 + j / nh) * (int64_t)dst->nb[1]) + (h0 + j % nh) * hd;
            for (int64_t d = 0; d < hd; d++) out[d] = accrow[j][d] * inv[j];
        }
    }
    return GGML_STATUS_OK;
}
