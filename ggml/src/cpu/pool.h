// pool.h: the thread pool's primitives for executors: run a function on every thread, compute a thread's
// share of one CPU node, meet at a barrier, record the first failure. The CPU-only graph executor
// (threadpool.c) and the engine's CPU+GPU executor (native/src/executor.c) are built from them.
#pragma once
#include "ops.h"

struct ggml_cgraph;

// called by each of the pool's threads, ith = 0 on the caller's thread
typedef void (*ggml_threadpool_fn)(struct ggml_threadpool *tp, int ith, void *arg);

// runs fn on every thread and returns when all are done: the first failure recorded, or GGML_STATUS_OK
int ggml_threadpool_run(struct ggml_threadpool *tp, ggml_threadpool_fn fn, void *arg);
// scratch for the CPU nodes of g (before a run)
int ggml_threadpool_reserve(struct ggml_threadpool *tp, const struct ggml_cgraph *g);
// thread ith's share of a CPU node, seq counting the CPU nodes of this run from 0 (its chunk counter);
// a failure is recorded for the run; the caller meets the others at ggml_barrier before the next node
int ggml_threadpool_compute_node(struct ggml_threadpool *tp, int ith, struct ggml_tensor *node, int seq);
// ggml_barrier for a wait that may be long (thread 0 waiting for the GPU): spins longer before sleeping
void ggml_barrier_patient(struct ggml_threadpool *tp);
// records a failure (the first one wins, with ggml_last_error's message) / reads the run's status
void ggml_threadpool_fail(struct ggml_threadpool *tp, int status);
int ggml_threadpool_status(struct ggml_threadpool *tp);
