// ops_recurrent.c: linear attention's recurrent ops (Qwen3.5's gated delta net): the causal convolution over
// the tokens and the gated delta rule, each carrying the sequence in a state leaf that it overwrites.
#include "ops_kernels.h"

#include <string.h>

static int32_t first_position(const struct ggml_tensor *pos) { return *(const int32_t *)pos->data; }

// ---------------------------------------------------------------------------------------------------
// SSM_CONV: y[c, t] = sum_j w[j, c] * xx[c, t + j], xx = the state's K-1 rows then x's n rows; each thread
// owns a range of channels, so it can overwrite their state once its outputs are made
// ---------------------------------------------------------------------------------------------------

int ggml_cpu_op_ssm_conv(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    struct ggml_tensor *state = dst->src[0];
    const struct ggml_tensor *x = dst->src[1], *w = dst->src[2];
    const int64_t C = x->ne[0], n = x->ne[1], K = w->ne[0];
    const bool fresh = first_position(dst->src[3]) == 0;
    float *s = state->data;                  // (K-1, C)
    const float *taps = w->data;             // (C, K)
    int64_t c0, c1;
    ggml_thread_range(C, p->ith, p->nth, &c0, &c1);
    for (int64_t c = c0; c < c1; c++) {
        float window[16]; // the K-1 inputs before token t, oldest first (K <= 16 checked below)
        for (int64_t j = 0; j < K - 1; j++) window[j] = fresh ? 0.0f : s[j * C + c];
        const float *tc = taps + c * K;
        for (int64_t t = 0; t < n; t++) {
            const float xt = ((const float *)((const char *)x->data + t * x->nb[1]))[c];
            float acc = tc[K - 1] * xt;
            for (int64_t j = 0; j < K - 1; j++) acc += tc[j] * window[j];
            ((float *)((char *)dst->data + t * dst->nb[1]))[c] = acc;
            memmove(window, window + 1, (size_t)(K - 2) * sizeof(float));
            window[K - 2] = xt;
        }
        for (int64_t j = 0; j < K - 1; j++) s[j * C + c] = window[j];
    }
    return GGML_STATUS_OK;
}

// ---------------------------------------------------------------------------------------------------
// DELTA_NET: per value head h and column j of its state S (a row of the transposed state, over D_k), per token:
// s = exp(g) s; s += k beta (v[j] - s.k); out[j] = scale s.q. The columns are independent, so each thread owns
// a range of (head, column) rows and keeps its row in a local buffer across the tokens
// ---------------------------------------------------------------------------------------------------

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
    float sum = 0.0f;
    for (; i < n; i++) sum += a[i] * b[i];
    for (int l = 0; l < 8; l++) sum += acc[l];
    return sum;
}

int ggml_cpu_op_delta_net(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    struct ggml_tensor *state = dst->src[0];
    const struct ggml_tensor *q = dst->src[1], *k = dst->src[2], *v = dst->src[3], *g = dst->src[4],
                             *beta = dst->src[5];
    const int64_t dk = k->ne[0], hk = k->ne[1], dv = v->ne[0], H = v->ne[1], n = v->ne[2];
    const float scale = ggml_op_param_f32(dst, 0);
    const bool fresh = first_position(dst->src[6]) == 0;
    float row[512];
    if (dk > (int64_t)(sizeof row / sizeof *row))
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "delta_net: key heads of %lld values (at most 512)", (long long)dk);
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
            const float vt = ((const float *)((const char *)v->data + t * v->nb[2] + h * v->nb[1]))[j];
            const float decay = expf(((const float *)g->data)[t * H + h]);
            const float b = ((const float *)beta->data)[t * H + h];
            for (int64_t i = 0; i < dk; i++) row[i] *= decay;
            const float delta = b * (vt - dot(row, kt, dk));
            for (int64_t i = 0; i < dk; i++) row[i] += delta * kt[i];
            ((float *)((char *)dst->data + t * dst->nb[2] + h * dst->nb[1]))[j] = scale * dot(row, qt, dk);
        }
        memcpy(s, row, (size_t)dk * sizeof(float));
    }
    return GGML_STATUS_OK;
}
