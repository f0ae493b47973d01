// device.cu: device selection, memory, copies, streams and CUDA graphs; the public device queries.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

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

int64_t cuda_sm_count(void) {
    static const int64_t n = [] {
        int dev = 0, v = 0;
        if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
            (void)cudaGetLastError(); // not fatal: assume one
        return (int64_t)(v > 0 ? v : 1);
    }();
    return n;
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

// every live device allocation and its size, so the library can say how many device bytes it holds
// (a VRAM budget is checked against this count)
static pthread_mutex_t g_alloc_lock = PTHREAD_MUTEX_INITIALIZER;
static struct cuda_alloc { void *ptr; size_t size; } *g_allocs;
static int g_n_allocs, g_cap_allocs;
static size_t g_allocated, g_peak; // bytes held now; the most held since ggml_cuda_peak_reset

static bool alloc_remember(void *ptr, size_t size) {
    pthread_mutex_lock(&g_alloc_lock);
    bool ok = true;
    if (g_n_allocs == g_cap_allocs) {
        int cap = g_cap_allocs ? 2 * g_cap_allocs : 256;
        struct cuda_alloc *a = (struct cuda_alloc *)realloc(g_allocs, (size_t)cap * sizeof *a);
        if (a) {
            g_allocs = a;
            g_cap_allocs = cap;
        } else {
            ok = false;
        }
    }
    if (ok) {
        g_allocs[g_n_allocs++] = {ptr, size};
        g_allocated += size;
        if (g_allocated > g_peak) g_peak = g_allocated;
    }
    pthread_mutex_unlock(&g_alloc_lock);
    return ok;
}

static void alloc_forget(void *ptr) {
    pthread_mutex_lock(&g_alloc_lock);
    for (int i = g_n_allocs - 1; i >= 0; i--)
        if (g_allocs[i].ptr == ptr) {
            g_allocated -= g_allocs[i].size;
            g_allocs[i] = g_allocs[--g_n_allocs];
            break;
        }
    pthread_mutex_unlock(&g_alloc_lock);
}

// device memory without initialising the device first (ggml_cuda_init's own allocations use it)
int cuda_device_alloc(void **ptr, size_t size) {
    *ptr = NULL;
    cudaError_t err = cudaMalloc(ptr, size + CUDA_ALLOC_SLACK);
    if (err != cudaSuccess) {
        cudaGetLastError();
        *ptr = NULL;
        return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "cudaMalloc of %zu bytes: %s", size, cudaGetErrorString(err));
    }
    if (!alloc_remember(*ptr, size + CUDA_ALLOC_SLACK)) {
        cudaFree(*ptr);
        *ptr = NULL;
        return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of host memory for the device allocation table");
    }
    return GGML_STATUS_OK;
}

extern "C" int ggml_cuda_malloc(void **ptr, size_t size) {
    *ptr = NULL;
    int st = ggml_cuda_init();
    return st ? st : cuda_device_alloc(ptr, size);
}

extern "C" void ggml_cuda_free(void *ptr) {
    if (!ptr) return;
    alloc_forget(ptr);
    cudaFree(ptr);
}

extern "C" size_t ggml_cuda_allocated(void) {
    pthread_mutex_lock(&g_alloc_lock);
    size_t n = g_allocated;
    pthread_mutex_unlock(&g_alloc_lock);
    return n;
}

extern "C" size_t ggml_cuda_peak_reset(void) {
    pthread_mutex_lock(&g_alloc_lock);
    size_t n = g_peak = g_allocated;
    pthread_mutex_unlock(&g_alloc_lock);
    return n;
}

extern "C" size_t ggml_cuda_allocated_peak(void) {
    pthread_mutex_lock(&g_alloc_lock);
    size_t n = g_peak;
    pthread_mutex_unlock(&g_alloc_lock);
    return n;
}

extern "C" int ggml_cuda_host_register(void *ptr, size_t size, bool read_only) {
    int st = ggml_cuda_init();
    if (st) return st;
    const cudaError_t err = cudaHostRegister(ptr, size, read_only ? cudaHostRegisterReadOnly : cudaHostRegisterDefault);
    // a refusal (memory already registered: small arrays share pages) is the caller's to handle, not the next
    // launch's error
    if (err != cudaSuccess) cudaGetLastError();
    return cuda_status(err, "host register");
}

extern "C" void ggml_cuda_host_unregister(void *ptr) {
    if (ptr && cudaHostUnregister(ptr) != cudaSuccess) cudaGetLastError();
}

extern "C" int ggml_cuda_mem_info(size_t *free_bytes, size_t *total_bytes) {
    *free_bytes = *total_bytes = 0;
    if (ggml_cuda_device_count() == 0) return GGML_STATUS_OK;
    int st = ggml_cuda_init();
    return st ? st : cuda_status(cudaMemGetInfo(free_bytes, total_bytes), "memory info");
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

extern "C" int ggml_cuda_memcpy_2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                                   size_t height, void *stream) {
    if (width == 0 || height == 0) return GGML_STATUS_OK;
    return cuda_status(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDefault,
                                         (cudaStream_t)stream), "2-D memcpy");
}

extern "C" int ggml_cuda_event_new(void **event, bool timing) {
    *event = NULL;
    int st = ggml_cuda_init();
    if (st) return st;
    cudaEvent_t e;
    if ((st = cuda_status(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming),
                          "event create")))
        return st;
    *event = e;
    return GGML_STATUS_OK;
}

extern "C" void ggml_cuda_event_free(void *event) {
    if (event) cudaEventDestroy((cudaEvent_t)event);
}

extern "C" int ggml_cuda_event_record(void *event, void *stream) {
    return cuda_status(cudaEventRecord((cudaEvent_t)event, (cudaStream_t)stream), "event record");
}

extern "C" int ggml_cuda_event_done(void *event, bool *done) {
    cudaError_t err = cudaEventQuery((cudaEvent_t)event);
    *done = err == cudaSuccess;
    if (err == cudaErrorNotReady) return GGML_STATUS_OK;
    return cuda_status(err, "event query");
}

extern "C" int ggml_cuda_event_elapsed_ms(void *from, void *to, float *ms) {
    return cuda_status(cudaEventElapsedTime(ms, (cudaEvent_t)from, (cudaEvent_t)to), "event elapsed time");
}

extern "C" int ggml_cuda_stream_done(void *stream, bool *done) {
    cudaError_t err = cudaStreamQuery((cudaStream_t)stream);
    *done = err == cudaSuccess;
    if (err == cudaErrorNotReady) return GGML_STATUS_OK;
    return cuda_status(err, "stream query");
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
