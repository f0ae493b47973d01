// pyinfer_native.h: the engine's own C API on top of ggml (what the cffi module binds besides ggml.h).
#pragma once
#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

// CFFI-BEGIN
// compiler, SIMD levels and whether CUDA objects are linked in, for `pyinfer --version` and bug reports
const char *pyinfer_build_info(void);
bool pyinfer_has_cuda_build(void);
// CFFI-END

#ifdef __cplusplus
}
#endif
