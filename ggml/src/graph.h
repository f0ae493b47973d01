// graph.h: the graph struct, shared by the planner and the executor.
#pragma once
#include "ggml-impl.h"
#include "cuda/cuda.h"

struct ggml_cgraph {
    struct ggml_tensor **nodes;   // (n_nodes) in execution order, transfers included after planning
    int n_nodes, cap_nodes;
    bool planned;
    int64_t stream_min_cols;      // weight ops of this many columns run on the GPU, host weights copied in (0: off)
    void *buffer;                 // (buffer_size) host memory of the CPU intermediates (pinned with a GPU)
    size_t buffer_size;
    // GPU side, present when some node runs on CUDA
    struct ggml_tensor *mirrors;  // (n_mirrors) transfer nodes the planner created
    int n_mirrors;
    struct ggml_tensor **uploads; // (n_uploads) transfers of host leaves, run before any node
    int n_uploads;
    void *staging;                // (sum of the uploads' bytes) pinned copies of the uploaded leaves
    size_t *staging_offs;         // (n_uploads) where each upload's bytes sit in staging
    void *dev_buffer;             // (dev_buffer_size) device memory of the CUDA intermediates
    size_t dev_buffer_size;
    void *dev_wdata;              // (dev_wsize) device scratch shared by the CUDA nodes
    size_t dev_wsize;
    void *stream;
    struct ggml_cuda_group *groups; // (n_nodes) how the CUDA backend runs each node (fused runs)
    // the executor's state for this graph (native/src/executor.c: its schedule, CUDA graphs, events),
    // freed with the graph
    void *exec;
    void (*exec_free)(void *exec);
};

// issues a transfer node on the graph's stream, asynchronously (an upload copies from its pinned staging)
int ggml_graph_run_transfer(struct ggml_cgraph *g, struct ggml_tensor *node);
// issues CUDA node i: the fused run it starts, nothing if an earlier run covered it
int ggml_graph_run_cuda_node(struct ggml_cgraph *g, int i);
// copies the host leaves the GPU nodes read into their pinned staging (before the uploads are issued)
void ggml_graph_stage_uploads(struct ggml_cgraph *g);
// true for a transfer that carries bytes from the GPU to the host
static inline bool ggml_is_download(const struct ggml_tensor *t) {
    return t->op == GGML_OP_TRANSFER && t->backend == GGML_BACKEND_CPU;
}
