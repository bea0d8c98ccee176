// The one-pass GELU kernel behind dtrain::nn::gelu (Note [GELU with its
// derivative] in gelu.cpp): for n contiguous floats it writes y = gelu(x) and
// d = gelu'(x), so that backward is dy * d; with d == nullptr, y alone (the
// same bits: the derivative's operations do not touch y's). Compiled once per instruction set
// ATen dispatches its own kernels to (gelu_kernel.cpp, src/CMakeLists.txt);
// gelu.cpp calls the one matching at::get_cpu_capability(), so dtrain's GELU
// runs the vector width and erf/exp/tanh approximations ATen's does.
#pragma once

#include <cstdint>

namespace dtrain::nn::detail {

// tanh: GELU's tanh approximation (at::gelu(x, "tanh")); else the exact, erf one.
using GeluKernel = void (*)(const float* x, float* y, float* d, std::int64_t n, bool tanh);

void gelu_with_derivative_default(const float* x, float* y, float* d, std::int64_t n, bool tanh);
#if defined(__x86_64__)
void gelu_with_derivative_avx2(const float* x, float* y, float* d, std::int64_t n, bool tanh);
void gelu_with_derivative_avx512(const float* x, float* y, float* d, std::int64_t n, bool tanh);
#endif

}  // namespace dtrain::nn::detail
