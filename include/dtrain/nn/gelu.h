// dtrain::nn::gelu: GELU, differentiable, a drop-in for at::gelu(x,
// approximate) whose forward also writes GELU's derivative, so that backward
// is one multiplication instead of ATen's second evaluation of erf and exp
// (Note [GELU with its derivative] in src/nn/gelu.cpp).
//
// Why: after the products, GELU was the largest kernel of the GPT's step (11 %
// of it on session 20's Intel VM; docs/performance.md, "The step's non-matmul
// time"), its backward the larger half.
//
// Results: equal to at::gelu's within fp32 rounding, output and input
// gradient, and at least as close to GELU in fp64 (tests/unit/gelu_test.cpp;
// the tanh form's output is bit for bit ATen's on AVX2 and AVX-512, the erf
// form's within a rounding step: this kernel's vector erf is the Abramowitz-
// Stegun one in ATen's vector headers, which torch 2.15's compiled GELU does
// not reproduce bit for bit). Memory is ATen's: the derivative is saved in
// place of the input.
// DTRAIN_LINEAR_KERNEL=aten (linear.h) makes this at::gelu everywhere, as it
// does the other dtrain kernels, so benchmarks can run PyTorch's own.
#pragma once

#include <ATen/core/Tensor.h>

#include <string_view>

namespace dtrain::nn {

// x: any shape -> x's shape. approximate: "none" (erf) or "tanh", as at::gelu.
// Runs dtrain's kernel when gelu_uses_fused_kernel(x): with the derivative
// saved where autograd will want x's gradient (grad mode on, x requiring
// it), the output alone otherwise, the same bits either way (so a recompute
// reproduces its forward). Otherwise returns at::gelu(x, approximate). The
// fused backward is first-order only: under create_graph it throws
// ConfigError (use at::gelu for a gradient penalty or other higher
// derivatives). ConfigError for another `approximate`.
at::Tensor gelu(const at::Tensor& x, std::string_view approximate = "none");

// True when gelu() runs dtrain's kernel for x: DTRAIN_LINEAR_KERNEL is not
// "aten" and x is a non-empty dense fp32 CPU tensor.
bool gelu_uses_fused_kernel(const at::Tensor& x);

}  // namespace dtrain::nn
