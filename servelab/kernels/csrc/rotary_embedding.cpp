// rotary_embedding: rotate-half rotary embedding of q and k, in place.

#include <ATen/Parallel.h>

#include <vector>

#include "ops.h"
#include "vec.h"

namespace servelab_cpu {
namespace {

// dst[0:2 * kLanes] = round(round(a * c) + round(b * s)) for two vectors of a and of b and
// the float32 table rows c and s.
template <typename T>
inline void store_rotated(T* dst, const Vec& a_low, const Vec& a_high, const float* c, const Vec& b_low,
                          const Vec& b_high, const float* s) {
  Vec direct_low = a_low * Vec::loadu(c), direct_high = a_high * Vec::loadu(c + kLanes);
  Vec turned_low = b_low * Vec::loadu(s), turned_high = b_high * Vec::loadu(s + kLanes);
  round_pair<T>(direct_low, direct_high);
  round_pair<T>(turned_low, turned_high);
  store_pair(dst, direct_low + turned_low, direct_high + turned_high);
}

// Rotates x [T, heads, D] in place (rotate-half convention): for i < D/2,
//   x_i = round(round(x_i c_i) + round(-x_{i+D/2} s_i)),
//   x_{i+D/2} = round(round(x_{i+D/2} c_{i+D/2}) + round(x_i s_{i+D/2}))
// with c, s the rows of the cos/sin tables [positions, D] at each token's position.
// x: `tokens` rows of `heads` heads at `data` (strides in elements), the first `dim` of each
// head rotated.
template <typename T>
void rotary_one(T* data, int64_t tokens, int64_t heads, int64_t dim, int64_t row_stride, int64_t head_stride,
                const int64_t* positions, const T* cos, const T* sin, int64_t table_stride) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> c(dim), s(dim);
    for (int64_t t = begin; t < end; ++t) {
      load_row(cos + positions[t] * table_stride, c.data(), dim);
      load_row(sin + positions[t] * table_stride, s.data(), dim);
      for (int64_t h = 0; h < heads; ++h) {
        T* row = data + t * row_stride + h * head_stride;
        int64_t i = 0;
        for (; i + 2 * kLanes <= half; i += 2 * kLanes) {
          const Vec first_low = load_vec(row + i), first_high = load_vec(row + i + kLanes);
          const Vec second_low = load_vec(row + half + i), second_high = load_vec(row + half + i + kLanes);
          store_rotated(row + i, first_low, first_high, c.data() + i, second_low.neg(), second_high.neg(),
                        s.data() + i);
          store_rotated(row + half + i, second_low, second_high, c.data() + half + i, first_low, first_high,
                        s.data() + half + i);
        }
        for (; i < half; ++i) {
          const float first = to_float(row[i]), second = to_float(row[i + half]);
          row[i] = static_cast<T>(round_to<T>(first * c[i]) + round_to<T>(-second * s[i]));
          row[i + half] = static_cast<T>(round_to<T>(second * c[i + half]) + round_to<T>(first * s[i + half]));
        }
      }
    }
  });
}

// Checks the position and table tensors for `tokens` rows and heads of width `dim` in `dtype`.
void check_tables(const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin, int64_t tokens,
                  int64_t dim, at::ScalarType dtype) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == tokens,
              "rotary_embedding: positions must be contiguous int64 [T]");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(1) == dim && cos.is_contiguous() && sin.is_contiguous(),
              "rotary_embedding: cos and sin must be contiguous [positions, D]");
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "rotary_embedding: q, k and the tables must share a dtype");
}

}  // namespace

void rotary_embedding_rows(void* q, int64_t q_heads, void* k, int64_t k_heads, at::ScalarType dtype, int64_t tokens,
                           int64_t row_stride, int64_t head_stride, int64_t dim, const at::Tensor& positions,
                           const at::Tensor& cos, const at::Tensor& sin) {
  check_tables(positions, cos, sin, tokens, dim, dtype);
  dispatch_dtype(dtype, "rotary_embedding", [&](auto tag) {
    using scalar_t = decltype(tag);
    const int64_t* pos = positions.data_ptr<int64_t>();
    rotary_one<scalar_t>(static_cast<scalar_t*>(q), tokens, q_heads, dim, row_stride, head_stride, pos,
                         cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), cos.stride(0));
    rotary_one<scalar_t>(static_cast<scalar_t*>(k), tokens, k_heads, dim, row_stride, head_stride, pos,
                         cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), cos.stride(0));
  });
}

void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) % 2 == 0,
              "rotary_embedding: q and k must be [T, heads, D] with unit last stride and even D");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2), "rotary_embedding: q and k disagree");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "rotary_embedding: q, k and the tables must share a dtype");
  check_tables(positions, cos, sin, q.size(0), q.size(2), q.scalar_type());
  dispatch_dtype(q.scalar_type(), "rotary_embedding", [&](auto tag) {
    using scalar_t = decltype(tag);
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (at::Tensor* x : {&q, &k})
      rotary_one<scalar_t>(x->data_ptr<scalar_t>(), x->size(0), x->size(1), x->size(2), x->stride(0), x->stride(1),
                           pos, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), cos.stride(0));
  });
}

}  // namespace servelab_cpu
