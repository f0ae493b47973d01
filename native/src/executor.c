// executor.c: runs a planned graph on the CPU thread pool and the GPU stream at the same time.
//
// The planner (ggml/src/graph.c) gives every node a device and puts transfers on the edges between them,
// downloads (GPU -> host) right after the data they carry exists. From that order this file makes a
// schedule of three kinds of items:
//   GPU    a run of consecutive stream operations (kernels, uploads, downloads), issued by thread 0 without
//          waiting: op by op on the first compute, captured as a CUDA graph on the second, replayed after;
//   EVENT  an event recorded after a run of downloads: the host's signal that their bytes have landed;
//   CPU    a CPU node that every thread of the pool computes its share of, after thread 0 has seen the
//          event of the downloads it reads.
// So in a split FFN layer the stream starts the hot neurons right after the downloads of x and the mask,
// while the pool computes the cold neurons; the upload of their sum and the add start the next GPU run.
#include "pyinfer_native.h"

#include "cpu/pool.h"
#include "cuda/cuda.h"
#include "graph.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum item_kind { ITEM_GPU, ITEM_EVENT, ITEM_CPU };

struct item {
    enum item_kind kind;
    int first, end;    // GPU: nodes [first, end) issued in order
    int node;          // CPU: the node
    int event;         // EVENT: the event it records; CPU: the event it waits for (-1: none)
    void *cuda_graph;  // GPU: the captured run, replayed from the third compute on
    bool eager;        // GPU: its capture failed once, so it is issued op by op
};

struct exec {
    struct ggml_cgraph *g;
    struct item *items;  // (n_items) in issue order
    int n_items;
    void **events;       // (n_events) download events, no timing
    int n_events;
    int n_computes;
    bool graphs_off;     // PYINFER_NO_CUDA_GRAPHS=1: every run op by op
    // timing, when asked for: a reference event, one before and one after each GPU item, host clocks
    bool timed;
    void *t_ref;
    void **t_start, **t_end; // (n_items)
    double *cpu_t0, *cpu_t1; // (n_items) ms since host_ref, CPU items
    double host_ref;
    double wait_ms;          // thread 0 waiting for events in the last compute
    struct pyinfer_step_stats stats;
};

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return 1e3 * (double)ts.tv_sec + 1e-6 * (double)ts.tv_nsec;
}

static void exec_free(void *p) {
    struct exec *x = p;
    if (!x) return;
    for (int k = 0; k < x->n_items; k++) {
        ggml_cuda_graph_free(x->items[k].cuda_graph);
        if (x->t_start) ggml_cuda_event_free(x->t_start[k]);
        if (x->t_end) ggml_cuda_event_free(x->t_end[k]);
    }
    for (int e = 0; e < x->n_events; e++) ggml_cuda_event_free(x->events[e]);
    ggml_cuda_event_free(x->t_ref);
    free(x->items), free(x->events), free(x->t_start), free(x->t_end), free(x->cpu_t0), free(x->cpu_t1);
    free(x);
}

static bool is_stream_op(const struct ggml_tensor *t) {
    return t->backend == GGML_BACKEND_CUDA || t->op == GGML_OP_TRANSFER;
}

static bool is_upload_from_cpu_node(const struct ggml_cgraph *g, int i) {
    const struct ggml_tensor *t = g->nodes[i];
    return t->op == GGML_OP_TRANSFER && t->backend == GGML_BACKEND_CUDA && i >= g->n_uploads;
}

static struct item *push(struct exec *x, enum item_kind kind) {
    struct item *it = &x->items[x->n_items++];
    *it = (struct item){.kind = kind, .node = -1, .event = -1};
    return it;
}

// the schedule of a planned graph (see the top of the file)
static int exec_build(struct exec *x) {
    struct ggml_cgraph *g = x->g;
    int n = g->n_nodes;
    // at most one item per node plus one event before each CPU node
    x->items = calloc((size_t)2 * n + 1, sizeof *x->items);
    x->events = calloc((size_t)n + 1, sizeof *x->events);
    int *event_of = malloc(((size_t)n + 1) * sizeof *event_of); // download node -> its event
    int *item_of_event = malloc(((size_t)n + 1) * sizeof *item_of_event);
    if (!x->items || !x->events || !event_of || !item_of_event) {
        free(event_of), free(item_of_event);
        return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory for a schedule");
    }
    struct item *gpu = NULL;   // the GPU item being extended
    int first_unsignalled = -1; // first download since the last event
    int last_upload_item = -1;  // the last GPU item holding an upload of a CPU node's output
    int synced_item = -1;       // the host has seen the stream pass the end of this item
    int status = GGML_STATUS_OK;
    for (int i = 0; i < n && !status; i++) {
        struct ggml_tensor *t = g->nodes[i];
        event_of[i] = -1;
        if (t->op == GGML_OP_VIEW) continue;
        if (is_stream_op(t)) {
            if (!gpu) {
                gpu = push(x, ITEM_GPU);
                gpu->first = i;
            }
            gpu->end = i + 1;
            if (is_upload_from_cpu_node(g, i)) last_upload_item = (int)(gpu - x->items);
            if (!ggml_is_download(t)) continue;
            if (first_unsignalled < 0) first_unsignalled = i;
            int next = i + 1;
            while (next < n && g->nodes[next]->op == GGML_OP_VIEW) next++;
            if (next < n && ggml_is_download(g->nodes[next])) continue;
            // the end of a run of downloads: an event tells the host when they are in
            gpu = NULL;
            struct item *ev = push(x, ITEM_EVENT);
            ev->event = x->n_events;
            item_of_event[x->n_events] = (int)(ev - x->items);
            status = ggml_cuda_event_new(&x->events[x->n_events++], false);
            for (int j = first_unsignalled; j <= i; j++) event_of[j] = ev->event;
            first_unsignalled = -1;
            continue;
        }
        gpu = NULL;
        int wait = -1;
        for (int s = 0; s < GGML_MAX_SRC; s++) {
            const struct ggml_tensor *src = t->src[s] && t->src[s]->view_src ? t->src[s]->view_src : t->src[s];
            if (!src || !ggml_is_download(src)) continue;
            for (int k = i - 1; k >= 0; k--)
                if (g->nodes[k] == src) {
                    if (event_of[k] > wait) wait = event_of[k];
                    break;
                }
        }
        // an upload issued since the host last saw the stream may still be reading a CPU tensor whose
        // memory this node reuses: wait for the stream to pass it first
        int waited_item = wait >= 0 ? item_of_event[wait] : -1;
        if (last_upload_item > synced_item && last_upload_item > waited_item) {
            struct item *ev = push(x, ITEM_EVENT);
            ev->event = x->n_events;
            item_of_event[x->n_events] = (int)(ev - x->items);
            status = ggml_cuda_event_new(&x->events[x->n_events++], false);
            wait = ev->event;
            waited_item = (int)(ev - x->items);
        }
        if (waited_item > synced_item) synced_item = waited_item;
        struct item *cpu = push(x, ITEM_CPU);
        cpu->node = i;
        cpu->event = wait;
    }
    free(event_of), free(item_of_event);
    return status;
}

static int exec_set_timed(struct exec *x, bool timed) {
    x->timed = timed;
    if (!timed || x->t_start || !x->g->stream) return GGML_STATUS_OK;
    x->t_start = calloc((size_t)x->n_items + 1, sizeof *x->t_start);
    x->t_end = calloc((size_t)x->n_items + 1, sizeof *x->t_end);
    if (!x->t_start || !x->t_end) return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory for timing events");
    int st = ggml_cuda_event_new(&x->t_ref, true);
    for (int k = 0; k < x->n_items && !st; k++) {
        if (x->items[k].kind != ITEM_GPU) continue;
        st = ggml_cuda_event_new(&x->t_start[k], true);
        if (!st) st = ggml_cuda_event_new(&x->t_end[k], true);
    }
    return st;
}

static struct exec *exec_of(struct ggml_cgraph *g) {
    if (g->exec) return g->exec;
    struct exec *x = calloc(1, sizeof *x);
    if (!x) {
        ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory for an executor");
        return NULL;
    }
    x->g = g;
    x->graphs_off = getenv("PYINFER_NO_CUDA_GRAPHS") != NULL;
    x->cpu_t0 = calloc((size_t)2 * g->n_nodes + 1, sizeof *x->cpu_t0);
    x->cpu_t1 = calloc((size_t)2 * g->n_nodes + 1, sizeof *x->cpu_t1);
    int st = x->cpu_t0 && x->cpu_t1 ? exec_build(x) : ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory");
    if (st) {
        exec_free(x);
        return NULL;
    }
    g->exec = x;
    g->exec_free = exec_free;
    return x;
}

// ---------------------------------------------------------------------------------------------------
// running
// ---------------------------------------------------------------------------------------------------

static int issue_nodes(struct ggml_cgraph *g, int first, int end) {
    int st = GGML_STATUS_OK;
    for (int i = first; i < end && !st; i++) {
        struct ggml_tensor *t = g->nodes[i];
        if (t->op == GGML_OP_VIEW) continue;
        st = t->op == GGML_OP_TRANSFER ? ggml_graph_run_transfer(g, t) : ggml_graph_run_cuda_node(g, i);
    }
    return st;
}

// a GPU item: replayed when captured; captured on the second compute (the first warms up libraries
// whose set-up cannot be captured); op by op otherwise
static int issue_gpu(struct exec *x, struct item *it) {
    struct ggml_cgraph *g = x->g;
    if (it->cuda_graph) return ggml_cuda_graph_launch(it->cuda_graph, g->stream);
    if (x->graphs_off || it->eager || x->n_computes != 1) return issue_nodes(g, it->first, it->end);
    int st = ggml_cuda_graph_capture_begin(g->stream);
    if (!st) {
        int issued = issue_nodes(g, it->first, it->end);
        void *exec = NULL;
        st = ggml_cuda_graph_capture_end(g->stream, &exec);
        if (!st && !issued) {
            it->cuda_graph = exec;
            return ggml_cuda_graph_launch(exec, g->stream);
        }
        ggml_cuda_graph_free(exec);
    }
    it->eager = true; // not capturable: run it op by op from now on
    ggml_clear_error();
    return issue_nodes(g, it->first, it->end);
}

static int wait_event(struct exec *x, int event) {
    double t0 = now_ms();
    for (;;) {
        bool done = false;
        int st = ggml_cuda_event_done(x->events[event], &done);
        if (st || done) {
            x->wait_ms += now_ms() - t0;
            return st;
        }
        for (int i = 0; i < 16; i++) _mm_pause();
    }
}

static void exec_run(struct ggml_threadpool *tp, int ith, void *arg) {
    struct exec *x = arg;
    struct ggml_cgraph *g = x->g;
    int seq = 0; // CPU nodes so far
    for (int k = 0; k < x->n_items; k++) {
        struct item *it = &x->items[k];
        if (it->kind != ITEM_CPU) { // stream work is issued by thread 0 alone, and nobody waits for it here
            if (ith != 0 || ggml_threadpool_status(tp)) continue;
            int st;
            if (it->kind == ITEM_EVENT) {
                st = ggml_cuda_event_record(x->events[it->event], g->stream);
            } else {
                if (x->timed) ggml_cuda_event_record(x->t_start[k], g->stream);
                st = issue_gpu(x, it);
                if (x->timed && !st) st = ggml_cuda_event_record(x->t_end[k], g->stream);
            }
            if (st) ggml_threadpool_fail(tp, st);
            continue;
        }
        if (it->event >= 0) { // its inputs come from the GPU: thread 0 waits, the others at the barrier
            if (ith == 0 && !ggml_threadpool_status(tp)) {
                int st = wait_event(x, it->event);
                if (st) ggml_threadpool_fail(tp, st);
            }
            ggml_barrier_patient(tp);
            if (ggml_threadpool_status(tp)) return;
        }
        if (ith == 0) x->cpu_t0[k] = now_ms() - x->host_ref;
        ggml_threadpool_compute_node(tp, ith, g->nodes[it->node], seq++);
        ggml_barrier(tp);
        if (ith == 0) x->cpu_t1[k] = now_ms() - x->host_ref;
        if (ggml_threadpool_status(tp)) return; // every thread sees it after the barrier
    }
}

// total length of the union of intervals [a[i], b[i]) (sorted in place by start)
struct span {
    double a, b;
};

static int span_cmp(const void *p, const void *q) {
    double d = ((const struct span *)p)->a - ((const struct span *)q)->a;
    return (d > 0) - (d < 0);
}

static double union_length(struct span *s, int n) {
    qsort(s, (size_t)n, sizeof *s, span_cmp);
    double total = 0, end = -INFINITY;
    for (int i = 0; i < n; i++) {
        double a = s[i].a > end ? s[i].a : end;
        if (s[i].b > a) total += s[i].b - a;
        if (s[i].b > end) end = s[i].b;
    }
    return total;
}

// GPU busy, CPU busy and their overlap from the last compute's intervals
static int exec_timings(struct exec *x) {
    int n_gpu = 0, n_cpu = 0;
    struct span *gpu = malloc(((size_t)x->n_items + 1) * sizeof *gpu);
    struct span *cpu = malloc(((size_t)x->n_items + 1) * sizeof *cpu);
    struct span *both = malloc(((size_t)x->n_items + 1) * sizeof *both);
    if (!gpu || !cpu || !both) {
        free(gpu), free(cpu), free(both);
        return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory for timings");
    }
    int st = GGML_STATUS_OK;
    for (int k = 0; k < x->n_items && !st; k++) {
        const struct item *it = &x->items[k];
        if (it->kind == ITEM_CPU) {
            cpu[n_cpu++] = (struct span){x->cpu_t0[k], x->cpu_t1[k]};
        } else if (it->kind == ITEM_GPU && x->t_start) {
            float a, b;
            st = ggml_cuda_event_elapsed_ms(x->t_ref, x->t_start[k], &a);
            if (!st) st = ggml_cuda_event_elapsed_ms(x->t_ref, x->t_end[k], &b);
            gpu[n_gpu++] = (struct span){a, b};
        }
    }
    // overlap = |G| + |C| - |G u C|
    memcpy(both, gpu, (size_t)n_gpu * sizeof *gpu);
    memcpy(both + n_gpu, cpu, (size_t)n_cpu * sizeof *cpu);
    double g_busy = union_length(gpu, n_gpu), c_busy = union_length(cpu, n_cpu);
    double all = union_length(both, n_gpu + n_cpu);
    x->stats.gpu_busy_ms = g_busy;
    x->stats.cpu_busy_ms = c_busy;
    x->stats.overlap_ms = x->t_start ? g_busy + c_busy - all : 0.0;
    free(gpu), free(cpu), free(both);
    return st;
}

int pyinfer_graph_compute(struct ggml_cgraph *g, struct ggml_threadpool *tp) {
    if (!g || !tp) return ggml_set_error(GGML_STATUS_INVALID_ARG, "null graph or thread pool");
    if (!g->planned) return ggml_set_error(GGML_STATUS_INVALID_ARG, "graph not planned: call ggml_graph_plan first");
    struct exec *x = exec_of(g);
    if (!x) return ggml_last_status();
    int st = ggml_threadpool_reserve(tp, g);
    if (st) return st;
    x->wait_ms = 0;
    double t0 = now_ms();
    x->host_ref = t0;
    if (g->stream) {
        if (x->timed && x->t_start) st = ggml_cuda_event_record(x->t_ref, g->stream); // the stream is idle here
        ggml_graph_stage_uploads(g);
    }
    if (!st) st = ggml_threadpool_run(tp, exec_run, x);
    // whatever was issued must finish before the caller reads outputs or writes inputs, also after a failure
    int sync = g->stream ? ggml_cuda_stream_sync(g->stream) : GGML_STATUS_OK;
    if (!st) st = sync;
    x->n_computes++;
    x->stats.wall_ms = now_ms() - t0;
    x->stats.wait_ms = x->wait_ms;
    x->stats.timed = x->timed && g->stream;
    if (!st) st = exec_timings(x);
    if (!g->stream) x->stats.gpu_busy_ms = x->stats.overlap_ms = 0.0;
    return st;
}

int pyinfer_graph_set_timed(struct ggml_cgraph *g, bool timed) {
    if (!g || !g->planned) return ggml_set_error(GGML_STATUS_INVALID_ARG, "graph not planned");
    struct exec *x = exec_of(g);
    return x ? exec_set_timed(x, timed) : ggml_last_status();
}

int pyinfer_graph_stats(const struct ggml_cgraph *g, struct pyinfer_step_stats *out) {
    if (!g || !out) return ggml_set_error(GGML_STATUS_INVALID_ARG, "null graph or stats");
    const struct exec *x = g->exec;
    memset(out, 0, sizeof *out);
    if (!x) return GGML_STATUS_OK;
    *out = x->stats;
    for (int k = 0; k < x->n_items; k++) {
        const struct item *it = &x->items[k];
        out->n_gpu_runs += it->kind == ITEM_GPU;
        out->n_replayed += it->kind == ITEM_GPU && it->cuda_graph;
        out->n_cpu_nodes += it->kind == ITEM_CPU;
        out->n_waits += it->kind == ITEM_CPU && it->event >= 0;
    }
    return GGML_STATUS_OK;
}
