// quants_q16.c: the 16-bit activations of precise matmuls (quants.h's block_q16, block_q16_K): their quantizer and
// the scalar dots of every weight type that has them, the oracles of the SIMD kernels (quants_q16_avx2.c).
// A dot sums 255 (w . hi) + w . lo exactly in integers, then scales it in float once per block.
#include "ggml-impl.h"
#include "quants.h"

#include <math.h>
#include <stdbool.h>

// q = round(x / d), d = amax / 32512, as the Q8 quantizers round (half away from zero; a NaN anywhere makes d NaN,
// values outside int range, infinities and NaNs give 0); hi, lo its two bytes; returns d, sums of q per 16 in sums
static float q16_quantize_block(const float *x, int n, int8_t *hi, int8_t *lo, int32_t *sums) {
    float amax = 0.0f;
    for (int j = 0; j < n; j++) amax = fabsf(x[j]) > amax || isnan(x[j]) ? fabsf(x[j]) : amax;
    const float d = amax / (float)Q16_MAX;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < n; j++) {
        const float v = roundf(x[j] * id);
        int q = v > -2147483648.0f && v < 2147483648.0f ? (int)v : 0;
        q = q < -Q16_MAX ? -Q16_MAX : q > Q16_MAX ? Q16_MAX : q;
        hi[j] = (int8_t)ggml_q16_hi(q);
        lo[j] = (int8_t)(q - 255 * hi[j]);
        if (j % 16 == 0) sums[j / 16] = 0;
        sums[j / 16] += q;
    }
    return d;
}

static void q16_quantize(const float *src, void *dst, int64_t n) {
    block_q16 *y = dst; // (n / 32,)
    for (int64_t i = 0; i < n / 32; i++) {
        int32_t sums[2];
        y[i].d = q16_quantize_block(src + 32 * i, 32, y[i].hi, y[i].lo, sums);
        y[i].sum = sums[0] + sums[1];
    }
}

static void q16_K_quantize(const float *src, void *dst, int64_t n) {
    block_q16_K *y = dst; // (n / 256,)
    for (int64_t i = 0; i < n / QK_K; i++) y[i].d = q16_quantize_block(src + QK_K * i, QK_K, y[i].hi, y[i].lo, y[i].bsums);
}

// 255 (w . hi) + w . lo over 32 values whose levels are w (exact: |w| <= 128, |q| <= 32512)
static inline int q16_dot32(const int *w, const int8_t *hi, const int8_t *lo) {
    int sh = 0, sl = 0;
    for (int j = 0; j < 32; j++) {
        sh += w[j] * hi[j];
        sl += w[j] * lo[j];
    }
    return 255 * sh + sl;
}

// the 32 levels of a 4-bit block (value j in the low nibble of byte j, j + 16 in the high one), less offset
static inline void q16_nibbles(const uint8_t *qs, int offset, int *w) {
    for (int j = 0; j < 16; j++) {
        w[j] = (qs[j] & 0x0F) - offset;
        w[j + 16] = (qs[j] >> 4) - offset;
    }
}

static void q4_0_vec_dot_q16_ref(int64_t n, float *s, const void *w, const void *x) {
    const block_q4_0 *a = w; // (n / 32,)
    const block_q16 *b = x;  // (n / 32,)
    float sum = 0.0f;
    for (int64_t i = 0; i < n / 32; i++) {
        int l[32];
        q16_nibbles(a[i].qs, 8, l);
        sum += (float)q16_dot32(l, b[i].hi, b[i].lo) * (ggml_fp16_to_fp32(a[i].d) * b[i].d);
    }
    *s = sum;
}

static void q4_1_vec_dot_q16_ref(int64_t n, float *s, const void *w, const void *x) {
    const block_q4_1 *a = w; // (n / 32,)
    const block_q16 *b = x;  // (n / 32,)
    float sum = 0.0f;
    for (int64_t i = 0; i < n / 32; i++) {
        int l[32];
        q16_nibbles(a[i].qs, 0, l);
        // sum_j (d l_j + m) x_j = d dx sum_j l_j q_j + m dx sum_j q_j
        sum += (float)q16_dot32(l, b[i].hi, b[i].lo) * (ggml_fp16_to_fp32(a[i].d) * b[i].d) +
               ggml_fp16_to_fp32(a[i].m) * (b[i].d * (float)b[i].sum);
    }
    *s = sum;
}

static void q5_0_vec_dot_q16_ref(int64_t n, float *s, const void *w, const void *x) {
    const block_q5_0 *a = w; // (n / 32,)
    const block_q16 *b = x;  // (n / 32,)
    float sum = 0.0f;
    for (int64_t i = 0; i < n / 32; i++) {
        const uint32_t qh = ggml_q5_0_qh(&a[i]);
        int l[32];
        q16_nibbles(a[i].qs, 0, l);
        for (int j = 0; j < 32; j++) l[j] += (int)((qh >> j) & 1) * 16 - 16;
        sum += (float)q16_dot32(l, b[i].hi, b[i].lo) * (ggml_fp16_to_fp32(a[i].d) * b[i].d);
    }
    *s = sum;
}

static void q8_0_vec_dot_q16_ref(int64_t n, float *s, const void *w, const void *x) {
    const block_q8_0 *a = w; // (n / 32,)
    const block_q16 *b = x;  // (n / 32,)
    float sum = 0.0f;
    for (int64_t i = 0; i < n / 32; i++) {
        int l[32];
        for (int j = 0; j < 32; j++) l[j] = a[i].qs[j];
        sum += (float)q16_dot32(l, b[i].hi, b[i].lo) * (ggml_fp16_to_fp32(a[i].d) * b[i].d);
    }
    *s = sum;
}

static void q4_K_vec_dot_q16_ref(int64_t n, float *s, const void *w, const void *x) {
    const block_q4_K *a = w;  // (n / 256,)
    const block_q16_K *b = x; // (n / 256,)
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int64_t sumi = 0, summ = 0; // sum over sub-blocks of sc * l.q, and of m * sum(q)
        for (int sb = 0; sb < 8; sb++) {
            uint8_t sc, m;
            ggml_q4_K_get_scale_min(a[i].scales, sb, &sc, &m);
            const uint8_t *qs = a[i].qs + 32 * (sb / 2); // (32,)
            int l[32];
            for (int j = 0; j < 32; j++) l[j] = (qs[j] >> (4 * (sb % 2))) & 0x0F;
            sumi += (int64_t)sc * q16_dot32(l, b[i].hi + 32 * sb, b[i].lo + 32 * sb);
            summ += (int64_t)m * (b[i].bsums[2 * sb] + b[i].bsums[2 * sb + 1]);
        }
        sum += b[i].d * ggml_fp16_to_fp32(a[i].d) * (float)sumi - b[i].d * ggml_fp16_to_fp32(a[i].dmin) * (float)summ;
    }
    *s = sum;
}

static void q6_K_vec_dot_q16_ref(int64_t n, float *s, const void *w, const void *x) {
    const block_q6_K *a = w;  // (n / 256,)
    const block_q16_K *b = x; // (n / 256,)
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int64_t sumi = 0;
        for (int sb = 0; sb < 16; sb++) {
            int64_t dot = 0;
            for (int j = 16 * sb; j < 16 * sb + 16; j++)
                dot += (int64_t)(ggml_q6_K_level(&a[i], j) - 32) * (255 * b[i].hi[j] + b[i].lo[j]);
            sumi += a[i].scales[sb] * dot;
        }
        sum += b[i].d * ggml_fp16_to_fp32(a[i].d) * (float)sumi;
    }
    *s = sum;
}

size_t ggml_q16_row_bytes(const struct ggml_type_traits *tw, int64_t n) {
    if (!tw->vec_dot_q16) return 0;
    return tw->blck_size == QK_K ? (size_t)(n / QK_K) * sizeof(block_q16_K) : (size_t)(n / 32) * sizeof(block_q16);
}

void ggml_quants_install_q16(struct ggml_type_traits *traits) {
    static const struct {
        enum ggml_type type;
        ggml_vec_dot_fn dot;
    } dots[] = {{GGML_TYPE_Q4_0, q4_0_vec_dot_q16_ref}, {GGML_TYPE_Q4_1, q4_1_vec_dot_q16_ref},
                {GGML_TYPE_Q5_0, q5_0_vec_dot_q16_ref}, {GGML_TYPE_Q8_0, q8_0_vec_dot_q16_ref},
                {GGML_TYPE_Q4_K, q4_K_vec_dot_q16_ref}, {GGML_TYPE_Q6_K, q6_K_vec_dot_q16_ref}};
    for (size_t i = 0; i < sizeof dots / sizeof dots[0]; i++) {
        struct ggml_type_traits *t = &traits[dots[i].type];
        t->vec_dot_q16 = t->vec_dot_q16_ref = dots[i].dot;
        t->quantize_q16 = t->blck_size == QK_K ? q16_K_quantize : q16_quantize;
    }
}
