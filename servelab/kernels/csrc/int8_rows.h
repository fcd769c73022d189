// Activation rows quantized to int8 at each call, as the int8-activation matmuls
// (w8a8_linear.cpp, w4a8_linear.cpp) multiply them: scale[m] = max |x[m]| / 127 (1 for a
// zero row) and q = round(x[m] / scale[m]) to nearest even, stored as the byte q + offset
// (offset 128 for the unsigned operand of vpdpbusd, 0 for its signed one). Built for
// AVX-512 only.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512)
namespace servelab_cpu {
namespace {

// xq[m, 0:padded_k] = round(x[m] / scale[m]) + offset (offset past K) for the M rows of x [M, K].
inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t padded_k, int offset, uint8_t* xq,
                          float* scale) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      __m512 largest = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
      float max_abs = _mm512_reduce_max_ps(largest);
      for (; k < K; ++k) max_abs = std::max(max_abs, std::fabs(row[k]));
      const float step = max_abs > 0.f ? max_abs / 127.f : 1.f;
      scale[m] = step;
      const __m512 inverse = _mm512_set1_ps(1.f / step);
      uint8_t* out = xq + m * padded_k;
      for (k = 0; k + 16 <= K; k += 16) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(row + k), inverse),
                                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k),
                         _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(offset))));
      }
      for (; k < K; ++k)
        out[k] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(row[k] * (1.f / step))) + offset);
      for (; k < padded_k; ++k) out[k] = static_cast<uint8_t>(offset);
    }
  });
}

}  // namespace
}  // namespace servelab_cpu
#endif
