// build_info.c: what this binary was built with and what the CPU it runs on offers.
#include "pyinfer_native.h"
#include "ggml.h"

#include <stdio.h>

bool pyinfer_has_cuda_build(void) {
#ifdef GGML_USE_CUDA
    return true;
#else
    return false;
#endif
}

const char *pyinfer_build_info(void) {
    static char info[256];
    snprintf(info, sizeof info, "compiler %s, cpu avx2=%d avx512=%d, cuda build=%d", __VERSION__,
             ggml_cpu_has_avx2(), ggml_cpu_has_avx512(), pyinfer_has_cuda_build());
    return info;
}
