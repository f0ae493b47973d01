// graph.h: the graph struct, shared by the planner and the backends.
#pragma once
#include "ggml-impl.h"

struct ggml_cgraph {
    struct ggml_tensor **nodes; // (n_nodes) in execution order
    int n_nodes, cap_nodes;
    void *buffer;               // (buffer_size) memory of every planned intermediate
    size_t buffer_size;
};
