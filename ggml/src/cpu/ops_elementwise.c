// ops_elementwise.c: copy/convert, get_rows, add, mul, scale, silu, gelu (tanh, erf), relu, tanh, abs.
// Sources may be views: rows are found through nb[1..3]; rows split evenly over the threads.
#include "exp_avx2.h"
#include "ops_kernels.h"

#include <math.h>
#include <string.h>

// rows are contiguous in every tensor: ggml_view sets only the outer strides nb[1..3]
static void row_to_f32(const struct ggml_type_traits *tt, enum ggml_type type, const void *row, float *buf, int64_t n) {
    if (type == GGML_TYPE_F32)
        memcpy(buf, row, (size_t)n * sizeof(float));
    else
        tt->to_float(row, buf, n);
}

static void row_from_f32(const struct ggml_type_traits *tt, enum ggml_type type, const float *buf, void *row, int64_t n) {
    if (type == GGML_TYPE_F32)
        memcpy(row, buf, (size_t)n * sizeof(float));
    else
        tt->from_float(buf, row, n);
}

static bool type_converts(const struct ggml_type_traits *tt, enum ggml_type type) {
    return type == GGML_TYPE_F32 || (tt->to_float && tt->from_float);
}

// ---------------------------------------------------------------------------------------------------
// CPY
// ---------------------------------------------------------------------------------------------------

size_t ggml_cpu_cpy_wsize(const struct ggml_tensor *dst, int n_threads) {
    // (n_threads, ne0) one F32 row per thread
    return (size_t)n_threads * ggml_cpu_align_up((size_t)dst->ne[0] * sizeof(float));
}

int ggml_cpu_op_cpy(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *src = dst->src[0];
    const struct ggml_type_traits *ts = ggml_get_type_traits(src->type);
    const struct ggml_type_traits *td = ggml_get_type_traits(dst->type);
    const int64_t n0 = src->ne[0], nrows = ggml_nrows(src);
    if (dst->ne[0] != n0 || ggml_nrows(dst) != nrows)
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "cpy: shapes differ");
    if (src->type != dst->type && (!type_converts(ts, src->type) || !type_converts(td, dst->type)))
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "cpy: no conversion %s -> %s", ggml_type_name(src->type),
                              ggml_type_name(dst->type));
    int64_t r0, r1;
    ggml_thread_range(nrows, p->ith, p->nth, &r0, &r1);
    if (src->type == dst->type) {
        // bytes move unchanged: exact for I32, quant blocks, F16 NaN payloads
        const size_t bytes = ggml_row_size(src->type, n0);
        for (int64_t r = r0; r < r1; r++) memmove(ggml_cpu_row_ptr(dst, r), ggml_cpu_row_ptr(src, r), bytes);
        return GGML_STATUS_OK;
    }
    float *buf = ggml_cpu_thread_scratch(p, (size_t)n0 * sizeof(float)); // (n0) the row in F32
    for (int64_t r = r0; r < r1; r++) {
        row_to_f32(ts, src->type, ggml_cpu_row_ptr(src, r), buf, n0);
        row_from_f32(td, dst->type, buf, ggml_cpu_row_ptr(dst, r), n0);
    }
    return GGML_STATUS_OK;
}

// ---------------------------------------------------------------------------------------------------
// GET_ROWS: dst [k, m] F32 = rows ids[0..m) of src0 [k, n]
// ---------------------------------------------------------------------------------------------------

int ggml_cpu_op_get_rows(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *src = dst->src[0], *ids = dst->src[1];
    const struct ggml_type_traits *ts = ggml_get_type_traits(src->type);
    const int64_t k = src->ne[0], n = src->ne[1], m = ids->ne[0];
    if (src->type != GGML_TYPE_F32 && !ts->to_float)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "get_rows cannot read %s", ggml_type_name(src->type));
    int64_t r0, r1;
    ggml_thread_range(m, p->ith, p->nth, &r0, &r1);
    // check this thread's ids before writing anything: each thread reports its own bad id
    for (int64_t r = r0; r < r1; r++) {
        int32_t id = *(const int32_t *)((const char *)ids->data + r * (int64_t)ids->nb[0]);
        if (id < 0 || id >= n)
            return ggml_set_error(GGML_STATUS_INVALID_ARG, "get_rows: id %d at %lld outside [0, %lld)", id,
                                  (long long)r, (long long)n);
    }
    for (int64_t r = r0; r < r1; r++) {
        int32_t id = *(const int32_t *)((const char *)ids->data + r * (int64_t)ids->nb[0]);
        const char *row = (const char *)src->data + id * (int64_t)src->nb[1];
        row_to_f32(ts, src->type, row, (float *)ggml_cpu_row_ptr(dst, r), k);
    }
    return GGML_STATUS_OK;
}

// ---------------------------------------------------------------------------------------------------
// ADD, MUL: src1 is either src0's shape or one row broadcast over all rows
// ---------------------------------------------------------------------------------------------------

int ggml_cpu_op_binary(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *a = dst->src[0], *b = dst->src[1];
    if (a->type != GGML_TYPE_F32 || b->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "add/mul take F32 tensors");
    const int64_t n0 = a->ne[0], nrows = ggml_nrows(a);
    const bool broadcast = ggml_nrows(b) == 1 && b->ne[0] == n0, per_row = b->ne[0] != n0; // ggml_add/mul's cases
    const bool is_add = dst->op == GGML_OP_ADD;
    int64_t r0, r1;
    ggml_thread_range(nrows, p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float *x = (const float *)ggml_cpu_row_ptr(a, r);                                      // (n0)
        const float *y = (const float *)(broadcast ? (const char *)b->data : ggml_cpu_row_ptr(b, r)); // (n0) or (1)
        float *z = (float *)ggml_cpu_row_ptr(dst, r);                                                // (n0)
        if (per_row && is_add)
            for (int64_t i = 0; i < n0; i++) z[i] = x[i] + y[0];
        else if (per_row)
            for (int64_t i = 0; i < n0; i++) z[i] = x[i] * y[0];
        else if (is_add)
            for (int64_t i = 0; i < n0; i++) z[i] = x[i] + y[i];
        else
            for (int64_t i = 0; i < n0; i++) z[i] = x[i] * y[i];
    }
    return GGML_STATUS_OK;
}

// ---------------------------------------------------------------------------------------------------
// SCALE, SILU, GELU, RELU, GELU_ERF, TANH, ABS, SIGMOID, SOFTPLUS, STEP
// ---------------------------------------------------------------------------------------------------

#if defined(__x86_64__)
// y = x sigmoid(x (a + b x^2)) on the first multiple of 8 values; returns how many: silu is a = 1, b = 0, and
// the tanh form of gelu, 0.5 x (1 + tanh(u)), is x sigmoid(2u) (scalar libm tanhf/expf cost Gemma's prompt 11 %)
__attribute__((target("avx2,fma"))) static int64_t sigmoid_gate_avx2(const float *x, float *y, int64_t n, float a,
                                                                     float b) {
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b), one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 t = _mm256_mul_ps(v, _mm256_fmadd_ps(vb, _mm256_mul_ps(v, v), va));
        const __m256 e = ggml_exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), t));
        _mm256_storeu_ps(y + i, _mm256_div_ps(v, _mm256_add_ps(one, e)));
    }
    return i;
}
#endif

// values [0, n) of silu (a = 1, b = 0) or gelu: eight at a time where the CPU can, the rest one by one
static int64_t sigmoid_gate(const float *x, float *y, int64_t n, float a, float b) {
#if defined(__x86_64__)
    if (ggml_cpu_has_avx2_fma()) return sigmoid_gate_avx2(x, y, n, a, b);
#endif
    (void)x, (void)y, (void)n, (void)a, (void)b;
    return 0;
}

static void unary_row(enum ggml_op op, float s, const float *x, float *y, int64_t n) {
    switch (op) {
    case GGML_OP_SCALE:
        for (int64_t i = 0; i < n; i++) y[i] = x[i] * s;
        break;
    case GGML_OP_SILU:
        for (int64_t i = sigmoid_gate(x, y, n, 1.0f, 0.0f); i < n; i++) y[i] = ggml_silu_f32(x[i]);
        break;
    case GGML_OP_GELU:
        for (int64_t i = sigmoid_gate(x, y, n, 2.0f * GGML_GELU_C, 2.0f * GGML_GELU_C * 0.044715f); i < n; i++)
            y[i] = ggml_gelu_f32(x[i]);
        break;
    case GGML_OP_GELU_ERF:
        for (int64_t i = 0; i < n; i++) y[i] = ggml_gelu_erf_f32(x[i]);
        break;
    case GGML_OP_TANH: // once per logit of the tokens asked for: libm's speed is enough
        for (int64_t i = 0; i < n; i++) y[i] = tanhf(x[i]);
        break;
    case GGML_OP_ABS:
        for (int64_t i = 0; i < n; i++) y[i] = fabsf(x[i]);
        break;
    case GGML_OP_SIGMOID:
        for (int64_t i = 0; i < n; i++) y[i] = 1.0f / (1.0f + expf(-x[i]));
        break;
    case GGML_OP_SOFTPLUS:
        for (int64_t i = 0; i < n; i++) y[i] = x[i] > 20.0f ? x[i] : log1pf(expf(x[i]));
        break;
    case GGML_OP_STEP:
        for (int64_t i = 0; i < n; i++) y[i] = x[i] > 0.0f ? 1.0f : 0.0f;
        break;
    default: // RELU; NaN stays NaN
        for (int64_t i = 0; i < n; i++) y[i] = x[i] < 0.0f ? 0.0f : x[i];
        break;
    }
}

int ggml_cpu_op_unary(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *a = dst->src[0];
    if (a->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "elementwise ops take F32 tensors");
    const float s = dst->op == GGML_OP_SCALE ? ggml_op_param_f32(dst, 0) : 0.0f;
    const int64_t n0 = a->ne[0], nrows = ggml_nrows(a);
    int64_t r0, r1;
    ggml_thread_range(nrows, p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++)
        unary_row(dst->op, s, (const float *)ggml_cpu_row_ptr(a, r), (float *)ggml_cpu_row_ptr(dst, r), n0);
    return GGML_STATUS_OK;
}
