// ggml.c: contexts, tensors, errors, and the op constructors, which validate and record, never compute.
#include "ggml-impl.h"
#include "cuda/cuda.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

// ---------------------------------------------------------------------------------------------------
// errors: one message per thread, so a failing call never aborts and threads do not race on it
// ---------------------------------------------------------------------------------------------------

static _Thread_local char g_error_msg[512];
static _Thread_local int g_error_status;

int ggml_set_error(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_error_msg, sizeof g_error_msg, fmt, ap);
    va_end(ap);
    g_error_status = status;
    return status;
}

const char *ggml_last_error(void) { return g_error_msg; }
int ggml_last_status(void) { return g_error_status; }
void ggml_clear_error(void) {
    g_error_msg[0] = '\0';
    g_error_status = GGML_STATUS_OK;
}

// ---------------------------------------------------------------------------------------------------
// context: one arena for tensor headers and (unless no_alloc) leaf data
// ---------------------------------------------------------------------------------------------------

#define GGML_MEM_ALIGN 64

struct ggml_context {
    uint8_t *mem;      // (mem_size) the arena
    size_t mem_size;
    size_t used;
    bool no_alloc;
    void **device_buffers; // (n_device_buffers) device memory of leaves moved to a GPU
    int n_device_buffers, cap_device_buffers;
    int32_t gemm_scratch; // ggml_set_gemm_scratch's bytes, given to each matmul made after
};

// large contexts on 2 MiB pages where the kernel has them, as numpy gives the FFN bundles: sparse reads jump
// between rows all over gigabytes, and 4 KiB pages cost a TLB miss every few rows (the machine profile
// measures the CPU's sparse rate on weights in a context, so it reads memory as the bundles do)
#define HUGE_PAGE ((size_t)2 << 20)

static void *context_memory(size_t size) {
    if (size < HUGE_PAGE) return aligned_alloc(GGML_MEM_ALIGN, size);
    void *mem = aligned_alloc(HUGE_PAGE, (size + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE);
#ifdef MADV_HUGEPAGE
    if (mem) madvise(mem, size, MADV_HUGEPAGE); // advice only: without huge pages the memory still works
#endif
    return mem;
}

struct ggml_context *ggml_init(size_t mem_size, bool no_alloc) {
    ggml_quants_init();
    struct ggml_context *ctx = calloc(1, sizeof *ctx);
    if (!ctx) {
        ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory for a context");
        return NULL;
    }
    mem_size = (mem_size + GGML_MEM_ALIGN - 1) / GGML_MEM_ALIGN * GGML_MEM_ALIGN;
    ctx->mem = context_memory(mem_size ? mem_size : GGML_MEM_ALIGN);
    if (!ctx->mem) {
        free(ctx);
        ggml_set_error(GGML_STATUS_ALLOC_FAILED, "cannot allocate a context of %zu bytes", mem_size);
        return NULL;
    }
    ctx->mem_size = mem_size;
    ctx->no_alloc = no_alloc;
    return ctx;
}

void ggml_free(struct ggml_context *ctx) {
    if (!ctx) return;
    for (int i = 0; i < ctx->n_device_buffers; i++) ggml_cuda_free(ctx->device_buffers[i]);
    free(ctx->device_buffers);
    free(ctx->mem);
    free(ctx);
}

void ggml_set_gemm_scratch(struct ggml_context *ctx, size_t bytes) {
    ctx->gemm_scratch = bytes > INT32_MAX ? INT32_MAX : (int32_t)bytes;
}

size_t ggml_used_mem(const struct ggml_context *ctx) { return ctx ? ctx->used : 0; }

int ggml_context_add_device_buffer(struct ggml_context *ctx, void *ptr) {
    if (ctx->n_device_buffers == ctx->cap_device_buffers) {
        int cap = ctx->cap_device_buffers ? 2 * ctx->cap_device_buffers : 16;
        void **b = realloc(ctx->device_buffers, (size_t)cap * sizeof *b);
        if (!b) return ggml_set_error(GGML_STATUS_ALLOC_FAILED, "out of memory");
        ctx->device_buffers = b;
        ctx->cap_device_buffers = cap;
    }
    ctx->device_buffers[ctx->n_device_buffers++] = ptr;
    return GGML_STATUS_OK;
}

static void *ctx_alloc(struct ggml_context *ctx, size_t size) {
    size_t need = (size + GGML_MEM_ALIGN - 1) / GGML_MEM_ALIGN * GGML_MEM_ALIGN;
    if (ctx->used + need > ctx->mem_size) {
        ggml_set_error(GGML_STATUS_ALLOC_FAILED, "context full: %zu of %zu bytes used, %zu more needed",
                       ctx->used, ctx->mem_size, need);
        return NULL;
    }
    void *p = ctx->mem + ctx->used;
    ctx->used += need;
    return p;
}

// ---------------------------------------------------------------------------------------------------
// tensors
// ---------------------------------------------------------------------------------------------------

static struct ggml_tensor *tensor_new(struct ggml_context *ctx, enum ggml_type type, int n_dims,
                                      const int64_t *ne, bool alloc_data) {
    if (!ctx) {
        ggml_set_error(GGML_STATUS_INVALID_ARG, "null context");
        return NULL;
    }
    if (!ggml_type_is_valid(type)) {
        ggml_set_error(GGML_STATUS_INVALID_ARG, "unknown tensor type %d", (int)type);
        return NULL;
    }
    if (n_dims < 1 || n_dims > GGML_MAX_DIMS) {
        ggml_set_error(GGML_STATUS_INVALID_ARG, "tensors have 1 to %d dimensions, not %d", GGML_MAX_DIMS, n_dims);
        return NULL;
    }
    int64_t nelements = 1;
    for (int i = 0; i < n_dims; i++) {
        if (ne[i] <= 0) {
            ggml_set_error(GGML_STATUS_INVALID_ARG, "dimension %d has size %lld", i, (long long)ne[i]);
            return NULL;
        }
        // sizes come from files: a product beyond int64 would wrap to a small allocation
        if (nelements > INT64_MAX / ne[i]) {
            ggml_set_error(GGML_STATUS_INVALID_ARG, "tensor of more than 2^63 elements");
            return NULL;
        }
        nelements *= ne[i];
    }
    int64_t blck = ggml_blck_size(type);
    if (ne[0] % blck != 0) {
        ggml_set_error(GGML_STATUS_INVALID_ARG, "row of %lld values is not a multiple of %s's block of %lld",
                       (long long)ne[0], ggml_type_name(type), (long long)blck);
        return NULL;
    }
    struct ggml_tensor *t = ctx_alloc(ctx, sizeof *t);
    if (!t) return NULL;
    memset(t, 0, sizeof *t);
    t->type = type;
    t->op = GGML_OP_NONE;
    t->owner = ctx;
    for (int i = 0; i < GGML_MAX_DIMS; i++) t->ne[i] = i < n_dims ? ne[i] : 1;
    t->nb[0] = ggml_type_size(type);
    t->nb[1] = ggml_row_size(type, t->ne[0]);
    for (int i = 2; i < GGML_MAX_DIMS; i++) t->nb[i] = t->nb[i - 1] * (size_t)t->ne[i - 1];
    if (alloc_data && !ctx->no_alloc) {
        t->data = ctx_alloc(ctx, ggml_nbytes(t));
        if (!t->data) return NULL;
    }
    return t;
}

struct ggml_tensor *ggml_new_tensor(struct ggml_context *ctx, enum ggml_type type, int n_dims, const int64_t *ne) {
    if (!ne) {
        ggml_set_error(GGML_STATUS_INVALID_ARG, "null shape");
        return NULL;
    }
    return tensor_new(ctx, type, n_dims, ne, true);
}

struct ggml_tensor *ggml_new_tensor_1d(struct ggml_context *ctx, enum ggml_type type, int64_t ne0) {
    return ggml_new_tensor(ctx, type, 1, (int64_t[]){ne0});
}

struct ggml_tensor *ggml_new_tensor_2d(struct ggml_context *ctx, enum ggml_type type, int64_t ne0, int64_t ne1) {
    return ggml_new_tensor(ctx, type, 2, (int64_t[]){ne0, ne1});
}

struct ggml_tensor *ggml_new_tensor_3d(struct ggml_context *ctx, enum ggml_type type, int64_t ne0, int64_t ne1,
                                       int64_t ne2) {
    return ggml_new_tensor(ctx, type, 3, (int64_t[]){ne0, ne1, ne2});
}

int ggml_set_data(struct ggml_tensor *t, void *data) {
    if (!t || !data) return ggml_set_error(GGML_STATUS_INVALID_ARG, "null tensor or data");
    if (t->op != GGML_OP_NONE) return ggml_set_error(GGML_STATUS_INVALID_ARG, "only leaf tensors take external data");
    if (t->backend != GGML_BACKEND_CPU) return ggml_set_error(GGML_STATUS_INVALID_ARG, "tensor lives on a device");
    t->data = data;
    return GGML_STATUS_OK;
}

enum ggml_backend ggml_get_backend(const struct ggml_tensor *t) { return t->view_src ? t->view_src->backend : t->backend; }

int ggml_tensor_to_backend(struct ggml_tensor *t, enum ggml_backend backend) {
    if (!t) return ggml_set_error(GGML_STATUS_INVALID_ARG, "null tensor");
    if (t->op != GGML_OP_NONE) return ggml_set_error(GGML_STATUS_INVALID_ARG, "only leaves move between backends");
    if (backend == t->backend) return GGML_STATUS_OK;
    if (backend != GGML_BACKEND_CUDA) return ggml_set_error(GGML_STATUS_INVALID_ARG, "a device tensor stays there");
    int st = ggml_cuda_init();
    if (st) return st;
    void *dev = NULL;
    size_t n = ggml_nbytes(t);
    if ((st = ggml_cuda_malloc(&dev, n))) return st;
    if (t->data && (st = ggml_cuda_memcpy_h2d(dev, t->data, n, NULL)) == GGML_STATUS_OK) st = ggml_cuda_stream_sync(NULL);
    if (!st) st = ggml_context_add_device_buffer(t->owner, dev);
    if (st) {
        ggml_cuda_free(dev);
        return st;
    }
    t->data = dev;
    t->backend = GGML_BACKEND_CUDA;
    return GGML_STATUS_OK;
}

static int check_span(const struct ggml_tensor *t, const void *host, size_t offset, size_t size) {
    if (!t || !host) return ggml_set_error(GGML_STATUS_INVALID_ARG, "null tensor or buffer");
    if (!t->data) return ggml_set_error(GGML_STATUS_INVALID_ARG, "tensor '%s' has no data yet", t->name);
    if (offset > ggml_nbytes(t) || size > ggml_nbytes(t) - offset)
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "bytes [%zu, %zu) outside the tensor's %zu", offset,
                              offset + size, ggml_nbytes(t));
    return GGML_STATUS_OK;
}

int ggml_tensor_write(struct ggml_tensor *t, const void *src, size_t offset, size_t size) {
    int st = check_span(t, src, offset, size);
    if (st) return st;
    if (ggml_get_backend(t) == GGML_BACKEND_CPU) {
        memcpy((char *)t->data + offset, src, size);
        return GGML_STATUS_OK;
    }
    st = ggml_cuda_memcpy_h2d((char *)t->data + offset, src, size, NULL);
    return st ? st : ggml_cuda_stream_sync(NULL);
}

int ggml_tensor_read(const struct ggml_tensor *t, void *dst, size_t offset, size_t size) {
    int st = check_span(t, dst, offset, size);
    if (st) return st;
    if (ggml_get_backend(t) == GGML_BACKEND_CPU) {
        memcpy(dst, (const char *)t->data + offset, size);
        return GGML_STATUS_OK;
    }
    st = ggml_cuda_memcpy_d2h(dst, (const char *)t->data + offset, size, NULL);
    return st ? st : ggml_cuda_stream_sync(NULL);
}

void *ggml_get_data(const struct ggml_tensor *t) { return t ? t->data : NULL; }

void ggml_set_name(struct ggml_tensor *t, const char *name) {
    if (!t || !name) return;
    snprintf(t->name, sizeof t->name, "%s", name);
}

const char *ggml_get_name(const struct ggml_tensor *t) { return t ? t->name : ""; }
enum ggml_type ggml_get_type(const struct ggml_tensor *t) { return t->type; }
enum ggml_op ggml_get_op(const struct ggml_tensor *t) { return t->op; }
int64_t ggml_get_ne(const struct ggml_tensor *t, int dim) { return dim >= 0 && dim < GGML_MAX_DIMS ? t->ne[dim] : 1; }
size_t ggml_get_nb(const struct ggml_tensor *t, int dim) { return dim >= 0 && dim < GGML_MAX_DIMS ? t->nb[dim] : 0; }

struct ggml_tensor *ggml_get_src(const struct ggml_tensor *t, int i) {
    return t && i >= 0 && i < GGML_MAX_SRC ? t->src[i] : NULL;
}

int ggml_n_dims(const struct ggml_tensor *t) {
    for (int i = GGML_MAX_DIMS - 1; i >= 1; i--)
        if (t->ne[i] > 1) return i + 1;
    return 1;
}

int64_t ggml_nelements(const struct ggml_tensor *t) { return t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3]; }
int64_t ggml_nrows(const struct ggml_tensor *t) { return t->ne[1] * t->ne[2] * t->ne[3]; }

size_t ggml_nbytes(const struct ggml_tensor *t) {
    // bytes spanned by the last element plus one row: right for views with gaps too
    size_t n = ggml_row_size(t->type, t->ne[0]);
    for (int i = 1; i < GGML_MAX_DIMS; i++) n += (size_t)(t->ne[i] - 1) * t->nb[i];
    return n;
}

bool ggml_is_contiguous(const struct ggml_tensor *t) {
    if (t->nb[0] != ggml_type_size(t->type)) return false;
    if (t->nb[1] != ggml_row_size(t->type, t->ne[0])) return false;
    for (int i = 2; i < GGML_MAX_DIMS; i++)
        if (t->nb[i] != t->nb[i - 1] * (size_t)t->ne[i - 1]) return false;
    return true;
}

// ---------------------------------------------------------------------------------------------------
// op constructors
// ---------------------------------------------------------------------------------------------------

#define CHECK_ARG(cond, ...)                                              \
    do {                                                                  \
        if (!(cond)) {                                                    \
            ggml_set_error(GGML_STATUS_INVALID_ARG, __VA_ARGS__);         \
            return NULL;                                                  \
        }                                                                 \
    } while (0)

static bool same_shape(const struct ggml_tensor *a, const struct ggml_tensor *b) {
    for (int i = 0; i < GGML_MAX_DIMS; i++)
        if (a->ne[i] != b->ne[i]) return false;
    return true;
}

// a new F32 (or `type`) node of shape ne recording op over sources
static struct ggml_tensor *op_new(struct ggml_context *ctx, enum ggml_op op, enum ggml_type type, int n_dims,
                                  const int64_t *ne, struct ggml_tensor *s0, struct ggml_tensor *s1,
                                  struct ggml_tensor *s2, struct ggml_tensor *s3) {
    struct ggml_tensor *t = tensor_new(ctx, type, n_dims, ne, false);
    if (!t) return NULL;
    t->op = op;
    t->src[0] = s0;
    t->src[1] = s1;
    t->src[2] = s2;
    t->src[3] = s3;
    return t;
}

static struct ggml_tensor *op_like(struct ggml_context *ctx, enum ggml_op op, struct ggml_tensor *a,
                                   struct ggml_tensor *b) {
    return op_new(ctx, op, GGML_TYPE_F32, GGML_MAX_DIMS, a->ne, a, b, NULL, NULL);
}

static struct ggml_tensor *view_new(struct ggml_context *ctx, struct ggml_tensor *a, int n_dims, const int64_t *ne,
                                    const size_t *nb, size_t offset) {
    struct ggml_tensor *t = tensor_new(ctx, a->type, n_dims, ne, false);
    if (!t) return NULL;
    t->op = GGML_OP_VIEW;
    t->src[0] = a;
    t->view_src = a->view_src ? a->view_src : a;
    t->view_offs = a->view_offs + offset;
    if (nb) {
        for (int i = 1; i < n_dims; i++) t->nb[i] = nb[i];
        for (int i = n_dims; i < GGML_MAX_DIMS; i++) t->nb[i] = t->nb[i - 1] * (size_t)t->ne[i - 1];
    }
    size_t owner_bytes = ggml_nbytes(t->view_src);
    if (t->view_offs + ggml_nbytes(t) > owner_bytes) {
        ggml_set_error(GGML_STATUS_INVALID_ARG, "view of %zu bytes at offset %zu exceeds its tensor's %zu bytes",
                       ggml_nbytes(t), t->view_offs, owner_bytes);
        return NULL;
    }
    return t;
}

struct ggml_tensor *ggml_reshape_2d(struct ggml_context *ctx, struct ggml_tensor *a, int64_t ne0, int64_t ne1) {
    CHECK_ARG(a, "null tensor");
    CHECK_ARG(ggml_is_contiguous(a), "reshape needs a contiguous tensor");
    CHECK_ARG(ne0 * ne1 == ggml_nelements(a), "reshape to %lldx%lld does not keep %lld elements", (long long)ne0,
              (long long)ne1, (long long)ggml_nelements(a));
    return view_new(ctx, a, 2, (int64_t[]){ne0, ne1}, NULL, 0);
}

struct ggml_tensor *ggml_reshape_3d(struct ggml_context *ctx, struct ggml_tensor *a, int64_t ne0, int64_t ne1,
                                    int64_t ne2) {
    CHECK_ARG(a, "null tensor");
    CHECK_ARG(ggml_is_contiguous(a), "reshape needs a contiguous tensor");
    CHECK_ARG(ne0 * ne1 * ne2 == ggml_nelements(a), "reshape does not keep %lld elements",
              (long long)ggml_nelements(a));
    return view_new(ctx, a, 3, (int64_t[]){ne0, ne1, ne2}, NULL, 0);
}

struct ggml_tensor *ggml_view(struct ggml_context *ctx, struct ggml_tensor *a, int n_dims, const int64_t *ne,
                              const size_t *nb, size_t offset) {
    CHECK_ARG(a && ne, "null tensor or shape");
    CHECK_ARG(n_dims >= 1 && n_dims <= GGML_MAX_DIMS, "a view has 1 to %d dimensions", GGML_MAX_DIMS);
    return view_new(ctx, a, n_dims, ne, nb, offset);
}

struct ggml_tensor *ggml_cpy(struct ggml_context *ctx, struct ggml_tensor *a, enum ggml_type type) {
    CHECK_ARG(a, "null tensor");
    CHECK_ARG(ggml_type_is_valid(type), "unknown type %d", (int)type);
    CHECK_ARG(a->type == GGML_TYPE_F32 || type == GGML_TYPE_F32 || a->type == type,
              "cpy converts to or from F32 only (%s -> %s)", ggml_type_name(a->type), ggml_type_name(type));
    return op_new(ctx, GGML_OP_CPY, type, GGML_MAX_DIMS, a->ne, a, NULL, NULL, NULL);
}

struct ggml_tensor *ggml_get_rows(struct ggml_context *ctx, struct ggml_tensor *a, struct ggml_tensor *ids) {
    CHECK_ARG(a && ids, "null tensor");
    CHECK_ARG(ids->type == GGML_TYPE_I32, "get_rows ids must be I32, not %s", ggml_type_name(ids->type));
    CHECK_ARG(ggml_n_dims(ids) == 1 && ggml_n_dims(a) <= 2, "get_rows takes a matrix and a vector of ids");
    CHECK_ARG(ggml_get_type_traits(a->type)->to_float, "get_rows cannot read %s", ggml_type_name(a->type));
    return op_new(ctx, GGML_OP_GET_ROWS, GGML_TYPE_F32, 2, (int64_t[]){a->ne[0], ids->ne[0]}, a, ids, NULL, NULL);
}

static struct ggml_tensor *binary_op(struct ggml_context *ctx, enum ggml_op op, struct ggml_tensor *a,
                                     struct ggml_tensor *b) {
    CHECK_ARG(a && b, "null tensor");
    CHECK_ARG(a->type == GGML_TYPE_F32 && b->type == GGML_TYPE_F32, "%s takes F32 tensors",
              op == GGML_OP_ADD ? "add" : "mul");
    bool rows = b->ne[0] == a->ne[0] && b->ne[1] == 1 && b->ne[2] == 1 && b->ne[3] == 1;
    // one value per row of a (a gate per token: Qwen3.5-MoE's shared expert), contiguous
    bool per_row = b->ne[0] == 1 && ggml_nrows(b) == ggml_nrows(a) && ggml_is_contiguous(b);
    CHECK_ARG(same_shape(a, b) || rows || per_row, "shapes [%lld,%lld,%lld] and [%lld,%lld,%lld] do not broadcast",
              (long long)a->ne[0], (long long)a->ne[1], (long long)a->ne[2], (long long)b->ne[0],
              (long long)b->ne[1], (long long)b->ne[2]);
    return op_like(ctx, op, a, b);
}

struct ggml_tensor *ggml_add(struct ggml_context *ctx, struct ggml_tensor *a, struct ggml_tensor *b) {
    return binary_op(ctx, GGML_OP_ADD, a, b);
}

struct ggml_tensor *ggml_mul(struct ggml_context *ctx, struct ggml_tensor *a, struct ggml_tensor *b) {
    return binary_op(ctx, GGML_OP_MUL, a, b);
}

static struct ggml_tensor *unary_op(struct ggml_context *ctx, enum ggml_op op, struct ggml_tensor *a) {
    CHECK_ARG(a, "null tensor");
    CHECK_ARG(a->type == GGML_TYPE_F32, "elementwise ops take F32, not %s", ggml_type_name(a->type));
    return op_like(ctx, op, a, NULL);
}

struct ggml_tensor *ggml_scale(struct ggml_context *ctx, struct ggml_tensor *a, float s) {
    struct ggml_tensor *t = unary_op(ctx, GGML_OP_SCALE, a);
    if (t) ggml_set_op_param_f32(t, 0, s);
    return t;
}

struct ggml_tensor *ggml_silu(struct ggml_context *ctx, struct ggml_tensor *a) { return unary_op(ctx, GGML_OP_SILU, a); }
struct ggml_tensor *ggml_gelu(struct ggml_context *ctx, struct ggml_tensor *a) { return unary_op(ctx, GGML_OP_GELU, a); }
struct ggml_tensor *ggml_relu(struct ggml_context *ctx, struct ggml_tensor *a) { return unary_op(ctx, GGML_OP_RELU, a); }
struct ggml_tensor *ggml_gelu_erf(struct ggml_context *ctx, struct ggml_tensor *a) {
    return unary_op(ctx, GGML_OP_GELU_ERF, a);
}
struct ggml_tensor *ggml_tanh(struct ggml_context *ctx, struct ggml_tensor *a) { return unary_op(ctx, GGML_OP_TANH, a); }
struct ggml_tensor *ggml_abs(struct ggml_context *ctx, struct ggml_tensor *a) { return unary_op(ctx, GGML_OP_ABS, a); }
struct ggml_tensor *ggml_sigmoid(struct ggml_context *ctx, struct ggml_tensor *a) {
    return unary_op(ctx, GGML_OP_SIGMOID, a);
}
struct ggml_tensor *ggml_softplus(struct ggml_context *ctx, struct ggml_tensor *a) {
    return unary_op(ctx, GGML_OP_SOFTPLUS, a);
}

struct ggml_tensor *ggml_step(struct ggml_context *ctx, struct ggml_tensor *a) { return unary_op(ctx, GGML_OP_STEP, a); }

static struct ggml_tensor *norm_op(struct ggml_context *ctx, enum ggml_op op, struct ggml_tensor *a, float eps) {
    // rows of consecutive values, however far apart (q's heads in a fused projection's rows)
    CHECK_ARG(a && a->nb[0] == ggml_type_size(a->type), "norms take rows of consecutive values");
    CHECK_ARG(eps >= 0.0f, "eps must be >= 0");
    struct ggml_tensor *t = unary_op(ctx, op, a);
    if (t) ggml_set_op_param_f32(t, 0, eps);
    return t;
}

struct ggml_tensor *ggml_rms_norm(struct ggml_context *ctx, struct ggml_tensor *a, float eps) {
    return norm_op(ctx, GGML_OP_RMS_NORM, a, eps);
}

struct ggml_tensor *ggml_layer_norm(struct ggml_context *ctx, struct ggml_tensor *a, float eps) {
    return norm_op(ctx, GGML_OP_LAYER_NORM, a, eps);
}

static const char *check_matmul(const struct ggml_tensor *w, const struct ggml_tensor *x) {
    static _Thread_local char msg[160];
    if (!w || !x) return "null tensor";
    if (x->type != GGML_TYPE_F32) return "activations must be F32";
    if (ggml_n_dims(w) > 2 || ggml_n_dims(x) > 2) return "weights and activations must be matrices";
    if (!ggml_is_contiguous(w) || !ggml_is_contiguous(x)) return "weights and activations must be contiguous";
    if (!ggml_get_type_traits(w->type)->vec_dot) return "no dot product for this weight type";
    if (w->ne[0] != x->ne[0]) {
        snprintf(msg, sizeof msg, "inner sizes differ: weights %lld, activations %lld", (long long)w->ne[0],
                 (long long)x->ne[0]);
        return msg;
    }
    return NULL;
}

struct ggml_tensor *ggml_mul_mat(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x) {
    const char *err = check_matmul(w, x);
    CHECK_ARG(!err, "mul_mat: %s", err);
    struct ggml_tensor *t = op_new(ctx, GGML_OP_MUL_MAT, GGML_TYPE_F32, 2, (int64_t[]){w->ne[1], x->ne[1]}, w, x, NULL,
                                   NULL);
    if (t) t->op_params[GGML_GEMM_SCRATCH_PARAM] = ctx->gemm_scratch;
    return t;
}

struct ggml_tensor *ggml_mul_mat_precise(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x) {
    struct ggml_tensor *t = ggml_mul_mat(ctx, w, x);
    if (t) t->op_params[0] = 1;
    return t;
}

// the pair whose angle turns n_turns times in n_ctx_orig positions (fractional), YaRN's correction dim
static double rope_yarn_corr_dim(int n_dims, int n_ctx_orig, double n_turns, double base) {
    return n_dims * log(n_ctx_orig / (n_turns * 2 * 3.14159265358979323846)) / (2 * log(base));
}

struct ggml_tensor *ggml_rope(struct ggml_context *ctx, struct ggml_tensor *x, struct ggml_tensor *pos, int n_dims,
                              int mode, float freq_base, float freq_scale, struct ggml_tensor *freq_factors) {
    return ggml_rope_ext(ctx, x, pos, n_dims, mode, freq_base, freq_scale, freq_factors, 0, 0.0f, 1.0f, 0.0f, 0.0f);
}

struct ggml_tensor *ggml_rope_ext(struct ggml_context *ctx, struct ggml_tensor *x, struct ggml_tensor *pos, int n_dims,
                                  int mode, float freq_base, float freq_scale, struct ggml_tensor *freq_factors,
                                  int n_ctx_orig, float ext_factor, float attn_factor, float beta_fast,
                                  float beta_slow) {
    CHECK_ARG(x && pos, "null tensor");
    CHECK_ARG(isfinite(attn_factor) && ext_factor >= 0.0f && ext_factor <= 1.0f,
              "rope: ext_factor must be in [0, 1] and attn_factor finite");
    CHECK_ARG(ext_factor == 0.0f || (n_ctx_orig > 0 && beta_fast > 0.0f && beta_slow > 0.0f),
              "rope: YaRN needs a positive original context and positive betas");
    CHECK_ARG(!freq_factors || (freq_factors->type == GGML_TYPE_F32 && ggml_n_dims(freq_factors) == 1 &&
                                freq_factors->ne[0] >= n_dims / 2),
              "rope frequency factors must be F32, at least n_dims/2 of them");
    CHECK_ARG(x->type == GGML_TYPE_F32 && pos->type == GGML_TYPE_I32, "rope takes F32 x and I32 positions");
    CHECK_ARG(pos->ne[0] == x->ne[2] && ggml_n_dims(pos) == 1, "rope needs one position per token");
    CHECK_ARG(n_dims > 0 && n_dims % 2 == 0 && n_dims <= x->ne[0], "rope dims %d must be even and <= %lld", n_dims,
              (long long)x->ne[0]);
    CHECK_ARG(mode == GGML_ROPE_NORMAL || mode == GGML_ROPE_NEOX, "unknown rope mode %d", mode);
    CHECK_ARG(freq_base > 0.0f && freq_scale > 0.0f, "rope frequencies must be positive");
    struct ggml_tensor *t = op_like(ctx, GGML_OP_ROPE, x, pos);
    if (!t) return NULL;
    t->op_params[0] = n_dims;
    t->op_params[1] = mode;
    ggml_set_op_param_f32(t, 2, freq_base);
    ggml_set_op_param_f32(t, 3, freq_scale);
    double lo = 0.0, hi = 0.0, mscale = attn_factor;
    if (ext_factor != 0.0f) { // as llama.cpp's ggml_rope_yarn_corr_dims, in double (transformers' yarn)
        lo = fmax(0.0, floor(rope_yarn_corr_dim(n_dims, n_ctx_orig, beta_fast, freq_base)));
        hi = fmin(n_dims - 1, ceil(rope_yarn_corr_dim(n_dims, n_ctx_orig, beta_slow, freq_base)));
        mscale *= 1.0 + 0.1 * log(1.0 / freq_scale);
    }
    ggml_set_op_param_f32(t, 4, ext_factor);
    ggml_set_op_param_f32(t, 5, (float)mscale);
    ggml_set_op_param_f32(t, 6, (float)lo);
    ggml_set_op_param_f32(t, 7, (float)hi);
    t->src[2] = freq_factors;
    return t;
}

struct ggml_tensor *ggml_soft_max(struct ggml_context *ctx, struct ggml_tensor *a, struct ggml_tensor *pos,
                                  float scale) {
    CHECK_ARG(a && a->type == GGML_TYPE_F32 && ggml_is_contiguous(a), "soft_max takes a contiguous F32 tensor");
    CHECK_ARG(!pos || (pos->type == GGML_TYPE_I32 && pos->ne[0] == ggml_nrows(a)),
              "soft_max positions must be I32, one per row");
    struct ggml_tensor *t = op_like(ctx, GGML_OP_SOFT_MAX, a, pos);
    if (t) ggml_set_op_param_f32(t, 0, scale);
    return t;
}

struct ggml_tensor *ggml_kv_store(struct ggml_context *ctx, struct ggml_tensor *cache, struct ggml_tensor *src,
                                  struct ggml_tensor *pos) {
    CHECK_ARG(cache && src && pos, "null tensor");
    CHECK_ARG(cache->op == GGML_OP_NONE && ggml_is_contiguous(cache), "the KV cache must be a contiguous leaf");
    CHECK_ARG(cache->type == GGML_TYPE_F32 || cache->type == GGML_TYPE_F16, "KV cache must be F32 or F16");
    CHECK_ARG(src->type == GGML_TYPE_F32 && pos->type == GGML_TYPE_I32, "kv_store takes F32 rows and I32 positions");
    CHECK_ARG(src->ne[0] == cache->ne[0] && src->ne[1] == cache->ne[1], "kv_store rows do not match the cache");
    CHECK_ARG(pos->ne[0] == src->ne[2], "kv_store needs one position per token");
    struct ggml_tensor *t = op_new(ctx, GGML_OP_KV_STORE, cache->type, 3, cache->ne, cache, src, pos, NULL);
    if (!t) return NULL;
    t->view_src = cache; // writes in place: its data is the cache's
    return t;
}

struct ggml_tensor *ggml_attention(struct ggml_context *ctx, struct ggml_tensor *q, struct ggml_tensor *k,
                                   struct ggml_tensor *v, struct ggml_tensor *pos, struct ggml_tensor *sinks,
                                   float scale, int window) {
    CHECK_ARG(q && k && v && pos, "null tensor");
    CHECK_ARG(window >= 0, "attention window %d must be >= 0", window);
    CHECK_ARG(k->op == GGML_OP_KV_STORE && v->op == GGML_OP_KV_STORE, "attention reads k and v from kv_store nodes");
    CHECK_ARG(q->type == GGML_TYPE_F32 && pos->type == GGML_TYPE_I32, "attention takes F32 q and I32 positions");
    CHECK_ARG(q->ne[0] == k->ne[0] && k->ne[0] == v->ne[0], "head sizes differ");
    CHECK_ARG(k->ne[1] == v->ne[1] && k->ne[2] == v->ne[2], "k and v caches differ in shape");
    CHECK_ARG(q->ne[1] % k->ne[1] == 0, "%lld query heads do not share %lld kv heads evenly", (long long)q->ne[1],
              (long long)k->ne[1]);
    CHECK_ARG(pos->ne[0] == q->ne[2], "attention needs one position per token");
    CHECK_ARG(!sinks || (sinks->type == GGML_TYPE_F32 && ggml_nelements(sinks) == q->ne[1]),
              "attention sinks must be %lld F32 values, one a query head", (long long)q->ne[1]);
    struct ggml_tensor *t =
        op_new(ctx, GGML_OP_ATTENTION, GGML_TYPE_F32, 2, (int64_t[]){q->ne[0] * q->ne[1], q->ne[2]}, q, k, v, pos);
    if (t) {
        t->src[4] = sinks;
        ggml_set_op_param_f32(t, 0, scale);
        t->op_params[1] = window;
    }
    return t;
}

static const char *check_selector(const struct ggml_tensor *sel, int64_t n_rows, int64_t m) {
    if (!sel) return NULL;
    if (sel->type == GGML_TYPE_F32) return sel->ne[0] == n_rows && sel->ne[1] == m ? NULL : "mask must be [n_rows, m]";
    if (sel->type == GGML_TYPE_I32) return sel->ne[0] <= n_rows && sel->ne[1] == m ? NULL : "index list must be [<= n_rows, m]";
    return "selector must be an F32 mask or an I32 index list";
}

static struct ggml_tensor *sparse_op(struct ggml_context *ctx, enum ggml_op op, const int64_t *ne,
                                     struct ggml_tensor *w, struct ggml_tensor *x, struct ggml_tensor *sel,
                                     int64_t n_rows, int64_t begin, int64_t end) {
    if (end < 0) end = n_rows;
    CHECK_ARG(begin >= 0 && begin <= end && end <= n_rows && n_rows <= INT32_MAX,
              "row range [%lld, %lld) outside [0, %lld]", (long long)begin, (long long)end, (long long)n_rows);
    const char *err = check_selector(sel, n_rows, x->ne[1]);
    CHECK_ARG(!err, "%s", err);
    struct ggml_tensor *t = op_new(ctx, op, GGML_TYPE_F32, 2, ne, w, x, sel, NULL);
    if (!t) return NULL;
    t->op_params[0] = (int32_t)begin;
    t->op_params[1] = (int32_t)end;
    return t;
}

struct ggml_tensor *ggml_mul_mat_rows(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x,
                                      struct ggml_tensor *sel, int64_t begin, int64_t end) {
    const char *err = check_matmul(w, x);
    CHECK_ARG(!err, "mul_mat_rows: %s", err);
    return sparse_op(ctx, GGML_OP_MUL_MAT_ROWS, (int64_t[]){w->ne[1], x->ne[1]}, w, x, sel, w->ne[1], begin, end);
}

struct ggml_tensor *ggml_axpy_rows(struct ggml_context *ctx, struct ggml_tensor *wt, struct ggml_tensor *h,
                                   struct ggml_tensor *sel, int64_t begin, int64_t end) {
    CHECK_ARG(wt && h, "null tensor");
    CHECK_ARG(h->type == GGML_TYPE_F32 && ggml_is_contiguous(h) && ggml_is_contiguous(wt), "axpy_rows takes contiguous tensors, F32 h");
    CHECK_ARG(ggml_n_dims(wt) <= 2 && ggml_n_dims(h) <= 2, "axpy_rows takes matrices");
    CHECK_ARG(ggml_get_type_traits(wt->type)->axpy, "axpy_rows cannot read %s", ggml_type_name(wt->type));
    CHECK_ARG(h->ne[0] == wt->ne[1], "h has %lld values for %lld rows", (long long)h->ne[0], (long long)wt->ne[1]);
    struct ggml_tensor *t = sparse_op(ctx, GGML_OP_AXPY_ROWS, (int64_t[]){wt->ne[0], h->ne[1]}, wt, h, sel, wt->ne[1],
                                      begin, end);
    if (t) t->op_params[GGML_GEMM_SCRATCH_PARAM] = ctx->gemm_scratch;
    return t;
}

struct ggml_tensor *ggml_axpy_rows_precise(struct ggml_context *ctx, struct ggml_tensor *wt, struct ggml_tensor *h,
                                           struct ggml_tensor *sel, int64_t begin, int64_t end) {
    struct ggml_tensor *t = ggml_axpy_rows(ctx, wt, h, sel, begin, end);
    if (t) t->op_params[2] = 1;
    return t;
}

struct ggml_tensor *ggml_sparse_ffn(struct ggml_context *ctx, struct ggml_tensor *bundle, struct ggml_tensor *x,
                                    struct ggml_tensor *sel, enum ggml_ffn_kind kind, float threshold) {
    CHECK_ARG(kind >= GGML_FFN_RELU && kind <= GGML_FFN_GEGLU, "unknown FFN kind %d", (int)kind);
    const char *err = check_matmul(bundle, x);
    CHECK_ARG(!err, "sparse_ffn: %s", err);
    CHECK_ARG(ggml_get_type_traits(bundle->type)->axpy, "sparse_ffn cannot read %s", ggml_type_name(bundle->type));
    const int64_t r = kind == GGML_FFN_RELU ? 2 : 3, n_ff = bundle->ne[1] / r;
    CHECK_ARG(bundle->ne[1] % r == 0, "a %s bundle has %lld rows, not a multiple of %lld", kind == GGML_FFN_RELU ? "relu" : "gated",
              (long long)bundle->ne[1], (long long)r);
    CHECK_ARG(threshold >= 0.0f, "threshold %g < 0", (double)threshold);
    struct ggml_tensor *t = sparse_op(ctx, GGML_OP_SPARSE_FFN, (int64_t[]){x->ne[0] + n_ff, x->ne[1]}, bundle, x, sel,
                                      n_ff, 0, n_ff);
    if (!t) return NULL;
    t->op_params[2] = (int32_t)kind;
    ggml_set_op_param_f32(t, 3, threshold);
    return t;
}

struct ggml_tensor *ggml_top_k(struct ggml_context *ctx, struct ggml_tensor *a, int k) {
    CHECK_ARG(a, "null tensor");
    CHECK_ARG(a->type == GGML_TYPE_F32 && ggml_n_dims(a) <= 2 && ggml_is_contiguous(a), "top_k takes an F32 matrix");
    CHECK_ARG(k >= 1 && k <= a->ne[0] && k <= GGML_TOP_K_MAX, "top_k: k = %d outside [1, %lld]", k,
              (long long)(a->ne[0] < GGML_TOP_K_MAX ? a->ne[0] : GGML_TOP_K_MAX));
    struct ggml_tensor *t = op_new(ctx, GGML_OP_TOP_K, GGML_TYPE_I32, 2, (int64_t[]){k, a->ne[1]}, a, NULL, NULL, NULL);
    if (t) t->op_params[0] = k;
    return t;
}

// the experts' matrices: n_local of them, each [cols, rows], the ffn_*_exps layout
static const char *check_experts(const struct ggml_tensor *w, int64_t cols, int64_t rows, int64_t n_local) {
    static _Thread_local char msg[160];
    if (!w) return "null tensor";
    if (!ggml_is_contiguous(w) || !ggml_get_type_traits(w->type)->vec_dot) return "experts must be contiguous, of a type with a dot product";
    if (w->ne[0] != cols || w->ne[1] != rows || w->ne[2] != n_local || w->ne[3] != 1) {
        snprintf(msg, sizeof msg, "an expert tensor is [%lld, %lld, %lld], expected [%lld, %lld, %lld]", (long long)w->ne[0],
                 (long long)w->ne[1], (long long)w->ne[2], (long long)cols, (long long)rows, (long long)n_local);
        return msg;
    }
    return NULL;
}

struct ggml_tensor *ggml_moe_ffn(struct ggml_context *ctx, struct ggml_tensor *gate, struct ggml_tensor *up,
                                 struct ggml_tensor *down, struct ggml_tensor *x, struct ggml_tensor *ids,
                                 struct ggml_tensor *logits, struct ggml_tensor *slots, struct ggml_tensor *biases,
                                 struct ggml_tensor *scales, enum ggml_ffn_kind kind, bool norm) {
    CHECK_ARG(gate && up && down && x && ids && logits, "null tensor");
    CHECK_ARG(kind == GGML_FFN_SWIGLU || kind == GGML_FFN_GEGLU || kind == GGML_FFN_SWIGLU_OAI,
              "moe_ffn: FFN kind %d is not gated by silu or gelu", (int)kind);
    CHECK_ARG(x->type == GGML_TYPE_F32 && ggml_n_dims(x) <= 2 && ggml_is_contiguous(x), "moe_ffn takes F32 activations [d, m]");
    const int64_t d = x->ne[0], m = x->ne[1], n_ff = gate->ne[1], n_local = gate->ne[2], n_expert = logits->ne[0];
    const char *err = check_experts(gate, d, n_ff, n_local);
    if (!err) err = check_experts(up, d, n_ff, n_local);
    if (!err) err = check_experts(down, n_ff, d, n_local);
    CHECK_ARG(!err, "moe_ffn: %s", err);
    CHECK_ARG(gate->type == up->type, "moe_ffn: gate and up differ in type");
    CHECK_ARG(n_local >= 1, "moe_ffn: no expert matrices");
    CHECK_ARG(ids->type == GGML_TYPE_I32 && ggml_is_contiguous(ids) && ggml_n_dims(ids) <= 2 && ids->ne[1] == m &&
              ids->ne[0] <= n_expert && ids->ne[0] <= GGML_TOP_K_MAX, "moe_ffn: ids must be I32 [k <= n_expert, m]");
    CHECK_ARG(ids->ne[0] * m <= INT32_MAX, "moe_ffn: %lld pairs of token and expert exceed the int32 lists",
              (long long)(ids->ne[0] * m));
    CHECK_ARG(logits->type == GGML_TYPE_F32 && ggml_is_contiguous(logits) && ggml_n_dims(logits) <= 2 &&
              logits->ne[1] == m, "moe_ffn: logits must be F32 [n_expert, m]");
    if (slots)
        CHECK_ARG(slots->type == GGML_TYPE_I32 && ggml_nelements(slots) == n_expert && ggml_is_contiguous(slots),
                  "moe_ffn: slots must be I32 [n_expert]");
    else
        CHECK_ARG(n_local == n_expert, "moe_ffn: %lld expert matrices for %lld experts need slots", (long long)n_local,
                  (long long)n_expert);
    if (biases)
        CHECK_ARG(biases->type == GGML_TYPE_F32 && ggml_is_contiguous(biases) && biases->ne[0] == 2 * n_ff + d &&
                  ggml_nelements(biases) == biases->ne[0] * n_expert, "moe_ffn: biases must be F32 [2 n_ff + d, n_expert]");
    if (scales)
        CHECK_ARG(scales->type == GGML_TYPE_F32 && ggml_is_contiguous(scales) && ggml_nelements(scales) == n_expert,
                  "moe_ffn: scales must be F32 [n_expert]");
    struct ggml_tensor *t = op_new(ctx, GGML_OP_MOE_FFN, GGML_TYPE_F32, 2, (int64_t[]){d, m}, gate, up, down, x);
    if (!t) return NULL;
    t->src[4] = ids;
    t->src[5] = logits;
    t->src[6] = slots;
    t->src[7] = biases;
    t->src[8] = scales;
    t->op_params[0] = (int32_t)kind;
    t->op_params[1] = norm;
    return t;
}

// a recurrent op's state: a contiguous F32 leaf
static bool is_state(const struct ggml_tensor *s) {
    return s && s->op == GGML_OP_NONE && s->type == GGML_TYPE_F32 && ggml_is_contiguous(s);
}

static bool is_positions(const struct ggml_tensor *pos, int64_t n) {
    return pos && pos->type == GGML_TYPE_I32 && ggml_n_dims(pos) == 1 && pos->ne[0] == n;
}

struct ggml_tensor *ggml_ssm_conv(struct ggml_context *ctx, struct ggml_tensor *state, struct ggml_tensor *x,
                                  struct ggml_tensor *w, struct ggml_tensor *pos) {
    CHECK_ARG(state && x && w && pos, "null tensor");
    CHECK_ARG(is_state(state), "ssm_conv: the state must be a contiguous F32 leaf");
    CHECK_ARG(x->type == GGML_TYPE_F32 && ggml_is_contiguous(x) && ggml_n_dims(x) <= 2, "ssm_conv takes F32 x [C, n]");
    CHECK_ARG(w->type == GGML_TYPE_F32 && ggml_is_contiguous(w) && ggml_n_dims(w) <= 2 && w->ne[1] == x->ne[0] &&
              w->ne[0] >= 2 && w->ne[0] <= 16, "ssm_conv: taps must be F32 [2 <= K <= 16, %lld]", (long long)x->ne[0]);
    CHECK_ARG(state->ne[0] == x->ne[0] && state->ne[1] == w->ne[0] - 1 && ggml_nelements(state) == x->ne[0] * (w->ne[0] - 1),
              "ssm_conv: the state must be [%lld, %lld]", (long long)x->ne[0], (long long)(w->ne[0] - 1));
    CHECK_ARG(is_positions(pos, x->ne[1]), "ssm_conv needs I32 positions, one per token");
    return op_new(ctx, GGML_OP_SSM_CONV, GGML_TYPE_F32, 2, x->ne, state, x, w, pos);
}

struct ggml_tensor *ggml_delta_net(struct ggml_context *ctx, struct ggml_tensor *state, struct ggml_tensor *q,
                                   struct ggml_tensor *k, struct ggml_tensor *v, struct ggml_tensor *g,
                                   struct ggml_tensor *beta, struct ggml_tensor *pos, float scale, float l2_eps) {
    CHECK_ARG(state && q && k && v && g && beta && pos, "null tensor");
    CHECK_ARG(is_state(state), "delta_net: the state must be a contiguous F32 leaf");
    CHECK_ARG(q->type == GGML_TYPE_F32 && k->type == GGML_TYPE_F32 && v->type == GGML_TYPE_F32,
              "delta_net takes F32 q, k and v");
    const int64_t dk = k->ne[0], hk = k->ne[1], dv = v->ne[0], h = v->ne[1], n = v->ne[2];
    CHECK_ARG(q->ne[0] == dk && q->ne[1] == hk && q->ne[2] == n && k->ne[2] == n && q->ne[3] == 1 && k->ne[3] == 1 &&
              v->ne[3] == 1, "delta_net: q and k must be [D_k, H_k, n] with v [D_v, H, n]");
    CHECK_ARG(h % hk == 0, "delta_net: %lld value heads do not share %lld key heads evenly", (long long)h, (long long)hk);
    CHECK_ARG(dk <= GGML_DELTA_NET_MAX_DK, "delta_net: key heads of %lld values (at most %d)", (long long)dk,
              GGML_DELTA_NET_MAX_DK);
    CHECK_ARG(g->type == GGML_TYPE_F32 && beta->type == GGML_TYPE_F32 && ggml_is_contiguous(g) &&
              ggml_is_contiguous(beta) && ggml_nelements(g) == h * n && ggml_nelements(beta) == h * n &&
              g->ne[0] == h && beta->ne[0] == h, "delta_net: g and beta must be contiguous F32 [H, n]");
    CHECK_ARG(state->ne[0] == dk && state->ne[1] == dv && state->ne[2] == h && state->ne[3] == 1,
              "delta_net: the state must be [%lld, %lld, %lld]", (long long)dk, (long long)dv, (long long)h);
    CHECK_ARG(is_positions(pos, n), "delta_net needs I32 positions, one per token");
    CHECK_ARG(isfinite(scale) && isfinite(l2_eps) && l2_eps >= 0.0f, "delta_net: scale and l2_eps must be finite, "
              "l2_eps >= 0");
    struct ggml_tensor *t = op_new(ctx, GGML_OP_DELTA_NET, GGML_TYPE_F32, 3, (int64_t[]){dv, h, n}, state, q, k, v);
    if (!t) return NULL;
    t->src[4] = g;
    t->src[5] = beta;
    t->src[6] = pos;
    ggml_set_op_param_f32(t, 0, scale);
    ggml_set_op_param_f32(t, 1, l2_eps);
    return t;
}
