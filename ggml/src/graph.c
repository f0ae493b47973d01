// graph.c: a graph is the topologically ordered list of op nodes that its outputs need. Planning gives
// every intermediate a place in one buffer, reusing the memory of tensors no later node reads.
#include "graph.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GRAPH_ALIGN 64

struct ggml_cgraph *ggml_graph_new(struct ggml_context *ctx) {
    (void)ctx; // graphs own their node list and buffer; the context owns the tensors
    struct ggml_cgraph *g = calloc(1, sizeof *g);
    if (!g) ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory for a graph");
    return g;
}

void ggml_graph_free(struct ggml_cgraph *g) {
    if (!g) return;
    if (g->exec_free) g->exec_free(g->exec);
    if (g->stream) ggml_cuda_stream_free(g->stream);
    if (g->dev_buffer) ggml_cuda_free(g->dev_buffer);
    if (g->dev_wdata) ggml_cuda_free(g->dev_wdata);
    if (g->staging) ggml_cuda_host_free(g->staging);
    if (g->stream) ggml_cuda_host_free(g->buffer);
    else free(g->buffer);
    free(g->staging_offs);
    free(g->groups);
    free(g->mirrors);
    free(g->uploads);
    free(g->nodes);
    free(g);
}

static int graph_push(struct ggml_cgraph *g, struct ggml_tensor *t) {
    if (g->n_nodes == g->cap_nodes) {
        int cap = g->cap_nodes ? 2 * g->cap_nodes : 256;
        struct ggml_tensor **nodes = realloc(g->nodes, (size_t)cap * sizeof *nodes);
        if (!nodes) return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory for graph nodes");
        g->nodes = nodes;
        g->cap_nodes = cap;
    }
    g->nodes[g->n_nodes++] = t;
    return GGML_STATUS_OK;
}

static bool graph_has(const struct ggml_cgraph *g, const struct ggml_tensor *t) {
    for (int i = g->n_nodes - 1; i >= 0; i--)
        if (g->nodes[i] == t) return true;
    return false;
}

// post-order walk so every node comes after its sources; leaves (weights, inputs) are not nodes
static int graph_visit(struct ggml_cgraph *g, struct ggml_tensor *t, int depth) {
    if (t->op == GGML_OP_NONE || graph_has(g, t)) return GGML_STATUS_OK;
    if (depth > 100000) return ggml_set_error(GGML_STATUS_INVALID_ARG, "graph too deep");
    for (int i = 0; i < GGML_MAX_SRC; i++) {
        if (!t->src[i]) continue;
        int st = graph_visit(g, t->src[i], depth + 1);
        if (st) return st;
    }
    return graph_push(g, t);
}

int ggml_graph_add_output(struct ggml_cgraph *g, struct ggml_tensor *t) {
    if (!g || !t) return ggml_set_error(GGML_STATUS_INVALID_ARG, "null graph or tensor");
    if (g->planned) return ggml_set_error(GGML_STATUS_INVALID_ARG, "graph already planned");
    t->is_output = true;
    return graph_visit(g, t, 0);
}

int ggml_graph_n_nodes(const struct ggml_cgraph *g) { return g ? g->n_nodes : 0; }

struct ggml_tensor *ggml_graph_node(const struct ggml_cgraph *g, int i) {
    if (!g || i < 0 || i >= g->n_nodes) return NULL;
    return g->nodes[i];
}

size_t ggml_graph_mem_size(const struct ggml_cgraph *g) { return g ? g->buffer_size : 0; }

size_t ggml_graph_device_mem_size(const struct ggml_cgraph *g) { return g ? g->dev_buffer_size : 0; }

int ggml_graph_n_fused(const struct ggml_cgraph *g) {
    int n = 0;
    for (int i = 0; g && g->groups && i < g->n_nodes; i++) n += g->groups[i].len == 0;
    return n;
}

// ---------------------------------------------------------------------------------------------------
// planning: first-fit over a virtual buffer, then one allocation of the high-water mark
// ---------------------------------------------------------------------------------------------------

struct free_block {
    size_t offs, size;
};

struct planner {
    struct free_block *blocks; // sorted by offset
    int n_blocks, cap_blocks;
    size_t top;                // end of the used part
    size_t peak;               // the largest top ever: the buffer's size
};

static size_t planner_alloc(struct planner *p, size_t size) {
    size = (size + GRAPH_ALIGN - 1) / GRAPH_ALIGN * GRAPH_ALIGN;
    for (int i = 0; i < p->n_blocks; i++) {
        if (p->blocks[i].size < size) continue;
        size_t offs = p->blocks[i].offs;
        p->blocks[i].offs += size;
        p->blocks[i].size -= size;
        if (p->blocks[i].size == 0) {
            memmove(&p->blocks[i], &p->blocks[i + 1], (size_t)(p->n_blocks - i - 1) * sizeof *p->blocks);
            p->n_blocks--;
        }
        return offs;
    }
    size_t offs = p->top;
    p->top += size;
    if (p->top > p->peak) p->peak = p->top;
    return offs;
}

static int planner_release(struct planner *p, size_t offs, size_t size) {
    size = (size + GRAPH_ALIGN - 1) / GRAPH_ALIGN * GRAPH_ALIGN;
    if (p->n_blocks == p->cap_blocks) {
        int cap = p->cap_blocks ? 2 * p->cap_blocks : 64;
        struct free_block *b = realloc(p->blocks, (size_t)cap * sizeof *b);
        if (!b) return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory while planning");
        p->blocks = b;
        p->cap_blocks = cap;
    }
    int i = 0;
    while (i < p->n_blocks && p->blocks[i].offs < offs) i++;
    memmove(&p->blocks[i + 1], &p->blocks[i], (size_t)(p->n_blocks - i) * sizeof *p->blocks);
    p->blocks[i] = (struct free_block){offs, size};
    p->n_blocks++;
    // merge with the neighbours so large tensors can reuse freed space
    if (i + 1 < p->n_blocks && p->blocks[i].offs + p->blocks[i].size == p->blocks[i + 1].offs) {
        p->blocks[i].size += p->blocks[i + 1].size;
        memmove(&p->blocks[i + 1], &p->blocks[i + 2], (size_t)(p->n_blocks - i - 2) * sizeof *p->blocks);
        p->n_blocks--;
    }
    if (i > 0 && p->blocks[i - 1].offs + p->blocks[i - 1].size == p->blocks[i].offs) {
        p->blocks[i - 1].size += p->blocks[i].size;
        memmove(&p->blocks[i], &p->blocks[i + 1], (size_t)(p->n_blocks - i - 1) * sizeof *p->blocks);
        p->n_blocks--;
    }
    if (p->n_blocks > 0 && p->blocks[p->n_blocks - 1].offs + p->blocks[p->n_blocks - 1].size == p->top) {
        p->top = p->blocks[p->n_blocks - 1].offs;
        p->n_blocks--;
    }
    return GGML_STATUS_OK;
}

// the tensor that owns t's memory
static struct ggml_tensor *storage_of(struct ggml_tensor *t) { return t->view_src ? t->view_src : t; }

static bool owns_planned_memory(const struct ggml_tensor *t) { return t->op != GGML_OP_NONE && !t->view_src; }

// ---------------------------------------------------------------------------------------------------
// backends: weight ops run where their weight lives, cache ops where the cache lives, the rest on the
// GPU as soon as any input is there (so data crosses to the GPU once and stays)
// ---------------------------------------------------------------------------------------------------

static enum ggml_backend node_backend(const struct ggml_cgraph *g, const struct ggml_tensor *t) {
    switch (t->op) {
    case GGML_OP_VIEW:
    case GGML_OP_KV_STORE: return storage_of((struct ggml_tensor *)t)->backend;
    case GGML_OP_MUL_MAT:
    case GGML_OP_MUL_MAT_ROWS:
    case GGML_OP_AXPY_ROWS:
        if (g->stream_min_cols > 0 && t->src[1]->ne[1] >= g->stream_min_cols) return GGML_BACKEND_CUDA;
        return ggml_get_backend(t->src[0]);
    case GGML_OP_MOE_FFN: // a prompt's host experts are streamed in like a matrix's rows
        if (g->stream_min_cols > 0 && t->src[3]->ne[1] >= g->stream_min_cols) return GGML_BACKEND_CUDA;
        return ggml_get_backend(t->src[0]);
    case GGML_OP_SPARSE_FFN:
    case GGML_OP_GET_ROWS: return ggml_get_backend(t->src[0]);
    case GGML_OP_ATTENTION: return ggml_get_backend(t->src[1]);
    case GGML_OP_SSM_CONV:
    case GGML_OP_DELTA_NET: return ggml_get_backend(t->src[0]); // where the state lives
    default:
        for (int i = 0; i < GGML_MAX_SRC; i++)
            if (t->src[i] && ggml_get_backend(t->src[i]) == GGML_BACKEND_CUDA) return GGML_BACKEND_CUDA;
        return GGML_BACKEND_CPU;
    }
}

// src s of t is a weight that a prompt batch streams in from the host (copied just before t reads it): the
// matrices of the weight ops that node_backend moves to the GPU for a wide batch
static bool streams_in(const struct ggml_cgraph *g, const struct ggml_tensor *t, int s) {
    if (g->stream_min_cols <= 0) return false;
    switch (t->op) {
    case GGML_OP_MUL_MAT:
    case GGML_OP_MUL_MAT_ROWS:
    case GGML_OP_AXPY_ROWS: return s == 0 && t->src[1]->ne[1] >= g->stream_min_cols;
    case GGML_OP_MOE_FFN: // the expert matrices, their biases and scales (a layer's chunks share one copy of those)
        return (s < 3 || s >= 7) && t->src[3]->ne[1] >= g->stream_min_cols;
    default: return false;
    }
}

static bool follows_inputs(const struct ggml_tensor *t) {
    switch (t->op) {
    case GGML_OP_VIEW:
    case GGML_OP_KV_STORE:
    case GGML_OP_MUL_MAT:
    case GGML_OP_MUL_MAT_ROWS:
    case GGML_OP_AXPY_ROWS:
    case GGML_OP_SPARSE_FFN:
    case GGML_OP_MOE_FFN:
    case GGML_OP_GET_ROWS:
    case GGML_OP_SSM_CONV:
    case GGML_OP_DELTA_NET:
    case GGML_OP_ATTENTION: return false;
    default: return true;
    }
}

// a CPU node whose readers all run on the GPU moves there too (e.g. the first norm after the CPU's
// embedding lookup), so the data crosses once, early, and the GPU part stays one capturable run
static void pull_to_gpu(struct ggml_cgraph *g) {
    for (int i = g->n_nodes - 1; i >= 0; i--) {
        struct ggml_tensor *t = g->nodes[i];
        if (t->backend != GGML_BACKEND_CPU || !follows_inputs(t) || t->is_output) continue;
        int readers = 0, gpu_readers = 0;
        for (int j = i + 1; j < g->n_nodes; j++)
            for (int s = 0; s < GGML_MAX_SRC; s++)
                if (g->nodes[j]->src[s] == t) {
                    readers++;
                    gpu_readers += g->nodes[j]->backend == GGML_BACKEND_CUDA && g->nodes[j]->op != GGML_OP_VIEW;
                    break;
                }
        if (readers > 0 && readers == gpu_readers) t->backend = GGML_BACKEND_CUDA;
    }
}

// gives every cross-device edge a transfer node (one per source and backend), placed before its reader
static int insert_transfers(struct ggml_cgraph *g) {
    for (int i = 0; i < g->n_nodes; i++) g->nodes[i]->backend = node_backend(g, g->nodes[i]);
    pull_to_gpu(g);
    int n_cross = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        struct ggml_tensor *t = g->nodes[i];
        for (int s = 0; s < GGML_MAX_SRC; s++)
            if (t->src[s] && t->op != GGML_OP_VIEW && ggml_get_backend(t->src[s]) != t->backend) n_cross++;
    }
    bool any_cuda = n_cross > 0;
    for (int i = 0; i < g->n_nodes && !any_cuda; i++) any_cuda = g->nodes[i]->backend == GGML_BACKEND_CUDA;
    if (!any_cuda) return GGML_STATUS_OK;
    g->mirrors = calloc((size_t)n_cross + 1, sizeof *g->mirrors);
    g->uploads = calloc((size_t)n_cross + 1, sizeof *g->uploads);
    struct ggml_tensor **nodes = malloc(((size_t)g->n_nodes + n_cross) * sizeof *nodes);
    if (!g->mirrors || !g->uploads || !nodes) {
        free(nodes);
        return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory while planning transfers");
    }
    int n = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        struct ggml_tensor *t = g->nodes[i];
        for (int s = 0; s < GGML_MAX_SRC && t->op != GGML_OP_VIEW; s++) {
            struct ggml_tensor *src = t->src[s];
            if (!src || ggml_get_backend(src) == t->backend) continue;
            struct ggml_tensor *m = NULL;
            for (int j = 0; j < g->n_mirrors && !m; j++)
                if (g->mirrors[j].src[0] == src && g->mirrors[j].backend == t->backend) m = &g->mirrors[j];
            if (!m) {
                m = &g->mirrors[g->n_mirrors++];
                memcpy(m->ne, src->ne, sizeof m->ne);
                m->type = src->type;
                // a strided view arrives packed: the copy is 2-D (rows of ne[0] values)
                m->nb[0] = ggml_type_size(src->type);
                m->nb[1] = ggml_row_size(src->type, src->ne[0]);
                for (int d = 2; d < GGML_MAX_DIMS; d++) m->nb[d] = m->nb[d - 1] * (size_t)src->ne[d - 1];
                m->op = GGML_OP_TRANSFER;
                m->backend = t->backend;
                m->src[0] = src;
                m->owner = t->owner;
                snprintf(m->name, sizeof m->name, "%.50s (copy)", src->name);
                // host leaves read on the GPU are uploaded up front through pinned staging, but for weights
                // streamed in: those are copied just before their reader, into memory that the next weight
                // reuses (by role, not size: a profiled split's single experts, under 1 MiB each, had been
                // staged, all of them alive through the whole batch); a device leaf that a CPU node reads is
                // downloaded like any node's output
                bool staged = storage_of(src)->op == GGML_OP_NONE && t->backend == GGML_BACKEND_CUDA &&
                              !streams_in(g, t, s);
                if (staged) g->uploads[g->n_uploads++] = m;
                else nodes[n++] = m;
            }
            t->src[s] = m;
        }
        nodes[n++] = t;
    }
    // uploads become nodes too, first, so the planner gives them memory and keeps them alive
    struct ggml_tensor **ordered = malloc(((size_t)n + g->n_uploads) * sizeof *ordered);
    if (!ordered) {
        free(nodes);
        return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory while planning transfers");
    }
    memcpy(ordered, g->uploads, (size_t)g->n_uploads * sizeof *ordered);
    memcpy(ordered + g->n_uploads, nodes, (size_t)n * sizeof *ordered);
    free(nodes);
    free(g->nodes);
    g->nodes = ordered;
    g->n_nodes = g->cap_nodes = n + g->n_uploads;
    return ggml_cuda_stream_new(&g->stream);
}

static int index_of(const struct ggml_cgraph *g, const struct ggml_tensor *t, int before) {
    for (int j = before - 1; j >= 0; j--)
        if (g->nodes[j] == t) return j;
    return -1;
}

// downloads (GPU -> host transfers) move up to just after the last node any download for the same CPU
// reader needs: the stream then copies as soon as the data exists, before GPU work that the CPU does not
// wait for (the hot half of a split FFN), and the CPU half starts while that work runs
static int issue_downloads_early(struct ggml_cgraph *g) {
    int n = g->n_nodes;
    int *after = malloc((size_t)n * sizeof *after); // a download's new place: after this node (-1: the uploads)
    int *reader = malloc((size_t)n * sizeof *reader);
    struct ggml_tensor **order = malloc((size_t)n * sizeof *order);
    if (!after || !reader || !order) {
        free(after), free(reader), free(order);
        return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory while planning transfers");
    }
    for (int i = 0; i < n; i++) {
        after[i] = reader[i] = -1;
        if (i < g->n_uploads || !ggml_is_download(g->nodes[i])) continue;
        after[i] = index_of(g, storage_of(g->nodes[i]->src[0]), i); // a view's bytes exist with its owner
        for (int j = i + 1; j < n && reader[i] < 0; j++)
            for (int s = 0; s < GGML_MAX_SRC; s++)
                if (g->nodes[j]->src[s] == g->nodes[i]) reader[i] = j;
    }
    for (int i = 0; i < n; i++) // the downloads of one reader go together, after the last of their sources
        for (int k = 0; k < n && reader[i] >= 0; k++)
            if (reader[k] == reader[i] && after[k] > after[i]) after[i] = after[k];
    int m = 0;
    for (int i = 0; i < g->n_uploads; i++) order[m++] = g->nodes[i];
    for (int k = 0; k < n; k++)
        if (reader[k] >= 0 && after[k] < g->n_uploads) order[m++] = g->nodes[k];
    for (int i = g->n_uploads; i < n; i++) {
        if (reader[i] >= 0) continue; // placed with its anchor (a download nobody reads stays where it was)
        order[m++] = g->nodes[i];
        for (int k = 0; k < n; k++)
            if (reader[k] >= 0 && after[k] == i) order[m++] = g->nodes[k];
    }
    memcpy(g->nodes, order, (size_t)n * sizeof *order);
    free(after), free(reader), free(order);
    return GGML_STATUS_OK;
}

// memory for one backend's intermediates; returns the high-water mark and fills offs[i]
// nodes[i] needs memory of its own: it owns it (no view) and is not a fused run's intermediate that nothing after the
// run reads (the run's kernel never writes those: a prompt's |x| - t chain had kept four batch activations alive)
static bool gets_memory(const struct ggml_cgraph *g, const int *last_use, int i) {
    if (!owns_planned_memory(g->nodes[i])) return false;
    if (!g->groups) return true;
    int start = i;
    while (start > 0 && g->groups[start].len == 0) start--;
    int end = start + g->groups[start].len - 1;
    return i == end || g->nodes[i]->is_output || last_use[i] > end;
}

static int plan_backend(struct ggml_cgraph *g, enum ggml_backend backend, const int *last_use, size_t *offs,
                        size_t *total) {
    struct planner p = {0};
    int status = GGML_STATUS_OK;
    for (int i = 0; i < g->n_nodes && !status; i++) {
        struct ggml_tensor *t = g->nodes[i];
        if (gets_memory(g, last_use, i) && t->backend == backend) offs[i] = planner_alloc(&p, ggml_nbytes(t));
        for (int j = 0; j <= i && !status; j++) {
            struct ggml_tensor *u = g->nodes[j];
            if (last_use[j] == i && gets_memory(g, last_use, j) && u->backend == backend)
                status = planner_release(&p, offs[j], ggml_nbytes(u));
        }
    }
    free(p.blocks);
    *total = p.peak ? p.peak : GRAPH_ALIGN;
    return status;
}

int ggml_graph_stream_weights(struct ggml_cgraph *g, int64_t min_cols) {
    if (!g) return ggml_set_error(GGML_STATUS_INVALID_ARG, "null graph");
    if (g->planned) return ggml_set_error(GGML_STATUS_INVALID_ARG, "graph already planned");
    if (min_cols > 0 && ggml_cuda_device_count() == 0)
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "no GPU to stream weights to");
    g->stream_min_cols = min_cols < 0 ? 0 : min_cols;
    return GGML_STATUS_OK;
}

int ggml_graph_to_backend(struct ggml_cgraph *g, enum ggml_backend backend) {
    if (!g) return ggml_set_error(GGML_STATUS_INVALID_ARG, "null graph");
    if (g->planned) return ggml_set_error(GGML_STATUS_INVALID_ARG, "graph already planned");
    for (int i = 0; i < g->n_nodes; i++)
        for (int s = 0; s < GGML_MAX_SRC; s++) {
            struct ggml_tensor *src = g->nodes[i]->src[s];
            if (!src || storage_of(src)->op != GGML_OP_NONE) continue; // nodes run where the planner puts them
            int st = ggml_tensor_to_backend(storage_of(src), backend);
            if (st) return st;
        }
    return GGML_STATUS_OK;
}

// pinned room for the uploaded leaves: they live in pageable memory the caller writes between computes
static int plan_staging(struct ggml_cgraph *g) {
    size_t total = GRAPH_ALIGN;
    g->staging_offs = calloc((size_t)g->n_uploads + 1, sizeof *g->staging_offs);
    if (!g->staging_offs) return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory while planning");
    for (int i = 0; i < g->n_uploads; i++) {
        g->staging_offs[i] = total;
        total += (ggml_nbytes(g->uploads[i]->src[0]) + GRAPH_ALIGN - 1) / GRAPH_ALIGN * GRAPH_ALIGN;
    }
    return ggml_cuda_host_malloc(&g->staging, total);
}

// asks the CUDA backend which runs of nodes it fuses (needs the readers of every node)
static int plan_cuda_groups(struct ggml_cgraph *g) {
    int n = g->n_nodes;
    int *readers = calloc((size_t)n + 1, sizeof *readers);
    g->groups = calloc((size_t)n + 1, sizeof *g->groups);
    if (!readers || !g->groups) {
        free(readers);
        return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory while planning");
    }
    for (int i = 0; i < n; i++) {
        const struct ggml_tensor *t = g->nodes[i];
        readers[i] += t->is_output;
        for (int s = 0; s < GGML_MAX_SRC; s++) {
            int j = t->src[s] ? index_of(g, t->src[s], i) : -1;
            bool again = false; // a node reading j twice counts once
            for (int s2 = 0; s2 < s && !again; s2++) again = t->src[s2] == t->src[s];
            if (j >= 0 && !again) readers[j]++;
        }
    }
    ggml_cuda_plan_groups(g->nodes, n, readers, g->groups);
    free(readers);
    return GGML_STATUS_OK;
}

// a fused run reads the sources of all its nodes while it writes its last node: they stay alive to its end
static void extend_to_groups(const struct ggml_cgraph *g, int *last_use) {
    for (int i = 0; i < g->n_nodes; i++) {
        int end = i + g->groups[i].len - 1;
        for (int k = i; k < end; k++)
            for (int s = 0; s < GGML_MAX_SRC; s++) {
                if (!g->nodes[k]->src[s]) continue;
                int j = index_of(g, storage_of(g->nodes[k]->src[s]), k);
                if (j >= 0 && last_use[j] < end) last_use[j] = end;
            }
    }
}

int ggml_graph_plan(struct ggml_cgraph *g) {
    if (!g) return ggml_set_error(GGML_STATUS_INVALID_ARG, "null graph");
    if (g->planned) return GGML_STATUS_OK;
    for (int i = 0; i < g->n_nodes; i++)
        for (int s = 0; s < GGML_MAX_SRC; s++) {
            struct ggml_tensor *src = g->nodes[i]->src[s];
            if (src && storage_of(src)->op == GGML_OP_NONE && !storage_of(src)->data)
                return ggml_set_error(GGML_STATUS_INVALID_ARG, "input tensor '%s' has no data", storage_of(src)->name);
        }
    int status = insert_transfers(g);
    if (!status && g->stream) status = issue_downloads_early(g);
    if (!status && g->stream) status = plan_cuda_groups(g);
    if (status) return status;
    int n = g->n_nodes;
    // last_use[i]: index of the last node that reads node i's storage (n for outputs: kept)
    int *last_use = calloc((size_t)n + 1, sizeof *last_use);
    size_t *offs = calloc((size_t)n + 1, sizeof *offs);
    if (!last_use || !offs) {
        status = ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory while planning");
        goto done;
    }
    for (int i = 0; i < n; i++) {
        struct ggml_tensor *t = g->nodes[i];
        last_use[i] = t->is_output ? n : i;
        for (int s = 0; s < GGML_MAX_SRC; s++) {
            if (!t->src[s]) continue;
            int j = index_of(g, storage_of(t->src[s]), i);
            if (j >= 0 && last_use[j] < i) last_use[j] = i;
        }
    }
    if (g->groups) extend_to_groups(g, last_use);
    for (int i = n - 1; i >= 0; i--) { // a view marked as output keeps its owner alive
        struct ggml_tensor *t = g->nodes[i];
        int j = t->view_src ? index_of(g, t->view_src, i) : -1;
        if (j >= 0 && last_use[j] < last_use[i]) last_use[j] = last_use[i];
    }
    status = plan_backend(g, GGML_BACKEND_CPU, last_use, offs, &g->buffer_size);
    if (status) goto done;
    if (g->stream) { // pinned, so copies to and from the GPU are asynchronous DMA, not staged by the driver
        status = ggml_cuda_host_malloc(&g->buffer, g->buffer_size);
        if (!status) status = plan_staging(g);
        if (status) goto done;
    } else if (!(g->buffer = aligned_alloc(GRAPH_ALIGN, g->buffer_size))) {
        status = ggml_set_error(GGML_STATUS_ALLOC_FAILED, "cannot allocate %zu bytes for the graph", g->buffer_size);
        goto done;
    }
    if (g->stream) {
        size_t *dev_offs = calloc((size_t)n + 1, sizeof *dev_offs);
        status = dev_offs ? plan_backend(g, GGML_BACKEND_CUDA, last_use, dev_offs, &g->dev_buffer_size)
                          : ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory while planning");
        if (!status) status = ggml_cuda_malloc(&g->dev_buffer, g->dev_buffer_size);
        for (int i = 0; i < n && !status; i++)
            if (g->nodes[i]->backend == GGML_BACKEND_CUDA) offs[i] = dev_offs[i];
        free(dev_offs);
        for (int i = 0; i < n && !status; i++) {
            size_t w = g->nodes[i]->backend == GGML_BACKEND_CUDA ? ggml_cuda_op_wsize(g->nodes[i]) : 0;
            if (w > g->dev_wsize) g->dev_wsize = w;
        }
        if (!status && g->dev_wsize) status = ggml_cuda_malloc(&g->dev_wdata, g->dev_wsize);
        if (status) goto done;
    }
    for (int i = 0; i < n; i++) {
        struct ggml_tensor *t = g->nodes[i];
        if (!gets_memory(g, last_use, i)) continue;
        t->data = (uint8_t *)(t->backend == GGML_BACKEND_CUDA ? g->dev_buffer : g->buffer) + offs[i];
    }
    for (int i = 0; i < n; i++) { // views last: their owners have data now
        struct ggml_tensor *t = g->nodes[i];
        if (t->view_src) t->data = (uint8_t *)t->view_src->data + t->view_offs;
    }
    g->planned = true;
done:
    free(last_use);
    free(offs);
    return status;
}

void ggml_graph_stage_uploads(struct ggml_cgraph *g) {
    for (int i = 0; i < g->n_uploads; i++) {
        const struct ggml_tensor *src = g->uploads[i]->src[0];
        memcpy((uint8_t *)g->staging + g->staging_offs[i], src->data, ggml_nbytes(src));
    }
}

int ggml_graph_run_cuda_node(struct ggml_cgraph *g, int i) {
    if (g->groups[i].len == 0 || g->nodes[i]->op == GGML_OP_VIEW) return GGML_STATUS_OK;
    return ggml_cuda_forward_group(&g->groups[i], &g->nodes[i], g->dev_wdata, g->stream);
}

// a view's values as rows of width bytes: dimensions that continue a row make it longer, dimensions that
// continue the spacing of the rows before them add rows, and up to three sets of evenly spaced rows remain
// (one 2-D copy each of the innermost). false: the values within a row are not contiguous.
struct ggml_strided_rows {
    size_t width;
    int64_t ne[3];
    size_t nb[3];
};

static bool ggml_strided_rows_of(const struct ggml_tensor *t, struct ggml_strided_rows *r) {
    if (t->nb[0] != ggml_type_size(t->type)) return false;
    *r = (struct ggml_strided_rows){.width = ggml_row_size(t->type, t->ne[0]), .ne = {1, 1, 1}};
    int n = 0;
    for (int k = 1; k < GGML_MAX_DIMS; k++) {
        if (t->ne[k] == 1) continue;
        if (n == 0 && t->nb[k] == r->width) {
            r->width *= (size_t)t->ne[k];
        } else if (n > 0 && t->nb[k] == r->nb[n - 1] * (size_t)r->ne[n - 1]) {
            r->ne[n - 1] *= t->ne[k];
        } else {
            r->ne[n] = t->ne[k];
            r->nb[n++] = t->nb[k];
        }
    }
    if (n == 0) r->nb[0] = r->width;
    return true;
}

int ggml_graph_run_transfer(struct ggml_cgraph *g, struct ggml_tensor *node) {
    const struct ggml_tensor *src = node->src[0];
    const bool up = node->backend == GGML_BACKEND_CUDA;
    for (int i = 0; i < g->n_uploads; i++)
        if (g->uploads[i] == node)
            return ggml_cuda_memcpy_h2d(node->data, (uint8_t *)g->staging + g->staging_offs[i], ggml_nbytes(src),
                                        g->stream);
    if (ggml_is_contiguous(src))
        return up ? ggml_cuda_memcpy_h2d(node->data, src->data, ggml_nbytes(src), g->stream)
                  : ggml_cuda_memcpy_d2h(node->data, src->data, ggml_nbytes(src), g->stream);
    // a strided window (a column slice of a matrix, heads of a fused projection): it arrives packed
    struct ggml_strided_rows r;
    if (!ggml_strided_rows_of(src, &r))
        return ggml_set_error(GGML_STATUS_UNSUPPORTED, "cannot copy '%s' between devices: its values are not "
                                                       "contiguous within a row", src->name);
    int st = GGML_STATUS_OK;
    uint8_t *dst = node->data;
    for (int64_t i2 = 0; i2 < r.ne[2] && !st; i2++)
        for (int64_t i1 = 0; i1 < r.ne[1] && !st; i1++) {
            const uint8_t *from = (const uint8_t *)src->data + i1 * r.nb[1] + i2 * r.nb[2];
            st = ggml_cuda_memcpy_2d(dst, r.width, from, r.nb[0], r.width, (size_t)r.ne[0], g->stream);
            dst += r.width * (size_t)r.ne[0];
        }
    return st;
}
