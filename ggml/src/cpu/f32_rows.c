// f32_rows.c: see f32_rows.h. One body, compiled three times (AVX-512, AVX2 with FMA, plain) and chosen at run
// time, as ggml_cpu_set_simd and ggml_cpu_set_avx512 allow, so that the rest of the library runs on any x86-64.
// Every row goes into y through one fused multiply-add per value (fmaf, which plain x86-64 computes in software:
// it only serves CPUs without FMA), so the three agree bit for bit.
#include "f32_rows.h"

#include "ggml-impl.h"

#include <math.h>
#include <stdbool.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

static inline __attribute__((always_inline)) void rows_add(int64_t n, float *restrict y, const float *c,
                                                           const int32_t *at, int k, const float *b, int64_t ld) {
    int q = 0;
    for (; q + 8 <= k; q += 8) {
        const float *restrict r[8];
        float cq[8];
        for (int t = 0; t < 8; t++) r[t] = b + at[q + t] * ld, cq[t] = c[q + t];
        for (int64_t v = 0; v < n; v++) {
            float s = y[v];
            for (int t = 0; t < 8; t++) s = fmaf(cq[t], r[t][v], s);
            y[v] = s;
        }
    }
    for (; q < k; q++) {
        const float cq = c[q], *restrict bq = b + at[q] * ld;
        for (int64_t v = 0; v < n; v++) y[v] = fmaf(cq, bq[v], y[v]);
    }
}

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512vl,fma"))) static void rows_add_avx512(int64_t n, float *y, const float *c,
                                                                             const int32_t *at, int k, const float *b,
                                                                             int64_t ld) {
    rows_add(n, y, c, at, k, b, ld);
}

__attribute__((target("avx2,fma"))) static void rows_add_avx2(int64_t n, float *y, const float *c, const int32_t *at,
                                                              int k, const float *b, int64_t ld) {
    rows_add(n, y, c, at, k, b, ld);
}
#endif

#if defined(__x86_64__)
// 16 values a compare and two compressing stores
__attribute__((target("avx512f"))) static int nonzero_avx512(float *c, int n, int32_t *at) {
    int k = 0, i = 0;
    __m512i place = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= n; i += 16, place = _mm512_add_epi32(place, _mm512_set1_epi32(16))) {
        const __m512 v = _mm512_loadu_ps(c + i);
        const __mmask16 keep = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_UQ);
        _mm512_mask_compressstoreu_ps(c + k, keep, v); // k <= i: the store lands on values already read
        _mm512_mask_compressstoreu_epi32(at + k, keep, place);
        k += __builtin_popcount(keep);
    }
    for (; i < n; i++)
        if (c[i] != 0.0f) c[k] = c[i], at[k++] = i;
    return k;
}
#endif

int ggml_f32_nonzero(float *c, int n, int32_t *at) {
#if defined(__x86_64__)
    if (ggml_quants_avx512_allowed() && __builtin_cpu_supports("avx512f")) return nonzero_avx512(c, n, at);
#endif
    int k = 0;
    for (int i = 0; i < n; i++)
        if (c[i] != 0.0f) c[k] = c[i], at[k++] = i;
    return k;
}

void ggml_f32_rows_add(int64_t n, float *y, const float *c, const int32_t *at, int k, const float *b, int64_t ld) {
#if defined(__x86_64__)
    if (ggml_quants_avx512_allowed() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("fma")) {
        rows_add_avx512(n, y, c, at, k, b, ld);
        return;
    }
    if (ggml_quants_simd_in_use() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        rows_add_avx2(n, y, c, at, k, b, ld);
        return;
    }
#endif
    rows_add(n, y, c, at, k, b, ld);
}
