// threadpool.c: persistent workers that run a whole graph together, node by node, with a spinning
// barrier between nodes (a node is microseconds long, too short for a sleep/wake). Between graphs the
// workers sleep on a condition variable so an idle engine costs no CPU.
#include "ops.h"
#include "../graph.h"
#include "../cuda/cuda.h"

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

struct ggml_threadpool {
    int n_threads;
    pthread_t *workers;          // (n_threads - 1) the caller is thread 0

    pthread_mutex_t mutex;
    pthread_cond_t cond;
    int generation;              // bumped for each graph; workers wake when it changes
    bool stop;

    struct ggml_cgraph *graph;   // the graph being computed
    void *wdata;                 // (wsize) scratch shared by the threads
    size_t wsize;

    // row-chunk counters of consecutive CPU nodes (see graph_run), each on a cache line of its own: the
    // barrier's lines are polled while they are being taken
    struct { _Alignas(64) atomic_int next; } chunk[2];
    atomic_int barrier_count;
    atomic_int barrier_phase;
    atomic_int barrier_sleepers; // threads asleep on barrier_phase
    atomic_int n_done;           // workers finished with the current graph
    atomic_int status;           // first failure of any thread
    char error[512];
};

// sleeps while *addr == val (or returns at once if it already differs)
static void futex_wait(atomic_int *addr, int val) { syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0); }
static void futex_wake_all(atomic_int *addr) { syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0); }

// spin briefly (the common case: the others are a few microseconds behind), then sleep on a futex, so
// a thread whose partner was descheduled gives its core back instead of burning the time slice
void ggml_barrier(struct ggml_threadpool *tp) {
    if (tp->n_threads == 1) return;
    int phase = atomic_load_explicit(&tp->barrier_phase, memory_order_relaxed);
    if (atomic_fetch_add_explicit(&tp->barrier_count, 1, memory_order_acq_rel) == tp->n_threads - 1) {
        atomic_store_explicit(&tp->barrier_count, 0, memory_order_relaxed);
        // seq_cst on both sides: a sleeper announces itself then rechecks the phase; the waker bumps the
        // phase then checks for sleepers; one of the two always sees the other
        atomic_fetch_add_explicit(&tp->barrier_phase, 1, memory_order_seq_cst);
        if (atomic_load_explicit(&tp->barrier_sleepers, memory_order_seq_cst)) futex_wake_all(&tp->barrier_phase);
        return;
    }
    for (int spins = 0; spins < 2048; spins++) {
        if (atomic_load_explicit(&tp->barrier_phase, memory_order_acquire) != phase) return;
        _mm_pause();
    }
    atomic_fetch_add_explicit(&tp->barrier_sleepers, 1, memory_order_seq_cst);
    while (atomic_load_explicit(&tp->barrier_phase, memory_order_seq_cst) == phase) futex_wait(&tp->barrier_phase, phase);
    atomic_fetch_sub_explicit(&tp->barrier_sleepers, 1, memory_order_acq_rel);
}

static void pool_record_error(struct ggml_threadpool *tp, int status) {
    int expected = GGML_STATUS_OK;
    if (atomic_compare_exchange_strong(&tp->status, &expected, status))
        snprintf(tp->error, sizeof tp->error, "%s", ggml_last_error());
}

// the CUDA-only tail: replayed from its capture when there is one, captured on the second compute
// (the first one warms up libraries whose set-up cannot be captured), launched op by op otherwise
static int run_cuda_tail(struct ggml_cgraph *g) {
    static int graphs_off = -1;
    if (graphs_off < 0) graphs_off = getenv("PYINFER_NO_CUDA_GRAPHS") != NULL;
    if (g->cuda_graph) return ggml_cuda_graph_launch(g->cuda_graph, g->stream);
    bool capture = !graphs_off && g->n_computes == 1 && g->n_nodes - g->capture_from > 1;
    if (capture && ggml_cuda_graph_capture_begin(g->stream) != GGML_STATUS_OK) capture = false;
    int st = GGML_STATUS_OK;
    for (int i = g->capture_from; i < g->n_nodes && !st; i++)
        st = ggml_graph_run_cuda_node(g, i);
    if (!capture) return st;
    void *exec = NULL;
    int cap_st = ggml_cuda_graph_capture_end(g->stream, &exec);
    if (st == GGML_STATUS_OK && cap_st == GGML_STATUS_OK) {
        g->cuda_graph = exec;
        return ggml_cuda_graph_launch(exec, g->stream);
    }
    if (exec) ggml_cuda_graph_free(exec);
    g->n_computes = 2; // capture failed: run op by op from now on
    ggml_clear_error();
    for (int i = g->capture_from; i < g->n_nodes && !st; i++)
        st = ggml_graph_run_cuda_node(g, i);
    return st;
}

static void graph_run(struct ggml_threadpool *tp, int ith) {
    struct ggml_compute_params params = {
        .ith = ith, .nth = tp->n_threads, .wdata = tp->wdata, .wsize = tp->wsize, .tp = tp};
    struct ggml_cgraph *g = tp->graph;
    int first = 0, n_cpu = 0; // CPU nodes run so far: node n_cpu hands out chunks from chunk[n_cpu & 1]
    if (g->stream) { // device work is issued by thread 0 alone; uploads read leaves nobody writes now
        first = g->n_uploads;
        int st = ith == 0 ? ggml_graph_run_uploads(g) : GGML_STATUS_OK;
        if (st) pool_record_error(tp, st);
    }
    for (int i = first; i < g->n_nodes; i++) {
        struct ggml_tensor *node = g->nodes[i];
        if (node->op == GGML_OP_VIEW) continue;
        if (node->backend == GGML_BACKEND_CUDA) { // stream-ordered: no barrier
            if (ith != 0) continue;
            int st;
            if (i == g->capture_from) {
                st = run_cuda_tail(g);
                i = g->n_nodes;
            } else {
                st = node->op == GGML_OP_TRANSFER ? ggml_graph_run_transfer(g, node) : ggml_graph_run_cuda_node(g, i);
            }
            if (st) pool_record_error(tp, st);
            continue;
        }
        // the other counter was last used by the node before the previous barrier: free to reset for the next
        if (ith == 0) atomic_store_explicit(&tp->chunk[(n_cpu + 1) & 1].next, 0, memory_order_relaxed);
        params.chunk_next = &tp->chunk[n_cpu++ & 1].next;
        int st = node->op == GGML_OP_TRANSFER ? (ith == 0 ? ggml_graph_run_transfer(g, node) : GGML_STATUS_OK)
                                              : ggml_cpu_forward(&params, node);
        if (st) pool_record_error(tp, st);
        ggml_barrier(tp);
        if (atomic_load_explicit(&tp->status, memory_order_relaxed)) return; // every thread sees it after the barrier
    }
    if (g->stream && ith == 0) {
        int st = ggml_cuda_stream_sync(g->stream);
        if (st) pool_record_error(tp, st);
    }
}

static void *worker_main(void *arg) {
    struct ggml_threadpool *tp = arg;
    int ith;
    // the worker's index is its position in the workers array, found once
    pthread_mutex_lock(&tp->mutex);
    for (ith = 0; ith < tp->n_threads - 1; ith++)
        if (pthread_equal(tp->workers[ith], pthread_self())) break;
    ith += 1;
    int seen = 0;
    for (;;) {
        while (tp->generation == seen && !tp->stop) pthread_cond_wait(&tp->cond, &tp->mutex);
        if (tp->stop) break;
        seen = tp->generation;
        pthread_mutex_unlock(&tp->mutex);
        graph_run(tp, ith);
        atomic_fetch_add_explicit(&tp->n_done, 1, memory_order_release);
        pthread_mutex_lock(&tp->mutex);
    }
    pthread_mutex_unlock(&tp->mutex);
    return NULL;
}

struct ggml_threadpool *ggml_threadpool_new(int n_threads) {
    if (n_threads < 1 || n_threads > 512) {
        ggml_set_error(GGML_STATUS_INVALID_ARG, "thread count must be 1..512, not %d", n_threads);
        return NULL;
    }
    ggml_quants_init();
    struct ggml_threadpool *tp = calloc(1, sizeof *tp);
    if (!tp || !(tp->workers = calloc((size_t)n_threads, sizeof *tp->workers))) {
        free(tp);
        ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory for a thread pool");
        return NULL;
    }
    tp->n_threads = n_threads;
    pthread_mutex_init(&tp->mutex, NULL);
    pthread_cond_init(&tp->cond, NULL);
    pthread_mutex_lock(&tp->mutex); // workers find their index only once all are created
    for (int i = 0; i < n_threads - 1; i++) {
        if (pthread_create(&tp->workers[i], NULL, worker_main, tp) != 0) {
            tp->n_threads = i + 1;
            tp->stop = true;
            pthread_mutex_unlock(&tp->mutex);
            ggml_threadpool_free(tp);
            ggml_set_error(GGML_STATUS_ALLOC_FAILED, "cannot start thread %d", i + 1);
            return NULL;
        }
    }
    pthread_mutex_unlock(&tp->mutex);
    return tp;
}

void ggml_threadpool_free(struct ggml_threadpool *tp) {
    if (!tp) return;
    pthread_mutex_lock(&tp->mutex);
    tp->stop = true;
    pthread_cond_broadcast(&tp->cond);
    pthread_mutex_unlock(&tp->mutex);
    for (int i = 0; i < tp->n_threads - 1; i++) pthread_join(tp->workers[i], NULL);
    pthread_mutex_destroy(&tp->mutex);
    pthread_cond_destroy(&tp->cond);
    free(tp->wdata);
    free(tp->workers);
    free(tp);
}

int ggml_threadpool_n_threads(const struct ggml_threadpool *tp) { return tp ? tp->n_threads : 0; }

int ggml_graph_compute(struct ggml_cgraph *g, struct ggml_threadpool *tp) {
    if (!g || !tp) return ggml_set_error(GGML_STATUS_INVALID_ARG, "null graph or thread pool");
    if (!g->planned) return ggml_set_error(GGML_STATUS_INVALID_ARG, "graph not planned: call ggml_graph_plan first");
    size_t wsize = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        if (g->nodes[i]->backend != GGML_BACKEND_CPU) continue;
        size_t w = ggml_cpu_op_wsize(g->nodes[i], tp->n_threads);
        if (w > wsize) wsize = w;
    }
    if (wsize > tp->wsize) {
        void *w = aligned_alloc(64, (wsize + 63) / 64 * 64);
        if (!w) return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "cannot allocate %zu bytes of scratch", wsize);
        free(tp->wdata);
        tp->wdata = w;
        tp->wsize = wsize;
    }
    tp->graph = g;
    atomic_store(&tp->chunk[0].next, 0);
    atomic_store(&tp->chunk[1].next, 0);
    atomic_store(&tp->status, GGML_STATUS_OK);
    atomic_store(&tp->n_done, 0);
    pthread_mutex_lock(&tp->mutex);
    tp->generation++;
    pthread_cond_broadcast(&tp->cond);
    pthread_mutex_unlock(&tp->mutex);
    graph_run(tp, 0);
    // workers may still be leaving graph_run; the next compute must not reset state under them
    while (atomic_load_explicit(&tp->n_done, memory_order_acquire) < tp->n_threads - 1) _mm_pause();
    g->n_computes++;
    int st = atomic_load(&tp->status);
    if (st) return ggml_set_error(st, "%s", tp->error);
    return GGML_STATUS_OK;
}
