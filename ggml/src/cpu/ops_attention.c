// ops_attention.c: rope, soft_max, kv_store and attention over the KV cache.
#include "exp_avx2.h"
#include "ops_kernels.h"
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
// softmax counts exp(sinks[h]) beside its keys'. A work unit is one head and up to ATTN_TOKENS consecutive tokens: each key
// and value row is converted to F32 once for all of them; scores go to a buffer, then one max, one
// vectorised exp pass and one weighted sum of the value rows per query (no running rescale).
// ---------------------------------------------------------------------------------------------------

#define ATTN_TOKENS 8

// y[i] = exp(y[i] - mx) for i < n; returns the sum
typedef float (*attn_exp_fn)(float *y, int64_t n, float mx);

static float attn_exp_scalar(float *y, int64_t n, float mx) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        y[i] = expf(y[i] - mx);
        sum += y[i];
    }
    return (float)sum;
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static float attn_exp_avx2(float *y, int64_t n, float mx) {
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
#endif

static attn_exp_fn attn_exp_pick(void) {
#if defined(__x86_64__)
    if (ggml_cpu_has_avx2_fma()) return attn_exp_avx2;
#endif
    return attn_exp_scalar;
}

// per thread: (ATTN_TOKENS, n_ctx) scores, (ATTN_TOKENS, hd) output accumulators, (hd) a K or V row in F32
static size_t attn_scratch_floats(int64_t hd, int64_t n_ctx) {
    return (size_t)ATTN_TOKENS * (size_t)n_ctx + (size_t)ATTN_TOKENS * (size_t)hd + (size_t)hd;
}

size_t ggml_cpu_attention_wsize(const struct ggml_tensor *dst, int n_threads) {
    const size_t floats = attn_scratch_floats(dst->src[0]->ne[0], dst->src[1]->ne[2]);
    return (size_t)n_threads * ggml_cpu_align_up(floats * sizeof(float));
}

// row s of cache c for KV head g as F32 (converted into buf unless the cache is F32)
static const float *attn_cache_row(const struct ggml_tensor *c, ggml_to_float_fn to_float, int64_t g, int64_t s,
                                   float *buf) {
    const char *row = (const char *)c->data + g * (int64_t)c->nb[1] + s * (int64_t)c->nb[2];
    if (c->type == GGML_TYPE_F32) return (const float *)row;
    to_float(row, buf, c->ne[0]);
    return buf;
}

int ggml_cpu_op_attention(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *pos = dst->src[3];
    const float *sinks = dst->src[4] ? (const float *)dst->src[4]->data : NULL;
    const float scale = ggml_op_param_f32(dst, 0);
    const int64_t window = dst->op_params[1];
    const int64_t hd = q->ne[0], n_head = q->ne[1], n_tokens = q->ne[2];
    const int64_t n_kv_head = k->ne[1], n_ctx = k->ne[2], group = n_head / n_kv_head;
    const struct ggml_type_traits *tk = ggml_get_type_traits(k->type), *tv = ggml_get_type_traits(v->type);
    const struct ggml_type_traits *tf = ggml_get_type_traits(GGML_TYPE_F32);
    if ((k->type != GGML_TYPE_F32 && !tk->to_float) || (v->type != GGML_TYPE_F32 && !tv->to_float) ||
        q->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "attention: cache of %s/%s not readable",
                              ggml_type_name(k->type), ggml_type_name(v->type));
    int st = check_positions(pos, 0, n_ctx, "attention");
    if (st) return st;
    const attn_exp_fn exp_sum = attn_exp_pick();
    float *scores = ggml_cpu_thread_scratch(p, attn_scratch_floats(hd, n_ctx) * sizeof(float)); // (T, n_ctx)
    float *acc = scores + ATTN_TOKENS * n_ctx;                                                  // (T, hd)
    float *row = acc + ATTN_TOKENS * hd;                                                        // (hd)
    const int64_t n_chunks = (n_tokens + ATTN_TOKENS - 1) / ATTN_TOKENS;
    // units dealt round robin: with causal masks later tokens cost more, so contiguous ranges would not balance
    for (int64_t u = p->ith; u < n_head * n_chunks; u += p->nth) {
        const int64_t h = u % n_head, t0 = u / n_head * ATTN_TOKENS, g = h / group;
        const int64_t nt = n_tokens - t0 < ATTN_TOKENS ? n_tokens - t0 : ATTN_TOKENS;
        int64_t first[ATTN_TOKENS], last[ATTN_TOKENS], smin = n_ctx, smax = 0;
        const float *qrow[ATTN_TOKENS]; // (nt) their query rows, (hd) each
        for (int64_t i = 0; i < nt; i++) {
            last[i] = pos_at(pos, t0 + i);
            first[i] = window && last[i] >= window ? last[i] - window + 1 : 0;
            smax = last[i] > smax ? last[i] : smax;
            smin = first[i] < smin ? first[i] : smin;
            qrow[i] = (const float *)((const char *)q->data + h * (int64_t)q->nb[1] + (t0 + i) * (int64_t)q->nb[2]);
        }
        for (int64_t s = smin; s <= smax; s++) {
            const float *kr = attn_cache_row(k, tk->to_float, g, s, row);
            for (int64_t i = 0; i < nt; i++) {
                if (s < first[i] || s > last[i]) continue;
                tf->vec_dot(hd, &scores[i * n_ctx + s], kr, qrow[i]);
                scores[i * n_ctx + s] *= scale;
            }
        }
        float inv[ATTN_TOKENS];
        for (int64_t i = 0; i < nt; i++) {
            float *sc = scores + i * n_ctx + first[i]; // (last - first + 1) this query's scores, then weights
            float mx = sinks ? sinks[h] : -INFINITY;
            for (int64_t s = 0; s <= last[i] - first[i]; s++) mx = sc[s] > mx ? sc[s] : mx;
            inv[i] = 1.0f / (exp_sum(sc, last[i] - first[i] + 1, mx) + (sinks ? expf(sinks[h] - mx) : 0.0f));
            memset(acc + i * hd, 0, (size_t)hd * sizeof(float));
        }
        for (int64_t s = smin; s <= smax; s++) {
            const float *vr = attn_cache_row(v, tv->to_float, g, s, row);
            for (int64_t i = 0; i < nt; i++) {
                if (s >= first[i] && s <= last[i]) tf->axpy(hd, acc + i * hd, scores[i * n_ctx + s], vr);
            }
        }
        for (int64_t i = 0; i < nt; i++) {
            float *out = (float *)((char *)dst->data + (t0 + i) * (int64_t)dst->nb[1]) + h * hd; // (hd)
            for (int64_t j = 0; j < hd; j++) out[j] = acc[i * hd + j] * inv[i];
        }
    }
    return GGML_STATUS_OK;
}
