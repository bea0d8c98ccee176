// Private: every difference between the LibTorch versions dtrain supports
// (2.11 through 2.15; cmake/DtrainTorch.cmake refuses the others) that
// dtrain's code meets, bridged in this one file. Public headers stay
// version-neutral; nothing else in src/ tests TORCH_VERSION_*.
//
// Note [LibTorch versions]
// Built against both ends of the window: 2.15 in CI (the full suite), 2.11
// by hand so far (library, unit and multirank suites; CI's 2.11 leg is
// still to come, issue 24). Where an API changed at a minor in between that
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
// - Not a version difference, though first seen as one: at::native::
//   mkldnn_matmul refuses fp32 on a CPU without AVX-512 BW/VL/DQ or
//   AVX-NE-CONVERT in 2.11 and 2.15 alike (AMD Zen 3); src/nn/linear.cpp
//   probes it once (onednn_matmul_available()).
// - Neither wheel ships Gloo's own headers (c10d's ProcessGroupGloo.hpp
//   includes <gloo/...>); Debian's libgloo-dev (scripts/setup.sh) provides
//   them for both.
// - c10d's own flight recorder (FlightRecorder<c10::Event>, which
//   ProcessGroupGloo records every collective into) inserts into its
//   all_pg_status_ map before taking its mutex in 2.11 (under it in 2.15), so
//   two threads issuing collectives on different Gloo groups at once can
//   corrupt the map (SIGSEGV in recordWithResetEnabled). c10d_flight_recorder_
//   off_by_default() turns that recorder off on the versions before 2.15.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>  // Node complete: 2.15 holds it by intrusive_ptr
#include <torch/headeronly/version.h>

#include <ftw.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <system_error>
#include <type_traits>
#include <utility>

// True when the LibTorch being compiled against is at least major.minor.
#define DTRAIN_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if !DTRAIN_TORCH_AT_LEAST(2, 11) || DTRAIN_TORCH_AT_LEAST(2, 16)
#error "dtrain supports LibTorch 2.11 through 2.15 (see cmake/DtrainTorch.cmake)"
#endif

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

// --- removing a directory tree ----------------------------------------------

// torch 2.11's libtorch.so exports its own, unversioned copies of libstdc++'s
// std::filesystem functions (64; 2.15 exports none), so libdtrain's calls
// bind to them, and its remove_all jumps to address 0 (the Checkpointer died
// by SIGSEGV pruning old steps). Trees are removed with POSIX nftw instead, on
// every version. A missing `root` is no error (as with std::filesystem).
namespace detail {
inline int remove_tree_entry(const char* path, const struct stat*, int, struct FTW*) {
  return std::remove(path) == 0 ? 0 : errno;
}
}  // namespace detail

inline void remove_all(const std::filesystem::path& root, std::error_code& ec) {
  ec.clear();
  struct stat st {};
  if (::lstat(root.c_str(), &st) != 0) {
    if (errno != ENOENT) ec.assign(errno, std::generic_category());
    return;
  }
  const int rc = ::nftw(root.c_str(), detail::remove_tree_entry, 16, FTW_DEPTH | FTW_PHYS);
  if (rc != 0) ec.assign(rc > 0 ? rc : errno, std::generic_category());
}

inline void remove_all(const std::filesystem::path& root) {
  std::error_code ec;
  compat::remove_all(root, ec);  // qualified: ADL would find std::filesystem::remove_all too
  if (ec) throw std::system_error(ec, "removing " + root.string());
}

// --- c10d's flight recorder ------------------------------------------------

// torch 2.11's FlightRecorder::recordWithResetEnabled (FlightRecorderDetail.hpp,
// compiled into libtorch_cpu) does `all_pg_status_[pg_id] = ...`, a std::map
// insert, before it locks the recorder's mutex; 2.15 moved the insert under the
// lock. ProcessGroupGloo records every collective it enqueues, so threads of
// one process issuing collectives on different groups (rank threads; DDP's
// bucket thread beside the training thread; pipeline stages) race on the map:
// multirank.PipelineTraining.OneFOneBEqualsUnpipelined died by SIGSEGV there in
// 3 of 85 runs on 2.11 and in 0 of 60 with the recorder off. 2.12-2.14 were not
// inspected and get the same treatment as 2.11.
inline constexpr bool kC10dFlightRecorderRacy = !DTRAIN_TORCH_AT_LEAST(2, 15);

// Turns c10d's flight recorder off (TORCH_FR_BUFFER_SIZE=0) on the versions
// where it races, unless the user chose a size (TORCH_FR_BUFFER_SIZE or its
// older name TORCH_NCCL_TRACE_BUFFER_SIZE; then theirs stands, race included).
// The recorder reads its size once, when first used, which is when the first
// Gloo group is made; so this must run before that, and runs when libdtrain is
// loaded (src/comm/backend_gloo.cpp), before any thread of ours exists, since
// setenv is not safe beside concurrent getenv. Returns whether it turned it off.
// dtrain's own recorder (issue 27) does not depend on c10d's.
inline bool c10d_flight_recorder_off_by_default() {
  if constexpr (!kC10dFlightRecorderRacy) {
    return false;
  } else {
    if (std::getenv("TORCH_FR_BUFFER_SIZE") != nullptr || std::getenv("TORCH_NCCL_TRACE_BUFFER_SIZE") != nullptr) {
      return false;
    }
    return ::setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0) == 0;
  }
}

}  // namespace dtrain::compat
