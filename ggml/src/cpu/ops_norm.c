// ops_norm.c: rms_norm and layer_norm over each row (no weight: models multiply after).
// Sums run in double: rows are thousands long and the cost is small next to the matmuls around them.
#include "ops_kernels.h"

#include <math.h>

int ggml_cpu_op_norm(const struct ggml_compute_params *p, struct ggml_tensor *dst) {
    const struct ggml_tensor *a = dst->src[0];
    if (a->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "norms take F32 rows");
    const double eps = ggml_op_param_f32(dst, 0);
    const int64_t n = a->ne[0], nrows = ggml_nrows(a);
    int64_t r0, r1;
    ggml_thread_range(nrows, p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float *x = (const float *)ggml_cpu_row_ptr(a, r); // (n)
        float *y = (float *)ggml_cpu_row_ptr(dst, r);           // (n)
        double mean = 0.0;
        if (dst->op == GGML_OP_LAYER_NORM) {
            double sum = 0.0;
            for (int64_t i = 0; i < n; i++) sum += x[i];
            mean = sum / (double)n;
        }
        double sum2 = 0.0;
        for (int64_t i = 0; i < n; i++) {
            double d = x[i] - mean;
            sum2 += d * d;
        }
        const float inv = (float)(1.0 / sqrt(sum2 / (double)n + eps));
        const float fmean = (float)mean;
        for (int64_t i = 0; i < n; i++) y[i] = (x[i] - fmean) * inv;
    }
    return GGML_STATUS_OK;
}
