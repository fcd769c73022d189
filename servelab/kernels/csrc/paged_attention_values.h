// paged_attention, part 2: the weighted sum of a span's value rows into the accumulators of
// a group of query vectors, instantiated per head size (1-6, 8 or 16 SIMD vectors).
#pragma once

#include <algorithm>

#include "paged_attention_scores.h"

namespace servelab_cpu {
namespace {

// acc[j] += sum_t weights[j * kSpan + t] * value row at cache + offsets[t] for the NV
// accumulators of D = C * kLanes floats at `acc`, held in registers over the span: each
// value row is loaded (and converted to float32) once for all of them.
template <typename T, int C, int NV>
inline void accumulate_vectors(const T* cache, const int64_t* offsets, int64_t count, const float* weights,
                               float* acc) {
  VecRegister a[NV][C];
  for (int n = 0; n < NV; ++n)
    for (int c = 0; c < C; ++c) a[n][c] = Vec::loadu(acc + (n * C + c) * kLanes);
  for (int64_t t = 0; t < count; ++t) {
    if (t + kPrefetchAhead < count) prefetch(cache + offsets[t + kPrefetchAhead], C * kLanes * sizeof(T));
    const T* value = cache + offsets[t];
    for (int c = 0; c < C; ++c) {
      const VecRegister v = load_vec(value + c * kLanes);
      for (int n = 0; n < NV; ++n) a[n][c] = fmadd_register(weights[n * kSpan + t], v, a[n][c]);
    }
  }
  for (int n = 0; n < NV; ++n)
    for (int c = 0; c < C; ++c) Vec(a[n][c]).store(acc + (n * C + c) * kLanes);
}

// accumulate_vectors over `vectors` accumulators from the j-th on, NV at a time while at
// least NV are left, then fewer.
template <typename T, int C, int NV>
inline void accumulate_from(const T* cache, const int64_t* offsets, int64_t count, const float* weights,
                            int64_t vectors, float* acc, int64_t j) {
  for (; j + NV <= vectors; j += NV)
    accumulate_vectors<T, C, NV>(cache, offsets, count, weights + j * kSpan, acc + j * C * kLanes);
  if constexpr (NV > 1) accumulate_from<T, C, NV / 2>(cache, offsets, count, weights, vectors, acc, j);
}

// acc[j] += sum_t weights[j * kSpan + t] * value row at cache + offsets[t], for `vectors`
// accumulators of D = C * kLanes floats; as many at a time as 16 registers hold.
template <typename T, int C>
void accumulate_span(const T* cache, const int64_t* offsets, int64_t count, const float* weights, int64_t vectors,
                     float* acc) {
  constexpr int kVectorsAtOnce = std::max(1, std::min(8, 16 / C));
  accumulate_from<T, C, kVectorsAtOnce>(cache, offsets, count, weights, vectors, acc, 0);
}

// Head sizes the value loop is instantiated for: 1-6, 8 or 16 SIMD vectors.
bool head_dim_supported(int64_t head_dim) {
  const int64_t chunks = head_dim / kLanes;
  return head_dim % kLanes == 0 && ((chunks >= 1 && chunks <= 6) || chunks == 8 || chunks == 16);
}

template <typename T>
using AccumulateFn = void (*)(const T*, const int64_t*, int64_t, const float*, int64_t, float*);

// The value loop instantiated for a head size of `chunks` vectors.
template <typename T>
AccumulateFn<T> accumulate_loop(int64_t chunks) {
  switch (chunks) {
    case 1: return accumulate_span<T, 1>;
    case 2: return accumulate_span<T, 2>;
    case 3: return accumulate_span<T, 3>;
    case 4: return accumulate_span<T, 4>;
    case 5: return accumulate_span<T, 5>;
    case 6: return accumulate_span<T, 6>;
    case 8: return accumulate_span<T, 8>;
    case 16: return accumulate_span<T, 16>;
    default: TORCH_CHECK(false, "paged_attention: head_dim ", chunks * kLanes, " is not supported here");
  }
}

}  // namespace
}  // namespace servelab_cpu
