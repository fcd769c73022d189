// Activation rows as int8 operands at each call: quantized, as the int8-activation matmuls
// (w8a8_linear.cpp, w4a8_linear.cpp) multiply them: scale[m] = max |x[m]| / 127 (1 for a
// zero row) and q = round(x[m] / scale[m]) to nearest even, stored as the byte q + offset
// (offset 128 for the unsigned operand of vpdpbusd, 0 for its signed one); or split into
// int8 slices that keep them to a small fraction of their largest value (weight-only
// int8_sliced_linear and int4_sliced_linear). Built for AVX-512 only.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <unistd.h>

#if defined(CPU_CAPABILITY_AVX512)
namespace servelab_cpu {
namespace {

// Rows of x per pass over a weight (a multiple of 16): their operand rows (per_row of
// row_bytes each) take at most half the core's L2, where they stay while every tile of the
// weight passes over them. (In one pass over 2048 rows of the 0.5B shape's layers, each
// 64-channel tile read all the rows again from L3: up to 1.2x (w8a8, w4a8), 1.6x (sliced
// int8) and 2.8x (sliced int4) slower than in passes, Xeon with 2 MiB L2.)
inline int64_t rows_per_pass(int64_t row_bytes, int64_t per_row) {
  static const int64_t pass_bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? l2 / 2 : int64_t{512} << 10;
  }();
  return std::max<int64_t>(16, pass_bytes / (row_bytes * per_row) / 16 * 16);
}

// max |row[k]| over the K values of row.
inline float max_abs_of(const float* row, int64_t K) {
  __m512 largest = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
  float max_abs = _mm512_reduce_max_ps(largest);
  for (; k < K; ++k) max_abs = std::max(max_abs, std::fabs(row[k]));
  return max_abs;
}

// xq[m, 0:padded_k] = round(x[m] / scale[m]) + offset (offset past K) for the M rows of x [M, K].
inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t padded_k, int offset, uint8_t* xq,
                          float* scale) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      const float max_abs = max_abs_of(row, K);
      const float step = max_abs > 0.f ? max_abs / 127.f : 1.f;
      scale[m] = step;
      const __m512 inverse = _mm512_set1_ps(1.f / step);
      uint8_t* out = xq + m * padded_k;
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
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

// Slices of the M rows of x [M, K] for a weight-only matmul on int8 dot products: row m
// becomes the `slices` rows xq[m * slices + l, 0:padded_k] (bytes q + offset, offset past K)
// with scale[m * slices + l] = s / 254^l, s = max |x[m]| / 127 (1 for a zero row), each
// slice the previous remainder quantized to [-127, 127]: x[m] = sum_l q_l * scale_l + e with
// |e| <= max |x[m]| / (2 * 127 * 254^(slices - 1)): with kSlices (int8 weights) about 6e-8
// of the row's largest value, float32 in effect; with two (int4 weights) 1.6e-5.
constexpr int kSlices = 3;

inline void slice_rows(const float* x, int64_t M, int64_t K, int64_t padded_k, int offset, uint8_t* xq,
                       float* scale, int slices = kSlices) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    const __m512 low = _mm512_set1_ps(-127.f), high = _mm512_set1_ps(127.f);
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      const float max_abs = max_abs_of(row, K);
      float steps[kSlices], inverses[kSlices];
      steps[0] = max_abs > 0.f ? max_abs / 127.f : 1.f;
      for (int l = 1; l < slices; ++l) steps[l] = steps[l - 1] / 254.f;
      for (int l = 0; l < slices; ++l) {
        inverses[l] = 1.f / steps[l];
        scale[m * slices + l] = steps[l];
      }
      uint8_t* out = xq + m * slices * padded_k;
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 lanes = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
        __m512 rest = _mm512_maskz_loadu_ps(lanes, row + k);
        for (int l = 0; l < slices; ++l) {
          const __m512 q = _mm512_min_ps(high, _mm512_max_ps(low, _mm512_roundscale_ps(
              _mm512_mul_ps(rest, _mm512_set1_ps(inverses[l])), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
          rest = _mm512_fnmadd_ps(q, _mm512_set1_ps(steps[l]), rest);
          _mm_mask_storeu_epi8(out + l * padded_k + k, lanes,
                               _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(q), _mm512_set1_epi32(offset))));
        }
      }
      for (int l = 0; l < slices; ++l)
        std::fill(out + l * padded_k + K, out + (l + 1) * padded_k, static_cast<uint8_t>(offset));
    }
  });
}

// out[r, 0:channels] (row stride ldo) = the sum of the `slices` rows r * slices + l of
// partial (row stride ldp): each row's result from its slices' results, for M rows.
inline void sum_slices(const float* partial, int64_t ldp, int64_t M, float* out, int64_t ldo, int64_t channels,
                       int slices = kSlices) {
  for (int64_t r = 0; r < M; ++r) {
    const float* slice = partial + r * slices * ldp;
    for (int64_t c = 0; c < channels; ++c) {
      float sum = slice[c];
      for (int l = 1; l < slices; ++l) sum += slice[l * ldp + c];
      out[r * ldo + c] = sum;
    }
  }
}

}  // namespace
}  // namespace servelab_cpu
#endif
