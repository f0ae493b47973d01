// ops_recurrent.c: linear attention's recurrent ops (Qwen3.5's gated delta net): the causal convolution over
// the tokens and the gated delta rule, each carrying the sequence in a state leaf that it overwrites.
#include "ops_kernels.h"

#include <string.h>

static int32_t first_position(const struct ggml_tensor *pos) { return *(const int32_t *)pos->data; }

// ---------------------------------------------------------------------------------------------------
// SSM_CONV: y[c, t] = sum_j w[j, c] * xx[c, t + j], xx = the state's K-1 rows then x's n rows. Each thread owns a
// range of channels and walks the tokens in order, reading rows of x and writing rows of y across its range;
// its channels' state rows are overwritten once its outputs are made
// ---------------------------------------------------------------------------------------------------

// row r of xx (C values): a state row (NULL for a fresh sequence's zeros) or a row of x
static const float *window_row(int64_t r, int64_t K, const float *state, bool fresh, const struct ggml_tensor *x) {
    if (r < K - 1) return fresh ? NULL : state + r * x->ne[0];
    return (const float *)((const char *)x->data + (r - (K - 1)) * x->nb[1]);
}

int ggml_cpu_op_ssm_conv(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    struct ggml_tensor *state = dst->src[0];
    const struct ggml_tensor *x = dst->src[1], *w = dst->src[2];
    const int64_t C = x->ne[0], n = x->ne[1], K = w->ne[0];
    const bool fresh = first_position(dst->src[3]) == 0;
    float *s = state->data;      // (K-1, C)
    const float *taps = w->data; // (C, K)
    int64_t c0, c1;
    ggml_thread_range(C, p->ith, p->nth, &c0, &c1);
    for (int64_t t = 0; t < n; t++) {
        float *y = (float *)((char *)dst->data + t * dst->nb[1]);
        for (int64_t c = c0; c < c1; c++) y[c] = 0.0f;
        for (int64_t j = 0; j < K; j++) {
            const float *row = window_row(t + j, K, s, fresh, x);
            if (!row) continue;
            for (int64_t c = c0; c < c1; c++) y[c] += taps[c * K + j] * row[c];
        }
    }
    // the new state: xx's last K-1 rows; row j comes from xx row n + j > j, not yet overwritten in this order
    for (int64_t j = 0; j < K - 1; j++) {
        const float *row = window_row(n + j, K, s, fresh, x);
        for (int64_t c = c0; c < c1; c++) s[j * C + c] = row ? row[c] : 0.0f;
    }
    return GGML_STATUS_OK;
}

// ---------------------------------------------------------------------------------------------------
// DELTA_NET: per value head h and column j of its state S (a row of the transposed state, over D_k), per token:
// s = exp(g) s; s += k beta (v[j] - s.k); out[j] = scale s.q. The columns are independent, so each thread owns
// a range of (head, column) rows and keeps its row in a local buffer across the tokens. With l2_eps > 0 q and k
// are normed: every thread first finds the norms of all of them (a 64th of its rows' work), which scale the dots
// ---------------------------------------------------------------------------------------------------

size_t ggml_cpu_delta_net_wsize(const struct ggml_tensor *dst, int n_threads) {
    const struct ggml_tensor *k = dst->src[2], *v = dst->src[3];
    // per thread: the inverse norms of q and k (n, H_k, 2), then the decays exp(g) (n, H)
    return (size_t)n_threads * ggml_cpu_align_up((size_t)(k->ne[2] * (2 * k->ne[1] + v->ne[1])) * sizeof(float));
}

// one token on one row s (D_k values), k taken as k_scale k (its L2 norm's inverse, or 1): s = decay s;
// s += k beta (v - s.k); returns s.q (the caller scales it by q's norm)
static float row_step(float *restrict s, const float *restrict k, const float *restrict q, int64_t dk, float decay,
                      float v, float beta, float k_scale) {
    float sk = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        s[i] *= decay;
        sk += s[i] * k[i];
    }
    const float delta = beta * (v - k_scale * sk) * k_scale;
    float sq = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        s[i] += delta * k[i];
        sq += s[i] * q[i];
    }
    return sq;
}

#if defined(__x86_64__)
#include "exp_avx2.h"

// row_step eight values at a time (dk a multiple of 8): a prompt's tokens each take every row twice through L1
__attribute__((target("avx2,fma"))) static float row_step_avx2(float *s, const float *k, const float *q, int64_t dk,
                                                                float decay, float v, float beta, float k_scale) {
    const __m256 dec = _mm256_set1_ps(decay);
    __m256 sk = _mm256_setzero_ps(), sq = _mm256_setzero_ps();
    for (int64_t i = 0; i < dk; i += 8) {
        const __m256 si = _mm256_mul_ps(_mm256_loadu_ps(s + i), dec);
        _mm256_storeu_ps(s + i, si);
        sk = _mm256_fmadd_ps(si, _mm256_loadu_ps(k + i), sk);
    }
    const __m256 delta = _mm256_set1_ps(beta * (v - k_scale * ggml_hsum_avx2(sk)) * k_scale);
    for (int64_t i = 0; i < dk; i += 8) {
        const __m256 si = _mm256_fmadd_ps(delta, _mm256_loadu_ps(k + i), _mm256_loadu_ps(s + i));
        _mm256_storeu_ps(s + i, si);
        sq = _mm256_fmadd_ps(si, _mm256_loadu_ps(q + i), sq);
    }
    return ggml_hsum_avx2(sq);
}
#endif

int ggml_cpu_op_delta_net(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    struct ggml_tensor *state = dst->src[0];
    const struct ggml_tensor *q = dst->src[1], *k = dst->src[2], *v = dst->src[3], *g = dst->src[4],
                             *beta = dst->src[5];
    const int64_t dk = k->ne[0], hk = k->ne[1], dv = v->ne[0], H = v->ne[1], n = v->ne[2];
    const float scale = ggml_op_param_f32(dst, 0), l2_eps = ggml_op_param_f32(dst, 1);
    const bool fresh = first_position(dst->src[6]) == 0;
    float *inv_norms = ggml_cpu_thread_scratch(p, ggml_cpu_delta_net_wsize(dst, 1)); // (n, H_k, 2): q's, k's
    float *decays = inv_norms + 2 * n * hk; // (n, H): once a head and token, not once a row
    for (int64_t i = 0; i < n * H; i++) decays[i] = expf(((const float *)g->data)[i]);
    if (l2_eps > 0.0f)
        for (int64_t i = 0; i < n * hk; i++)
            for (int which = 0; which < 2; which++) {
                const struct ggml_tensor *t = which ? k : q;
                const float *x = (const float *)((const char *)t->data + (i / hk) * t->nb[2] + (i % hk) * t->nb[1]);
                float sum = 0.0f;
                for (int64_t d = 0; d < dk; d++) sum += x[d] * x[d];
                inv_norms[2 * i + which] = 1.0f / sqrtf(sum + l2_eps);
            }
    float row[GGML_DELTA_NET_MAX_DK]; // (ggml_delta_net checks D_k)
    float (*step)(float *, const float *, const float *, int64_t, float, float, float, float) = row_step;
#if defined(__x86_64__)
    if (dk % 8 == 0 && ggml_cpu_has_avx2_fma()) step = row_step_avx2;
#endif
    int64_t r0, r1;
    ggml_thread_range(H * dv, p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t h = r / dv, j = r % dv, hq = h % hk;
        float *s = (float *)state->data + r * dk;
        if (fresh) memset(row, 0, (size_t)dk * sizeof(float));
        else memcpy(row, s, (size_t)dk * sizeof(float));
        for (int64_t t = 0; t < n; t++) {
            const float *kt = (const float *)((const char *)k->data + t * k->nb[2] + hq * k->nb[1]);
            const float *qt = (const float *)((const char *)q->data + t * q->nb[2] + hq * q->nb[1]);
            const float *norms = inv_norms + 2 * (t * hk + hq); // q's, k's
            const float q_scale = l2_eps > 0.0f ? norms[0] : 1.0f, k_scale = l2_eps > 0.0f ? norms[1] : 1.0f;
            const float vt = ((const float *)((const char *)v->data + t * v->nb[2] + h * v->nb[1]))[j];
            const float read = step(row, kt, qt, dk, decays[t * H + h], vt, ((const float *)beta->data)[t * H + h], k_scale);
            ((float *)((char *)dst->data + t * dst->nb[2] + h * dst->nb[1]))[j] = scale * q_scale * read;
        }
        memcpy(s, row, (size_t)dk * sizeof(float));
    }
    return GGML_STATUS_OK;
}
