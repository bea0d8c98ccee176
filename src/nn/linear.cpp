#include "dtrain/nn/linear.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <cstring>

#include "dtrain/comm/env.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "onednn_matmul.h"

namespace dtrain::nn {

namespace {

using detail::is_dense_cpu_float;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

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
    // A custom Function's forward is no op of its own: named for profilers.
    RECORD_FUNCTION("dtrain::nn::linear", std::vector<c10::IValue>());
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

}  // namespace

bool onednn_matmul_available() {
  // Probed once: torch 2.15's mkldnn_matmul refuses every dtype, fp32
  // included, on a CPU without the instructions of its bf16 path (AVX-512
  // BW/VL/DQ or AVX-NE-CONVERT), e.g. AMD Zen 3 ("mkldnn_matmul bf16 path
  // needs the cpu support ..."); there linear() is at::linear.
  static const bool available = [] {
    if (!at::hasMKLDNN()) return false;
    try {
      const at::Tensor a = at::ones({2, 2});
      at::Tensor out = at::empty({2, 2});
      at::native::mkldnn_matmul(a, a, out, /*beta=*/0.0F, /*alpha=*/1.0F);
      return at::equal(out, at::full({2, 2}, 2.0F));
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return available;
}

// Note [Kernel by CPU vendor]
// Which fp32 product is faster depends on the CPU, not on the model: ATen's
// at::mm is MKL's sgemm, which takes its fast code paths on Intel's CPUs
// only. Measured (bench/matmul and the GPT's step, one thread; docs/
// performance.md): AMD EPYC family 26 (Zen 5) oneDNN 2.2x MKL, the GPT
// 1.4-1.8x; family 25 model 17 (Zen 4) about even; family 25 model 1 (Zen 3)
// oneDNN's fp32 path does not run (onednn_matmul_available()); Intel Xeon
// family 6 model 207 MKL 5-20 % faster per product and the GPT step 3-15 %
// faster on ATen's kernels (2026-11-28). So "auto" takes oneDNN on x86 CPUs
// other than Intel's and at::linear on Intel's and elsewhere (another
// architecture has neither measurement). A rule on cpuid rather than a
// timing at start-up: every process of a job, and every run of a test that
// compares two runs bit for bit, must take the same kernel, which a timing
// on a busy host would not promise.
std::string cpu_vendor() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return {};
  char vendor[12];
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  return {vendor, sizeof vendor};
#else
  return {};
#endif
}

bool onednn_preferred_for(const std::string& vendor) {
  return !vendor.empty() && vendor != "GenuineIntel";
}

bool onednn_linear_enabled() {
  // Decided once: a process compares kernels by being started twice, never
  // by switching mid-run (a model's products would mix summation orders).
  static const bool enabled = [] {
    switch (dist::linear_kernel()) {
      case dist::LinearKernel::kAten: return false;
      case dist::LinearKernel::kOneDnn:
        if (!onednn_matmul_available()) {
          DTRAIN_LOG(kWarning) << "DTRAIN_LINEAR_KERNEL=onednn, but LibTorch's oneDNN matmul does not run fp32 on "
                                  "this CPU: dtrain::nn::linear runs at::linear";
        }
        return onednn_matmul_available();
      case dist::LinearKernel::kAuto: break;
    }
    return onednn_matmul_available() && onednn_preferred_for(cpu_vendor());
  }();
  return enabled;
}

const char* linear_kernel_name() {
  return onednn_linear_enabled() ? "onednn" : "aten";
}

bool linear_uses_onednn(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  return onednn_linear_enabled() && x.dim() >= 1 && weight.dim() == 2 && x.numel() > 0 && is_dense_cpu_float(x) &&
         is_dense_cpu_float(weight) && (!bias.defined() || is_dense_cpu_float(bias)) &&
         !at::autocast::is_autocast_enabled(at::kCPU);
}

at::Tensor onednn_mm(const at::Tensor& a, const at::Tensor& b) {
  DTRAIN_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), ConfigError,
               "onednn_mm: cannot multiply " << a.sizes() << " by " << b.sizes(), "pass matrices [m, k] and [k, n]");
  DTRAIN_CHECK(is_dense_cpu_float(a) && is_dense_cpu_float(b), ConfigError,
               "onednn_mm: takes dense fp32 CPU matrices (got " << a.toString() << " and " << b.toString() << ")",
               "use at::mm for other tensors");
  DTRAIN_CHECK(onednn_matmul_available(), ConfigError,
               "onednn_mm: LibTorch's oneDNN matmul does not run on this CPU (or this LibTorch has no oneDNN).",
               "use at::mm; dtrain::nn::linear does so by itself here");
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
