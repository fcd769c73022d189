// Where a weight stream's prefetch points, in the tiled layouts of the decode kernels
// (blocked_tile.h, w8a8_linear.cpp, w4a8_linear.cpp): a tile is `blocks` blocks of `block`
// elements one after another, one block per stream, and the next tile's blocks follow.
#pragma once

#include <cstdint>

namespace servelab_cpu {

// The element `ahead` elements into the stream that starts at `stream` (in a tile's first
// block, or within it). Past the block's end the prefetch runs on into the same stream of
// the next tile (blocks - 1 blocks further on), not into this tile's next block, which its
// own stream is reading already.
template <typename T>
inline const T* stream_ahead(const T* stream, int64_t ahead, int64_t block, int64_t blocks) {
  return stream + ahead + (ahead < block ? 0 : (blocks - 1) * block);
}

}  // namespace servelab_cpu
