// dtrain::nn::linear: y = x W^T + b, differentiable, a drop-in for at::linear
// that picks a faster matrix product where LibTorch's default is slow.
//
// Why: ATen's fp32 CPU matmul goes to MKL's sgemm, which on AMD processors
// takes a code path far below the machine (on this project's AMD EPYC, family
// 26, AVX-512: ~100 GFLOP/s on one core), while oneDNN's matmul, also shipped
// inside LibTorch, reaches ~230 GFLOP/s on the same shapes. On Intel's CPUs
// MKL takes its fast path and is the faster of the two (Note [Kernel by CPU
// vendor] in src/nn/linear.cpp). linear() runs the forward product and both
// backward products (dx = dy W, dW = dy^T x) on oneDNN's matmul when
// onednn_linear_enabled(), and is at::linear otherwise. The results are those
// of a different summation order: equal to at::linear's within fp32
// rounding, not bit for bit. bench/matmul prints both kernels' figures.
// DTRAIN_LINEAR_KERNEL (comm/env.h) overrides the choice: "aten" makes
// linear() at::linear everywhere, so a benchmark can compare dtrain with a
// PyTorch program on the same kernels and tell the kernel's gain from the
// distributed layer's; "onednn" takes oneDNN wherever it runs.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace dtrain::nn {

// x: [..., in], weight: [out, in], bias: [out] or undefined -> [..., out].
// Takes the oneDNN path when linear_uses_onednn(x, weight, bias); otherwise
// returns at::linear(x, weight, bias). Gradients flow to all three as through
// at::linear; only the inputs that need one get a gradient computed (the
// zero-bubble pipeline asks for dx and dW separately). Under create_graph the
// backward is built from differentiable ATen ops, so higher derivatives work.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});

// Whether LibTorch's oneDNN matmul runs fp32 on this CPU (probed once: some
// LibTorch versions refuse it on CPUs without AVX-512 BW/VL/DQ or
// AVX-NE-CONVERT, such as AMD Zen 3).
bool onednn_matmul_available();

// Whether linear() may take oneDNN's path at all, decided once per process
// (at the first call; ConfigError when DTRAIN_LINEAR_KERNEL is malformed):
// onednn_matmul_available(), and DTRAIN_LINEAR_KERNEL "onednn", or "auto"
// (or unset) on a CPU where oneDNN is the faster kernel
// (onednn_preferred_for(cpu_vendor())). "onednn" or "aten", as benchmarks
// report it.
bool onednn_linear_enabled();
const char* linear_kernel_name();

// The CPU's vendor string from cpuid ("GenuineIntel", "AuthenticAMD", ...);
// empty where there is none (not x86).
std::string cpu_vendor();
// Whether "auto" takes oneDNN on a CPU of `vendor`: x86 CPUs other than
// Intel's (Note [Kernel by CPU vendor]).
bool onednn_preferred_for(const std::string& vendor);

// True when linear() would use oneDNN for these tensors: onednn_linear_enabled()
// (above), all are dense fp32 CPU tensors, weight is 2-D, and CPU autocast
// is off (under autocast linear() defers to at::linear, which autocast casts).
bool linear_uses_onednn(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});

// The product a @ b of two fp32 CPU matrices on oneDNN (row- or column-major
// operands are taken as they are, others are made contiguous first). Used by
// linear() and by the benchmark that compares it with at::mm.
at::Tensor onednn_mm(const at::Tensor& a, const at::Tensor& b);

}  // namespace dtrain::nn
