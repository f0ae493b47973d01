// rowdot.cuh: weight bytes into registers and the per-type dot products of the quantized GEMV (gemv.cu).
// Quantized weights meet activations quantized to Q8_1 (int8 per value, (d, d * sum) per 32 values, d in
// F32) and multiply with dp4a. The GEMV splits each row into lane items (one block of the 32-value types,
// one 16-byte quant chunk of a K-quant super-block) and gives neighbouring items to neighbouring lanes, so
// a warp's loads cover a contiguous span; an item's bytes come straight from global memory (no shared
// memory), as the 16-byte chunks covering them.
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
static __device__ __forceinline__ int byte_at(const uint32_t *u, int off) { return (u[off >> 2] >> (8 * (off & 3))) & 0xFF; }

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

// ---------------------------------------------------------------------------------------------------
// weight windows: how an item's bytes get into registers
// ---------------------------------------------------------------------------------------------------

// NB bytes at p into words u[(NB + 3) / 4], u[0] holding bytes 0..3 of p: the 16-byte chunks that hold them
// (LDG.128; none beyond the last byte, so no load leaves the pages of the data), realigned in registers by the
// offset o of p in its chunk. p is 2-byte aligned for even NB (every block of an even size sits at even offsets);
// odd NB (MXFP4's 17-byte blocks) takes any offset. AT16: p is 16-byte aligned (o = 0).
template <int NB, bool AT16 = false>
static __device__ __forceinline__ void load_win(const uint8_t *p, uint32_t *u) {
    constexpr int NW = (NB + 3) / 4;
    if constexpr (AT16) {
        static_assert(NB % 16 == 0, "whole chunks");
#pragma unroll
        for (int i = 0; i < NB / 16; i++) {
            const int4 v = __ldg((const int4 *)p + i);
            u[4 * i] = v.x;
            u[4 * i + 1] = v.y;
            u[4 * i + 2] = v.z;
            u[4 * i + 3] = v.w;
        }
    } else {
        constexpr int ODD = NB % 2;                  // p may sit at odd offsets
        constexpr int NCH = (NB + 14 + ODD + 15) / 16; // chunks that hold NB bytes at any allowed offset
        constexpr int NV = 4 * NCH;
        const int o = (int)((uintptr_t)p & 15);
        const int4 *c = (const int4 *)(p - o);
        uint32_t v[NV + 3]; // (NV) loaded words, then zeros the shifts below may read
#pragma unroll
        for (int i = 0; i < NCH; i++) {
            int4 t = make_int4(0, 0, 0, 0);
            if (16 * i < NB || 16 * i < o + NB) t = __ldg(c + i);
            v[4 * i] = t.x;
            v[4 * i + 1] = t.y;
            v[4 * i + 2] = t.z;
            v[4 * i + 3] = t.w;
        }
        v[NV] = v[NV + 1] = v[NV + 2] = 0;
        // drop o / 4 words (as 1 + 2), then funnel out the bytes o % 4
        const int q = o >> 2;
        uint32_t t1[NV + 2];
#pragma unroll
        for (int i = 0; i < NV + 2; i++) t1[i] = (q & 1) ? v[i + 1] : v[i];
        uint32_t t2[NW + 1];
#pragma unroll
        for (int i = 0; i < NW + 1; i++) t2[i] = (q & 2) ? t1[i + 2] : t1[i];
        const uint32_t sh = (uint32_t)(o & (ODD ? 3 : 2)) * 8;
#pragma unroll
        for (int i = 0; i < NW; i++) u[i] = __funnelshift_r(t2[i], t2[i + 1], sh);
    }
}

// the 16 int8 activations at byte `off` of Q8_1 block b as 4 words
static __device__ __forceinline__ void load_x16(const int8_t *xq, int64_t b, int off, int *v) {
    const int4 a = __ldg((const int4 *)(xq + 32 * b + off));
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
}

// ---------------------------------------------------------------------------------------------------
// per weight type: the lane items of a row and their dot products
//   NR: rows a warp takes at once (they share the activation loads), U: items per lane in flight
//   items(k): items per row; W: an item's weight words; X: the activations an item meets
//   load<A16>(row, it, w) (A16: the row is 16-byte aligned); xload(xq, xds, it, x) (one column); dot(w, x, it)
// ---------------------------------------------------------------------------------------------------

template <int TYPE> struct qrow;

// the 32-value types: an item is one block (TS bytes) against one Q8_1 block
struct qrow_x32 {
    struct X {
        int v[8];
        float2 ds;
    };
    static __device__ __forceinline__ void xload(const int8_t *xq, const float2 *xds, int64_t it, X &x) {
        load_x16(xq, it, 0, x.v);
        load_x16(xq, it, 16, x.v + 4);
        x.ds = __ldg(xds + it);
    }
    static __host__ __device__ __forceinline__ int64_t items(int64_t k) { return k / 32; }
};

template <> struct qrow<GGML_TYPE_Q4_0> : qrow_x32 {
    static constexpr int NR = 2, U = 2, TS = 18; // f16 d, 16 bytes of nibbles
    struct W { uint32_t u[5]; };
    template <bool A16> static __device__ __forceinline__ void load(const uint8_t *row, int64_t it, W &w) {
        load_win<TS>(row + TS * it, w.u);
    }
    static __device__ __forceinline__ float dot(const W &w, const X &x, int64_t) {
        int s = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t q = wd(w.u, 2 + 4 * i);
            s = __dp4a((int)(q & 0x0F0F0F0F), x.v[i], s);
            s = __dp4a((int)((q >> 4) & 0x0F0F0F0F), x.v[i + 4], s);
        }
        return h2f(hw(w.u, 0)) * (x.ds.x * (float)s - 8.0f * x.ds.y);
    }
};

template <> struct qrow<GGML_TYPE_Q4_1> : qrow_x32 {
    static constexpr int NR = 2, U = 2, TS = 20; // f16 d, f16 m, 16 bytes of nibbles
    struct W { uint32_t u[5]; };
    template <bool A16> static __device__ __forceinline__ void load(const uint8_t *row, int64_t it, W &w) {
        load_win<TS>(row + TS * it, w.u);
    }
    static __device__ __forceinline__ float dot(const W &w, const X &x, int64_t) {
        int s = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t q = w.u[1 + i];
            s = __dp4a((int)(q & 0x0F0F0F0F), x.v[i], s);
            s = __dp4a((int)((q >> 4) & 0x0F0F0F0F), x.v[i + 4], s);
        }
        return h2f(hw(w.u, 0)) * x.ds.x * (float)s + h2f(hw(w.u, 2)) * x.ds.y;
    }
};

// bits 0..3 of t moved to bit 4 of bytes 0..3
static __device__ __forceinline__ uint32_t spread4(uint32_t t) {
    return ((t & 1) << 4) | ((t & 2) << 11) | ((t & 4) << 18) | ((t & 8) << 25);
}

template <> struct qrow<GGML_TYPE_Q5_0> : qrow_x32 {
    static constexpr int NR = 2, U = 2, TS = 22; // f16 d, 4 bytes of fifth bits, 16 bytes of nibbles
    struct W { uint32_t u[6]; };
    template <bool A16> static __device__ __forceinline__ void load(const uint8_t *row, int64_t it, W &w) {
        load_win<TS>(row + TS * it, w.u);
    }
    static __device__ __forceinline__ float dot(const W &w, const X &x, int64_t) {
        const uint32_t qh = wd(w.u, 2);
        int s = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t q = wd(w.u, 6 + 4 * i);
            s = __dp4a((int)((q & 0x0F0F0F0F) | spread4((qh >> (4 * i)) & 15)), x.v[i], s);
            s = __dp4a((int)(((q >> 4) & 0x0F0F0F0F) | spread4((qh >> (16 + 4 * i)) & 15)), x.v[i + 4], s);
        }
        return h2f(hw(w.u, 0)) * (x.ds.x * (float)s - 16.0f * x.ds.y);
    }
};

template <> struct qrow<GGML_TYPE_Q8_0> : qrow_x32 {
    static constexpr int NR = 2, U = 1, TS = 34; // f16 d, 32 int8
    struct W { uint32_t u[9]; };
    template <bool A16> static __device__ __forceinline__ void load(const uint8_t *row, int64_t it, W &w) {
        load_win<TS>(row + TS * it, w.u);
    }
    static __device__ __forceinline__ float dot(const W &w, const X &x, int64_t) {
        int s = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) s = __dp4a((int)wd(w.u, 2 + 4 * i), x.v[i], s);
        return h2f(hw(w.u, 0)) * x.ds.x * (float)s;
    }
};

// MXFP4 block (17 bytes, at any byte offset): E8M0 e, 16 bytes of nibbles indexing the levels (mxfp4_levels4)
template <> struct qrow<GGML_TYPE_MXFP4> : qrow_x32 {
    static constexpr int NR = 2, U = 2, TS = 17;
    struct W { uint32_t u[5]; };
    template <bool A16> static __device__ __forceinline__ void load(const uint8_t *row, int64_t it, W &w) {
        load_win<TS>(row + TS * it, w.u);
    }
    static __device__ __forceinline__ float dot(const W &w, const X &x, int64_t) {
        int s = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t q = __byte_perm(w.u[i], w.u[i + 1], 0x4321); // qs[4 i .. 4 i + 4): block bytes 1 on
            s = __dp4a(mxfp4_levels4(q & 0x0F0F0F0F), x.v[i], s);
            s = __dp4a(mxfp4_levels4((q >> 4) & 0x0F0F0F0F), x.v[i + 4], s);
        }
        return ggml_e8m0_to_fp32_half((uint8_t)(w.u[0] & 0xFF)) * (x.ds.x * (float)s); // the power of two last
    }
};

// Q4_K super-block (144 bytes): f16 d, f16 dmin, 12 bytes of six-bit scales and mins, 128 bytes of
// nibbles; bytes [32 j, 32 j + 32) of the nibbles hold sub-block 2 j (low nibbles) and 2 j + 1 (high).
// Item t (0..7) of a super-block: nibble chunk t, i.e. values [16 h, 16 h + 16) of sub-blocks 2 j and
// 2 j + 1 (j = t / 2, h = t % 2); the lane with h = 0 adds the mins of both sub-blocks.
template <> struct qrow<GGML_TYPE_Q4_K> {
    static constexpr int NR = 2, U = 2;
    struct W { uint32_t hd[4], q[4]; };
    struct X {
        int lo[4], hi[4];
        float2 dlo, dhi;
    };
    static __host__ __device__ __forceinline__ int64_t items(int64_t k) { return k / 256 * 8; }
    template <bool A16> static __device__ __forceinline__ void load(const uint8_t *row, int64_t it, W &w) {
        const uint8_t *b = row + 144 * (it >> 3); // 16-byte aligned with the row: 144 = 9 x 16
        load_win<16, A16>(b, w.hd);
        load_win<16, A16>(b + 16 + 16 * (it & 7), w.q);
    }
    static __device__ __forceinline__ void xload(const int8_t *xq, const float2 *xds, int64_t it, X &x) {
        const int64_t b = 8 * (it >> 3) + 2 * ((it >> 1) & 3); // Q8_1 block of sub-block 2 j
        const int off = 16 * (int)(it & 1);
        load_x16(xq, b, off, x.lo);
        load_x16(xq, b + 1, off, x.hi);
        x.dlo = __ldg(xds + b);
        x.dhi = __ldg(xds + b + 1);
    }
    static __device__ __forceinline__ float dot(const W &w, const X &x, int64_t it) {
        const int j = (int)(it >> 1) & 3;
        // six-bit scales and mins of sub-blocks 0..3 or 4..7 as bytes of a word
        const uint32_t a = w.hd[1], b = w.hd[2], c = w.hd[3];
        const uint32_t scw = j < 2 ? a & 0x3F3F3F3F : (c & 0x0F0F0F0F) | ((a >> 2) & 0x30303030);
        const uint32_t mw = j < 2 ? b & 0x3F3F3F3F : ((c >> 4) & 0x0F0F0F0F) | ((b >> 2) & 0x30303030);
        const uint32_t sh = 16 * (j & 1);
        int slo = 0, shi = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            slo = __dp4a((int)(w.q[i] & 0x0F0F0F0F), x.lo[i], slo);
            shi = __dp4a((int)((w.q[i] >> 4) & 0x0F0F0F0F), x.hi[i], shi);
        }
        const float sc0 = (float)((scw >> sh) & 0xFF), sc1 = (float)((scw >> (sh + 8)) & 0xFF);
        const float m0 = (float)((mw >> sh) & 0xFF), m1 = (float)((mw >> (sh + 8)) & 0xFF);
        const float r = h2f(w.hd[0] & 0xFFFF) * (sc0 * x.dlo.x * (float)slo + sc1 * x.dhi.x * (float)shi);
        const float mins = h2f(w.hd[0] >> 16) * (m0 * x.dlo.y + m1 * x.dhi.y);
        return (it & 1) ? r : r - mins;
    }
};

// Q6_K super-block (210 bytes): ql[128] (low nibbles), qh[64] (2-bit highs), int8 scales[16], f16 d.
// Half h (128 values) uses ql[64 h, 64 h + 64), qh[32 h, 32 h + 32), scales[8 h, 8 h + 8); value
// 128 h + 32 q + l (q = 0..3, l = 0..31) is (ql[64 h + l + 32 (q % 2)] nibble q / 2) | (qh[32 h + l]
// bits 2 q, 2 q + 1) << 4, minus 32, times scales[8 h + l / 16 + 2 q].
// Item t = 4 h + 2 p + i (0..7): l in [16 i, 16 i + 16) for q = p (low nibbles) and q = 2 + p (high).
template <> struct qrow<GGML_TYPE_Q6_K> {
    static constexpr int NR = 2, U = 1;
    struct W { uint32_t ql[4], qh[4], tail[5]; }; // tail: scales[16], d
    struct X {
        int a[4], b[4]; // q = p, q = 2 + p
        float da, db;
        int za, zb;     // 32 * (sum of the 16 activations): the -32 offset, once for all rows
    };
    static __host__ __device__ __forceinline__ int64_t items(int64_t k) { return k / 256 * 8; }
    template <bool A16> static __device__ __forceinline__ void load(const uint8_t *row, int64_t it, W &w) {
        const int t = (int)(it & 7), h = t >> 2, p = (t >> 1) & 1, i = t & 1;
        const uint8_t *b = row + 210 * (it >> 3);
        load_win<16>(b + 64 * h + 32 * p + 16 * i, w.ql);
        load_win<16>(b + 128 + 32 * h + 16 * i, w.qh);
        load_win<18>(b + 192, w.tail);
    }
    static __device__ __forceinline__ void xload(const int8_t *xq, const float2 *xds, int64_t it, X &x) {
        const int t = (int)(it & 7), h = t >> 2, p = (t >> 1) & 1, i = t & 1;
        const int64_t ba = 8 * (it >> 3) + 4 * h + p;
        load_x16(xq, ba, 16 * i, x.a);
        load_x16(xq, ba + 2, 16 * i, x.b);
        x.da = __ldg(&xds[ba].x);
        x.db = __ldg(&xds[ba + 2].x);
        int za = 0, zb = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            za = __dp4a(0x20202020, x.a[k], za);
            zb = __dp4a(0x20202020, x.b[k], zb);
        }
        x.za = za;
        x.zb = zb;
    }
    static __device__ __forceinline__ float dot(const W &w, const X &x, int64_t it) {
        const int t = (int)(it & 7), h = t >> 2, p = (t >> 1) & 1, i = t & 1;
        int sa = 0, sb = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const uint32_t ha = ((w.qh[k] >> (2 * p)) & 0x03030303) << 4;
            const uint32_t hb = ((w.qh[k] >> (4 + 2 * p)) & 0x03030303) << 4;
            sa = __dp4a((int)((w.ql[k] & 0x0F0F0F0F) | ha), x.a[k], sa);
            sb = __dp4a((int)(((w.ql[k] >> 4) & 0x0F0F0F0F) | hb), x.b[k], sb);
        }
        // scales[8 h + i + 2 p] and [.. + 4]: byte i + 2 p of tail words 2 h and 2 h + 1
        const uint32_t bs = 8 * (i + 2 * p);
        const float sca = (float)(int8_t)((h ? w.tail[2] : w.tail[0]) >> bs);
        const float scb = (float)(int8_t)((h ? w.tail[3] : w.tail[1]) >> bs);
        return h2f(w.tail[4] & 0xFFFF) * (sca * x.da * (float)(sa - x.za) + scb * x.db * (float)(sb - x.zb));
    }
};

// ---------------------------------------------------------------------------------------------------
// whole rows: float chunks, quantized row dot products, 32-value slices (gemv.cu, sparse.cu, sparse_ffn.cu)
// ---------------------------------------------------------------------------------------------------

// 8 consecutive weights of a float type from one 16-byte chunk (F32: 4, the rest zero)
template <int TYPE>
static __device__ __forceinline__ void chunk_vals(const int4 v, float *f) {
    if (TYPE == GGML_TYPE_F32) {
        f[0] = __int_as_float(v.x); f[1] = __int_as_float(v.y); f[2] = __int_as_float(v.z); f[3] = __int_as_float(v.w);
    } else {
        const uint32_t a[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            f[2 * i] = TYPE == GGML_TYPE_F16 ? h2f(a[i] & 0xFFFF) : bf2f(a[i] & 0xFFFF);
            f[2 * i + 1] = TYPE == GGML_TYPE_F16 ? h2f(a[i] >> 16) : bf2f(a[i] >> 16);
        }
    }
}

#define GEMV_FLOAT_UNROLL 4 // 16-byte chunks in flight per thread

// this thread's share of two float rows' dot products with x [k] (chunks first, first + STRIDE, ... of 16
// bytes, GEMV_FLOAT_UNROLL of each row in flight; the two rows share every x load): partial sums, for the
// caller to add up over the threads that share the rows
template <int TYPE, int STRIDE>
static __device__ __forceinline__ void pair_partial_f(const int4 *w0, const int4 *w1, const float *x, int64_t k,
                                                      unsigned first, float *s0, float *s1) {
    constexpr int VE = TYPE == GGML_TYPE_F32 ? 4 : 8; // values per 16-byte chunk
    const int64_t nch = k / VE;
    float a0 = 0.0f, a1 = 0.0f;
    for (int64_t c0 = first; c0 < nch; c0 += GEMV_FLOAT_UNROLL * STRIDE) {
        int4 v0[GEMV_FLOAT_UNROLL], v1[GEMV_FLOAT_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_FLOAT_UNROLL; u++) {
            const int64_t c = c0 + u * STRIDE;
            v0[u] = c < nch ? __ldg(w0 + c) : make_int4(0, 0, 0, 0);
            v1[u] = c < nch ? __ldg(w1 + c) : make_int4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < GEMV_FLOAT_UNROLL; u++) {
            const int64_t c = c0 + u * STRIDE;
            if (c >= nch) break;
            float f0[8], f1[8], xv[8];
            chunk_vals<TYPE>(v0[u], f0);
            chunk_vals<TYPE>(v1[u], f1);
            const float4 *xp = (const float4 *)(x + c * VE);
            const float4 xa = __ldg(xp), xb = VE == 8 ? __ldg(xp + 1) : xa;
            xv[0] = xa.x; xv[1] = xa.y; xv[2] = xa.z; xv[3] = xa.w;
            xv[4] = xb.x; xv[5] = xb.y; xv[6] = xb.z; xv[7] = xb.w;
#pragma unroll
            for (int i = 0; i < VE; i++) {
                a0 += f0[i] * xv[i];
                a1 += f1[i] * xv[i];
            }
        }
    }
    *s0 = a0;
    *s1 = a1;
}

// acc[r][j] += row r of wr . column j of x (j < mm), over the lane's items of the rows
template <int TYPE, bool A16, int NC, int NR>
static __device__ __forceinline__ void qrow_dots(const uint8_t *const *wr, const int8_t *xq, const float2 *xds,
                                                 int64_t k, int mm, int lane, float (*acc)[NC]) {
    using Q = qrow<TYPE>;
    constexpr int U = NC == 1 ? Q::U : 1;
    const int64_t nit = Q::items(k), kb = k / 32;
    for (int64_t i0 = lane; i0 < nit; i0 += 32 * U) {
        typename Q::W w[U][NR];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t it = i0 + 32 * u < nit ? i0 + 32 * u : i0; // past the end: item i0 again, unused
#pragma unroll
            for (int r = 0; r < NR; r++) Q::template load<A16>(wr[r], it, w[u][r]);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t it = i0 + 32 * u;
            if (it >= nit) break;
#pragma unroll
            for (int j = 0; j < NC; j++) {
                if (j >= mm) break;
                typename Q::X x;
                Q::xload(xq + j * k, xds + j * kb, it, x);
#pragma unroll
                for (int r = 0; r < NR; r++) acc[r][j] += Q::dot(w[u][r], x, it);
            }
        }
    }
}

// values [32 sl, 32 sl + 32) of a row of d values (fewer at the end of a float row: the rest are 0)
template <int TYPE>
static __device__ __forceinline__ void slice32(const uint8_t *row, int64_t sl, int64_t d, float *f) {
    if constexpr (TYPE == GGML_TYPE_F32 || TYPE == GGML_TYPE_F16 || TYPE == GGML_TYPE_BF16) {
        constexpr int ES = TYPE == GGML_TYPE_F32 ? 4 : 2;
        const uint8_t *p = row + sl * 32 * ES;
        if (sl * 32 + 32 <= d && ((uintptr_t)p & 15) == 0) {
            uint32_t u[8 * ES];
            load_bytes<32 * ES>(p, u);
#pragma unroll
            for (int i = 0; i < 32; i++)
                f[i] = TYPE == GGML_TYPE_F32 ? __uint_as_float(u[i])
                       : TYPE == GGML_TYPE_F16 ? h2f(hw(u, 2 * i)) : bf2f(hw(u, 2 * i));
        } else {
#pragma unroll
            for (int i = 0; i < 32; i++) f[i] = sl * 32 + i < d ? cuda_dequant1(TYPE, row, sl * 32 + i) : 0.0f;
        }
    } else if constexpr (TYPE == GGML_TYPE_Q4_0 || TYPE == GGML_TYPE_Q4_1 || TYPE == GGML_TYPE_Q5_0) {
        constexpr int TS = TYPE == GGML_TYPE_Q4_0 ? 18 : TYPE == GGML_TYPE_Q4_1 ? 20 : 22;
        constexpr int QS = TYPE == GGML_TYPE_Q4_0 ? 2 : TYPE == GGML_TYPE_Q4_1 ? 4 : 6; // offset of the nibbles
        uint32_t u[(TS + 3) / 4];
        load_bytes<TS>(row + sl * TS, u);
        const float dd = h2f(hw(u, 0));
        const float mn = TYPE == GGML_TYPE_Q4_1 ? h2f(hw(u, 2)) : 0.0f;
        const uint32_t qh = TYPE == GGML_TYPE_Q5_0 ? wd(u, 2) : 0;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const int b = (int)((wd(u, QS + 4 * (i / 4)) >> (8 * (i % 4))) & 0xFF);
            int lo = b & 15, hi = b >> 4;
            if (TYPE == GGML_TYPE_Q5_0) {
                lo = (lo | (int)((qh >> i) & 1) << 4) - 16;
                hi = (hi | (int)((qh >> (i + 16)) & 1) << 4) - 16;
            } else if (TYPE == GGML_TYPE_Q4_0) {
                lo -= 8;
                hi -= 8;
            }
            f[i] = dd * (float)lo + mn;
            f[i + 16] = dd * (float)hi + mn;
        }
    } else if constexpr (TYPE == GGML_TYPE_Q8_0) {
        uint32_t u[9];
        load_bytes<34>(row + sl * 34, u);
        const float dd = h2f(hw(u, 0));
#pragma unroll
        for (int i = 0; i < 32; i++) f[i] = dd * (float)(int8_t)((wd(u, 2 + 4 * (i / 4)) >> (8 * (i % 4))) & 0xFF);
    } else if constexpr (TYPE == GGML_TYPE_MXFP4) {
        uint32_t u[5];
        load_win<17>(row + sl * 17, u);
        const float dd = ggml_e8m0_to_fp32_half((uint8_t)(u[0] & 0xFF));
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t q = __byte_perm(u[i], u[i + 1], 0x4321); // qs[4 i .. 4 i + 4)
            const int lo = mxfp4_levels4(q & 0x0F0F0F0F), hi = mxfp4_levels4((q >> 4) & 0x0F0F0F0F);
#pragma unroll
            for (int b = 0; b < 4; b++) {
                f[4 * i + b] = dd * (float)(int8_t)(lo >> (8 * b));
                f[16 + 4 * i + b] = dd * (float)(int8_t)(hi >> (8 * b));
            }
        }
    } else if constexpr (TYPE == GGML_TYPE_Q4_K) {
        const uint8_t *blk = row + (sl / 8) * 144;
        const int s = (int)(sl % 8);
        uint32_t hd[4], q[8];
        load_bytes<16>(blk, hd);
        load_bytes<32>(blk + 16 + 32 * (s / 2), q);
        float sc, mn;
        q4k_scale_min(hd, 0, s, sc, mn);
        const float a = h2f(hw(hd, 0)) * sc, c = h2f(hw(hd, 2)) * mn;
        const int sh = (s & 1) * 4;
#pragma unroll
        for (int i = 0; i < 32; i++) f[i] = a * (float)((q[i / 4] >> (8 * (i % 4) + sh)) & 15) - c;
    } else { // Q6_K
        const uint8_t *blk = row + (sl / 8) * 210;
        const int s = (int)(sl % 8), h = s / 4, qq = s % 4;
        uint32_t ql[8], qh[8];
        load_bytes<32>(blk + 64 * h + 32 * (qq & 1), ql);
        load_bytes<32>(blk + 128 + 32 * h, qh);
        const uint32_t scw = __ldg((const uint16_t *)(blk + 192 + 8 * h + 2 * qq));
        const float dd = h2f(__ldg((const uint16_t *)(blk + 208)));
        const float s0 = dd * (float)(int8_t)(scw & 0xFF), s1 = dd * (float)(int8_t)(scw >> 8);
#pragma unroll
        for (int i = 0; i < 32; i++) {
            const int lo = (ql[i / 4] >> (8 * (i % 4) + (qq >= 2 ? 4 : 0))) & 15;
            const int hi = (qh[i / 4] >> (8 * (i % 4) + 2 * qq)) & 3;
            f[i] = (i < 16 ? s0 : s1) * (float)((lo | hi << 4) - 32);
        }
    }
}

// y[d] += the block's sums of its warps' slices (lane l of each warp holds acc[32] for values
// [32 (32 blockIdx.x + l), + 32)): added across warps in shared memory, then atomically into y, four
// values per atomic where y's alignment allows (Hopper's vector atomics: a quarter of the atomic traffic)
template <int WARPS>
static __device__ __forceinline__ void add_slices(const float *acc, float (*s_acc)[32 * 32], float *y, int64_t d) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int i = 0; i < 32; i++) s_acc[warp][i * 32 + lane] = acc[i];
    __syncthreads();
    const int64_t d0 = (int64_t)blockIdx.x * 32 * 32;
    if (d % 4 == 0 && ((uintptr_t)y & 15) == 0) {
        for (int e = threadIdx.x; e < 32 * 8; e += WARPS * 32) {
            const int ln = e % 32, v = 4 * (e / 32); // values v .. v + 3 of lane ln's slice
            const int64_t di = d0 + ln * 32 + v;
            if (di >= d) continue;
            float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int w = 0; w < WARPS; w++) {
                sum.x += s_acc[w][v * 32 + ln];
                sum.y += s_acc[w][(v + 1) * 32 + ln];
                sum.z += s_acc[w][(v + 2) * 32 + ln];
                sum.w += s_acc[w][(v + 3) * 32 + ln];
            }
            atomicAdd((float4 *)(y + di), sum);
        }
        return;
    }
    for (int e = threadIdx.x; e < 32 * 32; e += WARPS * 32) {
        const int ln = e % 32, v = e / 32;
        const int64_t di = d0 + ln * 32 + v;
        if (di >= d) continue;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) sum += s_acc[w][e];
        atomicAdd(y + di, sum);
    }
}
