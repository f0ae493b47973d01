// graph.h: the graph struct, shared by the planner and the executor.
#pragma once
#include "ggml-impl.h"
#include "cuda/cuda.h"

struct ggml_cgraph {
    struct ggml_tensor **nodes;   // (n_nodes) in execution order, transfers included after planning
    int n_nodes, cap_nodes;
    bool planned;
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
    int capture_from;             // nodes [capture_from, n_nodes) are CUDA-only: replayed as a CUDA graph
    int n_computes;
    void *cuda_graph;             // the captured replay, or NULL
};

// executes a transfer node (thread 0 only); syncs the stream when the bytes land on the host
int ggml_graph_run_transfer(struct ggml_cgraph *g, struct ggml_tensor *node);
// runs CUDA node i: the fused run it starts, nothing if an earlier run covered it (thread 0 only)
int ggml_graph_run_cuda_node(struct ggml_cgraph *g, int i);
// uploads the host leaves the GPU nodes read (thread 0, before any node)
int ggml_graph_run_uploads(struct ggml_cgraph *g);
