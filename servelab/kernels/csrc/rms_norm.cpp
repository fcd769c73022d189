// rms_norm and add_rms_norm: RMSNorm of rows, with the residual add fused in place.

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace servelab_cpu {
namespace {

// Rows of `x` [N, size] normalised into `out`: out = w * round(x / rms(x)). With `residual`,
// first residual = round(x + residual) in place and the norm is taken of the new residual.
// Three passes per row, two vectors at a time: the (summed) row into float32, its sum of
// squares, the scaled, rounded and weighted output.
template <typename T>
void rms_norm_kernel(at::Tensor& out, const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                     double eps) {
  const int64_t rows = x.size(0);
  const int64_t size = x.size(1);
  const T* x_data = x.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  T* res_data = residual ? residual->data_ptr<T>() : nullptr;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(size), w(size);
    load_row(weight.data_ptr<T>(), w.data(), size);
    for (int64_t r = begin; r < end; ++r) {
      const T* src = x_data + r * size;
      if (res_data) {
        T* res = res_data + r * size;
        int64_t i = 0;
        for (; i + 2 * kLanes <= size; i += 2 * kLanes) {
          Vec low = load_vec(src + i) + load_vec(res + i);
          Vec high = load_vec(src + i + kLanes) + load_vec(res + i + kLanes);
          round_pair<T>(low, high);
          low.store(row.data() + i);
          high.store(row.data() + i + kLanes);
          store_pair(res + i, low, high);
        }
        for (; i < size; ++i) {
          row[i] = round_to<T>(to_float(src[i]) + to_float(res[i]));
          res[i] = static_cast<T>(row[i]);
        }
      } else {
        load_row(src, row.data(), size);
      }
      const float squares = sum_of_squares(row.data(), size);
      const float inv_rms = 1.f / std::sqrt(squares / static_cast<float>(size) + static_cast<float>(eps));
      const Vec scale(inv_rms);
      T* dst = out_data + r * size;
      int64_t i = 0;
      for (; i + 2 * kLanes <= size; i += 2 * kLanes) {
        Vec low = Vec::loadu(row.data() + i) * scale, high = Vec::loadu(row.data() + i + kLanes) * scale;
        round_pair<T>(low, high);
        store_pair(dst + i, low * Vec::loadu(w.data() + i), high * Vec::loadu(w.data() + i + kLanes));
      }
      for (; i < size; ++i) dst[i] = static_cast<T>(round_to<T>(row[i] * inv_rms) * w[i]);
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be a contiguous [N, size] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm: weight must be [size]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: x and weight must share a dtype");
}

}  // namespace

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && out.scalar_type() == x.scalar_type(),
              "rms_norm: out must be contiguous and match x");
  dispatch_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_kernel<scalar_t>(out, x, nullptr, weight, eps);
  });
}

void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be contiguous and match x");
  dispatch_dtype(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_kernel<scalar_t>(x, x, &residual, weight, eps);
  });
}

}  // namespace servelab_cpu
