// SIMD helpers shared by servelab's native CPU ops: float32 vectors of torch's at::vec for
// the CPU_CAPABILITY the extension is built with, conversions between float32, bfloat16
// and float16 that round exactly as storing in the tensor dtype does, and the dtype
// dispatch of every op.
//
// Every op reads and writes float32, bfloat16 or float16 tensors and computes in float32;
// the element-wise ops round intermediate results to the tensor dtype exactly where the
// Hugging Face reference does, so greedy outputs stay identical in reduced precision too.
//
// The helpers of this folder's headers sit in an unnamed namespace, so each source file
// compiles its own private copy (internal linkage, as when the ops were one file): the
// compiler inlines and specializes them freely and never calls them through the PLT, which
// it would for shared template instances in a -fPIC library.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>

#include <array>
#include <cstdint>
#include <tuple>
#include <type_traits>

// AVX512-BF16 instructions (and, on top, the AMX tile unit) where the build targets them.
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#include <immintrin.h>
#define SERVELAB_AVX512_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SERVELAB_AMX 1
#endif
#endif

namespace servelab_cpu {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
// The SIMD register a Vec wraps, and a multiply-add on it. Accumulator arrays that a loop
// updates are declared of this type: GCC keeps an array of Vec objects in memory (a store
// and reload around every update), an array of the raw register type in registers.
#if defined(CPU_CAPABILITY_AVX512)
using VecRegister = __m512;
inline VecRegister fmadd_register(float w, VecRegister v, VecRegister acc) {
  return _mm512_fmadd_ps(_mm512_set1_ps(w), v, acc);
}
#elif defined(CPU_CAPABILITY_AVX2)
using VecRegister = __m256;
inline VecRegister fmadd_register(float w, VecRegister v, VecRegister acc) {
  return _mm256_fmadd_ps(_mm256_set1_ps(w), v, acc);
}
#else
using VecRegister = Vec;
inline VecRegister fmadd_register(float w, VecRegister v, VecRegister acc) { return at::vec::fmadd(Vec(w), v, acc); }
#endif
// Sentinel for masked scores (finite, so no inf arithmetic is needed).
constexpr float kMasked = -1e30f;

// ---- scalar and vector conversions between T and float32 ----

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

// float32 of each of the 256 float8_e4m3fn bit patterns (the KV cache's fp8 values).
inline const float* fp8_e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int bits = 0; bits < 256; ++bits)
      values[bits] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(bits), c10::Float8_e4m3fn::from_bits()));
    return values;
  }();
  return table.data();
}

// kLanes values of T from src, as float32 (T: float, bfloat16, float16, or the one-byte
// values of a quantized KV cache, int8 and float8_e4m3fn).
template <typename T>
inline Vec load_vec(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(src);
  } else if constexpr (std::is_same_v<T, int8_t>) {
#if defined(CPU_CAPABILITY_AVX512)
    return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)))));
#elif defined(CPU_CAPABILITY_AVX2)
    return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)))));
#else
    float values[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) values[l] = src[l];
    return Vec::loadu(values);
#endif
  } else if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {
    const float* table = fp8_e4m3_table();
    float values[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) values[l] = table[src[l].x];
    return Vec::loadu(values);
  } else {
    Vec out;
    at::vec::load_to_float<T>(src, out);
    return out;
  }
}

// dst[0:n] = src[0:n] converted to float32.
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) load_vec(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// Two vectors of float32 values stored as 2 * kLanes values of T. CPUs with AVX512-BF16
// round 32 float32 values to bfloat16 (nearest even) in one instruction, where the generic
// conversion takes about ten per vector.
template <typename T>
inline void store_pair(T* dst, const Vec& low, const Vec& high) {
  if constexpr (std::is_same_v<T, float>) {
    low.store(dst);
    high.store(dst + kLanes);
  }
#ifdef SERVELAB_AVX512_BF16
  else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
  }
#endif
  else {
    at::vec::convert_from_float<T>(low, high).store(dst);
  }
}

// Two vectors rounded through T in registers, as storing them in T and reading them back does.
template <typename T>
inline void round_pair(Vec& low, Vec& high) {
  if constexpr (std::is_same_v<T, float>) {
    return;
  }
#ifdef SERVELAB_AVX512_BF16
  else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
    low = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(packed)), 16));
    high = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(packed, 1)), 16));
  }
#endif
  else {
    std::tie(low, high) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(low, high));
  }
}

// dst[0:n] = src[0:n] rounded to T (two vectors at a time: full-width stores).
template <typename T>
inline void store_row(T* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) store_pair(dst + i, Vec::loadu(src + i), Vec::loadu(src + i + kLanes));
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

inline float sum_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// sum_i x_i^2 in float32, four vector accumulators wide (a scalar loop would be one chain
// of dependent adds: the compiler may not reorder float sums).
inline float sum_of_squares(const float* x, int64_t n) {
  Vec acc[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
  int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes)
    for (int a = 0; a < 4; ++a) {
      const Vec v = Vec::loadu(x + i + a * kLanes);
      acc[a] = at::vec::fmadd(v, v, acc[a]);
    }
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = Vec::loadu(x + i);
    acc[0] = at::vec::fmadd(v, v, acc[0]);
  }
  float total = sum_lanes((acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

// Calls f(T{}) with T the C++ type of `type` (float32, bfloat16 or float16).
template <typename F>
void dispatch_dtype(at::ScalarType type, const char* op, F&& f) {
  switch (type) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": dtype must be float32, bfloat16 or float16, got ", type);
  }
}

}  // namespace
}  // namespace servelab_cpu
