// threadpool.c: persistent workers that run a function together (a graph, node by node, with a spinning
// barrier between nodes: a node is microseconds long, too short for a sleep/wake). Between runs the
// workers poll for the next one a while (a decoding loop starts it within tens of microseconds), then
// sleep on a condition variable so an idle engine costs no CPU. The CPU-only graph executor is
// here; graphs with a GPU part are scheduled by the engine (native/src/executor.c) with the same primitives.
#include "pool.h"
#include "../graph.h"

#include <immintrin.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define POLL_MS 1.0               // a worker polls this long for the next run before it sleeps
#define BARRIER_SPIN_MS 1.0       // the longest a thread spins at a barrier before it sleeps (ggml_barrier)
#define BARRIER_SPIN_MIN_MS 0.02  // the shortest, on an oversubscribed host
#define BARRIER_SPIN_GROWTH 1.0625 // a wait that did not run out lengthens the spin by this factor
#define PATIENT_SPIN_MS 4.0       // the spin while thread 0 waits for the GPU (ggml_barrier_patient)

struct ggml_threadpool {
    int n_threads;
    pthread_t *workers;          // (n_threads - 1) the caller is thread 0

    pthread_mutex_t mutex;
    pthread_cond_t cond;
    atomic_int generation;       // bumped for each graph (under the mutex); workers start when it changes
    bool stop;

    ggml_threadpool_fn fn;       // the work of the current run, called by every thread
    void *arg;
    void *wdata;                 // (wsize) scratch shared by the threads
    size_t wsize;

    // row-chunk counters of consecutive CPU nodes (see ggml_threadpool_compute_node), each on a cache line
    // of its own: the barrier's lines are polled while they are being taken
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

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return 1e3 * (double)ts.tv_sec + 1e-6 * (double)ts.tv_nsec;
}

// true once *word differs from seen within max_ms of spinning, false if it did not (the clock is read now and
// then: a pause lasts 10 to 150 cycles, by CPU)
static bool spin_until_changed(atomic_int *word, int seen, double max_ms) {
    double t0 = 0.0;
    for (int spins = 0;; spins++) {
        if (atomic_load_explicit(word, memory_order_acquire) != seen) return true;
        if (spins % 256 == 0) {
            const double now = now_ms();
            if (spins == 0) t0 = now;
            else if (now - t0 > max_ms) return false;
        }
        _mm_pause();
    }
}

// spin (the common case: the others are a few microseconds behind), then sleep on a futex. How long a thread
// spins adapts to the host, per thread: a sleeping thread's core is soon lent to another process (or its
// virtual CPU to another guest), and getting it back is what made decoding unsteady on a shared host, so
// the spin starts long; but where the host is oversubscribed a partner is off its core for a whole time
// slice and spinning only keeps it off longer, so each wait that runs out halves the spin, and each that
// does not lengthens it a little (docs/BENCHMARKS.md, "CPU steadiness")
static _Thread_local double spin_ms = BARRIER_SPIN_MS;

// true if the others arrived within max_ms of spinning, false if this thread had to sleep
static bool barrier_wait(struct ggml_threadpool *tp, double max_ms) {
    if (tp->n_threads == 1) return true;
    int phase = atomic_load_explicit(&tp->barrier_phase, memory_order_relaxed);
    if (atomic_fetch_add_explicit(&tp->barrier_count, 1, memory_order_acq_rel) == tp->n_threads - 1) {
        atomic_store_explicit(&tp->barrier_count, 0, memory_order_relaxed);
        // seq_cst on both sides: a sleeper announces itself then rechecks the phase; the waker bumps the
        // phase then checks for sleepers; one of the two always sees the other
        atomic_fetch_add_explicit(&tp->barrier_phase, 1, memory_order_seq_cst);
        if (atomic_load_explicit(&tp->barrier_sleepers, memory_order_seq_cst)) futex_wake_all(&tp->barrier_phase);
        return true;
    }
    if (spin_until_changed(&tp->barrier_phase, phase, max_ms)) return true;
    atomic_fetch_add_explicit(&tp->barrier_sleepers, 1, memory_order_seq_cst);
    while (atomic_load_explicit(&tp->barrier_phase, memory_order_seq_cst) == phase) futex_wait(&tp->barrier_phase, phase);
    atomic_fetch_sub_explicit(&tp->barrier_sleepers, 1, memory_order_acq_rel);
    return false;
}

void ggml_barrier(struct ggml_threadpool *tp) {
    spin_ms = barrier_wait(tp, spin_ms) ? fmin(spin_ms * BARRIER_SPIN_GROWTH, BARRIER_SPIN_MS)
                                        : fmax(spin_ms / 2, BARRIER_SPIN_MIN_MS);
}

// while thread 0 waits for the GPU the others may wait a whole GPU run (up to milliseconds): waking them
// from a futex would cost as much again, so they spin longer before they sleep. A GPU run that outlasts the
// spin says nothing of the host, so this wait does not adapt
void ggml_barrier_patient(struct ggml_threadpool *tp) { barrier_wait(tp, PATIENT_SPIN_MS); }

void ggml_threadpool_fail(struct ggml_threadpool *tp, int status) {
    int expected = GGML_STATUS_OK;
    if (atomic_compare_exchange_strong(&tp->status, &expected, status))
        snprintf(tp->error, sizeof tp->error, "%s", ggml_last_error());
}

int ggml_threadpool_status(struct ggml_threadpool *tp) { return atomic_load_explicit(&tp->status, memory_order_relaxed); }

int ggml_threadpool_compute_node(struct ggml_threadpool *tp, int ith, struct ggml_tensor *node, int seq) {
    // node seq hands out chunks from counter seq & 1; the other one was last used by the node before the
    // previous barrier, so it is free to reset for the next
    if (ith == 0) atomic_store_explicit(&tp->chunk[(seq + 1) & 1].next, 0, memory_order_relaxed);
    struct ggml_compute_params params = {.ith = ith, .nth = tp->n_threads, .wdata = tp->wdata, .wsize = tp->wsize,
                                         .tp = tp, .chunk_next = &tp->chunk[seq & 1].next};
    int st = ggml_cpu_forward(&params, node);
    if (st) ggml_threadpool_fail(tp, st);
    return st;
}

int ggml_threadpool_reserve(struct ggml_threadpool *tp, const struct ggml_cgraph *g) {
    size_t wsize = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        if (g->nodes[i]->backend != GGML_BACKEND_CPU || g->nodes[i]->op == GGML_OP_TRANSFER) continue;
        size_t w = ggml_cpu_op_wsize(g->nodes[i], tp->n_threads);
        if (w > wsize) wsize = w;
    }
    if (wsize <= tp->wsize) return GGML_STATUS_OK;
    void *w = aligned_alloc(64, (wsize + 63) / 64 * 64);
    if (!w) return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "cannot allocate %zu bytes of scratch", wsize);
    free(tp->wdata);
    tp->wdata = w;
    tp->wsize = wsize;
    return GGML_STATUS_OK;
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
    for (;;) { // the mutex is held here
        while (atomic_load_explicit(&tp->generation, memory_order_acquire) == seen && !tp->stop)
            pthread_cond_wait(&tp->cond, &tp->mutex);
        if (tp->stop) break;
        pthread_mutex_unlock(&tp->mutex);
        do { // a run's fn and arg are set before its generation is published
            seen = atomic_load_explicit(&tp->generation, memory_order_acquire);
            tp->fn(tp, ith, tp->arg);
            atomic_fetch_add_explicit(&tp->n_done, 1, memory_order_release);
        } while (spin_until_changed(&tp->generation, seen, POLL_MS));
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

int ggml_threadpool_run(struct ggml_threadpool *tp, ggml_threadpool_fn fn, void *arg) {
    tp->fn = fn;
    tp->arg = arg;
    atomic_store(&tp->chunk[0].next, 0);
    atomic_store(&tp->chunk[1].next, 0);
    atomic_store(&tp->status, GGML_STATUS_OK);
    atomic_store(&tp->n_done, 0);
    pthread_mutex_lock(&tp->mutex);
    atomic_fetch_add_explicit(&tp->generation, 1, memory_order_release);
    pthread_cond_broadcast(&tp->cond);
    pthread_mutex_unlock(&tp->mutex);
    fn(tp, 0, arg);
    // workers may still be leaving fn; the next run must not reset state under them
    while (atomic_load_explicit(&tp->n_done, memory_order_acquire) < tp->n_threads - 1) _mm_pause();
    int st = atomic_load(&tp->status);
    return st ? ggml_set_error(st, "%s", tp->error) : GGML_STATUS_OK;
}

// every thread walks the nodes; each computes its share of a node, then all meet at the barrier
static void cpu_graph_run(struct ggml_threadpool *tp, int ith, void *arg) {
    struct ggml_cgraph *g = arg;
    for (int i = 0, seq = 0; i < g->n_nodes; i++) {
        if (g->nodes[i]->op == GGML_OP_VIEW) continue;
        ggml_threadpool_compute_node(tp, ith, g->nodes[i], seq++);
        ggml_barrier(tp);
        if (ggml_threadpool_status(tp)) return; // every thread sees it after the barrier
    }
}

int ggml_graph_compute(struct ggml_cgraph *g, struct ggml_threadpool *tp) {
    if (!g || !tp) return ggml_set_error(GGML_STATUS_INVALID_ARG, "null graph or thread pool");
    if (!g->planned) return ggml_set_error(GGML_STATUS_INVALID_ARG, "graph not planned: call ggml_graph_plan first");
    if (g->stream)
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "this graph has a GPU part: the engine's executor runs it "
                                                       "(pyinfer_graph_compute)");
    int st = ggml_threadpool_reserve(tp, g);
    return st ? st : ggml_threadpool_run(tp, cpu_graph_run, g);
}
