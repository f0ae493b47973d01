// pyinfer_native.h: the engine's own C API on top of ggml (what the cffi module binds besides ggml.h).
#pragma once
#include <stdbool.h>

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

// CFFI-BEGIN
// compiler, SIMD levels and whether CUDA objects are linked in, for `pyinfer --version` and bug reports
const char *pyinfer_build_info(void);
bool pyinfer_has_cuda_build(void);

// --- the executor: a planned graph on the CPU thread pool and the GPU stream at once ---
// What the last compute of a graph did. Busy times are unions of intervals on one clock: the CPU's are
// thread 0 inside CPU nodes, the GPU's come from events around each run of stream work (only when timed).
struct pyinfer_step_stats {
    double wall_ms;      // the whole compute call
    double cpu_busy_ms;  // CPU nodes
    double gpu_busy_ms;  // GPU runs (0 unless timed)
    double overlap_ms;   // both busy at once (0 unless timed)
    double wait_ms;      // the CPU waiting for data from the GPU
    int n_gpu_runs;      // runs of stream work per compute
    int n_replayed;      // of which replayed from captured CUDA graphs
    int n_cpu_nodes;
    int n_waits;         // CPU nodes that wait for downloads
    bool timed;
};
// runs a planned graph (CPU only, GPU only or both); one call per step, no Python per node
int pyinfer_graph_compute(struct ggml_cgraph *g, struct ggml_threadpool *tp);
// timing events around the GPU runs from the next compute on (they cost a few microseconds a run)
int pyinfer_graph_set_timed(struct ggml_cgraph *g, bool timed);
int pyinfer_graph_stats(const struct ggml_cgraph *g, struct pyinfer_step_stats *out);
// CFFI-END

#ifdef __cplusplus
}
#endif
