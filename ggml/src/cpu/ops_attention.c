// ops_attention.c: rope, soft_max, kv_store and attention over the KV cache.
#include "ops_kernels.h"

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
// ---------------------------------------------------------------------------------------------------

size_t ggml_cpu_rope_wsize(const struct ggml_tensor *dst, int n_threads) {
    // (n_threads, n_dims) cos and sin of one token's angles per thread
    return (size_t)n_threads * ggml_cpu_align_up((size_t)dst->op_params[0] * sizeof(float));
}

int ggml_cpu_op_rope(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *x = dst->src[0], *pos = dst->src[1];
    const int n_dims = dst->op_params[0], mode = dst->op_params[1];
    const double base = ggml_op_param_f32(dst, 2), fscale = ggml_op_param_f32(dst, 3);
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
            const double pt = (double)pos_at(pos, t) * fscale;
            for (int i = 0; i < half; i++) {
                double theta = pt * pow(base, -2.0 * i / n_dims);
                cs[i] = (float)cos(theta);
                cs[half + i] = (float)sin(theta);
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
// ATTENTION: out[:, h, t] = softmax_s(scale * q[:, h, t] . k[:, g, s]) . v[:, g, s] over s in [0, pos[t]],
// g = h / (n_head / n_kv_head). One pass with a running max and sum (online softmax): no score buffer.
// ---------------------------------------------------------------------------------------------------

size_t ggml_cpu_attention_wsize(const struct ggml_tensor *dst, int n_threads) {
    // (n_threads, 2, head_dim) per thread: k row in F32, output accumulator
    return (size_t)n_threads * ggml_cpu_align_up(2 * (size_t)dst->src[0]->ne[0] * sizeof(float));
}

int ggml_cpu_op_attention(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *pos = dst->src[3];
    const float scale = ggml_op_param_f32(dst, 0);
    const int64_t hd = q->ne[0], n_head = q->ne[1], n_tokens = q->ne[2];
    const int64_t n_kv_head = k->ne[1], n_ctx = k->ne[2], group = n_head / n_kv_head;
    const struct ggml_type_traits *tk = ggml_get_type_traits(k->type), *tv = ggml_get_type_traits(v->type);
    const ggml_vec_dot_fn dot = ggml_get_type_traits(GGML_TYPE_F32)->vec_dot;
    if (!dot || !tv->axpy || (k->type != GGML_TYPE_F32 && !tk->to_float) || q->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "attention: cache of %s/%s not readable",
                              ggml_type_name(k->type), ggml_type_name(v->type));
    int st = check_positions(pos, 0, n_ctx, "attention");
    if (st) return st;
    float *kbuf = ggml_cpu_thread_scratch(p, 2 * (size_t)hd * sizeof(float)); // (hd) key row in F32
    float *acc = kbuf + hd;                                                     // (hd) sum of p * v
    int64_t r0, r1;
    ggml_thread_range(n_head * n_tokens, p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t h = r % n_head, t = r / n_head, g = h / group;
        const float *qrow = (const float *)((const char *)q->data + h * (int64_t)q->nb[1] + t * (int64_t)q->nb[2]);
        memset(acc, 0, (size_t)hd * sizeof(float));
        float mx = -INFINITY, sum = 0.0f;
        const int64_t last = pos_at(pos, t);
        for (int64_t s = 0; s <= last; s++) {
            const char *krow = (const char *)k->data + g * (int64_t)k->nb[1] + s * (int64_t)k->nb[2];
            const char *vrow = (const char *)v->data + g * (int64_t)v->nb[1] + s * (int64_t)v->nb[2];
            float score;
            if (k->type == GGML_TYPE_F32) {
                dot(hd, &score, krow, qrow);
            } else {
                tk->to_float(krow, kbuf, hd);
                dot(hd, &score, kbuf, qrow);
            }
            score *= scale;
            if (score > mx) {
                // a new maximum: rescale what was summed so far to it
                const float c = expf(mx - score);
                for (int64_t i = 0; i < hd; i++) acc[i] *= c;
                sum *= c;
                mx = score;
            }
            const float w = expf(score - mx);
            sum += w;
            tv->axpy(hd, acc, w, vrow);
        }
        float *out = (float *)((char *)dst->data + t * (int64_t)dst->nb[1]) + h * hd;
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < hd; i++) out[i] = acc[i] * inv;
    }
    return GGML_STATUS_OK;
}
