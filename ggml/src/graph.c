// graph.c: a graph is the topologically ordered list of op nodes that its outputs need. Planning gives
// every intermediate a place in one buffer, reusing the memory of tensors no later node reads.
#include "graph.h"

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
    free(g->nodes);
    free(g->buffer);
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
    if (g->buffer) return ggml_set_error(GGML_STATUS_INVALID_ARG, "graph already planned");
    t->is_output = true;
    return graph_visit(g, t, 0);
}

int ggml_graph_n_nodes(const struct ggml_cgraph *g) { return g ? g->n_nodes : 0; }

struct ggml_tensor *ggml_graph_node(const struct ggml_cgraph *g, int i) {
    if (!g || i < 0 || i >= g->n_nodes) return NULL;
    return g->nodes[i];
}

size_t ggml_graph_mem_size(const struct ggml_cgraph *g) { return g ? g->buffer_size : 0; }

// ---------------------------------------------------------------------------------------------------
// planning: first-fit over a virtual buffer, then one allocation of the high-water mark
// ---------------------------------------------------------------------------------------------------

struct free_block {
    size_t offs, size;
};

struct planner {
    struct free_block *blocks; // sorted by offset
    int n_blocks, cap_blocks;
    size_t top;                // high-water mark
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

int ggml_graph_plan(struct ggml_cgraph *g) {
    if (!g) return ggml_set_error(GGML_STATUS_INVALID_ARG, "null graph");
    if (g->buffer) return GGML_STATUS_OK;
    int n = g->n_nodes;
    // last_use[i]: index of the last node that reads node i's storage (n for outputs: kept)
    int *last_use = calloc((size_t)n + 1, sizeof *last_use);
    size_t *offs = calloc((size_t)n + 1, sizeof *offs);
    struct planner p = {0};
    int status = GGML_STATUS_OK;
    if (!last_use || !offs) {
        status = ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory while planning");
        goto done;
    }
    for (int i = 0; i < n; i++) {
        struct ggml_tensor *t = g->nodes[i];
        last_use[i] = t->is_output ? n : i;
        for (int s = 0; s < GGML_MAX_SRC; s++) {
            struct ggml_tensor *src = t->src[s];
            if (!src) continue;
            struct ggml_tensor *own = storage_of(src);
            if (own->op == GGML_OP_NONE) {
                if (!own->data) {
                    status = ggml_set_error(GGML_STATUS_INVALID_ARG, "input tensor '%s' has no data", own->name);
                    goto done;
                }
                continue;
            }
            for (int j = i - 1; j >= 0; j--) {
                if (g->nodes[j] == own) {
                    if (last_use[j] < i) last_use[j] = i;
                    break;
                }
            }
        }
    }
    // a view marked as output keeps its owner alive
    for (int i = n - 1; i >= 0; i--) {
        struct ggml_tensor *t = g->nodes[i];
        if (!t->view_src) continue;
        for (int j = i - 1; j >= 0; j--)
            if (g->nodes[j] == t->view_src) {
                if (last_use[j] < last_use[i]) last_use[j] = last_use[i];
                break;
            }
    }
    for (int i = 0; i < n; i++) {
        struct ggml_tensor *t = g->nodes[i];
        if (owns_planned_memory(t)) offs[i] = planner_alloc(&p, ggml_nbytes(t));
        for (int j = 0; j <= i; j++) {
            if (last_use[j] != i || !owns_planned_memory(g->nodes[j])) continue;
            status = planner_release(&p, offs[j], ggml_nbytes(g->nodes[j]));
            if (status) goto done;
        }
    }
    g->buffer_size = p.top ? p.top : GRAPH_ALIGN;
    g->buffer = aligned_alloc(GRAPH_ALIGN, g->buffer_size);
    if (!g->buffer) {
        status = ggml_set_error(GGML_STATUS_ALLOC_FAILED, "cannot allocate %zu bytes for the graph", g->buffer_size);
        goto done;
    }
    for (int i = 0; i < n; i++) {
        struct ggml_tensor *t = g->nodes[i];
        if (owns_planned_memory(t)) t->data = (uint8_t *)g->buffer + offs[i];
    }
    for (int i = 0; i < n; i++) { // views last: their owners have data now
        struct ggml_tensor *t = g->nodes[i];
        if (t->view_src) t->data = (uint8_t *)t->view_src->data + t->view_offs;
    }
done:
    free(last_use);
    free(offs);
    free(p.blocks);
    return status;
}
