// moe.cuh: what the mixture-of-experts kernels share: the op's parameters as the kernels see them, an expert's
// slot, and the batch path (moe_gemm.cu) that moe.cu's moe_ffn hands prompts to.
#pragma once
#include "rowdot.cuh"
#include "../swiglu_oai.h"

#define MOE_UP_ROWS 32    // gate and up rows per block of the up kernel: their activations are one Q8_1 block
#define MOE_UP_WARPS 8    // warps per block of the up kernel
#define MOE_UP_WARP_ROWS (MOE_UP_ROWS / MOE_UP_WARPS) // rows a warp dots at once (gate's and up's: twice as many)
#define MOE_DOWN_ROWS 8   // output rows per block of the down kernel (a warp per pair dots all of them at once)
#define MOE_DOWN_WARPS 8  // warps per block of the down kernel, a token's pairs taken in turn

struct moe_params {
    const uint8_t *wg, *wu, *wd;     // gate, up [d, n_ff, n_local], down [n_ff, d, n_local]
    int64_t g_nb1, g_nb2, d_nb1, d_nb2;
    int64_t d, n_ff, n_expert, k, m, n_local;
    const float *x;                  // [d, m]
    const int8_t *xq;                // x as Q8_1 (quantized gate/up)
    const float2 *xds;
    const int32_t *ids;              // [k, m]
    const float *logits;             // [n_expert, m]
    const int32_t *slots;            // [n_expert] or NULL
    float *act;                      // [n_ff, k m]
    int8_t *aq;                      // act as Q8_1 (quantized down; the up kernel writes it in the GEMV path)
    float2 *ads;
    float *part;                     // [d, k m] each pair's weighted down output (a prompt's)
    float *wts;                      // [k m] each pair's routing weight
    float *y;                        // [d, m]
    const float *add;                // [d, m] added to y (a fused add's other operand), or NULL
    const float *biases;             // [2 n_ff + d, n_expert] by expert (gate's, up's, down's), or NULL
    const float *scales;             // [n_expert] each expert's weight multiplier, or NULL
    int kind;                        // enum ggml_ffn_kind: SWIGLU, GEGLU or SWIGLU_OAI
    bool norm;
};

// the biases of a pair's expert (gate's n_ff, up's n_ff, down's d), or nullptr
static __device__ __forceinline__ const float *moe_bias(const moe_params &p, int64_t pair) {
    return p.biases ? p.biases + (int64_t)p.ids[pair] * (2 * p.n_ff + p.d) : nullptr;
}

// the activation of a gate and an up value (ops_moe.c's moe_act)
static __device__ __forceinline__ float moe_act(int kind, float g, float u) {
    if (kind == GGML_FFN_SWIGLU_OAI) return ggml_swiglu_oai(g, u);
    return cuda_act(kind == GGML_FFN_SWIGLU ? GGML_OP_SILU : GGML_OP_GELU, g) * u;
}

static __device__ __forceinline__ int32_t moe_slot(const moe_params &p, int64_t pair) {
    const int32_t e = p.ids[pair];
    if (e < 0 || e >= p.n_expert) return -1; // (top_k never writes one; a kernel cannot fail the step)
    const int32_t s = p.slots ? p.slots[e] : e;
    return s < p.n_local ? s : -1;
}


template <int TYPE>
constexpr bool moe_float = TYPE == GGML_TYPE_F32 || TYPE == GGML_TYPE_F16 || TYPE == GGML_TYPE_BF16;

// a batch's experts as grouped GEMMs: pairs sorted by expert on the device, each expert's rows read once per
// tile of its pairs; act and part as the GEMV kernels leave them. Scratch: moe_gemm_wsize bytes at wdata.
size_t moe_gemm_wsize(int64_t n_local, int64_t pairs);
int moe_gemm(const moe_params &p, enum ggml_type gate_type, enum ggml_type down_type, void *wdata, cudaStream_t st);
