// ggml.h: the tensor library's public API.
// Tensors live in a context (one arena); ops are recorded by constructors and run later by a backend.
// The block between the CFFI markers is read verbatim by pyinfer's cffi build, so keep it free of
// macros and preprocessor logic.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

// CFFI-BEGIN
#define GGML_MAX_DIMS 4
#define GGML_MAX_SRC 9
#define GGML_MAX_OP_PARAMS 8
#define GGML_TOP_K_MAX 64 // experts a token may be routed to

// Type ids are GGUF's, so a tensor's type in a file maps directly.
enum ggml_type {
    GGML_TYPE_F32 = 0,
    GGML_TYPE_F16 = 1,
    GGML_TYPE_Q4_0 = 2,
    GGML_TYPE_Q4_1 = 3,
    GGML_TYPE_Q5_0 = 6,
    GGML_TYPE_Q8_0 = 8,
    GGML_TYPE_Q8_1 = 9,
    GGML_TYPE_Q4_K = 12,
    GGML_TYPE_Q6_K = 14,
    GGML_TYPE_Q8_K = 15,
    GGML_TYPE_I8 = 24,
    GGML_TYPE_I32 = 26,
    GGML_TYPE_BF16 = 30,
    GGML_TYPE_MXFP4 = 39, // gpt-oss's experts: 4-bit E2M1 values under an E8M0 scale per 32
    GGML_TYPE_COUNT = 40,
};

enum ggml_status {
    GGML_STATUS_OK = 0,
    GGML_STATUS_INVALID_ARG = 1,    // shape/type mismatch, null data, out-of-range rows
    GGML_STATUS_ALLOC_FAILED = 2,
    GGML_STATUS_UNSUPPORTED = 3,    // type or op not implemented on this backend
    GGML_STATUS_BACKEND_ERROR = 4,  // device failure (CUDA error, no device)
};

enum ggml_op {
    GGML_OP_NONE = 0,     // leaf: weights or inputs
    GGML_OP_VIEW,         // a window on another tensor's data (reshape, slices)
    GGML_OP_CPY,          // copy/convert to dst type
    GGML_OP_GET_ROWS,     // rows of src0 picked by I32 ids in src1
    GGML_OP_ADD,          // src0 + src1, src1 one row broadcast over rows, or one value per row
    GGML_OP_MUL,          // src0 * src1, src1 one row broadcast over rows, or one value per row
    GGML_OP_SCALE,        // src0 * s
    GGML_OP_SILU,
    GGML_OP_GELU,         // tanh approximation, as llama.cpp
    GGML_OP_RELU,
    GGML_OP_GELU_ERF,     // exact GELU, x * Phi(x) (transformers' nn.GELU: Falcon)
    GGML_OP_TANH,         // tanh(x): final logit softcapping, c tanh(x / c) (Gemma 2-4)
    GGML_OP_ABS,          // |x|: input sparsity's masks, |x| - t
    GGML_OP_SIGMOID,      // 1 / (1 + exp(-x)): gates (Qwen3.5's attention output, the delta rule's write strength)
    GGML_OP_SOFTPLUS,     // log(1 + exp(x)), x above 20 as is (torch's): the delta rule's decay step
    GGML_OP_STEP,         // 1 where x > 0, else 0 (NaN too): a mask of |x| - t as the factor a dense matmul takes
    GGML_OP_RMS_NORM,     // x / sqrt(mean(x^2) + eps) per row
    GGML_OP_LAYER_NORM,   // (x - mean) / sqrt(var + eps) per row
    GGML_OP_MUL_MAT,      // y[n, m] = W[n, :] . x[:, m]
    GGML_OP_ROPE,         // rotary embedding at positions src1 (I32), mode normal or neox
    GGML_OP_SOFT_MAX,     // softmax per row, scaled, optional causal mask from positions
    GGML_OP_KV_STORE,     // writes src1's rows into cache src0 at positions src2; returns the cache
    GGML_OP_ATTENTION,    // causal attention of q over the KV cache (GQA), positions from src3
    GGML_OP_MUL_MAT_ROWS, // mul_mat for selected rows only; unselected rows give 0
    GGML_OP_AXPY_ROWS,    // out = sum over selected rows i of h[i] * Wt[i]
    GGML_OP_SPARSE_FFN,   // a whole FFN over the selected neurons, each neuron's rows read together
    GGML_OP_TOP_K,        // I32 indices of each row's k largest values, largest first
    GGML_OP_MOE_FFN,      // the FFN of a mixture of experts: each token's routed experts, weighted and summed
    GGML_OP_SSM_CONV,     // causal depthwise convolution over the tokens, its last inputs kept in a state leaf
    GGML_OP_DELTA_NET,    // the gated delta rule: per head a matrix state, decayed, corrected and read per token
    GGML_OP_TRANSFER,     // inserted by the planner: src0's bytes copied to another backend
    GGML_OP_COUNT,
};

enum ggml_rope_mode {
    GGML_ROPE_NORMAL = 0, // rotate pairs (2i, 2i+1): LLaMA GGUF layout
    GGML_ROPE_NEOX = 2,   // rotate pairs (i, i + n_dims/2): GPT-NeoX, Qwen2, Gemma
};

enum ggml_backend {
    GGML_BACKEND_CPU = 0,
    GGML_BACKEND_CUDA = 1,
};

struct ggml_context;
struct ggml_tensor;
struct ggml_cgraph;
struct ggml_threadpool;

// --- errors: every failing call returns NULL or a status and leaves a message here (per thread) ---
const char *ggml_last_error(void);
int ggml_last_status(void);
void ggml_clear_error(void);

// --- types ---
const char *ggml_type_name(enum ggml_type type);
int64_t ggml_blck_size(enum ggml_type type);      // values per block (1 for plain types)
size_t ggml_type_size(enum ggml_type type);       // bytes per block
size_t ggml_row_size(enum ggml_type type, int64_t ne); // bytes of ne values
bool ggml_type_is_valid(enum ggml_type type);
enum ggml_type ggml_vec_dot_type(enum ggml_type type); // activation type the dot product of `type` takes

// --- conversion and quantization of contiguous rows (n a multiple of the block size) ---
int ggml_quantize(enum ggml_type type, const float *src, void *dst, int64_t n);
// the activation quantizer mul_mat uses (SIMD where available); equals ggml_quantize on finite input
int ggml_quantize_act(enum ggml_type type, const float *src, void *dst, int64_t n);
int ggml_dequantize(enum ggml_type type, const void *src, float *dst, int64_t n);
// dot of one weight row of `type` with activations already converted to ggml_vec_dot_type(type)
int ggml_vec_dot(enum ggml_type type, int64_t n, float *result, const void *w, const void *x);
// same, forcing the scalar reference path (the oracle for the SIMD path)
int ggml_vec_dot_ref(enum ggml_type type, int64_t n, float *result, const void *w, const void *x);
// a precise mul_mat's 16-bit activations for weights of `type` (quants.h's block_q16, or block_q16_K for the
// K-quants): bytes of n values (0 where the type has none), the conversion, the dot and its scalar oracle
size_t ggml_q16_row_size(enum ggml_type type, int64_t n);
int ggml_quantize_q16(enum ggml_type type, const float *src, void *dst, int64_t n);
int ggml_vec_dot_q16(enum ggml_type type, int64_t n, float *result, const void *w, const void *x);
int ggml_vec_dot_q16_ref(enum ggml_type type, int64_t n, float *result, const void *w, const void *x);
// y[0..n) += a * row, row of `type` (n a multiple of the block size); _ref forces the scalar path
int ggml_axpy(enum ggml_type type, int64_t n, float *y, float a, const void *row);
int ggml_axpy_ref(enum ggml_type type, int64_t n, float *y, float a, const void *row);
// y[0..n) += a[r] * rows[r] for r = 0..3 in turn (the fast axpy4 where the type has one, else 4 axpy calls)
int ggml_axpy4(enum ggml_type type, int64_t n, float *y, const float *a, const void *const *rows);
// y[0..n) += sum of a[r] * rows[r] over r = 0..7 with the coefficients rounded to 8 bits where the type has
// such a kernel (what axpy_rows runs unless precise), else 8 axpy calls
int ggml_axpy8_rounded(enum ggml_type type, int64_t n, float *y, const float *a, const void *const *rows);

// --- CPU features, chosen at run time ---
bool ggml_cpu_has_avx2(void);
bool ggml_cpu_has_avx512(void);
void ggml_cpu_set_simd(bool enabled); // false forces the scalar kernels (tests, debugging)
void ggml_cpu_set_avx512(bool enabled); // false: the AVX2 kernels where AVX512 ones exist (tests compare the two)
// prompt matmuls (4+ columns) of types with a levels form (Q4_0, Q4_1, Q5_0, Q8_0, MXFP4, Q4_K, Q6_K) as int8 tile
// GEMMs: on AMX where the CPU has it (AUTO), never (OFF), or through the tile GEMM's scalar oracle on any CPU (REF:
// tests); set between computes, as ggml_cpu_set_simd
enum ggml_levels_gemm { GGML_LEVELS_GEMM_AUTO, GGML_LEVELS_GEMM_OFF, GGML_LEVELS_GEMM_REF };
void ggml_cpu_set_levels_gemm(enum ggml_levels_gemm mode);
bool ggml_cpu_has_amx(void); // AMX's int8 tiles, usable by this process

// --- context: an arena for tensor headers and, unless no_alloc, their data ---
struct ggml_context *ggml_init(size_t mem_size, bool no_alloc);
void ggml_free(struct ggml_context *ctx);
size_t ggml_used_mem(const struct ggml_context *ctx);
// the most bytes of weight rows that a prompt GEMM of the matmuls made in ctx from now on dequantizes at once: a
// backend that dequantizes for its GEMM (CUDA's cuBLAS path) holds that much scratch for it (0: its own default)
void ggml_set_gemm_scratch(struct ggml_context *ctx, size_t bytes);

// --- tensors; ne[0] is the innermost (contiguous) dimension ---
struct ggml_tensor *ggml_new_tensor(struct ggml_context *ctx, enum ggml_type type, int n_dims, const int64_t *ne);
struct ggml_tensor *ggml_new_tensor_1d(struct ggml_context *ctx, enum ggml_type type, int64_t ne0);
struct ggml_tensor *ggml_new_tensor_2d(struct ggml_context *ctx, enum ggml_type type, int64_t ne0, int64_t ne1);
struct ggml_tensor *ggml_new_tensor_3d(struct ggml_context *ctx, enum ggml_type type, int64_t ne0, int64_t ne1, int64_t ne2);
// points a tensor at external memory (mmap'd weights); data must hold ggml_nbytes(t)
int ggml_set_data(struct ggml_tensor *t, void *data);
void *ggml_get_data(const struct ggml_tensor *t);
void ggml_set_name(struct ggml_tensor *t, const char *name);
const char *ggml_get_name(const struct ggml_tensor *t);
enum ggml_type ggml_get_type(const struct ggml_tensor *t);
enum ggml_op ggml_get_op(const struct ggml_tensor *t);
int64_t ggml_get_ne(const struct ggml_tensor *t, int dim);
size_t ggml_get_nb(const struct ggml_tensor *t, int dim);
struct ggml_tensor *ggml_get_src(const struct ggml_tensor *t, int i); // NULL past the last source
int ggml_n_dims(const struct ggml_tensor *t);
int64_t ggml_nelements(const struct ggml_tensor *t);
int64_t ggml_nrows(const struct ggml_tensor *t);
size_t ggml_nbytes(const struct ggml_tensor *t);
bool ggml_is_contiguous(const struct ggml_tensor *t);

// --- op constructors: record the op, allocate nothing; NULL on invalid arguments ---
struct ggml_tensor *ggml_reshape_2d(struct ggml_context *ctx, struct ggml_tensor *a, int64_t ne0, int64_t ne1);
struct ggml_tensor *ggml_reshape_3d(struct ggml_context *ctx, struct ggml_tensor *a, int64_t ne0, int64_t ne1, int64_t ne2);
// a strided window: shape ne[0..n_dims), byte strides nb[1..n_dims) (nb[0] is the element size), byte offset
struct ggml_tensor *ggml_view(struct ggml_context *ctx, struct ggml_tensor *a, int n_dims, const int64_t *ne, const size_t *nb, size_t offset);
struct ggml_tensor *ggml_cpy(struct ggml_context *ctx, struct ggml_tensor *a, enum ggml_type type);
struct ggml_tensor *ggml_get_rows(struct ggml_context *ctx, struct ggml_tensor *a, struct ggml_tensor *ids);
struct ggml_tensor *ggml_add(struct ggml_context *ctx, struct ggml_tensor *a, struct ggml_tensor *b);
struct ggml_tensor *ggml_mul(struct ggml_context *ctx, struct ggml_tensor *a, struct ggml_tensor *b);
struct ggml_tensor *ggml_scale(struct ggml_context *ctx, struct ggml_tensor *a, float s);
struct ggml_tensor *ggml_silu(struct ggml_context *ctx, struct ggml_tensor *a);
struct ggml_tensor *ggml_gelu(struct ggml_context *ctx, struct ggml_tensor *a);
struct ggml_tensor *ggml_gelu_erf(struct ggml_context *ctx, struct ggml_tensor *a);
struct ggml_tensor *ggml_tanh(struct ggml_context *ctx, struct ggml_tensor *a);
struct ggml_tensor *ggml_abs(struct ggml_context *ctx, struct ggml_tensor *a);
struct ggml_tensor *ggml_relu(struct ggml_context *ctx, struct ggml_tensor *a);
struct ggml_tensor *ggml_sigmoid(struct ggml_context *ctx, struct ggml_tensor *a);
struct ggml_tensor *ggml_softplus(struct ggml_context *ctx, struct ggml_tensor *a);
struct ggml_tensor *ggml_step(struct ggml_context *ctx, struct ggml_tensor *a);
struct ggml_tensor *ggml_rms_norm(struct ggml_context *ctx, struct ggml_tensor *a, float eps);
struct ggml_tensor *ggml_layer_norm(struct ggml_context *ctx, struct ggml_tensor *a, float eps);
// w: [k, n] any weight type; x: [k, m] F32 -> [n, m] F32
struct ggml_tensor *ggml_mul_mat(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x);
// same, on the CPU without the activations' rounding error (x's conversion residual is converted and dotted
// too); the GPU computes it as mul_mat, except that a batch's F32 weights are not rounded to TF32
struct ggml_tensor *ggml_mul_mat_precise(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x);
// x: [head_dim, n_head, n_tokens] F32; pos: [n_tokens] I32
// freq_factors: NULL, or F32 [>= n_dims/2]: pair i's frequency is divided by freq_factors[i] (Llama 3's
// long-context scaling, llama.cpp's rope_freqs tensor)
struct ggml_tensor *ggml_rope(struct ggml_context *ctx, struct ggml_tensor *x, struct ggml_tensor *pos, int n_dims, int mode, float freq_base, float freq_scale, struct ggml_tensor *freq_factors);
// ggml_rope with YaRN (llama.cpp's ggml_rope_ext): ext_factor > 0 keeps the pairs that turn more than beta_fast
// times in n_ctx_orig positions at their trained angle, interpolates (freq_scale) those under beta_slow, ramps
// between; cos and sin are multiplied by attn_factor, and by 1 + 0.1 ln(1/freq_scale) too when ext_factor != 0
struct ggml_tensor *ggml_rope_ext(struct ggml_context *ctx, struct ggml_tensor *x, struct ggml_tensor *pos, int n_dims, int mode, float freq_base, float freq_scale, struct ggml_tensor *freq_factors, int n_ctx_orig, float ext_factor, float attn_factor, float beta_fast, float beta_slow);
// a: [n_cols, n_rows] F32; row r of a is the scores of query r; with pos (I32 [n_rows]) columns j > pos[r] are masked
struct ggml_tensor *ggml_soft_max(struct ggml_context *ctx, struct ggml_tensor *a, struct ggml_tensor *pos, float scale);
// cache: [head_dim, n_kv_head, n_ctx] (F32 or F16); src: [head_dim, n_kv_head, n_tokens] F32; pos: [n_tokens] I32
struct ggml_tensor *ggml_kv_store(struct ggml_context *ctx, struct ggml_tensor *cache, struct ggml_tensor *src, struct ggml_tensor *pos);
// q: [head_dim, n_head, n_tokens]; k, v: results of ggml_kv_store; token t attends to cache slots [0, pos[t]]
// -> [head_dim * n_head, n_tokens]
// window > 0: a query at position p sees the keys at positions (p - window, p] only (sliding-window layers)
// sinks: NULL, or (n_head) F32 logits that every query's softmax counts beside its keys' and no value follows
// (gpt-oss' attention sinks)
struct ggml_tensor *ggml_attention(struct ggml_context *ctx, struct ggml_tensor *q, struct ggml_tensor *k, struct ggml_tensor *v, struct ggml_tensor *pos, struct ggml_tensor *sinks, float scale, int window);
// neuron-aware sparse ops. sel: F32 [n_rows, m] (row selected where > 0), I32 [n_sel, m] index list
// (entries < 0 end it), or NULL (all rows); only rows in [begin, end) are considered (end < 0: n_rows).
// w: [k, n_rows]; x: [k, m] F32 -> [n_rows, m] F32, zero where not selected
struct ggml_tensor *ggml_mul_mat_rows(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x, struct ggml_tensor *sel, int64_t begin, int64_t end);
// wt: [d, n_rows] one row per neuron; h: [n_rows, m] F32 -> [d, m] F32 = sum_i h[i] * wt[i]
struct ggml_tensor *ggml_axpy_rows(struct ggml_context *ctx, struct ggml_tensor *wt, struct ggml_tensor *h, struct ggml_tensor *sel, int64_t begin, int64_t end);
// axpy_rows without rounding its coefficients to 8 bits on the CPU (as ggml_mul_mat_precise)
struct ggml_tensor *ggml_axpy_rows_precise(struct ggml_context *ctx, struct ggml_tensor *wt, struct ggml_tensor *h, struct ggml_tensor *sel, int64_t begin, int64_t end);

// the activation of a sparse_ffn: act(up) for RELU, act(gate) * up for the gated kinds (DRELU: relu(gate) * relu(up))
// (SWIGLU_OAI, experts only: gpt-oss' clamped SwiGLU, min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1))
enum ggml_ffn_kind { GGML_FFN_RELU, GGML_FFN_REGLU, GGML_FFN_DRELU, GGML_FFN_SWIGLU, GGML_FFN_GEGLU, GGML_FFN_SWIGLU_OAI };
// bundle: [d, r * n_ff], neuron i's r rows adjacent: its gate row (gated kinds, r = 3), up row, then its
// down_t row; x: [d, m] F32; sel: over n_ff as above. -> [d + n_ff, m] F32: rows [0, d) the FFN output
// (sum over selected neurons of act * down_t), rows [d, d + n_ff) 1 where a neuron's down row was summed
// (|act| > threshold), else 0
struct ggml_tensor *ggml_sparse_ffn(struct ggml_context *ctx, struct ggml_tensor *bundle, struct ggml_tensor *x, struct ggml_tensor *sel, enum ggml_ffn_kind kind, float threshold);

// mixtures of experts. top_k: a [n, m] F32 -> [k, m] I32, the indices of each column's k largest values,
// largest first, ties to the lower index (a router's choice of experts); k <= GGML_TOP_K_MAX
struct ggml_tensor *ggml_top_k(struct ggml_context *ctx, struct ggml_tensor *a, int k);
// gate, up: [d, n_ff, n_local] and down: [n_ff, d, n_local], one matrix per expert (llama.cpp's ffn_*_exps);
// x: [d, m] F32; ids: [k, m] I32 the k distinct experts each token is routed to (top_k of the router's logits);
// logits: [n_expert, m] F32 the router's logits; slots: NULL (n_local == n_expert: expert e is matrix e) or
// I32 [n_expert], expert e's matrix or -1 where this op does not hold it (a device's share of the experts; no two
// experts share a matrix).
// -> [d, m] F32: sum over the token's experts e this op holds of weight_e * down_e(act(gate_e x) * up_e x),
// weight_e = exp(logit_e) / Z, Z summed over the k chosen experts (norm: the weights of the k add up to 1,
// Mixtral and Qwen3-MoE) or over all experts (OLMoE). kind: SWIGLU, GEGLU or SWIGLU_OAI. biases: NULL or F32
// [2 n_ff + d, n_expert], by expert (not by matrix): gate's, up's and down's (added before the weighting; gpt-oss).
// scales: NULL or F32 [n_expert]: expert e's weight times scales[e] (Gemma 4's per-expert scale).
struct ggml_tensor *ggml_moe_ffn(struct ggml_context *ctx, struct ggml_tensor *gate, struct ggml_tensor *up, struct ggml_tensor *down, struct ggml_tensor *x, struct ggml_tensor *ids, struct ggml_tensor *logits, struct ggml_tensor *slots, struct ggml_tensor *biases, struct ggml_tensor *scales, enum ggml_ffn_kind kind, bool norm);

// linear attention (Qwen3.5's gated delta net). Both ops carry a sequence between graphs in a state leaf that they
// read and overwrite in place, so they run where it lives (as kv_store). The state stands after pos[0] tokens of
// the sequence: at pos[0] == 0 it is taken as zeros, not read. pos: [n] I32, consecutive positions.
// ssm_conv: state [C, K-1] F32, the K-1 inputs before x; x [C, n] F32; w [K, C] F32, channel c's taps, oldest
// first. -> [C, n]: y[c, t] = sum over j of w[j, c] * xx[c, t + j], xx the state's rows then x's; the state
// becomes xx's last K-1 rows
struct ggml_tensor *ggml_ssm_conv(struct ggml_context *ctx, struct ggml_tensor *state, struct ggml_tensor *x, struct ggml_tensor *w, struct ggml_tensor *pos);
// delta_net: state [D_k, D_v, H] F32, head h's matrix S (D_k x D_v) transposed (row j is S's column j); q, k
// [D_k, H_k, n] F32 (strided rows allowed), v [D_v, H, n], g and beta [H, n] F32 (per head and token the log
// decay and the write strength). Value head h reads query and key head h % H_k (llama.cpp's tiled order).
// l2_eps > 0: q and k are L2-normed per head first, x / sqrt(sum x^2 + l2_eps) (transformers' Qwen3.5).
// Per token: S = exp(g) S; S += k (beta (v - S^T k))^T; out = scale S^T q. -> [D_v, H, n]
// D_k <= GGML_DELTA_NET_MAX_DK (a row of S in a CUDA warp's registers, 16 a lane).
#define GGML_DELTA_NET_MAX_DK 512
struct ggml_tensor *ggml_delta_net(struct ggml_context *ctx, struct ggml_tensor *state, struct ggml_tensor *q, struct ggml_tensor *k, struct ggml_tensor *v, struct ggml_tensor *g, struct ggml_tensor *beta, struct ggml_tensor *pos, float scale, float l2_eps);

// --- graphs: built from output tensors, planned once (buffers for intermediates), computed many times ---
struct ggml_cgraph *ggml_graph_new(struct ggml_context *ctx);
int ggml_graph_add_output(struct ggml_cgraph *g, struct ggml_tensor *t);
int ggml_graph_n_nodes(const struct ggml_cgraph *g);
struct ggml_tensor *ggml_graph_node(const struct ggml_cgraph *g, int i);
// moves every leaf the graph reads to `backend` (before planning): the whole graph then runs there
int ggml_graph_to_backend(struct ggml_cgraph *g, enum ggml_backend backend);
// (before planning) weight ops (moe_ffn included) of at least min_cols columns run on the GPU whatever their weight's place:
// weights in host memory are copied in just before their reader, into graph memory that later weights
// reuse (prompt batches, where the GPU's speed pays for the copy; host memory registered with
// ggml_cuda_host_register copies fastest); 0 turns it off
int ggml_graph_stream_weights(struct ggml_cgraph *g, int64_t min_cols);
// allocates data for every node that has none; outputs keep their buffers across computes
int ggml_graph_plan(struct ggml_cgraph *g);
size_t ggml_graph_mem_size(const struct ggml_cgraph *g);
size_t ggml_graph_device_mem_size(const struct ggml_cgraph *g); // its GPU nodes' planned buffer
// nodes the CUDA backend runs inside a fused kernel started by an earlier node (0 without a GPU part)
int ggml_graph_n_fused(const struct ggml_cgraph *g);
void ggml_graph_free(struct ggml_cgraph *g);

// --- devices ---
int ggml_cuda_device_count(void);  // 0 without a GPU or in a build without CUDA
const char *ggml_cuda_device_name(void);
// device bytes the library holds now (weights, KV caches, graph buffers, scratch, the cuBLAS workspace)
size_t ggml_cuda_allocated(void);
// the most device bytes held at once since the last ggml_cuda_peak_reset (which returns the bytes held now):
// a prompt's graph buffers may come and go between two readings of ggml_cuda_allocated
size_t ggml_cuda_peak_reset(void);
size_t ggml_cuda_allocated_peak(void);
// pins host memory so copies from it (read_only: a model file's mapping) or also into it run at full speed,
// asynchronously
int ggml_cuda_host_register(void *ptr, size_t size, bool read_only);
void ggml_cuda_host_unregister(void *ptr);
// the device's free and total bytes (cudaMemGetInfo; 0 and 0 without a GPU)
int ggml_cuda_mem_info(size_t *free_bytes, size_t *total_bytes);
// moves a leaf's data to the device (allocating there, copying what it holds now); views of it follow
int ggml_tensor_to_backend(struct ggml_tensor *t, enum ggml_backend backend);
enum ggml_backend ggml_get_backend(const struct ggml_tensor *t);
// copies bytes between host memory and a tensor wherever it lives
int ggml_tensor_write(struct ggml_tensor *t, const void *src, size_t offset, size_t size);
int ggml_tensor_read(const struct ggml_tensor *t, void *dst, size_t offset, size_t size);

// --- CPU execution: a persistent pool of worker threads ---
struct ggml_threadpool *ggml_threadpool_new(int n_threads);
void ggml_threadpool_free(struct ggml_threadpool *tp);
int ggml_threadpool_n_threads(const struct ggml_threadpool *tp);
// runs a planned graph whose nodes all run on the CPU (the engine's pyinfer_graph_compute runs any graph)
int ggml_graph_compute(struct ggml_cgraph *g, struct ggml_threadpool *tp);
// CFFI-END

#ifdef __cplusplus
}
#endif
