// rope.h: one RoPE pair's angle per position, shared by the CPU kernel and the CUDA kernel (nvcc compiles it too).
#pragma once
#include <math.h>

#ifdef __CUDACC__
#define GGML_ROPE_FN static inline __host__ __device__
#else
#define GGML_ROPE_FN static inline
#endif

// A ROPE node's op_params: [0] n_dims, [1] mode, [2] freq_base, [3] freq_scale, [4] ext_factor, [5] mscale (what
// cos and sin are multiplied by), [6], [7] YaRN's correction dims (first and last pair of the ramp).

// Pair i's angle per unit position: base^(-2i/n_dims) / factor (Llama 3's rope_freqs, else 1), scaled by
// freq_scale; with YaRN (ext != 0) the fast pairs (i <= lo) keep the trained angle and the ramp up to hi blends
// towards the interpolated one (llama.cpp's rope_yarn, transformers' yarn).
GGML_ROPE_FN double ggml_rope_pair_freq(int i, int n_dims, double base, double fscale, double factor, double ext,
                                        double lo, double hi) {
    const double trained = pow(base, -2.0 * i / n_dims) / factor;
    double keep = 0.0; // 1: the trained angle, 0: the interpolated one
    if (ext != 0.0) {
        const double y = (i - lo) / fmax(0.001, hi - lo);
        keep = (1.0 - fmin(1.0, fmax(0.0, y))) * ext;
    }
    return trained * (fscale * (1.0 - keep) + keep);
}
