// f32_rows.h: many float rows added into one, each times its coefficient: the inner step of a prompt batch's
// sparse sums (ops_sparse.c), where a chunk of weight rows, dequantized once, is added to every column.
#pragma once

#include <stdint.h>

// y[0..n) += the sum over q < k of c[q] * b[at[q] * ld + 0..n), in q order; AVX-512 or AVX2 where the CPU has
// it, the same sums in the same order either way
void ggml_f32_rows_add(int64_t n, float *y, const float *c, const int32_t *at, int k, const float *b, int64_t ld);

// c's nonzero values moved to its front in order, their places in at; returns how many (NaN counts as nonzero)
int ggml_f32_nonzero(float *c, int n, int32_t *at);
