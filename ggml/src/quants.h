// quants.h: quantized block layouts (llama.cpp's, byte for byte) and F16/BF16 <-> F32 conversion.
// Plain C structs and integer-only helpers, shared by the C kernels and the CUDA kernels (nvcc).
#pragma once
#include <stdint.h>

#ifdef __CUDACC__
#define GGML_QFN static inline __host__ __device__
#else
#define GGML_QFN static inline
#endif

#ifdef __cplusplus
#define GGML_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define GGML_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif

#define QK4_0 32
#define QK4_1 32
#define QK5_0 32
#define QK8_0 32
#define QK8_1 32
#define QK_MXFP4 32
#define QK_K 256
#define K_SCALE_SIZE 12 // Q4_K: 8 six-bit scales + 8 six-bit mins packed into 12 bytes

// x = d * (q - 8), q in [0, 15]; qs[j] holds value j (low nibble) and value j + 16 (high nibble)
typedef struct {
    uint16_t d;            // f16 scale
    uint8_t qs[QK4_0 / 2]; // (16,) nibbles
} block_q4_0;
GGML_STATIC_ASSERT(sizeof(block_q4_0) == 18, "block_q4_0 must be 18 bytes");

// x = d * q + m, q in [0, 15]; nibble order as Q4_0
typedef struct {
    uint16_t d;            // f16 scale
    uint16_t m;            // f16 minimum
    uint8_t qs[QK4_1 / 2]; // (16,) nibbles
} block_q4_1;
GGML_STATIC_ASSERT(sizeof(block_q4_1) == 20, "block_q4_1 must be 20 bytes");

// x = d * (q - 16), q in [0, 31]: low 4 bits as Q4_0, bit 4 of value j is bit j of qh (little endian)
typedef struct {
    uint16_t d;            // f16 scale
    uint8_t qh[4];         // (32,) fifth bits
    uint8_t qs[QK5_0 / 2]; // (16,) nibbles
} block_q5_0;
GGML_STATIC_ASSERT(sizeof(block_q5_0) == 22, "block_q5_0 must be 22 bytes");

// x = d * q, q in [-127, 127]
typedef struct {
    uint16_t d;        // f16 scale
    int8_t qs[QK8_0];  // (32,)
} block_q8_0;
GGML_STATIC_ASSERT(sizeof(block_q8_0) == 34, "block_q8_0 must be 34 bytes");

// x = d * kvalues[q], q in [0, 15], d = 2^(e - 128): E2M1 values doubled (ggml_mxfp4_kvalues) under half the
// E8M0 scale 2^(e - 127); nibble order as Q4_0
typedef struct {
    uint8_t e;                // E8M0 exponent
    uint8_t qs[QK_MXFP4 / 2]; // (16,) nibbles
} block_mxfp4;
GGML_STATIC_ASSERT(sizeof(block_mxfp4) == 17, "block_mxfp4 must be 17 bytes");
// (16,) MXFP4's levels: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives (quants.c; the CUDA kernels pack them themselves)
extern const int8_t ggml_mxfp4_kvalues[16];

// activations for Q4_1: as Q8_0 plus s = d * sum(qs), which carries Q4_1's minimum through the dot
typedef struct {
    uint16_t d;        // f16 scale
    uint16_t s;        // f16 d * sum(qs)
    int8_t qs[QK8_1];  // (32,)
} block_q8_1;
GGML_STATIC_ASSERT(sizeof(block_q8_1) == 36, "block_q8_1 must be 36 bytes");

// 8 sub-blocks of 32: x = d * sc[s] * q - dmin * m[s], q in [0, 15], sc/m six bits each.
// qs[32 c + l] holds sub-block 2c value l (low nibble) and sub-block 2c + 1 value l (high nibble).
typedef struct {
    uint16_t d;                    // f16 scale of the scales
    uint16_t dmin;                 // f16 scale of the mins
    uint8_t scales[K_SCALE_SIZE];  // (12,) packed sc[8], m[8]
    uint8_t qs[QK_K / 2];          // (128,) nibbles
} block_q4_K;
GGML_STATIC_ASSERT(sizeof(block_q4_K) == 144, "block_q4_K must be 144 bytes");

// 16 sub-blocks of 16: x = d * scales[s] * (q - 32), q in [0, 63].
// For half h and l in [0, 32): value 128h + l      = ql[64h + l] & 15      | (qh[32h + l] >> 0 & 3) << 4
//                             value 128h + l + 32 = ql[64h + l + 32] & 15 | (qh[32h + l] >> 2 & 3) << 4
//                             value 128h + l + 64 = ql[64h + l] >> 4      | (qh[32h + l] >> 4 & 3) << 4
//                             value 128h + l + 96 = ql[64h + l + 32] >> 4 | (qh[32h + l] >> 6 & 3) << 4
typedef struct {
    uint8_t ql[QK_K / 2];      // (128,) low 4 bits
    uint8_t qh[QK_K / 4];      // (64,) high 2 bits
    int8_t scales[QK_K / 16];  // (16,) sub-block scales
    uint16_t d;                // f16 super-block scale
} block_q6_K;
GGML_STATIC_ASSERT(sizeof(block_q6_K) == 210, "block_q6_K must be 210 bytes");

// Q6_K's rows as a prompt's AVX2 tile reads them, rewritten once per row tile (ops_matmul.c): the levels (0..63) a
// byte each in value order, so the tile loads them where it would rebuild them from ql and qh for every 4 columns
typedef struct {
    uint8_t q[QK_K];           // (256,) levels
    int8_t scales[QK_K / 16];  // (16,) sub-block scales
    uint16_t d;                // f16 super-block scale
} block_q6_K_levels;
GGML_STATIC_ASSERT(sizeof(block_q6_K_levels) == 274, "block_q6_K_levels must be 274 bytes");

// activations for the K-quants: x = d * q, with per-16 sums of q for the mins/offset terms
typedef struct {
    float d;                 // f32 scale
    int8_t qs[QK_K];         // (256,)
    int16_t bsums[QK_K / 16]; // (16,) sum of qs[16 i .. 16 i + 16)
} block_q8_K;
GGML_STATIC_ASSERT(sizeof(block_q8_K) == 292, "block_q8_K must be 292 bytes");

// Q4_K: six-bit scale and min of sub-block s (0..7) from the packed 12 bytes
GGML_QFN void ggml_q4_K_get_scale_min(const uint8_t *scales, int s, uint8_t *sc, uint8_t *m) {
    if (s < 4) {
        *sc = scales[s] & 63;
        *m = scales[s + 4] & 63;
    } else {
        *sc = (uint8_t)((scales[s + 4] & 0x0F) | ((scales[s - 4] >> 6) << 4));
        *m = (uint8_t)((scales[s + 4] >> 4) | ((scales[s] >> 6) << 4));
    }
}

// Q4_K: all 8 sub-blocks' six-bit scales (sc) and mins (m) at once, sub-block s in byte s of each word (what
// ggml_q4_K_get_scale_min gives one at a time): sub-blocks 0..3 are the low 6 bits of bytes 0..3 (4..7), 4..7 the
// nibbles of bytes 8..11 with the top 2 bits of bytes 0..3 (4..7) above
GGML_QFN void ggml_q4_K_scales_mins(const uint8_t *scales, uint64_t *sc, uint64_t *m) {
    uint32_t u[3];
    for (int w = 0; w < 3; w++)
        u[w] = (uint32_t)scales[4 * w] | (uint32_t)scales[4 * w + 1] << 8 | (uint32_t)scales[4 * w + 2] << 16 |
               (uint32_t)scales[4 * w + 3] << 24;
    *sc = (uint64_t)((u[2] & 0x0F0F0F0F) | ((u[0] >> 2) & 0x30303030)) << 32 | (u[0] & 0x3F3F3F3F);
    *m = (uint64_t)(((u[2] >> 4) & 0x0F0F0F0F) | ((u[1] >> 2) & 0x30303030)) << 32 | (u[1] & 0x3F3F3F3F);
}

// Q5_0: the 32 fifth bits as one little-endian word
GGML_QFN uint32_t ggml_q5_0_qh(const block_q5_0 *b) {
    return (uint32_t)b->qh[0] | (uint32_t)b->qh[1] << 8 | (uint32_t)b->qh[2] << 16 | (uint32_t)b->qh[3] << 24;
}

// Q6_K: level k (0..63) of a super-block, as the layout above reads
GGML_QFN int ggml_q6_K_level(const block_q6_K *b, int k) {
    const int h = k / 128, g = (k % 128) / 32, l = k % 32;
    const int low = (b->ql[64 * h + 32 * (g % 2) + l] >> (4 * (g / 2))) & 0x0F;
    const int high = (b->qh[32 * h + l] >> (2 * g)) & 3;
    return low | (high << 4);
}

// activations of a precise mul_mat (ggml_mul_mat_precise) over 32-value weight blocks: x = d * q, q a 16-bit level
// (|q| <= 32512) kept as two bytes, q = 255 hi + lo, so that the 8-bit products the weight types' kernels are made
// of serve it: w . q = 255 (w . hi) + w . lo, two products a weight under one scale (rounding x to 8 bits and dotting
// what that lost as well costs two of each). 255, being odd, leaves no ties: both bytes stay in [-127, 127], as the
// sign trick of signed weights (maddubs takes |w| and moves w's sign onto x) needs.
#define Q16_MAX 32512 // 255 * 127 + 127
typedef struct {
    float d;          // amax / 32512
    int32_t sum;      // sum(q): Q4_1's minimum (and Q4_0's, Q5_0's offsets) multiply d * sum
    int8_t hi[32];    // (32,) q / 255 rounded to nearest
    int8_t lo[32];    // (32,) q - 255 hi
} block_q16;
GGML_STATIC_ASSERT(sizeof(block_q16) == 72, "block_q16 must be 72 bytes");

// the same over the K-quants' 256-value super-blocks, with sums of q per 16 values (their mins and offsets)
typedef struct {
    float d;
    int32_t bsums[QK_K / 16]; // (16,)
    int8_t hi[QK_K];          // (256,)
    int8_t lo[QK_K];          // (256,)
} block_q16_K;
GGML_STATIC_ASSERT(sizeof(block_q16_K) == 580, "block_q16_K must be 580 bytes");

// q / 255 to nearest (never a tie), without dividing a negative number
GGML_QFN int ggml_q16_hi(int q) {
    return (q + 127 + 255 * 128) / 255 - 128;
}

// --- F16 / BF16 <-> F32, integer only so that host and device agree bit for bit ---

GGML_QFN uint32_t ggml_f32_bits(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    return v.u;
}

GGML_QFN float ggml_f32_from_bits(uint32_t u) {
    union { float f; uint32_t u; } v;
    v.u = u;
    return v.f;
}

// exact: every half is a float
GGML_QFN float ggml_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F;
    uint32_t man = h & 0x3FF;
    if (exp == 0x1F) {
        return ggml_f32_from_bits(sign | 0x7F800000 | (man << 13)); // inf, NaN (payload kept)
    }
    if (exp == 0) {
        if (man == 0) {
            return ggml_f32_from_bits(sign);
        }
        // subnormal half: normalize into a float exponent
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        return ggml_f32_from_bits(sign | (exp << 23) | ((man & 0x3FF) << 13));
    }
    return ggml_f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

// Q4_K sub-block s of b: value = *step * level - *minimum, the two products as to_float rounds them (d * sc, dmin * m)
GGML_QFN void ggml_q4_K_sub_block(const block_q4_K *b, int s, float *step, float *minimum) {
    uint8_t sc, m;
    ggml_q4_K_get_scale_min(b->scales, s, &sc, &m);
    *step = ggml_fp16_to_fp32(b->d) * (float)sc;
    *minimum = ggml_fp16_to_fp32(b->dmin) * (float)m;
}

// round to nearest even (as numpy's astype(float16)); overflow gives inf, NaN stays NaN (quieted)
GGML_QFN uint16_t ggml_fp32_to_fp16(float f) {
    uint32_t u = ggml_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7FFFFFFF;
    if (a > 0x7F800000) {
        return (uint16_t)(sign | 0x7E00 | ((a >> 13) & 0x3FF));
    }
    if (a >= 0x47800000) { // >= 65536 (or inf): beyond every rounding to 65504
        return (uint16_t)(sign | 0x7C00);
    }
    if (a >= 0x38800000) { // normal half range: rebias the exponent, round 13 dropped bits
        uint32_t h = (a - 0x38000000) >> 13;
        uint32_t rest = a & 0x1FFF;
        if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) {
            h++; // a carry out of the mantissa correctly bumps the exponent (up to inf)
        }
        return (uint16_t)(sign | h);
    }
    if (a < 0x33000000) { // <= 2^-25: rounds to zero (2^-25 itself ties to even zero)
        return sign;
    }
    // subnormal half: value / 2^-24, rounded to nearest even
    uint32_t man = (a & 0x7FFFFF) | 0x800000;
    int shift = 126 - (int)(a >> 23); // in [14, 24]
    uint32_t h = man >> shift;
    uint32_t rest = man & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rest > half || (rest == half && (h & 1))) {
        h++;
    }
    return (uint16_t)(sign | h);
}

// MXFP4's scale d = 2^(e - 128), exactly (subnormal for e < 2): half of the E8M0 value, as llama.cpp reads it
GGML_QFN float ggml_e8m0_to_fp32_half(uint8_t e) {
    return ggml_f32_from_bits(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

GGML_QFN float ggml_bf16_to_fp32(uint16_t h) {
    return ggml_f32_from_bits((uint32_t)h << 16);
}

// as gguf.quants.BF16: NaN forced quiet (truncated), everything else rounded to nearest even
GGML_QFN uint16_t ggml_fp32_to_bf16(float f) {
    uint32_t u = ggml_f32_bits(f);
    if ((u & 0x7FFFFFFF) > 0x7F800000) {
        return (uint16_t)((u >> 16) | 0x40);
    }
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
