// swiglu_oai.h: gpt-oss' clamped SwiGLU, shared by the CPU and CUDA mixture-of-experts kernels (nvcc compiles it
// too): min(g, 7) sigmoid(1.702 min(g, 7)) (clamp(u, -7, 7) + 1), as transformers' GptOssExperts and llama.cpp's
// swiglu_oai.
#pragma once
#include <math.h>

#ifdef __CUDACC__
#define GGML_SWIGLU_OAI_FN static inline __host__ __device__
#else
#define GGML_SWIGLU_OAI_FN static inline
#endif

#define GGML_SWIGLU_OAI_ALPHA 1.702f
#define GGML_SWIGLU_OAI_LIMIT 7.0f

GGML_SWIGLU_OAI_FN float ggml_swiglu_oai(float g, float u) {
    g = fminf(g, GGML_SWIGLU_OAI_LIMIT);
    u = fminf(fmaxf(u, -GGML_SWIGLU_OAI_LIMIT), GGML_SWIGLU_OAI_LIMIT);
    return g / (1.0f + expf(-GGML_SWIGLU_OAI_ALPHA * g)) * (u + 1.0f);
}
