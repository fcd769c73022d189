// The AMX tile unit (Sapphire Rapids and later): whether this process may use it, and the
// tile shapes the attention, w8a8 and w4a8 ops use. Everything here exists only where SERVELAB_AMX is
// defined (vec.h: built for AVX-512 with AMX-BF16).
#pragma once

#include "vec.h"

#if defined(SERVELAB_AMX) && defined(__AMX_INT8__)
#define SERVELAB_AMX_INT8 1  // the int8 tile products (tdpbusd) too
#endif

#ifdef SERVELAB_AMX
#include <sys/syscall.h>
#include <unistd.h>

namespace servelab_cpu {
namespace {

// Dimension pairs (bfloat16 pairs, one 32-bit lane each) per tile row: 64-byte rows.
constexpr int64_t kTilePairs = 16;

// The tile unit is usable in this process (Linux grants its register state on request).
bool amx_available() {
  static const bool available = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return available;
}

// Configures all eight tiles as 16 rows of 64 bytes, the shape every tile op here uses
// (palette 1).
inline void configure_full_tiles() {
  static const struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  } config;
  _tile_loadconfig(&config);
}

}  // namespace
}  // namespace servelab_cpu
#endif
