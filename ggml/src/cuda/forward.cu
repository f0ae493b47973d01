// forward.cu: runs one graph node on a stream (dispatch to the op families) and sizes its scratch.
#include "common.cuh"

extern "C" size_t ggml_cuda_op_wsize(const struct ggml_tensor *node) {
    switch (node->op) {
    case GGML_OP_MUL_MAT: return cuda_mul_mat_wsize(node);
    case GGML_OP_MUL_MAT_ROWS: return cuda_mul_mat_rows_wsize(node);
    case GGML_OP_AXPY_ROWS: return cuda_axpy_rows_wsize(node);
    case GGML_OP_MOE_FFN: return cuda_moe_ffn_wsize(node);
    case GGML_OP_ATTENTION: return cuda_attention_wsize(node);
    default: return 0;
    }
}

extern "C" int ggml_cuda_forward(struct ggml_tensor *node, void *wdata, void *stream) {
    if (!node->data) return ggml_set_error(GGML_STATUS_INVALID_ARG, "node '%s' has no device data", node->name);
    for (int i = 0; i < GGML_MAX_SRC; i++)
        if (node->src[i] && !node->src[i]->data)
            return ggml_set_error(GGML_STATUS_INVALID_ARG, "source %d of node '%s' has no data", i, node->name);
    if (ggml_cuda_op_wsize(node) && !wdata)
        return ggml_set_error(GGML_STATUS_INVALID_ARG, "node '%s' needs device scratch", node->name);
    cudaStream_t st = (cudaStream_t)stream;
    switch (node->op) {
    case GGML_OP_NONE:
    case GGML_OP_VIEW: return GGML_STATUS_OK;
    case GGML_OP_CPY: return cuda_op_cpy(node, st);
    case GGML_OP_GET_ROWS: return cuda_op_get_rows(node, st);
    case GGML_OP_ADD:
    case GGML_OP_MUL: return cuda_op_binary(node, st);
    case GGML_OP_SCALE:
    case GGML_OP_SILU:
    case GGML_OP_GELU:
    case GGML_OP_GELU_ERF:
    case GGML_OP_TANH:
    case GGML_OP_ABS:
    case GGML_OP_SIGMOID:
    case GGML_OP_SOFTPLUS:
    case GGML_OP_STEP:
    case GGML_OP_RELU: return cuda_op_unary(node, st);
    case GGML_OP_RMS_NORM:
    case GGML_OP_LAYER_NORM: return cuda_op_norm(node, st);
    case GGML_OP_MUL_MAT: return cuda_op_mul_mat(node, wdata, st);
    case GGML_OP_ROPE: return cuda_op_rope(node, st);
    case GGML_OP_SOFT_MAX: return cuda_op_soft_max(node, st);
    case GGML_OP_KV_STORE: return cuda_op_kv_store(node, st);
    case GGML_OP_ATTENTION: return cuda_op_attention(node, wdata, st);
    case GGML_OP_MUL_MAT_ROWS: return cuda_op_mul_mat_rows(node, wdata, st);
    case GGML_OP_AXPY_ROWS: return cuda_op_axpy_rows(node, wdata, st);
    case GGML_OP_TOP_K: return cuda_op_top_k(node, st);
    case GGML_OP_MOE_FFN: return cuda_op_moe_ffn(node, wdata, st);
    case GGML_OP_SSM_CONV: return cuda_op_ssm_conv(node, st);
    case GGML_OP_DELTA_NET: return cuda_op_delta_net(node, st);
    default: break; // TRANSFER and other executor-level ops are run by the executor itself
    }
    return ggml_set_error(GGML_STATUS_UNSUPPORTED, "op %d has no CUDA kernel", (int)node->op);
}
