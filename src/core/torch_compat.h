// Private: every difference between the LibTorch versions dtrain supports
// (2.11 through 2.15; cmake/DtrainTorch.cmake refuses the others) that
// dtrain's code meets, bridged in this one file. Public headers stay
// version-neutral; nothing else in src/ tests TORCH_VERSION_*.
//
// Note [LibTorch versions]
// CI builds against both ends of the window (2.15: the full suite; 2.11: the
// unit and multirank suites). Where an API changed at a minor in between that
// we have not built against, the choice is made on the API itself (decltype,
// a requires-expression) rather than on a guessed version number, and a
// static_assert pins what each end we do build against must pick, so a
// wrong guess about either end fails to compile instead of misbehaving.
//
// The differences met so far, 2.11 -> 2.15:
// - autograd: an Edge holds its Node by std::shared_ptr (2.11) or by
//   c10::intrusive_ptr (2.15); make_node() and NodePtr hide which.
// - c10d::Backend: the flat all-gather and reduce-scatter are
//   `_allgather_base` / `_reduce_scatter_base` (2.11) or `all_gather_single`
//   / `reduce_scatter_single` (2.15; the old names remain as deprecated
//   forwarding aliases). backend_all_gather_single() and
//   backend_reduce_scatter_single() call whichever this LibTorch has; they are
//   templates over the backend type so that this header includes no c10d
//   header (only src/comm/ does, and only src/comm/ calls them).
// - at::native::mkldnn_matmul (oneDNN's matrix product, which
//   dtrain::nn::linear uses for fp32 on the CPU) multiplies fp32 matrices in
//   2.15; 2.11 applies its bf16 CPU check to fp32 too and refuses them on a
//   CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT (CI's machines: "bf16 path
//   needs ..."). As that depends on the CPU as well as the version,
//   onednn_matmul_takes_fp32() asks it once, with a 1x1 product, and
//   dtrain::nn::linear() is at::linear where it says no.
// - Neither wheel ships Gloo's own headers (c10d's ProcessGroupGloo.hpp
//   includes <gloo/...>); Debian's libgloo-dev provides them for both, see
//   cmake/DtrainTorch.cmake.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/headeronly/version.h>

#include <memory>
#include <type_traits>
#include <utility>

// True when the LibTorch being compiled against is at least major.minor.
#define DTRAIN_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if !DTRAIN_TORCH_AT_LEAST(2, 11) || DTRAIN_TORCH_AT_LEAST(2, 16)
#error "dtrain supports LibTorch 2.11 through 2.15 (see cmake/DtrainTorch.cmake)"
#endif

// LibTorch exports its oneDNN matrix product (TORCH_API in
// ATen/native/mkldnn/Matmul.h, a header the wheel does not ship):
// result = beta * result + alpha * (mat1 @ mat2), for 2-D or batched 3-D
// operands in row- or column-major layout. With beta = 0 `result` is only
// written.
namespace at::native {
TORCH_API void mkldnn_matmul(const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor& result, float beta,
                             float alpha);
}  // namespace at::native

namespace dtrain::compat {

// --- autograd nodes ---------------------------------------------------------

using NodePtr = decltype(torch::autograd::Edge::function);
inline constexpr bool kNodeIsSharedPtr = std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>;
static_assert(kNodeIsSharedPtr || std::is_same_v<NodePtr, c10::intrusive_ptr<torch::autograd::Node>>,
              "an autograd Edge holds its Node in a pointer dtrain does not know");
#if TORCH_VERSION_MINOR == 11
static_assert(kNodeIsSharedPtr, "LibTorch 2.11 holds autograd nodes by std::shared_ptr");
#elif TORCH_VERSION_MINOR == 15
static_assert(!kNodeIsSharedPtr, "LibTorch 2.15 holds autograd nodes by c10::intrusive_ptr");
#endif

// The owning pointer to a node of type T, as this LibTorch's autograd keeps it.
template <class T>
using NodeHandle = std::conditional_t<kNodeIsSharedPtr, std::shared_ptr<T>, c10::intrusive_ptr<T>>;

// A new autograd node of type T (a torch::autograd::Node), owned the way this
// LibTorch's graph owns nodes.
template <class T, class... Args>
NodeHandle<T> make_node(Args&&... args) {
  if constexpr (kNodeIsSharedPtr) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

// --- c10d backends (called from src/comm/ only) -----------------------------

template <class Backend, class Tensor, class Options>
concept HasAllGatherSingle = requires(Backend& b, Tensor& t, const Options& o) {
  b.all_gather_single(t, t, o);
};
template <class Backend, class Tensor, class Options>
concept HasReduceScatterSingle = requires(Backend& b, Tensor& t, const Options& o) {
  b.reduce_scatter_single(t, t, o);
};

// Gathers `input` from every rank into `output` (world x input's elements).
template <class Backend, class Tensor, class Options>
auto backend_all_gather_single(Backend& backend, Tensor& output, Tensor& input, const Options& options) {
  if constexpr (HasAllGatherSingle<Backend, Tensor, Options>) {
    return backend.all_gather_single(output, input, options);
  } else {
    static_assert(TORCH_VERSION_MINOR != 15 || sizeof(Backend) == 0, "LibTorch 2.15 has all_gather_single");
    return backend._allgather_base(output, input, options);
  }
}

// Reduces `input` (world x output's elements) over the ranks and keeps this
// rank's chunk in `output`.
template <class Backend, class Tensor, class Options>
auto backend_reduce_scatter_single(Backend& backend, Tensor& output, Tensor& input, const Options& options) {
  if constexpr (HasReduceScatterSingle<Backend, Tensor, Options>) {
    return backend.reduce_scatter_single(output, input, options);
  } else {
    static_assert(TORCH_VERSION_MINOR != 15 || sizeof(Backend) == 0, "LibTorch 2.15 has reduce_scatter_single");
    return backend._reduce_scatter_base(output, input, options);
  }
}

// --- oneDNN's fp32 matrix product (src/nn/linear.cpp) ----------------------

// Whether at::native::mkldnn_matmul multiplies fp32 CPU matrices here (see
// the Note); asked once per process. `probe` makes the 1x1 operands (this
// header includes no ATen operators).
template <class MakeOperand>
bool onednn_matmul_takes_fp32(MakeOperand probe) {
  static const bool takes = [&] {
    try {
      at::Tensor a = probe(), b = probe(), out = probe();
      at::native::mkldnn_matmul(a, b, out, /*beta=*/0.0F, /*alpha=*/1.0F);
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return takes;
}

}  // namespace dtrain::compat
