// rowdot.cuh: dot products of weight blocks with activations, per weight type, for gemv.cu.
// Quantized weights meet activations quantized to Q8_1 (int8 per value, (d, d * sum) per 32 values) and
// multiply with dp4a; F32/F16/BF16 weights meet F32 activations. Weight bytes are loaded into registers
// as 32-bit words aligned to the start of what was loaded (16-byte loads where the address allows).
#pragma once
#include "common.cuh"

// 32 bits at even byte offset `off` of the words u (compile-time after unrolling)
static __device__ __forceinline__ uint32_t wd(const uint32_t *u, int off) {
    return (off & 3) ? __byte_perm(u[off >> 2], u[(off >> 2) + 1], 0x5432) : u[off >> 2];
}
// 16 bits at even byte offset `off`
static __device__ __forceinline__ uint32_t hw(const uint32_t *u, int off) {
    return (u[off >> 2] >> (8 * (off & 3))) & 0xFFFF;
}

// NB bytes at p (2-byte aligned) into words u[(NB + 3) / 4], u[0] holding bytes 0..3 of p
template <int NB>
static __device__ __forceinline__ void load_bytes(const uint8_t *p, uint32_t *u) {
    const uintptr_t a = (uintptr_t)p;
    if (NB % 16 == 0 && (a & 15) == 0) {
#pragma unroll
        for (int i = 0; i < NB / 16; i++) {
            const int4 v = __ldg((const int4 *)p + i);
            u[4 * i] = v.x;
            u[4 * i + 1] = v.y;
            u[4 * i + 2] = v.z;
            u[4 * i + 3] = v.w;
        }
    } else if ((a & 3) == 0) {
#pragma unroll
        for (int i = 0; i < NB / 4; i++) u[i] = __ldg((const uint32_t *)p + i);
        if (NB % 4) u[NB / 4] = __ldg((const uint16_t *)(p + NB - 2));
    } else {
        // 2 mod 4: aligned words from p - 2 (inside the buffer: p is not its start), realigned in registers
        constexpr int NW = NB / 4 + 1;
        uint32_t w[NW];
        const uint32_t *q = (const uint32_t *)(p - 2);
#pragma unroll
        for (int i = 0; i < NB / 4 + (NB % 4 ? 1 : 0); i++) w[i] = __ldg(q + i);
        if (NB % 4 == 0) w[NB / 4] = __ldg((const uint16_t *)(p + NB - 2));
#pragma unroll
        for (int i = 0; i < NB / 4; i++) u[i] = __byte_perm(w[i], w[i + 1], 0x5432);
        if (NB % 4) u[NB / 4] = w[NB / 4] >> 16;
    }
}

// the 32 int8 activations of x block bi as 8 words
static __device__ __forceinline__ void load_xq(const int8_t *xq, int64_t bi, int *xv) {
    const int4 *p = (const int4 *)(xq + 32 * bi);
    const int4 a = __ldg(p), b = __ldg(p + 1);
    xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w;
    xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
}

// 4 six-bit... byte j of the words u starting at byte offset off
static __device__ __forceinline__ int byte_at(const uint32_t *u, int off) { return (u[off >> 2] >> (8 * (off & 3))) & 0xFF; }

// each weight type: QK values and TS bytes per block, G blocks per 16-byte-aligned unit, and the dot of
// the block at byte B of u with x blocks starting at bi
template <int TYPE> struct wq;

template <> struct wq<GGML_TYPE_Q4_0> {
    static constexpr int QK = 32, TS = 18, G = 8;
    static __device__ __forceinline__ float dot(const uint32_t *u, int B, const int8_t *xq, const float2 *xds, int64_t bi) {
        int xv[8];
        load_xq(xq, bi, xv);
        const float2 ds = __ldg(xds + bi);
        int s = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t q = wd(u, B + 2 + 4 * i);
            s = __dp4a((int)(q & 0x0F0F0F0F), xv[i], s);
            s = __dp4a((int)((q >> 4) & 0x0F0F0F0F), xv[i + 4], s);
        }
        return h2f(hw(u, B)) * (ds.x * (float)s - 8.0f * ds.y);
    }
};

template <> struct wq<GGML_TYPE_Q4_1> {
    static constexpr int QK = 32, TS = 20, G = 4;
    static __device__ __forceinline__ float dot(const uint32_t *u, int B, const int8_t *xq, const float2 *xds, int64_t bi) {
        int xv[8];
        load_xq(xq, bi, xv);
        const float2 ds = __ldg(xds + bi);
        int s = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t q = wd(u, B + 4 + 4 * i);
            s = __dp4a((int)(q & 0x0F0F0F0F), xv[i], s);
            s = __dp4a((int)((q >> 4) & 0x0F0F0F0F), xv[i + 4], s);
        }
        return h2f(hw(u, B)) * ds.x * (float)s + h2f(hw(u, B + 2)) * ds.y;
    }
};

// bits 0..3 of t moved to bit 4 of bytes 0..3
static __device__ __forceinline__ uint32_t spread4(uint32_t t) {
    return ((t & 1) << 4) | ((t & 2) << 11) | ((t & 4) << 18) | ((t & 8) << 25);
}

template <> struct wq<GGML_TYPE_Q5_0> {
    static constexpr int QK = 32, TS = 22, G = 8;
    static __device__ __forceinline__ float dot(const uint32_t *u, int B, const int8_t *xq, const float2 *xds, int64_t bi) {
        int xv[8];
        load_xq(xq, bi, xv);
        const float2 ds = __ldg(xds + bi);
        const uint32_t qh = wd(u, B + 2);
        int s = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t q = wd(u, B + 6 + 4 * i);
            s = __dp4a((int)((q & 0x0F0F0F0F) | spread4((qh >> (4 * i)) & 15)), xv[i], s);
            s = __dp4a((int)(((q >> 4) & 0x0F0F0F0F) | spread4((qh >> (16 + 4 * i)) & 15)), xv[i + 4], s);
        }
        return h2f(hw(u, B)) * (ds.x * (float)s - 16.0f * ds.y);
    }
};

template <> struct wq<GGML_TYPE_Q8_0> {
    static constexpr int QK = 32, TS = 34, G = 8;
    static __device__ __forceinline__ float dot(const uint32_t *u, int B, const int8_t *xq, const float2 *xds, int64_t bi) {
        int xv[8];
        load_xq(xq, bi, xv);
        const float2 ds = __ldg(xds + bi);
        int s = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) s = __dp4a((int)wd(u, B + 2 + 4 * i), xv[i], s);
        return h2f(hw(u, B)) * ds.x * (float)s;
    }
};

// Q4_K six-bit scale and min of sub-block s from the 12 packed bytes at byte 4 of the block
static __device__ __forceinline__ void q4k_scale_min(const uint32_t *u, int B, int s, float &sc, float &m) {
    const int o = B + 4;
    if (s < 4) {
        sc = (float)(byte_at(u, o + s) & 63);
        m = (float)(byte_at(u, o + s + 4) & 63);
    } else {
        sc = (float)((byte_at(u, o + s + 4) & 0x0F) | ((byte_at(u, o + s - 4) >> 6) << 4));
        m = (float)((byte_at(u, o + s + 4) >> 4) | ((byte_at(u, o + s) >> 6) << 4));
    }
}

template <> struct wq<GGML_TYPE_Q4_K> {
    static constexpr int QK = 256, TS = 144, G = 1;
    static __device__ __forceinline__ float dot(const uint32_t *u, int B, const int8_t *xq, const float2 *xds, int64_t bi) {
        float acc = 0.0f, accm = 0.0f;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            int xa[8], xb[8];
            load_xq(xq, bi + 2 * c, xa);
            load_xq(xq, bi + 2 * c + 1, xb);
            const float2 da = __ldg(xds + bi + 2 * c), db = __ldg(xds + bi + 2 * c + 1);
            int sa = 0, sb = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const uint32_t q = wd(u, B + 16 + 32 * c + 4 * i);
                sa = __dp4a((int)(q & 0x0F0F0F0F), xa[i], sa);
                sb = __dp4a((int)((q >> 4) & 0x0F0F0F0F), xb[i], sb);
            }
            float sca, ma, scb, mb;
            q4k_scale_min(u, B, 2 * c, sca, ma);
            q4k_scale_min(u, B, 2 * c + 1, scb, mb);
            acc += sca * da.x * (float)sa + scb * db.x * (float)sb;
            accm += ma * da.y + mb * db.y;
        }
        return h2f(hw(u, B)) * acc - h2f(hw(u, B + 2)) * accm;
    }
};

template <> struct wq<GGML_TYPE_Q6_K> {
    static constexpr int QK = 256, TS = 210, G = 1;
    static __device__ __forceinline__ float dot(const uint32_t *u, int B, const int8_t *xq, const float2 *xds, int64_t bi) {
        float acc = 0.0f;
#pragma unroll
        for (int h = 0; h < 2; h++) {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                int xv[8];
                load_xq(xq, bi + 4 * h + q, xv);
                const float dx = __ldg(xds + bi + 4 * h + q).x;
                int sa = 0, sb = 0;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const uint32_t ql = wd(u, B + 64 * h + 32 * (q & 1) + 4 * i);
                    const uint32_t qh = wd(u, B + 128 + 32 * h + 4 * i);
                    const uint32_t lo = (q < 2 ? ql : ql >> 4) & 0x0F0F0F0F;
                    const int v = (int)__vsubss4(lo | (((qh >> (2 * q)) & 0x03030303) << 4), 0x20202020);
                    if (i < 4)
                        sa = __dp4a(v, xv[i], sa);
                    else
                        sb = __dp4a(v, xv[i], sb);
                }
                const int s0 = 8 * h + 2 * q; // 16-value sub-block of the first half
                const float sc0 = (float)(int8_t)byte_at(u, B + 192 + s0), sc1 = (float)(int8_t)byte_at(u, B + 193 + s0);
                acc += dx * (sc0 * (float)sa + sc1 * (float)sb);
            }
        }
        return h2f(hw(u, B + 208)) * acc;
    }
};
