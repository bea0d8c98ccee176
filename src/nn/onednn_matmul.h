// What linear.cpp and attention.cpp share to run products on oneDNN (and
// gelu.cpp its tensor check).
#pragma once

#include <ATen/ATen.h>

// LibTorch exports its oneDNN matrix product (TORCH_API in
// ATen/native/mkldnn/Matmul.h, a header the wheel does not ship):
// result = beta * result + alpha * (mat1 @ mat2), for 2-D or batched 3-D
// operands in row- or column-major layout. With beta = 0 `result` is only
// written.
namespace at::native {
TORCH_API void mkldnn_matmul(const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor& result, float beta,
                             float alpha);
}  // namespace at::native

namespace dtrain::nn::detail {

// A plain fp32 CPU tensor, the only kind the oneDNN path takes
// (oneDNN-layout tensors are kMkldnn, not kStrided).
inline bool is_dense_cpu_float(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided && t.scalar_type() == at::kFloat;
}

}  // namespace dtrain::nn::detail
