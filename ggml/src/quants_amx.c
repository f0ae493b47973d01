// quants_amx.c: the levels tile GEMM (levels.h) on AMX's int8 tiles, for prompts on CPUs that have them
// (Sapphire Rapids and later Xeons). A tile multiply does a panel's 16 rows by a group's 16 columns over one
// scale group (16 x 16 x 32 int8 products) on the tile unit; the 512-bit units scale its int32 sums while the
// next one runs. The AVX-512 and AMX instructions are enabled per function, so the file builds for any x86-64.
#include "levels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx2,fma")))

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

// tile registers, two sets so that one granule's dots run on the tile unit while the vector units scale the
// last one's (literals: the intrinsics paste them into the instructions' names)
#define TILE_W0 0   // the panel's levels
#define TILE_X0 1   // the group's activations
#define TILE_SUM0 2 // their int32 dots
#define TILE_W1 3
#define TILE_X1 4
#define TILE_SUM1 5

// granule g's 16 x 16 int32 dots into buf through one tile set
#define GRANULE_DOTS(tw, tx, tsum, g, buf)                                                                        \
    do {                                                                                                          \
        _tile_loadd(tw, w->levels + (g) * LEVELS_ROWS * G, G);                                                    \
        _tile_loadd(tx, xgroup + (g) * G / LEVELS_XBLOCK * LEVELS_XBLOCK_BYTES +                                  \
                            ((g) * G % LEVELS_XBLOCK) / 4 * 4 * LEVELS_COLS, 4 * LEVELS_COLS);                    \
        _tile_zero(tsum);                                                                                         \
        _tile_dpbssd(tsum, tw, tx);                                                                               \
        _tile_stored(tsum, buf, 4 * LEVELS_COLS);                                                                 \
    } while (0)

// acc[r] += dots[r] * (d * scale[r]), then offset[r] * s: levels_gemm_ref's float operations, in its order
AMX_TARGET static inline void granule_scale(__m512 *acc, const int32_t *dots, const struct levels_panel *w,
                                            int64_t g, const float *d, const float *s) {
    const int64_t b = g * w->group / LEVELS_XBLOCK;
    const __m512 db = _mm512_loadu_ps(d + b * LEVELS_COLS);
    const float *scale = w->scale + g * LEVELS_ROWS;
    for (int r = 0; r < LEVELS_ROWS; r++) {
        const __m512 t = _mm512_mul_ps(db, _mm512_set1_ps(scale[r]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots + r * LEVELS_COLS)), t, acc[r]);
    }
    if (w->offset) {
        const __m512 sb = _mm512_loadu_ps(s + b * LEVELS_COLS);
        const float *offset = w->offset + g * LEVELS_ROWS;
        for (int r = 0; r < LEVELS_ROWS; r++) acc[r] = _mm512_fmadd_ps(sb, _mm512_set1_ps(offset[r]), acc[r]);
    }
}

AMX_TARGET static void levels_gemm_amx_kernel(const struct levels_panel *w, const char *xgroup, float *out) {
    const int64_t k = w->k, nb = k / LEVELS_XBLOCK, ng = k / w->group;
    const int G = w->group;
    const float *d = (const float *)(xgroup + nb * LEVELS_XBLOCK_BYTES); // (nb, LEVELS_COLS)
    const float *s = d + nb * LEVELS_COLS;                               // (nb, LEVELS_COLS)
    struct tile_config cfg = {.palette = 1};
    for (int set = 0; set < 2; set++) {
        cfg.rows[3 * set] = LEVELS_ROWS, cfg.colsb[3 * set] = (uint16_t)G;                // 16 rows x G levels
        cfg.rows[3 * set + 1] = (uint8_t)(G / 4), cfg.colsb[3 * set + 1] = 4 * LEVELS_COLS; // G/4 rows of 4 x 16
        cfg.rows[3 * set + 2] = LEVELS_ROWS, cfg.colsb[3 * set + 2] = 4 * LEVELS_COLS;    // 16 x 16 int32
    }
    _tile_loadconfig(&cfg);
    int32_t dots[2][LEVELS_ROWS * LEVELS_COLS] __attribute__((aligned(64)));
    __m512 acc[LEVELS_ROWS];
    for (int r = 0; r < LEVELS_ROWS; r++) acc[r] = _mm512_setzero_ps();
    // software pipelined: granule g + 1's dots are asked for before granule g's are scaled
    GRANULE_DOTS(TILE_W0, TILE_X0, TILE_SUM0, 0, dots[0]);
    for (int64_t g = 0; g < ng; g++) {
        if (g + 1 < ng && g % 2 == 0) GRANULE_DOTS(TILE_W1, TILE_X1, TILE_SUM1, g + 1, dots[1]);
        if (g + 1 < ng && g % 2 == 1) GRANULE_DOTS(TILE_W0, TILE_X0, TILE_SUM0, g + 1, dots[0]);
        granule_scale(acc, dots[g % 2], w, g, d, s);
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

levels_gemm_fn levels_gemm_amx(void) {
    pthread_once(&amx_once, amx_probe);
    return amx_kernel;
}

#else

levels_gemm_fn levels_gemm_amx(void) {
    return NULL;
}

#endif
