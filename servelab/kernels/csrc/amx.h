// The AMX tile unit (Sapphire Rapids and later): whether this process may use it, and the
// tile shapes the attention, w8a8 and w4a8 ops use. Everything here exists only where SERVELAB_AMX is
// defined (vec.h: built for AVX-512 with AMX-BF16).
#pragma once

#include "vec.h"

#if defined(SERVELAB_AMX) && defined(__AMX_INT8__)
#define SERVELAB_AMX_INT8 1  // the int8 tile products (tdpbusd, tdpbssd) too
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

#ifdef SERVELAB_AMX_INT8
// tmm c += tmm a x tmm b on the int8 tile product: signed a (signed_rows) or unsigned, signed
// b. A macro: the tile intrinsics write their register numbers into the instruction's text.
#define SERVELAB_TILE_PRODUCT(signed_rows, c, a, b) \
  do {                                              \
    if constexpr (signed_rows)                      \
      _tile_dpbssd(c, a, b);                        \
    else                                            \
      _tile_dpbusd(c, a, b);                        \
  } while (0)

// sums[r][16 v + j] = the int32 dot product over `inputs` (a multiple of 64) of row r of the
// 16 byte rows at `rows` (row stride `row_stride` bytes; unsigned, or signed with
// kSignedRows) with channel 16 v + j of a 64-channel tile of signed-byte weights: four
// blocks of 16 channels `block_stride` bytes apart, each `inputs / 4` rows of 64 bytes (4
// inputs x 16 channels, the tile unit's B layout). Uses tmm0-3 (C), tmm4 (A) and tmm5-6
// (B, in turn), configured by configure_full_tiles.
template <bool kSignedRows = false>
inline void tile_unit_sums(const uint8_t* rows, int64_t row_stride, const void* weights, int64_t block_stride,
                           int64_t inputs, int32_t (*sums)[64]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < inputs; k += 64) {
    const char* block = static_cast<const char*>(weights) + k * 16;
    _tile_loadd(4, rows + k, row_stride);
    _tile_loadd(5, block, 64);
    SERVELAB_TILE_PRODUCT(kSignedRows, 0, 4, 5);
    _tile_loadd(6, block + block_stride, 64);
    SERVELAB_TILE_PRODUCT(kSignedRows, 1, 4, 6);
    _tile_loadd(5, block + 2 * block_stride, 64);
    SERVELAB_TILE_PRODUCT(kSignedRows, 2, 4, 5);
    _tile_loadd(6, block + 3 * block_stride, 64);
    SERVELAB_TILE_PRODUCT(kSignedRows, 3, 4, 6);
  }
  _tile_stored(0, sums[0], 64 * 4);
  _tile_stored(1, sums[0] + 16, 64 * 4);
  _tile_stored(2, sums[0] + 32, 64 * 4);
  _tile_stored(3, sums[0] + 48, 64 * 4);
}
#endif

}  // namespace
}  // namespace servelab_cpu
#endif

namespace servelab_cpu {
namespace {

// Whether the int8 tile products (tdpbusd) run here: built for AMX-INT8 and granted by Linux.
inline bool int8_tile_unit_available() {
#ifdef SERVELAB_AMX_INT8
  return amx_available();
#else
  return false;
#endif
}

}  // namespace
}  // namespace servelab_cpu
