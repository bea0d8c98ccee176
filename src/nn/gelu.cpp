#include "dtrain/nn/gelu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include <string>

#include "dtrain/comm/env.h"
#include "dtrain/error.h"
#include "gelu_kernel.h"
#include "onednn_matmul.h"

namespace dtrain::nn {

// Note [GELU with its derivative]
// ATen's GELU saves its input x; its backward evaluates erf(x / sqrt 2) and
// exp(-x^2 / 2) again per element to form dy (Phi(x) + x phi(x)). Its forward
// already evaluates that exp: its vector erf is 1 - P(t) exp(-z^2) (Abramowitz
// and Stegun 7.1.26), and with z = x / sqrt 2, exp(-z^2) is GELU's Gaussian.
// So one pass can write y and the derivative d = Phi(x) + x phi(x) (the tanh
// form likewise: one tanh gives both), and backward is dy * d, a memory-bound
// multiplication in place of a compute-bound pass (on the Intel VM of session
// 20 ATen's GELU backward ran 1.93 ns per element against its forward's
// 1.16). Measured on AMD EPYC 25/17 (docs/performance.md, session 22): one
// layer of the GPT, forward + backward 365 us against ATen's 533-723; the
// forward alone 280-304 against 187-213 (the derivative's store, and this
// kernel's output alone, 250-310 us, is slower than ATen's compiled forward:
// not traced). d is saved in place of x, and x, which nothing else keeps (the
// fc product's backward needs its input, not its output), is freed: the
// activation memory is ATen's.
//
// Where no gradient is wanted (evaluation, a recompute's first pass) the same
// kernel writes y alone: the output's bits do not depend on grad mode, so a
// recomputed block reproduces its forward exactly (nn::checkpoint).
//
// The kernel is written in ATen's header-only vector type and compiled once
// per instruction set ATen dispatches to; the one at::get_cpu_capability()
// names runs, so ATEN_CPU_CAPABILITY moves both together.

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

detail::GeluKernel kernel_for_this_cpu() {
  static const detail::GeluKernel kernel = []() -> detail::GeluKernel {
#if defined(__x86_64__)
    const std::string isa = at::get_cpu_capability();
    if (isa == "AVX512") return detail::gelu_with_derivative_avx512;
    if (isa == "AVX2") return detail::gelu_with_derivative_avx2;
#endif
    return detail::gelu_with_derivative_default;
  }();
  return kernel;
}

bool is_tanh(std::string_view approximate) {
  DTRAIN_CHECK(approximate == "none" || approximate == "tanh", ConfigError,
               "dtrain::nn::gelu: approximate=\"" << approximate << "\" is not a GELU", "pass \"none\" or \"tanh\"");
  return approximate == "tanh";
}

// gelu(x) over the intra-op threads, and into *d (x's shape) its derivative
// where d is given: the one place either path runs the kernel.
at::Tensor gelu_output(const at::Tensor& x, at::Tensor* d, bool tanh) {
  RECORD_FUNCTION("dtrain::nn::gelu", std::vector<c10::IValue>());
  const at::Tensor in = x.contiguous();
  at::Tensor y = at::empty_like(in);
  if (d != nullptr) *d = at::empty_like(in);
  const float* px = in.const_data_ptr<float>();
  float* py = y.mutable_data_ptr<float>();
  float* pd = d != nullptr ? d->mutable_data_ptr<float>() : nullptr;
  const detail::GeluKernel kernel = kernel_for_this_cpu();
  at::parallel_for(0, in.numel(), at::internal::GRAIN_SIZE, [&](std::int64_t begin, std::int64_t end) {
    kernel(px + begin, py + begin, pd != nullptr ? pd + begin : nullptr, end - begin, tanh);
  });
  return y;
}

struct FusedGelu : torch::autograd::Function<FusedGelu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, bool tanh) {
    at::Tensor d;
    at::Tensor y = gelu_output(x, &d, tanh);
    ctx->save_for_backward({d});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    DTRAIN_CHECK(!at::GradMode::is_enabled(), ConfigError,
                 "dtrain::nn::gelu has no second derivative: its backward keeps GELU's derivative, not its input",
                 "use at::gelu where a higher derivative is taken (create_graph, a gradient penalty)");
    const auto saved = ctx->get_saved_variables();
    return {grads[0] * saved[0], at::Tensor()};
  }
};

}  // namespace

bool gelu_uses_fused_kernel(const at::Tensor& x) {
  // Decided once per process, as linear()'s kernel (linear.cpp).
  static const bool enabled = dist::linear_kernel() != dist::LinearKernel::kAten;
  return enabled && x.numel() > 0 && detail::is_dense_cpu_float(x);
}

at::Tensor gelu(const at::Tensor& x, std::string_view approximate) {
  const bool tanh = is_tanh(approximate);
  if (!gelu_uses_fused_kernel(x)) return at::gelu(x, tanh ? "tanh" : "none");
  if (at::GradMode::is_enabled() && x.requires_grad()) return FusedGelu::apply(x, tanh);
  return gelu_output(x, nullptr, tanh);
}

}  // namespace dtrain::nn
