// fusion.cu: which runs of graph nodes the CUDA backend executes as one kernel, and running them. A
// decode step is dozens of tiny launches per layer besides its GEMVs; each costs a launch gap and a
// pass over its data, so the common chains of a transformer layer run as one kernel:
//   norm -> mul by the norm weight                 (norm_kernel with a weight row)
//   GEMV -> add of a bias or the residual          (the GEMV adds it when it writes a row)
//   GEMV -> silu/gelu/relu                         (the GEMV applies it when it writes a row)
//   GEMV gate, act, GEMV up of the same x -> mul   (one GEMV over both matrices, act(gate) * up per row)
//   rope -> kv_store                               (rotated rows written into their cache slots)
//   rms_norm -> mul -> rope [-> kv_store]          (Qwen3's and Gemma's q and k norms: a warp norms its head)
//   GEMV [-> add] -> view -> kv_store              (v's projection written straight into its cache slot)
//   rope q, rope k -> kv_store, kv_store v         (q, k, v views of one projection: one kernel for all three)
//   one token's gate rows, act, up rows, mul -> axpy of down_t under the predictor's mask (sparse_ffn.cu), and
//   the residual add after it (the sum starts from the residual instead of 0)
//   silu/gelu/relu/abs/sigmoid/softplus -> add or mul (input sparsity's |x| - t, act(gate) * up, Qwen3.5's gates)
//   moe_ffn -> add                                 (the experts' sum starts the residual's add)
// and quantized GEMVs of the same x (q, k, v; across Qwen3's q and k norms too) quantize it once, or not at all
// when the norm that made x left it quantized (a mixture's experts too, across the router and top_k).
#include "common.cuh"

static bool is_f32_vector(const struct ggml_tensor *t, int64_t n) {
    return t->type == GGML_TYPE_F32 && t->ne[0] == n && ggml_nrows(t) == 1 && t->nb[0] == sizeof(float);
}

// the source of b that is not a (NULL when b does not read a)
static const struct ggml_tensor *other_src(const struct ggml_tensor *b, const struct ggml_tensor *a) {
    if (b->src[0] == a) return b->src[1];
    if (b->src[1] == a) return b->src[0];
    return NULL;
}

static bool on_cuda(const struct ggml_tensor *t) { return t->backend == GGML_BACKEND_CUDA; }

// nodes[0..len) on CUDA, each but the last read only by the next ones of the run
static bool private_run(struct ggml_tensor *const *nodes, const int *readers, int len) {
    for (int j = 0; j < len; j++)
        if (!on_cuda(nodes[j]) || (j < len - 1 && readers[j] != 1)) return false;
    return true;
}

static int match_norm_mul(struct ggml_tensor *const *nd, const int *readers, int n) {
    if (n < 2 || (nd[0]->op != GGML_OP_RMS_NORM && nd[0]->op != GGML_OP_LAYER_NORM) || nd[1]->op != GGML_OP_MUL)
        return 0;
    const struct ggml_tensor *w = other_src(nd[1], nd[0]);
    if (!w || !is_f32_vector(w, nd[0]->ne[0]) || !private_run(nd, readers, 2)) return 0;
    return 2;
}

static int match_gemv_add(struct ggml_tensor *const *nd, const int *readers, int n) {
    if (n < 2 || nd[0]->op != GGML_OP_MUL_MAT || nd[1]->op != GGML_OP_ADD) return 0;
    const struct ggml_tensor *v = other_src(nd[1], nd[0]);
    if (!v || !is_f32_vector(v, nd[0]->ne[0]) || !cuda_gemv_takes_extra(nd[0]->src[0], nd[0]->src[1])) return 0;
    return private_run(nd, readers, 2) ? 2 : 0;
}

static bool is_act(const struct ggml_tensor *t) {
    return t->op == GGML_OP_SILU || t->op == GGML_OP_GELU || t->op == GGML_OP_GELU_ERF || t->op == GGML_OP_RELU;
}

static int match_gemv_act(struct ggml_tensor *const *nd, const int *readers, int n) {
    if (n < 2 || nd[0]->op != GGML_OP_MUL_MAT || !is_act(nd[1]) || nd[1]->src[0] != nd[0]) return 0;
    if (!cuda_gemv_takes_extra(nd[0]->src[0], nd[0]->src[1])) return 0;
    return private_run(nd, readers, 2) ? 2 : 0;
}

static int match_glu(struct ggml_tensor *const *nd, const int *readers, int n) {
    if (n < 4) return 0;
    const struct ggml_tensor *gate = nd[0], *act = nd[1], *up = nd[2], *mul = nd[3];
    if (gate->op != GGML_OP_MUL_MAT || up->op != GGML_OP_MUL_MAT || mul->op != GGML_OP_MUL) return 0;
    if (act->op != GGML_OP_SILU && act->op != GGML_OP_GELU && act->op != GGML_OP_RELU) return 0;
    if (act->src[0] != gate || up->src[1] != gate->src[1] || other_src(mul, act) != up) return 0;
    const struct ggml_tensor *wg = gate->src[0], *wu = up->src[0];
    if (wg->type != wu->type || wg->ne[0] != wu->ne[0] || wg->ne[1] != wu->ne[1] || wg->nb[1] != wu->nb[1]) return 0;
    if (!cuda_gemv_takes_extra(wg, gate->src[1]) || !cuda_gemv_takes_extra(wu, up->src[1])) return 0;
    return private_run(nd, readers, 4) ? 4 : 0;
}

static int match_rope_store(struct ggml_tensor *const *nd, const int *readers, int n) {
    if (n < 2 || nd[0]->op != GGML_OP_ROPE || nd[1]->op != GGML_OP_KV_STORE || nd[1]->src[1] != nd[0]) return 0;
    return private_run(nd, readers, 2) ? 2 : 0;
}

// nodes a head rotation takes at nd[0]: a rope (1), or rms_norm of each head, mul by a weight of the head's size,
// rope (3: Qwen3's and Gemma's q and k norms, which the rope kernel applies); 0 if neither
static int rope_part(struct ggml_tensor *const *nd, const int *readers, int n) {
    if (n >= 1 && nd[0]->op == GGML_OP_ROPE) return 1;
    if (n < 3 || nd[0]->op != GGML_OP_RMS_NORM || nd[1]->op != GGML_OP_MUL || nd[2]->op != GGML_OP_ROPE) return 0;
    const struct ggml_tensor *w = other_src(nd[1], nd[0]);
    if (!w || !is_f32_vector(w, nd[0]->ne[0]) || nd[2]->src[0] != nd[1] || nd[0]->src[0]->type != GGML_TYPE_F32)
        return 0;
    return readers[0] == 1 && readers[1] == 1 ? 3 : 0;
}

// a normed head rotation [, the kv_store of its rows]
static int match_norm_rope(struct ggml_tensor *const *nd, const int *readers, int n) {
    if (rope_part(nd, readers, n) != 3 || !private_run(nd, readers, 2) || !on_cuda(nd[2])) return 0;
    if (n > 3 && nd[3]->op == GGML_OP_KV_STORE && nd[3]->src[1] == nd[2] && private_run(nd, readers, 4)) return 4;
    return 3;
}

// a one-column mul_mat [, add of a bias], its rows viewed in order as (heads, head size), their kv_store: v
static int match_gemv_store(struct ggml_tensor *const *nd, const int *readers, int n) {
    if (n < 3 || nd[0]->op != GGML_OP_MUL_MAT || !cuda_gemv_takes_extra(nd[0]->src[0], nd[0]->src[1])) return 0;
    int i = 1; // the view's place
    if (nd[1]->op == GGML_OP_ADD) {
        const struct ggml_tensor *bias = other_src(nd[1], nd[0]);
        if (!bias || !is_f32_vector(bias, nd[0]->ne[0]) || nd[1]->type != GGML_TYPE_F32) return 0;
        i = 2;
    }
    if (n < i + 2) return 0;
    const struct ggml_tensor *view = nd[i], *store = nd[i + 1];
    if (view->op != GGML_OP_VIEW || view->src[0] != nd[i - 1] || store->op != GGML_OP_KV_STORE || store->src[1] != view)
        return 0;
    const bool in_order = view->view_offs == 0 && view->nb[0] == sizeof(float) &&
                          view->nb[1] == (size_t)view->ne[0] * sizeof(float) && view->ne[2] == 1 && view->ne[3] == 1 &&
                          view->ne[0] * view->ne[1] == nd[0]->ne[0];
    if (!in_order || store->ne[0] != view->ne[0] || store->ne[1] != view->ne[1] ||
        (store->type != GGML_TYPE_F32 && store->type != GGML_TYPE_F16))
        return 0;
    return private_run(nd, readers, i + 2) ? i + 2 : 0;
}

// models/common.py's attention over a fused projection (q, k and v views of one GEMV's output): rope q, k's view,
// rope k, its kv_store, v's view, its kv_store, q's and k's ropes each after their heads' norms where the model has
// them (rope_part). Rope q is read later (by attention) and written as usual; the views are read by the next node
// only, and every node's inputs come from before the run
static int match_rope_qkv(struct ggml_tensor *const *nd, const int *readers, int n) {
    const int a = rope_part(nd, readers, n); // q's rotation, then k's view
    if (!a || n < a + 1 || nd[a]->op != GGML_OP_VIEW) return 0;
    const int b = rope_part(nd + a + 1, readers + a + 1, n - a - 1), i = a + 1 + b; // k's rotation at a + 1
    if (!b || n < i + 3) return 0;
    const struct ggml_tensor *rq = nd[a - 1], *vk = nd[a], *rk = nd[i - 1], *sk = nd[i], *vv = nd[i + 1], *sv = nd[i + 2];
    if (sk->op != GGML_OP_KV_STORE || vv->op != GGML_OP_VIEW || sv->op != GGML_OP_KV_STORE) return 0;
    if (nd[a + 1]->src[0] != vk || sk->src[1] != rk || sv->src[1] != vv) return 0;
    for (int j = 0; j < i; j++) // the views are of the projection, not of a node inside the run
        if (vv->src[0] == nd[j] || (j < a && vk->src[0] == nd[j])) return 0;
    // the same rotation for q and k
    if (rq->src[1] != rk->src[1] || rq->src[2] != rk->src[2] ||
        memcmp(rq->op_params, rk->op_params, sizeof rq->op_params))
        return 0;
    if (vv->type != GGML_TYPE_F32 || vv->nb[0] != sizeof(float)) return 0;
    for (int j = 0; j < i + 3; j++)
        if (!on_cuda(nd[j])) return 0;
    return readers[a] == 1 && readers[i - 1] == 1 && readers[i + 1] == 1 ? i + 3 : 0;
}

// the unary ops an add/mul applies to its first operand when fused (cuda_act computes each)
static bool is_pre_op(const struct ggml_tensor *t) {
    return is_act(t) || t->op == GGML_OP_ABS || t->op == GGML_OP_SIGMOID || t->op == GGML_OP_SOFTPLUS ||
           t->op == GGML_OP_STEP;
}

// u = silu/gelu/relu/abs/sigmoid/softplus/step(a) -> add or mul of u and b: b of a's shape, or one row that u's op
// broadcasts as its second operand
static int match_unary_binary(struct ggml_tensor *const *nd, const int *readers, int n) {
    if (n < 2 || !is_pre_op(nd[0]) || (nd[1]->op != GGML_OP_ADD && nd[1]->op != GGML_OP_MUL)) return 0;
    const struct ggml_tensor *a = nd[0]->src[0], *b = other_src(nd[1], nd[0]);
    if (!b || b == nd[0] || a->type != GGML_TYPE_F32 || b->type != GGML_TYPE_F32 || b->ne[0] != a->ne[0]) return 0;
    const bool broadcast = ggml_nrows(b) == 1 && ggml_nrows(a) > 1;
    if ((broadcast && nd[1]->src[0] != nd[0]) || (!broadcast && ggml_nrows(b) != ggml_nrows(a))) return 0;
    return private_run(nd, readers, 2) ? 2 : 0;
}

// a mul_mat_rows or axpy_rows over all rows of w [k, n] with the F32 mask sel [n] of one token
static bool full_rows_under(const struct ggml_tensor *op, const struct ggml_tensor *sel) {
    const int64_t n = op->src[0]->ne[1];
    return op->src[2] == sel && op->op_params[0] == 0 && op->op_params[1] == n && sel->type == GGML_TYPE_F32 &&
           sel->ne[0] == n && ggml_nrows(sel) == 1;
}

// rows_ffn's graph (pyinfer/models/sparse_ffn.py) for one token: gate = mul_mat_rows(wg, x, pred), act,
// up = mul_mat_rows(wu, x, sel), mul(act, up), axpy_rows(wd, mul, sel); sel is relu(gate) for relu (a finer
// mask, which up and down also read), else pred
static int match_sparse_ffn(struct ggml_tensor *const *nd, const int *readers, int n) {
    if (n < 5) return 0;
    const struct ggml_tensor *gate = nd[0], *act = nd[1], *up = nd[2], *mul = nd[3], *down = nd[4];
    if (gate->op != GGML_OP_MUL_MAT_ROWS || up->op != GGML_OP_MUL_MAT_ROWS || mul->op != GGML_OP_MUL ||
        down->op != GGML_OP_AXPY_ROWS)
        return 0;
    if (act->op != GGML_OP_SILU && act->op != GGML_OP_GELU && act->op != GGML_OP_RELU) return 0;
    const bool relu = act->op == GGML_OP_RELU;
    const struct ggml_tensor *x = gate->src[1], *pred = gate->src[2], *sel = relu ? act : pred;
    if (!pred || act->src[0] != gate || up->src[1] != x || other_src(mul, act) != up || down->src[1] != mul) return 0;
    if (!full_rows_under(gate, pred) || !full_rows_under(up, sel) || !full_rows_under(down, sel)) return 0;
    const struct ggml_tensor *wg = gate->src[0], *wu = up->src[0], *wd = down->src[0];
    if (wg->type != wu->type || wg->ne[0] != wu->ne[0] || wg->ne[1] != wu->ne[1] || wg->nb[1] != wu->nb[1]) return 0;
    // down_t's own type is fine (sparse_ffn.cu launches its kernel for it): one whose rows the row ops can read
    if (!cuda_type_is_weight(wd->type) || wd->ne[0] != wg->ne[0] || wd->ne[1] != wg->ne[1] || wg->ne[1] < 1 ||
        ggml_nrows(mul) != 1)
        return 0;
    if (!cuda_gemv_takes_extra(wg, x) || !cuda_gemv_takes_extra(wu, x)) return 0;
    for (int j = 0; j < 5; j++)
        if (!on_cuda(nd[j])) return 0;
    const int inside[4] = {1, relu ? 3 : 1, 1, 1}; // readers of nodes 0..3, all within the run
    for (int j = 0; j < 4; j++)
        if (readers[j] != inside[j]) return 0;
    if (n > 5 && readers[4] == 1 && nd[5]->op == GGML_OP_ADD && on_cuda(nd[5]) && nd[5]->type == GGML_TYPE_F32) {
        const struct ggml_tensor *residual = other_src(nd[5], down);
        if (residual && residual != down && is_f32_vector(residual, down->ne[0])) return 6;
    }
    return 5;
}

// moe_ffn, then an add of a contiguous F32 tensor of its shape (the residual)
static int match_moe_add(struct ggml_tensor *const *nd, const int *readers, int n) {
    if (n < 2 || nd[0]->op != GGML_OP_MOE_FFN || nd[1]->op != GGML_OP_ADD || nd[1]->type != GGML_TYPE_F32) return 0;
    const struct ggml_tensor *v = other_src(nd[1], nd[0]);
    if (!v || v == nd[0] || v->type != GGML_TYPE_F32 || !ggml_is_contiguous(v) || !ggml_is_contiguous(nd[1])) return 0;
    for (int d = 0; d < GGML_MAX_DIMS; d++)
        if (v->ne[d] != nd[0]->ne[d]) return 0;
    return private_run(nd, readers, 2) ? 2 : 0;
}

// the x that node's GEMV (alone or heading a run) or few-token moe_ffn quantizes into the scratch; NULL if it
// leaves none there
static const struct ggml_tensor *quantized_x(const struct ggml_tensor *node) {
    if (node->op == GGML_OP_MOE_FFN) {
        const struct ggml_tensor *gate = node->src[0], *x = node->src[3];
        const bool q = cuda_type_is_weight(gate->type) && !cuda_type_is_float(gate->type);
        return q && x->ne[1] <= GEMV_MAX_COLS && ggml_is_contiguous(x) ? x : NULL;
    }
    const struct ggml_tensor *w = node->src[0], *x = node->src[1];
    const bool gemv = node->op == GGML_OP_MUL_MAT_ROWS || (node->op == GGML_OP_MUL_MAT && x->ne[1] <= GEMV_MAX_COLS);
    return gemv && cuda_type_is_weight(w->type) && !cuda_type_is_float(w->type) ? x : NULL;
}

extern "C" void ggml_cuda_plan_groups(struct ggml_tensor *const *nodes, int n, const int *readers,
                                      struct ggml_cuda_group *groups) {
    const struct ggml_tensor *xq_of = NULL; // the x whose Q8_1 copy the scratch holds (or will)
    int xq_norm = -1;                       // a norm group whose output a later GEMV may find quantized there
    for (int i = 0; i < n;) {
        struct ggml_cuda_group g = {GGML_CUDA_FUSE_NONE, 1, false, false};
        int len;
        if ((len = match_sparse_ffn(nodes + i, readers + i, n - i)))
            g.kind = GGML_CUDA_FUSE_SPARSE_FFN;
        else if ((len = match_gemv_store(nodes + i, readers + i, n - i)))
            g.kind = GGML_CUDA_FUSE_GEMV_STORE;
        else if ((len = match_glu(nodes + i, readers + i, n - i)))
            g.kind = GGML_CUDA_FUSE_GLU;
        else if ((len = match_gemv_add(nodes + i, readers + i, n - i)))
            g.kind = GGML_CUDA_FUSE_GEMV_ADD;
        else if ((len = match_gemv_act(nodes + i, readers + i, n - i)))
            g.kind = GGML_CUDA_FUSE_GEMV_ACT;
        else if ((len = match_rope_qkv(nodes + i, readers + i, n - i)))
            g.kind = GGML_CUDA_FUSE_ROPE_QKV;
        else if ((len = match_norm_rope(nodes + i, readers + i, n - i)))
            g.kind = GGML_CUDA_FUSE_NORM_ROPE;
        else if ((len = match_norm_mul(nodes + i, readers + i, n - i)))
            g.kind = GGML_CUDA_FUSE_NORM_MUL;
        else if ((len = match_rope_store(nodes + i, readers + i, n - i)))
            g.kind = GGML_CUDA_FUSE_ROPE_STORE;
        else if ((len = match_unary_binary(nodes + i, readers + i, n - i)))
            g.kind = GGML_CUDA_FUSE_UNARY_BINARY;
        else if ((len = match_moe_add(nodes + i, readers + i, n - i)))
            g.kind = GGML_CUDA_FUSE_MOE_ADD;
        g.len = len ? len : 1;
        if (on_cuda(nodes[i])) { // CPU nodes do not touch the device scratch
            const struct ggml_tensor *x = quantized_x(nodes[i]);
            if (g.kind == GGML_CUDA_FUSE_NORM_MUL) { // a candidate: it writes Q8_1 only if a GEMV reads it
                xq_norm = i;
            } else if (x) {
                // the candidate's output, or what the scratch holds already (then the candidate can no longer
                // write there: this GEMV reads the older copy after it); else this GEMV quantizes x itself.
                // Qwen3's q and k norms sit between q, k and v, which so quantize the layer's x once.
                const bool from_norm = xq_norm >= 0 && x == nodes[xq_norm + groups[xq_norm].len - 1];
                g.xq_ready = from_norm || x == xq_of;
                if (from_norm) groups[xq_norm].writes_xq = true;
                xq_norm = -1;
                xq_of = x;
            } else if (ggml_cuda_op_wsize(nodes[i]) || g.kind == GGML_CUDA_FUSE_SPARSE_FFN) {
                xq_of = NULL; // e.g. a GEMM's dequantized tiles, or a float sparse FFN's row list, overwrite it
                xq_norm = -1;
            }
        }
        groups[i] = g;
        for (int j = 1; j < g.len; j++) groups[i + j] = {GGML_CUDA_FUSE_NONE, 0, false, false};
        i += g.len;
    }
}

extern "C" int ggml_cuda_forward_group(const struct ggml_cuda_group *group, struct ggml_tensor *const *nodes,
                                       void *wdata, void *stream) {
    cudaStream_t st = (cudaStream_t)stream;
    struct ggml_tensor *node = nodes[0], *last = nodes[group->len - 1];
    const cuda_rows_sel all = {CUDA_SEL_ALL, NULL, 0, 0, 0, 0, node->src[0]->ne[1]};
    cuda_gemv_extra e = {};
    e.xq_ready = group->xq_ready;
    switch (group->kind) {
    case GGML_CUDA_FUSE_NORM_MUL:
        return cuda_norm_mul(node, other_src(last, node), last, group->writes_xq ? wdata : NULL, st);
    case GGML_CUDA_FUSE_ROPE_STORE: return cuda_rope_store(node, last, st);
    case GGML_CUDA_FUSE_NORM_ROPE:
        return cuda_norm_rope(node, nodes[2], group->len == 4 ? last : NULL, st);
    case GGML_CUDA_FUSE_ROPE_QKV: {
        const int a = node->op == GGML_OP_ROPE ? 1 : 3, i = a + 1 + (nodes[a + 1]->op == GGML_OP_ROPE ? 1 : 3);
        return cuda_rope_qkv_store(nodes[a - 1], a == 3 ? node : NULL, nodes[i - 1], i - a == 4 ? nodes[a + 1] : NULL,
                                   nodes[i], last, st);
    }
    case GGML_CUDA_FUSE_SPARSE_FFN:
        return cuda_sparse_ffn(nodes, last, group->len == 6 ? (const float *)other_src(last, nodes[4])->data : NULL,
                               group->xq_ready, wdata, st);
    case GGML_CUDA_FUSE_GEMV_ADD:
        e.add = (const float *)other_src(last, node)->data;
        return cuda_rows_dot(node->src[0], node->src[1], last, all, wdata, st, e);
    case GGML_CUDA_FUSE_GEMV_STORE:
        if (group->len == 4) e.add = (const float *)other_src(nodes[1], node)->data;
        e.store = last;
        return cuda_rows_dot(node->src[0], node->src[1], last, all, wdata, st, e);
    case GGML_CUDA_FUSE_GEMV_ACT:
        e.act = last->op;
        return cuda_rows_dot(node->src[0], node->src[1], last, all, wdata, st, e);
    case GGML_CUDA_FUSE_UNARY_BINARY:
        return cuda_binary(node->src[0], node->op, other_src(last, node), last, last->op == GGML_OP_ADD, st);
    case GGML_CUDA_FUSE_GLU:
        e.up = nodes[2]->src[0];
        e.act = nodes[1]->op;
        return cuda_rows_dot(node->src[0], node->src[1], last, all, wdata, st, e);
    case GGML_CUDA_FUSE_MOE_ADD:
        return cuda_moe_ffn(node, (float *)last->data, (const float *)other_src(last, node)->data, group->xq_ready,
                            wdata, st);
    default:
        if (node->op == GGML_OP_MOE_FFN) return cuda_moe_ffn(node, (float *)node->data, NULL, group->xq_ready, wdata, st);
        if (!group->xq_ready) return ggml_cuda_forward(node, wdata, stream);
        if (node->op == GGML_OP_MUL_MAT_ROWS) return cuda_op_mul_mat_rows(node, wdata, st, e);
        return cuda_rows_dot(node->src[0], node->src[1], node, all, wdata, st, e);
    }
}
