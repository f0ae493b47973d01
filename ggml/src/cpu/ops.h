// ops.h: the CPU kernels, one per op. Each is called by every thread of the pool with its index ith
// of nth and computes its share of dst; kernels that need two phases call ggml_barrier between them.
#pragma once
#include "../ggml-impl.h"

#include <stdatomic.h>

struct ggml_compute_params {
    int ith, nth;
    void *wdata;                 // scratch shared by the threads for this node (ggml_cpu_op_wsize bytes)
    size_t wsize;
    struct ggml_threadpool *tp;
    atomic_int *chunk_next;      // 0 when the node starts: work chunks handed out first come, first served
};

void ggml_barrier(struct ggml_threadpool *tp);

// scratch bytes the node needs (e.g. activations quantized to the weight's vec_dot_type)
size_t ggml_cpu_op_wsize(const struct ggml_tensor *node, int n_threads);
// runs one node; returns GGML_STATUS_OK or an error status (with the message set)
int ggml_cpu_forward(const struct ggml_compute_params *params, struct ggml_tensor *node);

// the next chunk [*r0, *r1) of [0, n) in chunks of `size`, taken from the node's counter first come,
// first served; false when none is left
static inline bool ggml_next_chunk(atomic_int *next, int64_t n, int64_t size, int64_t *r0, int64_t *r1) {
    *r0 = (int64_t)atomic_fetch_add_explicit(next, 1, memory_order_relaxed) * size;
    *r1 = *r0 + size < n ? *r0 + size : n;
    return *r0 < n;
}

// rows [*r0, *r1) of n that thread ith of nth takes
static inline void ggml_thread_range(int64_t n, int ith, int nth, int64_t *r0, int64_t *r1) {
    int64_t per = (n + nth - 1) / nth;
    *r0 = per * ith < n ? per * ith : n;
    *r1 = *r0 + per < n ? *r0 + per : n;
}
