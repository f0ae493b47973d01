// quants.c: the per-type traits table, the scalar reference kernels (the oracles of every SIMD and
// CUDA kernel) and the public type/quantization functions of ggml.h.
// The quantizers of Q4_0, Q4_1, Q5_0, Q8_0 and MXFP4 and every dequantizer round like gguf.quants (numpy
// float32, one rounding per operation): this file must not be compiled with fused multiply-add.
#include "ggml-impl.h"
#include "quants.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

#ifdef __FMA__
#error "quants.c holds the bit-exact reference kernels: compile it without -mfma / -march=native"
#endif

// numpy's float -> integer cast as gguf.quants relies on it (x86): non-finite or out of range gives 0
static inline int quant_cast_int(float v) {
    return (v > -2147483648.0f && v < 2147483648.0f) ? (int)v : 0;
}

static inline int quant_clamp(int v, int lo, int hi) {
    return v < lo ? lo : v > hi ? hi : v;
}

// smallest half >= f for finite f >= 0 (scales rounded up so that every value stays in range)
static uint16_t quant_fp16_ceil(float f) {
    uint16_t h = ggml_fp32_to_fp16(f);
    if (ggml_fp16_to_fp32(h) < f && h < 0x7C00) {
        h++;
    }
    return h;
}

// ============================================================================================
// F32, F16, BF16
// ============================================================================================

static void f32_to_float(const void *src, float *dst, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static void f32_from_float(const float *src, void *dst, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static void f16_to_float(const void *src, float *dst, int64_t n) {
    const uint16_t *x = src; // (n,)
    for (int64_t i = 0; i < n; i++) {
        dst[i] = ggml_fp16_to_fp32(x[i]);
    }
}

static void f16_from_float(const float *src, void *dst, int64_t n) {
    uint16_t *y = dst; // (n,)
    for (int64_t i = 0; i < n; i++) {
        y[i] = ggml_fp32_to_fp16(src[i]);
    }
}

static void bf16_to_float(const void *src, float *dst, int64_t n) {
    const uint16_t *x = src; // (n,)
    for (int64_t i = 0; i < n; i++) {
        dst[i] = ggml_bf16_to_fp32(x[i]);
    }
}

static void bf16_from_float(const float *src, void *dst, int64_t n) {
    uint16_t *y = dst; // (n,)
    for (int64_t i = 0; i < n; i++) {
        y[i] = ggml_fp32_to_bf16(src[i]);
    }
}

// the float dot products accumulate in double: this is the oracle the SIMD paths are held to
static void f32_vec_dot_ref(int64_t n, float *s, const void *w, const void *x) {
    const float *a = w, *b = x; // (n,), (n,)
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        sum += (double)a[i] * (double)b[i];
    }
    *s = (float)sum;
}

static void f16_vec_dot_ref(int64_t n, float *s, const void *w, const void *x) {
    const uint16_t *a = w, *b = x; // (n,), (n,)
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        sum += (double)ggml_fp16_to_fp32(a[i]) * (double)ggml_fp16_to_fp32(b[i]);
    }
    *s = (float)sum;
}

static void bf16_vec_dot_ref(int64_t n, float *s, const void *w, const void *x) {
    const uint16_t *a = w, *b = x; // (n,), (n,)
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        sum += (double)ggml_bf16_to_fp32(a[i]) * (double)ggml_bf16_to_fp32(b[i]);
    }
    *s = (float)sum;
}

static void f32_axpy_ref(int64_t n, float *y, float a, const void *row) {
    const float *x = row; // (n,)
    for (int64_t i = 0; i < n; i++) {
        y[i] += a * x[i];
    }
}

static void f16_axpy_ref(int64_t n, float *y, float a, const void *row) {
    const uint16_t *x = row; // (n,)
    for (int64_t i = 0; i < n; i++) {
        y[i] += a * ggml_fp16_to_fp32(x[i]);
    }
}

static void bf16_axpy_ref(int64_t n, float *y, float a, const void *row) {
    const uint16_t *x = row; // (n,)
    for (int64_t i = 0; i < n; i++) {
        y[i] += a * ggml_bf16_to_fp32(x[i]);
    }
}

// ============================================================================================
// Q4_0, Q4_1, Q5_0, Q8_0: quantizers bit-exact with gguf.quants
// ============================================================================================

// first value of largest magnitude, sign kept, or the first NaN (numpy's argmax of abs)
static float quant_signed_absmax(const float *x, int n) {
    float amax = fabsf(x[0]), max = x[0];
    for (int j = 0; j < n && !isnan(max); j++) {
        if (isnan(x[j]) || fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    return max;
}

static void q4_0_from_float(const float *src, void *dst, int64_t n) {
    block_q4_0 *y = dst; // (n / 32,)
    for (int64_t i = 0; i < n / QK4_0; i++) {
        const float *x = src + i * QK4_0; // (32,)
        const float d = quant_signed_absmax(x, QK4_0) / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = ggml_fp32_to_fp16(d);
        for (int j = 0; j < QK4_0 / 2; j++) {
            const int q0 = quant_clamp(quant_cast_int(truncf(x[j] * id + 8.5f)), 0, 15);
            const int q1 = quant_clamp(quant_cast_int(truncf(x[j + QK4_0 / 2] * id + 8.5f)), 0, 15);
            y[i].qs[j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

static void q4_0_to_float(const void *src, float *dst, int64_t n) {
    const block_q4_0 *x = src; // (n / 32,)
    for (int64_t i = 0; i < n / QK4_0; i++) {
        const float d = ggml_fp16_to_fp32(x[i].d);
        float *y = dst + i * QK4_0; // (32,)
        for (int j = 0; j < QK4_0 / 2; j++) {
            y[j] = d * (float)((x[i].qs[j] & 0x0F) - 8);
            y[j + QK4_0 / 2] = d * (float)((x[i].qs[j] >> 4) - 8);
        }
    }
}

static void q4_1_from_float(const float *src, void *dst, int64_t n) {
    block_q4_1 *y = dst; // (n / 32,)
    for (int64_t i = 0; i < n / QK4_1; i++) {
        const float *x = src + i * QK4_1; // (32,)
        float min = x[0], max = x[0]; // a NaN anywhere makes both NaN, as numpy's min/max
        for (int j = 1; j < QK4_1; j++) {
            min = x[j] < min || isnan(x[j]) ? x[j] : min;
            max = x[j] > max || isnan(x[j]) ? x[j] : max;
        }
        const float d = (max - min) / 15.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = ggml_fp32_to_fp16(d);
        y[i].m = ggml_fp32_to_fp16(min);
        for (int j = 0; j < QK4_1 / 2; j++) {
            const int q0 = quant_clamp(quant_cast_int(truncf((x[j] - min) * id + 0.5f)), 0, 15);
            const int q1 = quant_clamp(quant_cast_int(truncf((x[j + QK4_1 / 2] - min) * id + 0.5f)), 0, 15);
            y[i].qs[j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

static void q4_1_to_float(const void *src, float *dst, int64_t n) {
    const block_q4_1 *x = src; // (n / 32,)
    for (int64_t i = 0; i < n / QK4_1; i++) {
        const float d = ggml_fp16_to_fp32(x[i].d);
        const float m = ggml_fp16_to_fp32(x[i].m);
        float *y = dst + i * QK4_1; // (32,)
        for (int j = 0; j < QK4_1 / 2; j++) {
            y[j] = d * (float)(x[i].qs[j] & 0x0F) + m;
            y[j + QK4_1 / 2] = d * (float)(x[i].qs[j] >> 4) + m;
        }
    }
}

static void q5_0_from_float(const float *src, void *dst, int64_t n) {
    block_q5_0 *y = dst; // (n / 32,)
    for (int64_t i = 0; i < n / QK5_0; i++) {
        const float *x = src + i * QK5_0; // (32,)
        const float d = quant_signed_absmax(x, QK5_0) / -16.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = ggml_fp32_to_fp16(d);
        uint32_t qh = 0;
        for (int j = 0; j < QK5_0 / 2; j++) {
            const int q0 = quant_clamp(quant_cast_int(truncf(x[j] * id + 16.5f)), 0, 31);
            const int q1 = quant_clamp(quant_cast_int(truncf(x[j + QK5_0 / 2] * id + 16.5f)), 0, 31);
            y[i].qs[j] = (uint8_t)((q0 & 0x0F) | ((q1 & 0x0F) << 4));
            qh |= (uint32_t)(q0 >> 4) << j;
            qh |= (uint32_t)(q1 >> 4) << (j + QK5_0 / 2);
        }
        for (int b = 0; b < 4; b++) {
            y[i].qh[b] = (uint8_t)(qh >> (8 * b));
        }
    }
}

static void q5_0_to_float(const void *src, float *dst, int64_t n) {
    const block_q5_0 *x = src; // (n / 32,)
    for (int64_t i = 0; i < n / QK5_0; i++) {
        const float d = ggml_fp16_to_fp32(x[i].d);
        const uint32_t qh = ggml_q5_0_qh(&x[i]);
        float *y = dst + i * QK5_0; // (32,)
        for (int j = 0; j < QK5_0 / 2; j++) {
            const int q0 = (x[i].qs[j] & 0x0F) | (int)((qh >> j) & 1) << 4;
            const int q1 = (x[i].qs[j] >> 4) | (int)((qh >> (j + QK5_0 / 2)) & 1) << 4;
            y[j] = d * (float)(q0 - 16);
            y[j + QK5_0 / 2] = d * (float)(q1 - 16);
        }
    }
}

// d = amax / 127, q = round half away from zero (gguf's np_roundf); returns sum(q) for Q8_1
static int q8_quantize_block(const float *x, int8_t *qs, float *d_out) {
    float amax = 0.0f; // a NaN anywhere makes it NaN, as numpy's max
    for (int j = 0; j < QK8_0; j++) {
        amax = fabsf(x[j]) > amax || isnan(x[j]) ? fabsf(x[j]) : amax;
    }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK8_0; j++) {
        qs[j] = (int8_t)quant_clamp(quant_cast_int(roundf(x[j] * id)), -128, 127);
        sum += qs[j];
    }
    *d_out = d;
    return sum;
}

static void q8_0_from_float(const float *src, void *dst, int64_t n) {
    block_q8_0 *y = dst; // (n / 32,)
    for (int64_t i = 0; i < n / QK8_0; i++) {
        float d;
        q8_quantize_block(src + i * QK8_0, y[i].qs, &d);
        y[i].d = ggml_fp32_to_fp16(d);
    }
}

static void q8_0_to_float(const void *src, float *dst, int64_t n) {
    const block_q8_0 *x = src; // (n / 32,)
    for (int64_t i = 0; i < n / QK8_0; i++) {
        const float d = ggml_fp16_to_fp32(x[i].d);
        for (int j = 0; j < QK8_0; j++) {
            dst[i * QK8_0 + j] = (float)x[i].qs[j] * d;
        }
    }
}

// s is d (as stored, f16) times sum(qs), so that it equals the sum of the dequantized block
static void q8_1_from_float(const float *src, void *dst, int64_t n) {
    block_q8_1 *y = dst; // (n / 32,)
    for (int64_t i = 0; i < n / QK8_1; i++) {
        float d;
        const int sum = q8_quantize_block(src + i * QK8_1, y[i].qs, &d);
        y[i].d = ggml_fp32_to_fp16(d);
        y[i].s = ggml_fp32_to_fp16(ggml_fp16_to_fp32(y[i].d) * (float)sum);
    }
}

static void q8_1_to_float(const void *src, float *dst, int64_t n) {
    const block_q8_1 *x = src; // (n / 32,)
    for (int64_t i = 0; i < n / QK8_1; i++) {
        const float d = ggml_fp16_to_fp32(x[i].d);
        for (int j = 0; j < QK8_1; j++) {
            dst[i * QK8_1 + j] = (float)x[i].qs[j] * d;
        }
    }
}

static void q4_0_vec_dot_ref(int64_t n, float *s, const void *w, const void *x) {
    const block_q4_0 *a = w; // (n / 32,)
    const block_q8_0 *b = x; // (n / 32,)
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK4_0; i++) {
        int sumi = 0;
        for (int j = 0; j < QK4_0 / 2; j++) {
            sumi += ((a[i].qs[j] & 0x0F) - 8) * b[i].qs[j];
            sumi += ((a[i].qs[j] >> 4) - 8) * b[i].qs[j + QK4_0 / 2];
        }
        sum += (float)sumi * (ggml_fp16_to_fp32(a[i].d) * ggml_fp16_to_fp32(b[i].d));
    }
    *s = sum;
}

static void q4_1_vec_dot_ref(int64_t n, float *s, const void *w, const void *x) {
    const block_q4_1 *a = w; // (n / 32,)
    const block_q8_1 *b = x; // (n / 32,)
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK4_1; i++) {
        int sumi = 0;
        for (int j = 0; j < QK4_1 / 2; j++) {
            sumi += (a[i].qs[j] & 0x0F) * b[i].qs[j];
            sumi += (a[i].qs[j] >> 4) * b[i].qs[j + QK4_1 / 2];
        }
        // sum_j (d q_j + m) x_j = d dx sum_j q_j qx_j + m s
        sum += (float)sumi * (ggml_fp16_to_fp32(a[i].d) * ggml_fp16_to_fp32(b[i].d)) +
               ggml_fp16_to_fp32(a[i].m) * ggml_fp16_to_fp32(b[i].s);
    }
    *s = sum;
}

static void q5_0_vec_dot_ref(int64_t n, float *s, const void *w, const void *x) {
    const block_q5_0 *a = w; // (n / 32,)
    const block_q8_0 *b = x; // (n / 32,)
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK5_0; i++) {
        const uint32_t qh = ggml_q5_0_qh(&a[i]);
        int sumi = 0;
        for (int j = 0; j < QK5_0 / 2; j++) {
            const int q0 = (a[i].qs[j] & 0x0F) | (int)((qh >> j) & 1) << 4;
            const int q1 = (a[i].qs[j] >> 4) | (int)((qh >> (j + QK5_0 / 2)) & 1) << 4;
            sumi += (q0 - 16) * b[i].qs[j] + (q1 - 16) * b[i].qs[j + QK5_0 / 2];
        }
        sum += (float)sumi * (ggml_fp16_to_fp32(a[i].d) * ggml_fp16_to_fp32(b[i].d));
    }
    *s = sum;
}

static void q8_0_vec_dot_ref(int64_t n, float *s, const void *w, const void *x) {
    const block_q8_0 *a = w; // (n / 32,)
    const block_q8_0 *b = x; // (n / 32,)
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK8_0; i++) {
        int sumi = 0;
        for (int j = 0; j < QK8_0; j++) {
            sumi += a[i].qs[j] * b[i].qs[j];
        }
        sum += (float)sumi * (ggml_fp16_to_fp32(a[i].d) * ggml_fp16_to_fp32(b[i].d));
    }
    *s = sum;
}

// ============================================================================================
// MXFP4: 32 values share a power-of-two scale, each one of 16 levels (E2M1 values, doubled); Q8_0 activations
// ============================================================================================

const int8_t ggml_mxfp4_kvalues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// the index of the level nearest x at scale d, the first of equals as numpy's argmin (ties to the smaller
// magnitude, zero to +0, a NaN x to 0)
static int mxfp4_nearest(float x, float d) {
    int best = 0;
    float best_err = fabsf(d * (float)ggml_mxfp4_kvalues[0] - x);
    for (int i = 1; i < 16; i++) {
        const float err = fabsf(d * (float)ggml_mxfp4_kvalues[i] - x);
        if (err < best_err) {
            best = i;
            best_err = err;
        }
    }
    return best;
}

// e = floor(log2(amax)) - 2 + 127 (gguf.quants, llama.cpp): amax / d lies in [8, 16), so values past the top level
// 12 d saturate (the OCP MX rule). A zero, NaN or Inf amax gives e = 0 as numpy's casts do; an amax below 2^-125
// gives e = 0 too, the smallest scale (gguf.quants' uint8 cast wraps it around to a huge one)
static void mxfp4_from_float(const float *src, void *dst, int64_t n) {
    block_mxfp4 *y = dst; // (n / 32,)
    for (int64_t i = 0; i < n / QK_MXFP4; i++) {
        const float *x = src + i * QK_MXFP4; // (32,)
        float amax = 0.0f; // a NaN anywhere makes it NaN, as numpy's max
        for (int j = 0; j < QK_MXFP4; j++) {
            amax = fabsf(x[j]) > amax || isnan(x[j]) ? fabsf(x[j]) : amax;
        }
        const int e = amax > 0.0f && isfinite(amax) ? quant_clamp((int)floorf(log2f(amax)) + 125, 0, 255) : 0;
        const float d = ggml_e8m0_to_fp32_half((uint8_t)e);
        y[i].e = (uint8_t)e;
        for (int j = 0; j < QK_MXFP4 / 2; j++) {
            y[i].qs[j] = (uint8_t)(mxfp4_nearest(x[j], d) | mxfp4_nearest(x[j + QK_MXFP4 / 2], d) << 4);
        }
    }
}

static void mxfp4_to_float(const void *src, float *dst, int64_t n) {
    const block_mxfp4 *x = src; // (n / 32,)
    for (int64_t i = 0; i < n / QK_MXFP4; i++) {
        const float d = ggml_e8m0_to_fp32_half(x[i].e);
        float *y = dst + i * QK_MXFP4; // (32,)
        for (int j = 0; j < QK_MXFP4 / 2; j++) {
            y[j] = d * (float)ggml_mxfp4_kvalues[x[i].qs[j] & 0x0F];
            y[j + QK_MXFP4 / 2] = d * (float)ggml_mxfp4_kvalues[x[i].qs[j] >> 4];
        }
    }
}

static void mxfp4_vec_dot_ref(int64_t n, float *s, const void *w, const void *x) {
    const block_mxfp4 *a = w; // (n / 32,)
    const block_q8_0 *b = x;  // (n / 32,)
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK_MXFP4; i++) {
        int sumi = 0;
        for (int j = 0; j < QK_MXFP4 / 2; j++) {
            sumi += ggml_mxfp4_kvalues[a[i].qs[j] & 0x0F] * b[i].qs[j];
            sumi += ggml_mxfp4_kvalues[a[i].qs[j] >> 4] * b[i].qs[j + QK_MXFP4 / 2];
        }
        // the power-of-two scale last: exact unless the product leaves float's normal range
        sum += ggml_e8m0_to_fp32_half(a[i].e) * (ggml_fp16_to_fp32(b[i].d) * (float)sumi);
    }
    *s = sum;
}

// ============================================================================================
// Q4_K, Q6_K, Q8_K (super-blocks of 256)
// ============================================================================================

// Q4_K quantizer (simpler than llama.cpp's search, sound): per sub-block of 32, offset m = -min(0, min x)
// and step = (max + m) / 15, both six-bit multiples of f16 super-scales rounded up so nothing clips;
// values rounded to the nearest level. Error per value <= step / 2 (tests state the RMS bound).
static void q4_K_from_float(const float *src, void *dst, int64_t n) {
    block_q4_K *y = dst; // (n / 256,)
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float *x = src + i * QK_K; // (256,)
        float offs[8], hi[8];            // per sub-block: -min(0, min), max
        float max_offs = 0.0f;
        for (int s = 0; s < 8; s++) {
            float lo = 0.0f, top = x[32 * s];
            for (int l = 0; l < 32; l++) {
                lo = x[32 * s + l] < lo ? x[32 * s + l] : lo;
                top = x[32 * s + l] > top ? x[32 * s + l] : top;
            }
            offs[s] = -lo;
            hi[s] = top;
            max_offs = offs[s] > max_offs ? offs[s] : max_offs;
        }
        y[i].dmin = quant_fp16_ceil(max_offs / 63.0f);
        const float dmin = ggml_fp16_to_fp32(y[i].dmin);
        uint8_t sc[8], mq[8];
        float step_min[8], max_step = 0.0f; // smallest step covering [-m, max] per sub-block
        for (int s = 0; s < 8; s++) {
            mq[s] = dmin > 0.0f ? (uint8_t)quant_clamp((int)ceilf(offs[s] / dmin), 0, 63) : 0;
            step_min[s] = (hi[s] + dmin * (float)mq[s]) / 15.0f;
            step_min[s] = step_min[s] > 0.0f ? step_min[s] : 0.0f;
            max_step = step_min[s] > max_step ? step_min[s] : max_step;
        }
        y[i].d = quant_fp16_ceil(max_step / 63.0f);
        const float d = ggml_fp16_to_fp32(y[i].d);
        for (int s = 0; s < 8; s++) {
            sc[s] = d > 0.0f ? (uint8_t)quant_clamp((int)ceilf(step_min[s] / d), 0, 63) : 0;
        }
        for (int s = 0; s < 4; s++) {
            y[i].scales[s] = (uint8_t)((sc[s] & 63) | ((sc[s + 4] >> 4) << 6));
            y[i].scales[s + 4] = (uint8_t)((mq[s] & 63) | ((mq[s + 4] >> 4) << 6));
            y[i].scales[s + 8] = (uint8_t)((sc[s + 4] & 0x0F) | ((mq[s + 4] & 0x0F) << 4));
        }
        uint8_t q[QK_K]; // (256,) levels in [0, 15]
        for (int s = 0; s < 8; s++) {
            const float step = d * (float)sc[s];
            const float m = dmin * (float)mq[s];
            for (int l = 0; l < 32; l++) {
                const int v = step > 0.0f ? quant_cast_int(roundf((x[32 * s + l] + m) / step)) : 0;
                q[32 * s + l] = (uint8_t)quant_clamp(v, 0, 15);
            }
        }
        for (int c = 0; c < 4; c++) {
            for (int l = 0; l < 32; l++) {
                y[i].qs[32 * c + l] = (uint8_t)(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
            }
        }
    }
}

static void q4_K_to_float(const void *src, float *dst, int64_t n) {
    const block_q4_K *x = src; // (n / 256,)
    for (int64_t i = 0; i < n / QK_K; i++) {
        float *y = dst + i * QK_K; // (256,)
        for (int s = 0; s < 8; s++) {
            float dl, ml;
            ggml_q4_K_sub_block(&x[i], s, &dl, &ml);
            const uint8_t *qs = x[i].qs + 32 * (s / 2); // (32,) nibbles shared by sub-blocks 2c, 2c + 1
            const int shift = 4 * (s % 2);
            for (int l = 0; l < 32; l++) {
                y[32 * s + l] = dl * (float)((qs[l] >> shift) & 0x0F) - ml;
            }
        }
    }
}

// Q6_K level (0..63) of value k (0..255) of a block
// Q6_K quantizer (simpler than llama.cpp's search, sound): per sub-block of 16 a signed scale that maps
// the largest-magnitude value to -32, stored as an int8 multiple of an f16 super-scale rounded away
// from zero so nothing clips except a tie of opposite sign (one step); values rounded to nearest.
static void q6_K_from_float(const float *src, void *dst, int64_t n) {
    block_q6_K *y = dst; // (n / 256,)
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float *x = src + i * QK_K; // (256,)
        float t[16], max_t = 0.0f;       // wanted signed step per sub-block
        for (int s = 0; s < 16; s++) {
            t[s] = quant_signed_absmax(x + 16 * s, 16) / -32.0f;
            max_t = fabsf(t[s]) > max_t ? fabsf(t[s]) : max_t;
        }
        y[i].d = quant_fp16_ceil(max_t / 127.0f);
        const float d = ggml_fp16_to_fp32(y[i].d);
        uint8_t q[QK_K]; // (256,) levels in [0, 63]
        for (int s = 0; s < 16; s++) {
            const int mag = d > 0.0f ? quant_clamp((int)ceilf(fabsf(t[s]) / d), 0, 127) : 0;
            y[i].scales[s] = (int8_t)(t[s] < 0.0f ? -mag : mag);
            const float step = d * (float)y[i].scales[s];
            for (int l = 0; l < 16; l++) {
                const int v = step != 0.0f ? quant_cast_int(roundf(x[16 * s + l] / step)) : 0;
                q[16 * s + l] = (uint8_t)(quant_clamp(v, -32, 31) + 32);
            }
        }
        memset(y[i].ql, 0, sizeof y[i].ql);
        memset(y[i].qh, 0, sizeof y[i].qh);
        for (int k = 0; k < QK_K; k++) {
            const int h = k / 128, g = (k % 128) / 32, l = k % 32;
            y[i].ql[64 * h + 32 * (g % 2) + l] |= (uint8_t)((q[k] & 0x0F) << (4 * (g / 2)));
            y[i].qh[32 * h + l] |= (uint8_t)((q[k] >> 4) << (2 * g));
        }
    }
}

static void q6_K_to_float(const void *src, float *dst, int64_t n) {
    const block_q6_K *x = src; // (n / 256,)
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = ggml_fp16_to_fp32(x[i].d);
        for (int k = 0; k < QK_K; k++) {
            const float dl = d * (float)x[i].scales[k / 16];
            dst[i * QK_K + k] = dl * (float)(ggml_q6_K_level(&x[i], k) - 32);
        }
    }
}

static void q8_K_from_float(const float *src, void *dst, int64_t n) {
    block_q8_K *y = dst; // (n / 256,)
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float *x = src + i * QK_K; // (256,)
        float amax = 0.0f;
        for (int k = 0; k < QK_K; k++) {
            amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
        }
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = d;
        for (int s = 0; s < QK_K / 16; s++) {
            int sum = 0;
            for (int l = 0; l < 16; l++) {
                const int q = quant_clamp(quant_cast_int(roundf(x[16 * s + l] * id)), -127, 127);
                y[i].qs[16 * s + l] = (int8_t)q;
                sum += q;
            }
            y[i].bsums[s] = (int16_t)sum;
        }
    }
}

static void q8_K_to_float(const void *src, float *dst, int64_t n) {
    const block_q8_K *x = src; // (n / 256,)
    for (int64_t i = 0; i < n / QK_K; i++) {
        for (int k = 0; k < QK_K; k++) {
            dst[i * QK_K + k] = (float)x[i].qs[k] * x[i].d;
        }
    }
}

static void q4_K_vec_dot_ref(int64_t n, float *s, const void *w, const void *x) {
    const block_q4_K *a = w; // (n / 256,)
    const block_q8_K *b = x; // (n / 256,)
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int sumi = 0, summ = 0; // sum over sub-blocks of sc * q.qx, and of m * sum(qx)
        for (int sb = 0; sb < 8; sb++) {
            uint8_t sc, m;
            ggml_q4_K_get_scale_min(a[i].scales, sb, &sc, &m);
            const uint8_t *qs = a[i].qs + 32 * (sb / 2); // (32,)
            const int shift = 4 * (sb % 2);
            int dot = 0;
            for (int l = 0; l < 32; l++) {
                dot += ((qs[l] >> shift) & 0x0F) * b[i].qs[32 * sb + l];
            }
            sumi += sc * dot;
            summ += m * (b[i].bsums[2 * sb] + b[i].bsums[2 * sb + 1]);
        }
        sum += b[i].d * ggml_fp16_to_fp32(a[i].d) * (float)sumi -
               b[i].d * ggml_fp16_to_fp32(a[i].dmin) * (float)summ;
    }
    *s = sum;
}

static void q6_K_vec_dot_ref(int64_t n, float *s, const void *w, const void *x) {
    const block_q6_K *a = w; // (n / 256,)
    const block_q8_K *b = x; // (n / 256,)
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int sumi = 0;
        for (int sb = 0; sb < 16; sb++) {
            int dot = 0;
            for (int l = 0; l < 16; l++) {
                dot += (ggml_q6_K_level(&a[i], 16 * sb + l) - 32) * b[i].qs[16 * sb + l];
            }
            sumi += a[i].scales[sb] * dot;
        }
        sum += b[i].d * ggml_fp16_to_fp32(a[i].d) * (float)sumi;
    }
    *s = sum;
}

// ============================================================================================
// axpy for block types: y += a * dequant(row), one block at a time
// ============================================================================================

static inline void quant_axpy_blocks(ggml_to_float_fn to_float, int64_t blck, size_t type_size, int64_t n,
                                     float *y, float a, const void *row) {
    float tmp[QK_K]; // (blck,) one dequantized block
    const uint8_t *p = row;
    for (int64_t i = 0; i < n / blck; i++) {
        to_float(p + (size_t)i * type_size, tmp, blck);
        for (int64_t j = 0; j < blck; j++) {
            y[i * blck + j] += a * tmp[j];
        }
    }
}

#define QUANT_AXPY_REF(name, blck, block_t)                                       \
    static void name##_axpy_ref(int64_t n, float *y, float a, const void *row) {  \
        quant_axpy_blocks(name##_to_float, blck, sizeof(block_t), n, y, a, row);  \
    }
QUANT_AXPY_REF(q4_0, QK4_0, block_q4_0)
QUANT_AXPY_REF(q4_1, QK4_1, block_q4_1)
QUANT_AXPY_REF(q5_0, QK5_0, block_q5_0)
QUANT_AXPY_REF(q8_0, QK8_0, block_q8_0)
QUANT_AXPY_REF(mxfp4, QK_MXFP4, block_mxfp4)
QUANT_AXPY_REF(q4_K, QK_K, block_q4_K)
QUANT_AXPY_REF(q6_K, QK_K, block_q6_K)

// ============================================================================================
// traits table
// ============================================================================================

#define TRAITS_FULL(type_, name_, blck_, size_, quant_, fn_, dot_type_)                     \
    [type_] = {.name = name_, .blck_size = blck_, .type_size = size_, .is_quantized = quant_, \
               .to_float = fn_##_to_float, .from_float = fn_##_from_float,                   \
               .quantize_act = fn_##_from_float,                                             \
               .vec_dot = fn_##_vec_dot_ref, .vec_dot_ref = fn_##_vec_dot_ref,               \
               .axpy = fn_##_axpy_ref, .axpy_ref = fn_##_axpy_ref, .vec_dot_type = dot_type_}

// ggml_quants_init adds the 16-bit activations' kernels (quants_q16.c), copies it and lets the SIMD installers
// overwrite the kernels in the copy
static struct ggml_type_traits traits_scalar[GGML_TYPE_COUNT] = {
    TRAITS_FULL(GGML_TYPE_F32, "f32", 1, sizeof(float), false, f32, GGML_TYPE_F32),
    TRAITS_FULL(GGML_TYPE_F16, "f16", 1, sizeof(uint16_t), false, f16, GGML_TYPE_F16),
    TRAITS_FULL(GGML_TYPE_BF16, "bf16", 1, sizeof(uint16_t), false, bf16, GGML_TYPE_BF16),
    TRAITS_FULL(GGML_TYPE_Q4_0, "q4_0", QK4_0, sizeof(block_q4_0), true, q4_0, GGML_TYPE_Q8_0),
    TRAITS_FULL(GGML_TYPE_Q4_1, "q4_1", QK4_1, sizeof(block_q4_1), true, q4_1, GGML_TYPE_Q8_1),
    TRAITS_FULL(GGML_TYPE_Q5_0, "q5_0", QK5_0, sizeof(block_q5_0), true, q5_0, GGML_TYPE_Q8_0),
    TRAITS_FULL(GGML_TYPE_Q8_0, "q8_0", QK8_0, sizeof(block_q8_0), true, q8_0, GGML_TYPE_Q8_0),
    TRAITS_FULL(GGML_TYPE_Q4_K, "q4_K", QK_K, sizeof(block_q4_K), true, q4_K, GGML_TYPE_Q8_K),
    TRAITS_FULL(GGML_TYPE_Q6_K, "q6_K", QK_K, sizeof(block_q6_K), true, q6_K, GGML_TYPE_Q8_K),
    TRAITS_FULL(GGML_TYPE_MXFP4, "mxfp4", QK_MXFP4, sizeof(block_mxfp4), true, mxfp4, GGML_TYPE_Q8_0),
    // activation types: converted to, never dotted as weights
    [GGML_TYPE_Q8_1] = {.name = "q8_1", .blck_size = QK8_1, .type_size = sizeof(block_q8_1), .is_quantized = true,
                        .to_float = q8_1_to_float, .from_float = q8_1_from_float,
                        .quantize_act = q8_1_from_float, .vec_dot_type = GGML_TYPE_Q8_1},
    [GGML_TYPE_Q8_K] = {.name = "q8_K", .blck_size = QK_K, .type_size = sizeof(block_q8_K), .is_quantized = true,
                        .to_float = q8_K_to_float, .from_float = q8_K_from_float,
                        .quantize_act = q8_K_from_float, .vec_dot_type = GGML_TYPE_Q8_K},
    // index types: storage only
    [GGML_TYPE_I8] = {.name = "i8", .blck_size = 1, .type_size = sizeof(int8_t), .vec_dot_type = GGML_TYPE_I8},
    [GGML_TYPE_I32] = {.name = "i32", .blck_size = 1, .type_size = sizeof(int32_t), .vec_dot_type = GGML_TYPE_I32},
};

static struct ggml_type_traits traits_simd[GGML_TYPE_COUNT]; // scalar table with the SIMD kernels
static struct ggml_type_traits traits_avx2[GGML_TYPE_COUNT]; // the same without the AVX512 ones
static struct ggml_type_traits traits_live[GGML_TYPE_COUNT]; // what ggml_get_type_traits hands out
static bool quants_simd_available;
static pthread_once_t quants_once = PTHREAD_ONCE_INIT;

static bool quants_cpu_has_avx2_set(void) {
#if defined(__x86_64__) || defined(__i386__)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return false;
#endif
}

static bool quants_simd_on;
static bool quants_avx512_on = true;

bool ggml_quants_simd_in_use(void) {
    return quants_simd_on;
}

bool ggml_quants_avx512_allowed(void) {
    return quants_simd_on && quants_avx512_on;
}

static void quants_use_simd(bool enabled) {
    quants_simd_on = enabled && quants_simd_available;
    const struct ggml_type_traits *src = !quants_simd_on ? traits_scalar : quants_avx512_on ? traits_simd : traits_avx2;
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        traits_live[t].vec_dot = src[t].vec_dot;
        traits_live[t].vec_dot4 = src[t].vec_dot4;
        traits_live[t].axpy = src[t].axpy;
        traits_live[t].axpy4 = src[t].axpy4;
        traits_live[t].axpy8_rounded = src[t].axpy8_rounded;
        traits_live[t].to_float = src[t].to_float;     // SIMD conversions are bit-identical (F16C)
        traits_live[t].from_float = src[t].from_float;
        traits_live[t].quantize_act = src[t].quantize_act;
        traits_live[t].gemm_tile = src[t].gemm_tile;
        traits_live[t].quantize_q16 = src[t].quantize_q16;
        traits_live[t].vec_dot_q16 = src[t].vec_dot_q16;
        traits_live[t].gemm_tile_q16 = src[t].gemm_tile_q16;
        traits_live[t].gemm_tile_rewritten = src[t].gemm_tile_rewritten;
        traits_live[t].rewrite_rows = src[t].rewrite_rows;
        traits_live[t].rewritten_block_size = src[t].rewritten_block_size;
    }
}

static void quants_init_once(void) {
    ggml_quants_install_q16(traits_scalar);
    memcpy(traits_live, traits_scalar, sizeof traits_live);
    memcpy(traits_simd, traits_scalar, sizeof traits_simd);
    memcpy(traits_avx2, traits_scalar, sizeof traits_avx2);
    quants_simd_available = quants_cpu_has_avx2_set();
    if (quants_simd_available) {
        ggml_quants_install_avx2(traits_simd, true);
        ggml_quants_install_q16_avx2(traits_simd);
        ggml_quants_install_avx2(traits_avx2, false);
        ggml_quants_install_q16_avx2(traits_avx2);
    }
    quants_use_simd(true);
}

void ggml_quants_init(void) {
    pthread_once(&quants_once, quants_init_once);
}

const struct ggml_type_traits *ggml_get_type_traits(enum ggml_type type) {
    ggml_quants_init();
    if ((int)type < 0 || type >= GGML_TYPE_COUNT || traits_live[type].name == NULL) {
        return NULL;
    }
    return &traits_live[type];
}

// ============================================================================================
// public API (ggml.h)
// ============================================================================================

// traits of a valid type, or NULL with the error set
static const struct ggml_type_traits *quants_traits_checked(enum ggml_type type) {
    const struct ggml_type_traits *tt = ggml_get_type_traits(type);
    if (tt == NULL) {
        ggml_set_error(GGML_STATUS_INVALID_ARG, "invalid ggml type %d", (int)type);
    }
    return tt;
}

const char *ggml_type_name(enum ggml_type type) {
    const struct ggml_type_traits *tt = quants_traits_checked(type);
    return tt ? tt->name : NULL;
}

int64_t ggml_blck_size(enum ggml_type type) {
    const struct ggml_type_traits *tt = quants_traits_checked(type);
    return tt ? tt->blck_size : 0;
}

size_t ggml_type_size(enum ggml_type type) {
    const struct ggml_type_traits *tt = quants_traits_checked(type);
    return tt ? tt->type_size : 0;
}

size_t ggml_row_size(enum ggml_type type, int64_t ne) {
    const struct ggml_type_traits *tt = quants_traits_checked(type);
    if (tt == NULL) {
        return 0;
    }
    if (ne < 0 || ne % tt->blck_size != 0) {
        ggml_set_error(GGML_STATUS_INVALID_ARG, "%s row of %lld values: not a multiple of the block size %lld",
                       tt->name, (long long)ne, (long long)tt->blck_size);
        return 0;
    }
    return tt->type_size * (size_t)(ne / tt->blck_size);
}

bool ggml_type_is_valid(enum ggml_type type) {
    return ggml_get_type_traits(type) != NULL;
}

enum ggml_type ggml_vec_dot_type(enum ggml_type type) {
    const struct ggml_type_traits *tt = quants_traits_checked(type);
    return tt ? tt->vec_dot_type : GGML_TYPE_COUNT;
}

enum quants_kernel { QUANTS_FROM_FLOAT, QUANTS_TO_FLOAT, QUANTS_VEC_DOT, QUANTS_AXPY };

// checks shared by the row functions: valid type, kernel present, n a non-negative block multiple, data
static int quants_row_check(enum ggml_type type, int64_t n, const void *a, const void *b, enum quants_kernel kernel,
                            const struct ggml_type_traits **out) {
    static const char *const names[] = {"quantize", "dequantize", "vec_dot", "axpy"};
    const char *what = names[kernel];
    const struct ggml_type_traits *tt = quants_traits_checked(type);
    if (tt == NULL) {
        return GGML_STATUS_INVALID_ARG;
    }
    const bool has_kernel = kernel == QUANTS_FROM_FLOAT ? tt->from_float != NULL
                            : kernel == QUANTS_TO_FLOAT ? tt->to_float != NULL
                            : kernel == QUANTS_VEC_DOT  ? tt->vec_dot_ref != NULL
                                                        : tt->axpy_ref != NULL;
    if (!has_kernel) {
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "%s: not available for type %s", what, tt->name);
    }
    if (n < 0 || n % tt->blck_size != 0) {
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "%s: n = %lld is not a multiple of the %s block size %lld",
                              what, (long long)n, tt->name, (long long)tt->blck_size);
    }
    if (a == NULL || b == NULL) {
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "%s: null data", what);
    }
    *out = tt;
    return GGML_STATUS_OK;
}

int ggml_quantize(enum ggml_type type, const float *src, void *dst, int64_t n) {
    const struct ggml_type_traits *tt = NULL;
    const int status = quants_row_check(type, n, src, dst, QUANTS_FROM_FLOAT, &tt);
    if (status == GGML_STATUS_OK) {
        tt->from_float(src, dst, n);
    }
    return status;
}

int ggml_quantize_act(enum ggml_type type, const float *src, void *dst, int64_t n) {
    const struct ggml_type_traits *tt = NULL;
    const int status = quants_row_check(type, n, src, dst, QUANTS_FROM_FLOAT, &tt);
    if (status == GGML_STATUS_OK) {
        tt->quantize_act(src, dst, n);
    }
    return status;
}

int ggml_dequantize(enum ggml_type type, const void *src, float *dst, int64_t n) {
    const struct ggml_type_traits *tt = NULL;
    const int status = quants_row_check(type, n, src, dst, QUANTS_TO_FLOAT, &tt);
    if (status == GGML_STATUS_OK) {
        tt->to_float(src, dst, n);
    }
    return status;
}

static int quants_vec_dot(enum ggml_type type, int64_t n, float *result, const void *w, const void *x, bool ref) {
    const struct ggml_type_traits *tt = NULL;
    const int status = quants_row_check(type, n, w, x, QUANTS_VEC_DOT, &tt);
    if (status != GGML_STATUS_OK) {
        return status;
    }
    if (result == NULL) {
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "vec_dot: null result");
    }
    (ref ? tt->vec_dot_ref : tt->vec_dot)(n, result, w, x);
    return GGML_STATUS_OK;
}

int ggml_vec_dot(enum ggml_type type, int64_t n, float *result, const void *w, const void *x) {
    return quants_vec_dot(type, n, result, w, x, false);
}

int ggml_vec_dot_ref(enum ggml_type type, int64_t n, float *result, const void *w, const void *x) {
    return quants_vec_dot(type, n, result, w, x, true);
}

size_t ggml_q16_row_size(enum ggml_type type, int64_t n) {
    const struct ggml_type_traits *tt = quants_traits_checked(type);
    return tt && n >= 0 && n % tt->blck_size == 0 ? ggml_q16_row_bytes(tt, n) : 0;
}

// checks of the 16-bit activations' functions: the type has them, n whole blocks, data
static int quants_q16_check(enum ggml_type type, int64_t n, const void *a, const void *b, const char *what,
                            const struct ggml_type_traits **out) {
    const struct ggml_type_traits *tt = quants_traits_checked(type);
    if (tt == NULL) return GGML_STATUS_INVALID_ARG;
    if (!tt->vec_dot_q16) return ggml_set_error(GGML_STATUS_UNSUPPORTED, "%s: no 16-bit activations for %s", what, tt->name);
    if (n < 0 || n % tt->blck_size)
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "%s: n = %lld is not a multiple of the %s block size %lld",
                              what, (long long)n, tt->name, (long long)tt->blck_size);
    if (a == NULL || b == NULL) return ggml_set_error(GGML_STATUS_INVALID_ARG, "%s: null data", what);
    *out = tt;
    return GGML_STATUS_OK;
}

int ggml_quantize_q16(enum ggml_type type, const float *src, void *dst, int64_t n) {
    const struct ggml_type_traits *tt = NULL;
    const int status = quants_q16_check(type, n, src, dst, "quantize_q16", &tt);
    if (status == GGML_STATUS_OK) tt->quantize_q16(src, dst, n);
    return status;
}

static int quants_vec_dot_q16(enum ggml_type type, int64_t n, float *result, const void *w, const void *x, bool ref) {
    const struct ggml_type_traits *tt = NULL;
    const int status = quants_q16_check(type, n, w, x, "vec_dot_q16", &tt);
    if (status != GGML_STATUS_OK) return status;
    if (result == NULL) return ggml_set_error(GGML_STATUS_INVALID_ARG, "vec_dot_q16: null result");
    (ref ? tt->vec_dot_q16_ref : tt->vec_dot_q16)(n, result, w, x);
    return GGML_STATUS_OK;
}

int ggml_vec_dot_q16(enum ggml_type type, int64_t n, float *result, const void *w, const void *x) {
    return quants_vec_dot_q16(type, n, result, w, x, false);
}

int ggml_vec_dot_q16_ref(enum ggml_type type, int64_t n, float *result, const void *w, const void *x) {
    return quants_vec_dot_q16(type, n, result, w, x, true);
}

static int quants_axpy(enum ggml_type type, int64_t n, float *y, float a, const void *row, bool ref) {
    const struct ggml_type_traits *tt = NULL;
    const int status = quants_row_check(type, n, row, y, QUANTS_AXPY, &tt);
    if (status == GGML_STATUS_OK) {
        (ref ? tt->axpy_ref : tt->axpy)(n, y, a, row);
    }
    return status;
}

int ggml_axpy(enum ggml_type type, int64_t n, float *y, float a, const void *row) {
    return quants_axpy(type, n, y, a, row, false);
}

int ggml_axpy_ref(enum ggml_type type, int64_t n, float *y, float a, const void *row) {
    return quants_axpy(type, n, y, a, row, true);
}

// y[0..n) += sum of a[r] * rows[r] over n_rows rows: the group kernel (axpy4, or axpy8_rounded where rounded) where
// the type has one, else one axpy a row
static int quants_axpy_group(const char *what, enum ggml_type type, int64_t n, float *y, const float *a,
                             const void *const *rows, int n_rows, bool rounded) {
    const struct ggml_type_traits *tt = NULL;
    const int status = quants_row_check(type, n, rows, y, QUANTS_AXPY, &tt);
    if (status != GGML_STATUS_OK) {
        return status;
    }
    bool null = a == NULL;
    for (int r = 0; r < n_rows; r++) {
        null = null || rows[r] == NULL;
    }
    if (null) {
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "%s: null data", what);
    }
    const ggml_axpy_group_fn group = rounded ? tt->axpy8_rounded : tt->axpy4;
    if (group) {
        group(n, y, a, rows);
    } else {
        for (int r = 0; r < n_rows; r++) {
            tt->axpy(n, y, a[r], rows[r]);
        }
    }
    return GGML_STATUS_OK;
}

int ggml_axpy4(enum ggml_type type, int64_t n, float *y, const float *a, const void *const *rows) {
    return quants_axpy_group("axpy4", type, n, y, a, rows, 4, false);
}

int ggml_axpy8_rounded(enum ggml_type type, int64_t n, float *y, const float *a, const void *const *rows) {
    return quants_axpy_group("axpy8_rounded", type, n, y, a, rows, 8, true);
}

// true when the AVX2 kernels can run: AVX2, FMA and F16C together
bool ggml_cpu_has_avx2(void) {
    return quants_cpu_has_avx2_set();
}

bool ggml_cpu_has_avx512(void) {
#if defined(__x86_64__) || defined(__i386__)
    return __builtin_cpu_supports("avx512f");
#else
    return false;
#endif
}

void ggml_cpu_set_simd(bool enabled) {
    ggml_quants_init();
    quants_use_simd(enabled);
}

void ggml_cpu_set_avx512(bool enabled) {
    ggml_quants_init();
    quants_avx512_on = enabled;
    quants_use_simd(quants_simd_on);
}
