/* AMX tiles for the CPU kernels that take their bf16 products on them (included by
 * kernels/delta_rule/cpu_chunk.c and kernels/prefill_attention/attention.c, x86 only, after
 * <immintrin.h>; the includer defines _GNU_SOURCE for syscall): whether they run here, and
 * the tile configuration every kernel uses, eight tiles of 16 rows of 64 bytes. */
#ifndef DASC_CPU_AMX_H
#define DASC_CPU_AMX_H

#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 where the CPU has AMX-BF16 and AVX512-BF16 and Linux grants this process the tile state
 * (asked once; the answer does not change). */
static int amx_usable(void) {
    static int usable = -1;
    if (usable < 0)
        usable = __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("avx512bf16") &&
                 __builtin_cpu_supports("avx512f") &&
                 syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return usable;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Per thread (the tile configuration is a thread's state). */
__attribute__((target("amx-tile")))
static void amx_configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    /* not _tile_loadconfig: gcc's form tells the compiler it reads 8 bytes, and it dropped the
     * stores of the rest */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

__attribute__((target("amx-tile")))
static void amx_release(void) {
    _tile_release();
}

#endif
