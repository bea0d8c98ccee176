#include "dtrain/nn/linear.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include "../core/torch_compat.h"
#include "dtrain/error.h"

// oneDNN's matrix product, at::native::mkldnn_matmul, is declared in
// torch_compat.h (its fp32 support differs between LibTorch versions).

namespace dtrain::nn {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool is_dense_cpu_float(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided &&
         t.scalar_type() == at::kFloat;  // oneDNN-layout tensors are kMkldnn
}

// oneDNN reads a matrix whose rows or columns are contiguous.
at::Tensor matrix_operand(const at::Tensor& t) {
  if (t.stride(1) == 1 || t.stride(0) == 1) return t;
  return t.contiguous();
}

at::Tensor flatten_rows(const at::Tensor& t) {
  return t.reshape({-1, t.size(-1)});
}

// x W^T and its backward, the products on oneDNN (the bias is added outside:
// an autograd Function takes no undefined tensor).
struct OneDnnLinear : torch::autograd::Function<OneDnnLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    ctx->save_for_backward({x, weight});
    const at::Tensor y = onednn_mm(flatten_rows(x), weight.t());
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    return y.view(sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor dy = flatten_rows(grads[0]);
    // create_graph: build the gradients from ops autograd can differentiate.
    const bool differentiable = at::GradMode::is_enabled();
    auto product = [&](const at::Tensor& a, const at::Tensor& b) {
      return differentiable ? at::mm(a, b) : onednn_mm(a, b);
    };
    at::Tensor dx, dweight;
    if (ctx->needs_input_grad(0)) dx = product(dy, weight).view(x.sizes());
    if (ctx->needs_input_grad(1)) dweight = product(dy.t(), flatten_rows(x));
    return {dx, dweight};
  }
};

bool onednn_takes_fp32() {
  return at::hasMKLDNN() && compat::onednn_matmul_takes_fp32([] { return at::ones({1, 1}); });
}

}  // namespace

bool linear_uses_onednn(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  return onednn_takes_fp32() && x.dim() >= 1 && weight.dim() == 2 && x.numel() > 0 && is_dense_cpu_float(x) &&
         is_dense_cpu_float(weight) && (!bias.defined() || is_dense_cpu_float(bias)) &&
         !at::autocast::is_autocast_enabled(at::kCPU);
}

at::Tensor onednn_mm(const at::Tensor& a, const at::Tensor& b) {
  DTRAIN_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), ConfigError,
               "onednn_mm: cannot multiply " << a.sizes() << " by " << b.sizes(), "pass matrices [m, k] and [k, n]");
  DTRAIN_CHECK(onednn_takes_fp32(), ConfigError,
               "onednn_mm: this LibTorch's oneDNN matrix product does not take fp32 matrices on this CPU",
               "use at::mm (dtrain::nn::linear falls back to at::linear by itself)");
  DTRAIN_CHECK(is_dense_cpu_float(a) && is_dense_cpu_float(b), ConfigError,
               "onednn_mm: takes dense fp32 CPU matrices (got " << a.toString() << " and " << b.toString() << ")",
               "use at::mm for other tensors");
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  at::native::mkldnn_matmul(matrix_operand(a), matrix_operand(b), out, /*beta=*/0.0F, /*alpha=*/1.0F);
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (!linear_uses_onednn(x, weight, bias)) return at::linear(x, weight, bias);
  const at::Tensor y = OneDnnLinear::apply(x, weight);
  return bias.defined() ? y + bias : y;
}

}  // namespace dtrain::nn
