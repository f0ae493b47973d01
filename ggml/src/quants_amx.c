// quants_amx.c: the levels tile GEMM (levels.h) on AMX's int8 tiles, for prompts on CPUs that have them
// (Sapphire Rapids and later Xeons), whether this process may use them, and which levels kernel runs. A tile
// multiply does a panel's 16 rows by a group's 16 columns over one scale group (16 x 16 x 32 int8 products) on the
// tile unit; the 512-bit units scale its int32 sums. The AVX-512 and AMX instructions are enabled per function and
// reached only through the pointer the probe sets, so the file builds and runs on any x86-64 whose compiler has
// the AMX intrinsics (GCC 11, clang 12).
#include "levels.h"

#if defined(__x86_64__) && defined(__GNUC__) && __has_include(<amxtileintrin.h>)
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl")))

#define ARCH_REQ_XCOMP_PERM 0x1023 // Linux: ask for an extended state component (arch_prctl)
#define XFEATURE_XTILEDATA 18      // the tiles' 8 KB of state

// ldtilecfg's 64 bytes (palette 1)
struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16]; // bytes a row, per tile
    uint8_t rows[16];
};

// tile registers (literals: the intrinsics paste them into the instructions' names)
#define TILE_W 0      // the panel's levels
#define TILE_X 1      // the group's activations (wide: their high bytes)
#define TILE_SUM 2    // their int32 dots
#define TILE_X_LO 3   // wide: the activations' low bytes
#define TILE_SUM_LO 4 // wide: their dots

// Per scale group: the 16 x 16 int32 dots on the tile unit (wide: 255 times the high bytes' plus the low bytes'),
// through memory to the vector units, which add them times (d * scale[r]) into the sums, then offset[r] * s:
// levels_gemm_ref's operations, in its order
AMX_TARGET static void levels_gemm_amx_kernel(const struct levels_panel *w, const char *xgroup, bool wide,
                                              float *out) {
    const int64_t nb = w->k / LEVELS_XBLOCK, planes = wide ? 2 : 1;
    const int G = w->group;
    const float *d = (const float *)(xgroup + nb * planes * LEVELS_XBLOCK_BYTES); // (nb, LEVELS_COLS)
    const float *s = d + nb * LEVELS_COLS;                                        // (nb, LEVELS_COLS)
    struct tile_config cfg = {.palette = 1};
    cfg.rows[TILE_W] = LEVELS_ROWS, cfg.colsb[TILE_W] = (uint16_t)G; // 16 rows x G levels
    cfg.rows[TILE_X] = cfg.rows[TILE_X_LO] = (uint8_t)(G / 4);      // G/4 rows of 4 values x 16 columns
    cfg.colsb[TILE_X] = cfg.colsb[TILE_X_LO] = 4 * LEVELS_COLS;
    cfg.rows[TILE_SUM] = cfg.rows[TILE_SUM_LO] = LEVELS_ROWS; // 16 x 16 int32
    cfg.colsb[TILE_SUM] = cfg.colsb[TILE_SUM_LO] = 4 * LEVELS_COLS;
    _tile_loadconfig(&cfg);
    int32_t dots[LEVELS_ROWS * LEVELS_COLS] __attribute__((aligned(64)));    // (row, column)
    int32_t dots_lo[LEVELS_ROWS * LEVELS_COLS] __attribute__((aligned(64))); // wide: the low bytes'
    __m512 acc[LEVELS_ROWS];
    for (int r = 0; r < LEVELS_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < w->k / G; g++) {
        const int64_t b = g * G / LEVELS_XBLOCK; // the activations' block
        const char *x = xgroup + b * planes * LEVELS_XBLOCK_BYTES + (g * G % LEVELS_XBLOCK) / 4 * 4 * LEVELS_COLS;
        _tile_loadd(TILE_W, w->levels + g * LEVELS_ROWS * G, G);
        _tile_loadd(TILE_X, x, 4 * LEVELS_COLS);
        _tile_zero(TILE_SUM);
        _tile_dpbssd(TILE_SUM, TILE_W, TILE_X);
        if (wide) {
            _tile_loadd(TILE_X_LO, x + LEVELS_XBLOCK_BYTES, 4 * LEVELS_COLS);
            _tile_zero(TILE_SUM_LO);
            _tile_dpbssd(TILE_SUM_LO, TILE_W, TILE_X_LO);
            _tile_stored(TILE_SUM_LO, dots_lo, 4 * LEVELS_COLS);
        }
        _tile_stored(TILE_SUM, dots, 4 * LEVELS_COLS);
        const __m512 db = _mm512_loadu_ps(d + b * LEVELS_COLS);
        const float *scale = w->scale + g * LEVELS_ROWS;
        for (int r = 0; r < LEVELS_ROWS; r++) {
            __m512i dot = _mm512_load_si512(dots + r * LEVELS_COLS);
            if (wide) // 255 hi + lo = (hi << 8) - hi + lo
                dot = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(dot, 8), dot),
                                       _mm512_load_si512(dots_lo + r * LEVELS_COLS));
            const __m512 t = _mm512_mul_ps(db, _mm512_set1_ps(scale[r]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), t, acc[r]);
        }
        if (w->offset) {
            const __m512 sb = _mm512_loadu_ps(s + b * LEVELS_COLS);
            const float *offset = w->offset + g * LEVELS_ROWS;
            for (int r = 0; r < LEVELS_ROWS; r++) acc[r] = _mm512_fmadd_ps(sb, _mm512_set1_ps(offset[r]), acc[r]);
        }
    }
    for (int r = 0; r < LEVELS_ROWS; r++) _mm512_storeu_ps(out + r * LEVELS_COLS, acc[r]);
}

// AMX-TILE and AMX-INT8 (CPUID 7.0 EDX bits 24, 25), AVX-512 for the scaling, and the kernel's leave to use
// the tiles' state (Linux grants it per process, to all its threads)
static levels_gemm_fn amx_kernel;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl"))
        return;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return;
    amx_kernel = levels_gemm_amx_kernel;
}

static levels_gemm_fn levels_gemm_amx(void) {
    pthread_once(&amx_once, amx_probe);
    return amx_kernel;
}

AMX_TARGET static void amx_release(void) {
    _tile_release();
}

void levels_gemm_done(levels_gemm_fn gemm) {
    if (gemm && gemm == amx_kernel) amx_release();
}

#else

static levels_gemm_fn levels_gemm_amx(void) {
    return NULL;
}

void levels_gemm_done(levels_gemm_fn gemm) {
    (void)gemm;
}

#endif

// ---------------------------------------------------------------------------------------------------
// which kernel runs
// ---------------------------------------------------------------------------------------------------

static int levels_mode = GGML_LEVELS_GEMM_AUTO;

void ggml_cpu_set_levels_gemm(enum ggml_levels_gemm mode) {
    levels_mode = mode;
}

// asking also obtains the tiles' state for the process, as the first prompt would (a thread's signal stack must
// then hold it: sigaltstack sizes from before AMX fall short)
bool ggml_cpu_has_amx(void) {
    return levels_gemm_amx() != NULL;
}

levels_gemm_fn levels_gemm_current(void) {
    switch (levels_mode) {
    case GGML_LEVELS_GEMM_REF:
        return levels_gemm_ref;
    case GGML_LEVELS_GEMM_AUTO:
        return ggml_quants_simd_in_use() ? levels_gemm_amx() : NULL;
    default:
        return NULL;
    }
}
