// ops.c: dispatch of a graph node to its CPU kernel, and the scratch each kernel needs.
#include "ops_kernels.h"

size_t ggml_cpu_op_wsize(const struct ggml_tensor *node, int n_threads) {
    if (n_threads < 1) n_threads = 1;
    switch (node->op) {
    case GGML_OP_CPY: return ggml_cpu_cpy_wsize(node, n_threads);
    case GGML_OP_MUL_MAT: return ggml_cpu_mul_mat_wsize(node, n_threads);
    case GGML_OP_ROPE: return ggml_cpu_rope_wsize(node, n_threads);
    case GGML_OP_ATTENTION: return ggml_cpu_attention_wsize(node, n_threads);
    case GGML_OP_MUL_MAT_ROWS: return ggml_cpu_mul_mat_rows_wsize(node, n_threads);
    case GGML_OP_AXPY_ROWS: return ggml_cpu_axpy_rows_wsize(node, n_threads);
    case GGML_OP_SPARSE_FFN: return ggml_cpu_sparse_ffn_wsize(node, n_threads);
    case GGML_OP_MOE_FFN: return ggml_cpu_moe_ffn_wsize(node, n_threads);
    case GGML_OP_DELTA_NET: return ggml_cpu_delta_net_wsize(node, n_threads);
    default: return 0;
    }
}

int ggml_cpu_forward(const struct ggml_compute_params *params, struct ggml_tensor *node) {
    if (!node->data) return ggml_set_error(GGML_STATUS_INVALID_ARG, "node '%s' has no data: plan the graph first", node->name);
    for (int i = 0; i < GGML_MAX_SRC; i++)
        if (node->src[i] && !node->src[i]->data)
            return ggml_set_error(GGML_STATUS_INVALID_ARG, "source %d of node '%s' has no data", i, node->name);
    switch (node->op) {
    case GGML_OP_NONE:
    case GGML_OP_VIEW: return GGML_STATUS_OK;
    case GGML_OP_CPY: return ggml_cpu_op_cpy(params, node);
    case GGML_OP_GET_ROWS: return ggml_cpu_op_get_rows(params, node);
    case GGML_OP_ADD:
    case GGML_OP_MUL: return ggml_cpu_op_binary(params, node);
    case GGML_OP_SCALE:
    case GGML_OP_SILU:
    case GGML_OP_GELU:
    case GGML_OP_GELU_ERF:
    case GGML_OP_TANH:
    case GGML_OP_ABS:
    case GGML_OP_SIGMOID:
    case GGML_OP_SOFTPLUS:
    case GGML_OP_STEP:
    case GGML_OP_RELU: return ggml_cpu_op_unary(params, node);
    case GGML_OP_RMS_NORM:
    case GGML_OP_LAYER_NORM: return ggml_cpu_op_norm(params, node);
    case GGML_OP_MUL_MAT: return ggml_cpu_op_mul_mat(params, node);
    case GGML_OP_ROPE: return ggml_cpu_op_rope(params, node);
    case GGML_OP_SOFT_MAX: return ggml_cpu_op_soft_max(params, node);
    case GGML_OP_KV_STORE: return ggml_cpu_op_kv_store(params, node);
    case GGML_OP_ATTENTION: return ggml_cpu_op_attention(params, node);
    case GGML_OP_MUL_MAT_ROWS: return ggml_cpu_op_mul_mat_rows(params, node);
    case GGML_OP_AXPY_ROWS: return ggml_cpu_op_axpy_rows(params, node);
    case GGML_OP_SPARSE_FFN: return ggml_cpu_op_sparse_ffn(params, node);
    case GGML_OP_TOP_K: return ggml_cpu_op_top_k(params, node);
    case GGML_OP_MOE_FFN: return ggml_cpu_op_moe_ffn(params, node);
    case GGML_OP_SSM_CONV: return ggml_cpu_op_ssm_conv(params, node);
    case GGML_OP_DELTA_NET: return ggml_cpu_op_delta_net(params, node);
    default: break; // TRANSFER and other executor-level ops never reach the CPU kernels
    }
    return ggml_set_error(GGML_STATUS_UNSUPPORTED, "op %d has no CPU kernel", (int)node->op);
}
