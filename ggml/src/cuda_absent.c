// cuda_absent.c: the CUDA backend's functions in a build without nvcc: every call fails cleanly and
// ggml_cuda_device_count() reports no device, so callers need no #ifdefs.
#ifndef GGML_USE_CUDA
#include "cuda/cuda.h"

#define CUDA_ABSENT_MSG "this build has no CUDA (nvcc was not found when it was built)"

static int cuda_absent(void) { return ggml_set_error(GGML_STATUS_UNSUPPORTED, CUDA_ABSENT_MSG); }

int ggml_cuda_device_count(void) { return 0; }
const char *ggml_cuda_device_name(void) { return ""; }
int ggml_cuda_init(void) { return cuda_absent(); }
size_t ggml_cuda_allocated(void) { return 0; }
size_t ggml_cuda_peak_reset(void) { return 0; }
size_t ggml_cuda_allocated_peak(void) { return 0; }

int ggml_cuda_host_register(void *ptr, size_t size, bool read_only) {
    (void)ptr, (void)size, (void)read_only;
    return cuda_absent();
}

void ggml_cuda_host_unregister(void *ptr) { (void)ptr; }

int ggml_cuda_mem_info(size_t *free_bytes, size_t *total_bytes) {
    *free_bytes = *total_bytes = 0;
    return GGML_STATUS_OK;
}

int ggml_cuda_malloc(void **ptr, size_t size) {
    (void)size;
    *ptr = NULL;
    return cuda_absent();
}

void ggml_cuda_free(void *ptr) { (void)ptr; }

int ggml_cuda_host_malloc(void **ptr, size_t size) {
    (void)size;
    *ptr = NULL;
    return cuda_absent();
}

void ggml_cuda_host_free(void *ptr) { (void)ptr; }

int ggml_cuda_memcpy_h2d(void *dst, const void *src, size_t n, void *stream) {
    (void)dst, (void)src, (void)n, (void)stream;
    return cuda_absent();
}

int ggml_cuda_memcpy_d2h(void *dst, const void *src, size_t n, void *stream) {
    (void)dst, (void)src, (void)n, (void)stream;
    return cuda_absent();
}

int ggml_cuda_memcpy_d2d(void *dst, const void *src, size_t n, void *stream) {
    (void)dst, (void)src, (void)n, (void)stream;
    return cuda_absent();
}

int ggml_cuda_memcpy_2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                        void *stream) {
    (void)dst, (void)dpitch, (void)src, (void)spitch, (void)width, (void)height, (void)stream;
    return cuda_absent();
}

int ggml_cuda_stream_done(void *stream, bool *done) {
    (void)stream;
    *done = true;
    return cuda_absent();
}

int ggml_cuda_event_new(void **event, bool timing) {
    (void)timing;
    *event = NULL;
    return cuda_absent();
}

void ggml_cuda_event_free(void *event) { (void)event; }

int ggml_cuda_event_record(void *event, void *stream) {
    (void)event, (void)stream;
    return cuda_absent();
}

int ggml_cuda_event_done(void *event, bool *done) {
    (void)event;
    *done = true;
    return cuda_absent();
}

int ggml_cuda_event_elapsed_ms(void *from, void *to, float *ms) {
    (void)from, (void)to;
    *ms = 0.0f;
    return cuda_absent();
}

int ggml_cuda_stream_new(void **stream) {
    *stream = NULL;
    return cuda_absent();
}

void ggml_cuda_stream_free(void *stream) { (void)stream; }

int ggml_cuda_stream_sync(void *stream) {
    (void)stream;
    return cuda_absent();
}

int ggml_cuda_graph_capture_begin(void *stream) {
    (void)stream;
    return cuda_absent();
}

int ggml_cuda_graph_capture_end(void *stream, void **exec) {
    (void)stream;
    *exec = NULL;
    return cuda_absent();
}

int ggml_cuda_graph_launch(void *exec, void *stream) {
    (void)exec, (void)stream;
    return cuda_absent();
}

void ggml_cuda_graph_free(void *exec) { (void)exec; }

size_t ggml_cuda_op_wsize(const struct ggml_tensor *node) {
    (void)node;
    return 0;
}

void ggml_cuda_plan_groups(struct ggml_tensor *const *nodes, int n, const int *readers, struct ggml_cuda_group *groups) {
    (void)nodes, (void)readers;
    for (int i = 0; i < n; i++) groups[i] = (struct ggml_cuda_group){GGML_CUDA_FUSE_NONE, 1, false, false};
}

int ggml_cuda_forward_group(const struct ggml_cuda_group *group, struct ggml_tensor *const *nodes, void *wdata,
                            void *stream) {
    (void)group, (void)nodes, (void)wdata, (void)stream;
    return cuda_absent();
}

int ggml_cuda_forward(struct ggml_tensor *node, void *wdata, void *stream) {
    (void)node, (void)wdata, (void)stream;
    return cuda_absent();
}
#else
typedef int ggml_cuda_absent_unused; // ISO C forbids an empty translation unit
#endif
