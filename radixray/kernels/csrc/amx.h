// Intel AMX plumbing shared by the tile kernels (int8_amx.h, attention_amx.cpp): whether the
// CPU and the OS allow the tiles, and the one tile shape they all use.
#pragma once
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace radixray_amx {

// CPUID leaf 7, EDX: AMX-BF16 (bit 22), AMX-TILE (24), AMX-INT8 (25); then the kernel's
// permission to use the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, granted to the
// whole process). RADIXRAY_DISABLE_AMX=1 turns the tiles off. Read once per process.
inline unsigned amx_features() {
  static const unsigned edx = [] {
    const char* off = std::getenv("RADIXRAY_DISABLE_AMX");
    if (off != nullptr && std::strcmp(off, "1") == 0) return 0u;
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 24) & 1)) return 0u;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 ? d : 0u;
  }();
  return edx;
}

inline bool amx_int8_usable() { return (amx_features() >> 25) & 1; }
inline bool amx_bf16_usable() { return (amx_features() >> 22) & 1; }

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#pragma GCC push_options
#pragma GCC target("amx-tile")

// All 8 tiles 16 rows x 64 bytes (16 x 16 int32/fp32 results, 16 x 64 int8 or 16 x 32 bf16
// operands). Tile state is per thread: call in each thread before its first tile op, and
// _tile_release() when done.
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

#pragma GCC pop_options

}  // namespace radixray_amx
