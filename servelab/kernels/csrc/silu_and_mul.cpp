// silu_and_mul: SiLU(gate) x up of a Llama MLP, for x = [gate | up].

#include <ATen/Parallel.h>

#include <algorithm>

#include "ops.h"
#include "vec.h"

namespace servelab_cpu {
namespace {

// exp(-g) is taken at -g >= -kExpFloor: from g = 17.4 on, 1 + exp(-g) rounds to 1 in
// float32 anyway, and past g = 87.3 exp(-g) would be a denormal, which costs the CPU a
// microcode assist per operation (a 2000 x 4864 call with many such gates took 2.3x as
// long on the Xeon).
constexpr float kExpFloor = 30.f;

// silu(g) = g / (1 + exp(-g)) for a vector of float32 gates. float32 results use torch's
// own formula (exp to 1 ulp, exact division), so they equal F.silu bit for bit; results
// that are rounded to bfloat16 or float16 next take exp_u20 and a refined reciprocal,
// about 1e-6 relative error, far below the 8- or 11-bit rounding that follows.
template <typename T>
inline Vec silu_vec(const Vec& g) {
  const Vec one(1.f);
  const Vec exponent = at::vec::maximum(g.neg(), Vec(-kExpFloor));
  if constexpr (std::is_same_v<T, float>) {
    return g / (one + exponent.exp());
  } else {
    // exp's argument is capped where exp(-g) stays finite (g < -88 gives silu ~ 0 either way),
    // so the reciprocal step below never meets inf * 0.
    const Vec denom = one + at::vec::minimum(exponent, Vec(88.f)).exp_u20();
#if defined(CPU_CAPABILITY_AVX512)
    // rcp14 is good to 14 bits; one Newton step doubles that.
    const __m512 d = denom;
    const __m512 r = _mm512_rcp14_ps(d);
    const __m512 refined = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
    return g * Vec(refined);
#else
    return g / denom;
#endif
  }
}

// dst[0:2 * kLanes] = round(round(silu(gate)) * up) for two vectors of gates and of ups.
template <typename T>
inline void silu_times_up(Vec gate_low, Vec gate_high, const Vec& up_low, const Vec& up_high, T* dst) {
  gate_low = silu_vec<T>(gate_low);
  gate_high = silu_vec<T>(gate_high);
  round_pair<T>(gate_low, gate_high);
  store_pair(dst, gate_low * up_low, gate_high * up_high);
}

// out [N, I] = round(round(silu(gate)) * up) for x [N, 2I] = [gate | up], two vectors at a
// time in registers (a row's last, shorter stretch through zero-padded buffers).
template <typename T>
void silu_and_mul_kernel(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0);
  const int64_t size = out.size(1);
  const T* in = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate_row = in + r * 2 * size;
      const T* up_row = gate_row + size;
      T* out_row = dst + r * size;
      int64_t i = 0;
      for (; i + 2 * kLanes <= size; i += 2 * kLanes)
        silu_times_up(load_vec(gate_row + i), load_vec(gate_row + i + kLanes), load_vec(up_row + i),
                      load_vec(up_row + i + kLanes), out_row + i);
      if (i < size) {
        const int64_t n = size - i;
        float gate[2 * kLanes] = {}, up[2 * kLanes] = {};
        T result[2 * kLanes];
        load_row(gate_row + i, gate, n);
        load_row(up_row + i, up, n);
        silu_times_up(Vec::loadu(gate), Vec::loadu(gate + kLanes), Vec::loadu(up), Vec::loadu(up + kLanes), result);
        std::copy(result, result + n, out_row + i);
      }
    }
  });
}

}  // namespace

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "silu_and_mul: x must be contiguous [N, 2I]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) * 2 == x.size(1) &&
                  out.scalar_type() == x.scalar_type(),
              "silu_and_mul: out must be contiguous [N, I] of x's dtype");
  dispatch_dtype(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    silu_and_mul_kernel<scalar_t>(out, x);
  });
}

}  // namespace servelab_cpu
