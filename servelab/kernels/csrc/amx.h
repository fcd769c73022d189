// The AMX tile unit (Sapphire Rapids and later): whether this process may use it, and the
// tile shape both attention ops use. Everything here exists only where SERVELAB_AMX is
// defined (vec.h: built for AVX-512 with AMX-BF16).
#pragma once

#include "vec.h"

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

}  // namespace
}  // namespace servelab_cpu
#endif
