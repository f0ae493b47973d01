// device.cu: device selection, memory, copies, streams and CUDA graphs; the public device queries.
#include <stdio.h>

#include "common.cuh"

static int g_device_count = -1; // -1: not asked yet
static bool g_ready = false;
static char g_device_name[256];

extern "C" int ggml_cuda_device_count(void) {
    if (g_device_count < 0) {
        int n = 0;
        // no driver or no GPU both mean zero devices, not an error
        g_device_count = cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
        cudaGetLastError();
    }
    return g_device_count;
}

extern "C" const char *ggml_cuda_device_name(void) {
    if (ggml_cuda_device_count() == 0) return "";
    if (!g_device_name[0]) {
        cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "";
        snprintf(g_device_name, sizeof g_device_name, "%s", prop.name);
    }
    return g_device_name;
}

extern "C" int ggml_cuda_init(void) {
    if (g_ready) return GGML_STATUS_OK;
    if (ggml_cuda_device_count() == 0) return ggml_set_error(GGML_STATUS_BACKEND_ERROR, "no CUDA device found");
    int st = cuda_status(cudaSetDevice(0), "set device 0");
    if (st) return st;
    // cuBLAS is loaded now, outside any graph capture; without it mul_mat falls back to our WMMA kernel
    cuda_blas_load();
    g_ready = true;
    return GGML_STATUS_OK;
}

// the row kernels read whole 16-byte chunks from rows at any alignment, so the last chunk of a tensor
// may reach up to 15 bytes past it: every allocation carries that much slack
#define CUDA_ALLOC_SLACK 64

extern "C" int ggml_cuda_malloc(void **ptr, size_t size) {
    *ptr = NULL;
    int st = ggml_cuda_init();
    if (st) return st;
    cudaError_t err = cudaMalloc(ptr, size + CUDA_ALLOC_SLACK);
    if (err != cudaSuccess) {
        cudaGetLastError();
        *ptr = NULL;
        return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "cudaMalloc of %zu bytes: %s", size, cudaGetErrorString(err));
    }
    return GGML_STATUS_OK;
}

extern "C" void ggml_cuda_free(void *ptr) {
    if (ptr) cudaFree(ptr);
}

extern "C" int ggml_cuda_host_malloc(void **ptr, size_t size) {
    *ptr = NULL;
    int st = ggml_cuda_init();
    if (st) return st;
    cudaError_t err = cudaMallocHost(ptr, size ? size : 1);
    if (err != cudaSuccess) {
        cudaGetLastError();
        *ptr = NULL;
        return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "cudaMallocHost of %zu bytes: %s", size,
                              cudaGetErrorString(err));
    }
    return GGML_STATUS_OK;
}

extern "C" void ggml_cuda_host_free(void *ptr) {
    if (ptr) cudaFreeHost(ptr);
}

static int memcpy_async(void *dst, const void *src, size_t n, cudaMemcpyKind kind, void *stream) {
    if (n == 0) return GGML_STATUS_OK;
    return cuda_status(cudaMemcpyAsync(dst, src, n, kind, (cudaStream_t)stream), "memcpy");
}

extern "C" int ggml_cuda_memcpy_h2d(void *dst, const void *src, size_t n, void *stream) {
    return memcpy_async(dst, src, n, cudaMemcpyHostToDevice, stream);
}

extern "C" int ggml_cuda_memcpy_d2h(void *dst, const void *src, size_t n, void *stream) {
    return memcpy_async(dst, src, n, cudaMemcpyDeviceToHost, stream);
}

extern "C" int ggml_cuda_memcpy_d2d(void *dst, const void *src, size_t n, void *stream) {
    return memcpy_async(dst, src, n, cudaMemcpyDeviceToDevice, stream);
}

extern "C" int ggml_cuda_stream_new(void **stream) {
    *stream = NULL;
    int st = ggml_cuda_init();
    if (st) return st;
    cudaStream_t s;
    // non-blocking: the legacy default stream (used by synchronous copies) does not serialize with it
    if ((st = cuda_status(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream create"))) return st;
    *stream = s;
    return GGML_STATUS_OK;
}

extern "C" void ggml_cuda_stream_free(void *stream) {
    if (stream) cudaStreamDestroy((cudaStream_t)stream);
}

extern "C" int ggml_cuda_stream_sync(void *stream) {
    return cuda_status(cudaStreamSynchronize((cudaStream_t)stream), "stream sync");
}

extern "C" int ggml_cuda_graph_capture_begin(void *stream) {
    if (!stream) return ggml_set_error(GGML_STATUS_INVALID_ARG, "the legacy default stream cannot be captured");
    // relaxed: other threads may allocate or copy meanwhile (the CPU half of the hybrid executor)
    return cuda_status(cudaStreamBeginCapture((cudaStream_t)stream, cudaStreamCaptureModeRelaxed), "capture begin");
}

extern "C" int ggml_cuda_graph_capture_end(void *stream, void **exec) {
    *exec = NULL;
    cudaGraph_t graph;
    int st = cuda_status(cudaStreamEndCapture((cudaStream_t)stream, &graph), "capture end");
    if (st) return st;
    cudaGraphExec_t ge;
    st = cuda_status(cudaGraphInstantiate(&ge, graph, 0), "graph instantiate");
    cudaGraphDestroy(graph);
    if (st) return st;
    *exec = ge;
    return GGML_STATUS_OK;
}

extern "C" int ggml_cuda_graph_launch(void *exec, void *stream) {
    return cuda_status(cudaGraphLaunch((cudaGraphExec_t)exec, (cudaStream_t)stream), "graph launch");
}

extern "C" void ggml_cuda_graph_free(void *exec) {
    if (exec) cudaGraphExecDestroy((cudaGraphExec_t)exec);
}
