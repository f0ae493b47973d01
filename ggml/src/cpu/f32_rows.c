// f32_rows.c: see f32_rows.h. Three forms (AVX-512, AVX2 with FMA, plain C) chosen at run time, as
// ggml_cpu_set_simd and ggml_cpu_set_avx512 allow, so that the rest of the library runs on any x86-64. Every row
// goes into y through one fused multiply-add per value in q order (fmaf, which plain x86-64 computes in software:
// it only serves CPUs without FMA), so the three agree bit for bit.
#include "f32_rows.h"

#include "ggml-impl.h"

#include <math.h>
#include <stdbool.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// the plain form: every value's sum in q order, fused multiply-adds
static void rows_add_plain(int64_t n, float *restrict y, const float *c, const int32_t *at, int k, const float *b,
                           int64_t ld) {
    for (int64_t v = 0; v < n; v++) {
        float s = y[v];
        for (int q = 0; q < k; q++) s = fmaf(c[q], b[at[q] * ld + v], s);
        y[v] = s;
    }
}

#if defined(__x86_64__)
// W vectors of y held in registers across all k rows (one load and store of y a call, and W independent chains
// of fused multiply-adds, where a pass of rows through memory had made each pass wait on the last one's store);
// the same sums in the same order as the plain form
#define ROWS_ADD_SIMD(NAME, TARGET, VEC, LANES, W, LOAD, STORE, SET1, FMA)                                        \
    __attribute__((target(TARGET))) static void NAME(int64_t n, float *y, const float *c, const int32_t *at, int k,  \
                                                     const float *b, int64_t ld) {                                \
        int64_t v = 0;                                                                                          \
        for (; v + W * LANES <= n; v += W * LANES) {                                                             \
            VEC acc[W];                                                                                         \
            for (int t = 0; t < W; t++) acc[t] = LOAD(y + v + t * LANES);                                       \
            for (int q = 0; q < k; q++) {                                                                       \
                const VEC cq = SET1(c[q]);                                                                      \
                const float *bq = b + at[q] * ld + v;                                                           \
                for (int t = 0; t < W; t++) acc[t] = FMA(cq, LOAD(bq + t * LANES), acc[t]);                     \
            }                                                                                                   \
            for (int t = 0; t < W; t++) STORE(y + v + t * LANES, acc[t]);                                       \
        }                                                                                                       \
        for (; v + LANES <= n; v += LANES) {                                                                    \
            VEC acc = LOAD(y + v);                                                                              \
            for (int q = 0; q < k; q++) acc = FMA(SET1(c[q]), LOAD(b + at[q] * ld + v), acc);                    \
            STORE(y + v, acc);                                                                                  \
        }                                                                                                       \
        if (v < n) rows_add_plain(n - v, y + v, c, at, k, b + v, ld);                                           \
    }

ROWS_ADD_SIMD(rows_add_avx512, "avx512f,fma", __m512, 16, 8, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps,
              _mm512_fmadd_ps)
ROWS_ADD_SIMD(rows_add_avx2, "avx2,fma", __m256, 8, 8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps,
              _mm256_fmadd_ps)
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
    rows_add_plain(n, y, c, at, k, b, ld);
}
