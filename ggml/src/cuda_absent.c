// cuda_absent.c: the CUDA interface in a build without nvcc: no devices, and every call says why.
#include "cuda/cuda.h"

#ifndef GGML_USE_CUDA

static int no_cuda(void) {
    return ggml_set_error(GGML_STATUS_UNSUPPORTED, "this build has no CUDA (nvcc was not found when it was built)");
}

int ggml_cuda_device_count(void) { return 0; }
const char *ggml_cuda_device_name(void) { return "none"; }
int ggml_cuda_init(void) { return no_cuda(); }
int ggml_cuda_malloc(void **ptr, size_t size) { (void)ptr; (void)size; return no_cuda(); }
void ggml_cuda_free(void *ptr) { (void)ptr; }
int ggml_cuda_host_malloc(void **ptr, size_t size) { (void)ptr; (void)size; return no_cuda(); }
void ggml_cuda_host_free(void *ptr) { (void)ptr; }
int ggml_cuda_memcpy_h2d(void *dst, const void *src, size_t n, void *stream) { (void)dst; (void)src; (void)n; (void)stream; return no_cuda(); }
int ggml_cuda_memcpy_d2h(void *dst, const void *src, size_t n, void *stream) { (void)dst; (void)src; (void)n; (void)stream; return no_cuda(); }
int ggml_cuda_memcpy_d2d(void *dst, const void *src, size_t n, void *stream) { (void)dst; (void)src; (void)n; (void)stream; return no_cuda(); }
int ggml_cuda_stream_new(void **stream) { (void)stream; return no_cuda(); }
void ggml_cuda_stream_free(void *stream) { (void)stream; }
int ggml_cuda_stream_sync(void *stream) { (void)stream; return no_cuda(); }
int ggml_cuda_graph_capture_begin(void *stream) { (void)stream; return no_cuda(); }
int ggml_cuda_graph_capture_end(void *stream, void **exec) { (void)stream; (void)exec; return no_cuda(); }
int ggml_cuda_graph_launch(void *exec, void *stream) { (void)exec; (void)stream; return no_cuda(); }
void ggml_cuda_graph_free(void *exec) { (void)exec; }
size_t ggml_cuda_op_wsize(const struct ggml_tensor *node) { (void)node; return 0; }
int ggml_cuda_forward(struct ggml_tensor *node, void *wdata, void *stream) { (void)node; (void)wdata; (void)stream; return no_cuda(); }

#endif
