// GELU and its derivative in one pass over the input, for one instruction set:
// src/CMakeLists.txt compiles this file once per ISA with ATen's definitions
// for it (CPU_CAPABILITY=DEFAULT | AVX2 | AVX512 and the matching -m flags),
// naming the function by DTRAIN_GELU_KERNEL_NAME. Only ATen's header-only
// vector type is used (at::vec::Vectorized, the type ATen's own CPU kernels
// are written in); its exp and tanh are ATen's (Sleef's, exported by
// libtorch_cpu).
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>

#include "gelu_kernel.h"

#ifndef DTRAIN_GELU_KERNEL_NAME
#error "src/CMakeLists.txt defines DTRAIN_GELU_KERNEL_NAME for each instruction set"
#endif

namespace dtrain::nn::detail {

namespace {

using Vec = at::vec::Vectorized<float>;
using at::vec::fmadd;

// erf(z) by the steps of ATen's vectorised erf (Abramowitz and Stegun 7.1.26:
// 1 - (p1 t + ... + p5 t^5) exp(-z^2), t = 1 / (1 + p |z|), the sign of z
// restored), handing back its exp(-z^2): with z = x / sqrt(2) that is the
// Gaussian exp(-x^2 / 2) GELU's derivative needs, so one exp serves both.
inline Vec erf_and_gaussian(const Vec& z, Vec& gaussian) {
  const Vec neg_zero(-0.0F), one(1.0F);
  const Vec p(0.3275911F), p1(0.254829592F), p2(-0.284496736F), p3(1.421413741F), p4(-1.453152027F), p5(1.061405429F);
  const Vec sign = neg_zero & z;
  const Vec t = one / fmadd(p, z.abs(), one);
  Vec r = fmadd(p5, t, p4);
  r = fmadd(r, t, p3);
  r = fmadd(r, t, p2);
  r = fmadd(r, t, p1);
  gaussian = (neg_zero ^ (z * z)).exp();
  return sign ^ fmadd((neg_zero ^ gaussian) * t, r, one);
}

// gelu(x) = x Phi(x) with Phi(x) = (1 + erf(x / sqrt(2))) / 2;
// gelu'(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
inline void exact(const Vec& x, Vec& y, Vec& d) {
  const Vec alpha(static_cast<float>(M_SQRT1_2)), half(0.5F), one(1.0F);
  const Vec inv_sqrt_2pi(static_cast<float>(M_2_SQRTPI * M_SQRT1_2 * 0.5));
  Vec gaussian;
  const Vec erf = erf_and_gaussian(x * alpha, gaussian);
  y = x * half * (one + erf);
  d = fmadd(x * inv_sqrt_2pi, gaussian, half * (one + erf));
}

// The tanh approximation: gelu(x) = x (1 + tanh(u)) / 2, u = b (x + k x^3);
// gelu'(x) = (1 + tanh u) / 2 + x / 2 (1 - tanh^2 u) b (1 + 3 k x^2): one tanh
// for both. y's operations are at::gelu(x, "tanh")'s, in its order (the
// same bits on AVX2 and AVX-512).
inline void tanh_approximation(const Vec& x, Vec& y, Vec& d) {
  const Vec beta(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5)), kappa(0.044715F), half(0.5F), one(1.0F), three(3.0F);
  const Vec x_sq = x * x;
  const Vec th = (beta * (x + kappa * (x * x * x))).tanh();
  const Vec right = one + th;
  y = half * x * right;
  d = fmadd(half * x * (one - th * th), beta * fmadd(three * kappa, x_sq, one), half * right);
}

// d == nullptr: y alone, by the same operations (so a no-grad forward, such
// as a recompute's first pass, gives the bits the training forward gives).
template <void (*Op)(const Vec&, Vec&, Vec&)>
void run(const float* x, float* y, float* d, std::int64_t n) {
  constexpr std::int64_t w = Vec::size();
  Vec vy, vd;
  std::int64_t i = 0;
  for (; i + w <= n; i += w) {
    Op(Vec::loadu(x + i), vy, vd);
    vy.store(y + i);
    if (d != nullptr) vd.store(d + i);
  }
  if (i < n) {  // the tail, through the same vector code on a partial load
    Op(Vec::loadu(x + i, n - i), vy, vd);
    vy.store(y + i, n - i);
    if (d != nullptr) vd.store(d + i, n - i);
  }
}

}  // namespace

void DTRAIN_GELU_KERNEL_NAME(const float* x, float* y, float* d, std::int64_t n, bool tanh) {
  if (tanh) {
    run<tanh_approximation>(x, y, d, n);
  } else {
    run<exact>(x, y, d, n);
  }
}

}  // namespace dtrain::nn::detail
