// cuda.h: the CUDA backend's C interface, used by the graph executor (C) and implemented in *.cu.
// Every function returns a GGML status and sets ggml_set_error(GGML_STATUS_BACKEND_ERROR, ...) on failure;
// without a CUDA build (cuda_absent.c) they fail with "this build has no CUDA".
#pragma once
#include "../ggml-impl.h"

#ifdef __cplusplus
extern "C" {
#endif

int ggml_cuda_init(void);                      // picks device 0 once; fails without a GPU
int ggml_cuda_malloc(void **ptr, size_t size); // device memory
void ggml_cuda_free(void *ptr);
int ggml_cuda_host_malloc(void **ptr, size_t size); // pinned host memory (fast, async copies)
void ggml_cuda_host_free(void *ptr);
int ggml_cuda_memcpy_h2d(void *dst, const void *src, size_t n, void *stream); // async on stream
int ggml_cuda_memcpy_d2h(void *dst, const void *src, size_t n, void *stream); // async on stream
int ggml_cuda_memcpy_d2d(void *dst, const void *src, size_t n, void *stream);
// height rows of width bytes, pitches apart on each side; either side on the host or the device (async)
int ggml_cuda_memcpy_2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                        void *stream);
int ggml_cuda_stream_new(void **stream);
void ggml_cuda_stream_free(void *stream);
int ggml_cuda_stream_sync(void *stream);
int ggml_cuda_stream_done(void *stream, bool *done); // everything queued so far has finished
// events: recorded on a stream, done once the stream has reached them; timing events measure between two
int ggml_cuda_event_new(void **event, bool timing);
void ggml_cuda_event_free(void *event);
int ggml_cuda_event_record(void *event, void *stream);
int ggml_cuda_event_done(void *event, bool *done);
int ggml_cuda_event_elapsed_ms(void *from, void *to, float *ms);
// CUDA graphs: capture the launches made on `stream` between begin and end, replay with launch
int ggml_cuda_graph_capture_begin(void *stream);
int ggml_cuda_graph_capture_end(void *stream, void **exec);
int ggml_cuda_graph_launch(void *exec, void *stream);
void ggml_cuda_graph_free(void *exec);

// device scratch bytes a node needs (e.g. activations quantized to Q8, dequantized F16 tiles)
size_t ggml_cuda_op_wsize(const struct ggml_tensor *node);
// runs one node on `stream`; node->data and every src's data are device pointers; wdata is device scratch
int ggml_cuda_forward(struct ggml_tensor *node, void *wdata, void *stream);

// Runs of consecutive nodes the backend executes as one kernel (ggml/src/cuda/fusion.cu). The graph
// planner asks for them once; intermediates inside a run are never written.
enum ggml_cuda_fusion {
    GGML_CUDA_FUSE_NONE,     // the node alone
    GGML_CUDA_FUSE_NORM_MUL, // rms_norm or layer_norm, then mul by a weight row
    GGML_CUDA_FUSE_GEMV_ADD, // one-column mul_mat, then add of a vector (bias or residual)
    GGML_CUDA_FUSE_GEMV_ACT, // one-column mul_mat, then silu/gelu/relu of it (the predictor's first layer)
    GGML_CUDA_FUSE_GLU,      // mul_mat (gate), silu/gelu/relu, mul_mat (up) of the same x, mul
    GGML_CUDA_FUSE_ROPE_STORE, // rope, then kv_store of its rows
    GGML_CUDA_FUSE_ROPE_QKV,   // rope q; k's view, rope, kv_store; v's view, kv_store (views of one projection)
    GGML_CUDA_FUSE_SPARSE_FFN, // one token's mul_mat_rows gate, act, mul_mat_rows up, mul, axpy_rows down
    GGML_CUDA_FUSE_UNARY_BINARY, // a unary op of a (fusion.cu's is_pre_op), then add or mul by a tensor of a's shape
                                 // or a row
    GGML_CUDA_FUSE_MOE_ADD,      // moe_ffn, then add of a tensor of its shape (the residual)
    GGML_CUDA_FUSE_NORM_ROPE,    // rms_norm of each head, mul by a head-sized weight, rope [, kv_store of its rows]
    GGML_CUDA_FUSE_GEMV_STORE,   // one-column mul_mat [, add of a bias], its rows viewed as heads, kv_store of them
};
struct ggml_cuda_group {
    int kind;      // ggml_cuda_fusion
    int len;       // nodes the group covers; 0 for the nodes after a group's first
    bool xq_ready;  // its GEMV (or moe_ffn) finds x already quantized in the device scratch (by a GEMV or norm)
    bool writes_xq; // (norm -> mul) also leaves its output quantized in the scratch, for the GEMVs after it
};
// groups[i] for nodes[0..n); readers[i]: how many nodes read nodes[i] (one more for graph outputs)
void ggml_cuda_plan_groups(struct ggml_tensor *const *nodes, int n, const int *readers, struct ggml_cuda_group *groups);
// runs the group that starts at nodes[0]
int ggml_cuda_forward_group(const struct ggml_cuda_group *group, struct ggml_tensor *const *nodes, void *wdata,
                            void *stream);

#ifdef __cplusplus
}
#endif
