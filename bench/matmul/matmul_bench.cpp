// The products of the GPT's Linears (nanoGPT's CPU config: 12 x 64 tokens,
// width 128), forward and both backward, on one thread: ATen's default fp32
// CPU matmul (at::mm) and dtrain::nn::onednn_mm, the kernel dtrain::nn::linear
// uses. Prints one JSON line per case and kernel:
//   {"case": "fc.fwd", "impl": "dtrain" | "aten", "us": ..., "gflops": ...}
// (bench/matmul/peer.py times torch.mm on the same shapes from Python).
//
// bench_matmul --peak: the machine's fp32 matmul peak instead, the
// denominator of bench/gpt's MFU: square products of 1024 and 2048 on ATen's
// at::mm (MKL's sgemm here) and on oneDNN, on one thread and on every core
// (at::get_num_threads() before this program changes it). One line per size,
// kernel and thread count, then the best per thread count:
//   {"case": "peak", "threads": 1, "gflops": ..., "impl": "aten" | "onednn", "n": 2048}
// The peak is the best either kernel reaches, so an MFU against it is not
// flattered by a slow sgemm path (MKL on AMD).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "../common/timing.h"
#include "dtrain/nn/linear.h"

namespace {

using dtrain::bench::Clock;
using dtrain::bench::ms_since;

// Median microseconds of `f` over `reps` runs of `inner` calls, after warm-up.
double median_us(const std::function<void()>& f) {
  constexpr int kWarmup = 20, kReps = 15, kInner = 20;
  for (int i = 0; i < kWarmup; ++i) f();
  std::vector<double> us;
  for (int r = 0; r < kReps; ++r) {
    const auto t = Clock::now();
    for (int i = 0; i < kInner; ++i) f();
    us.push_back(ms_since(t) * 1000.0 / kInner);
  }
  return dtrain::bench::percentile(us, 0.5);
}

struct Case {
  std::string name;
  at::Tensor a, b;  // a @ b
};

// Prints the peak lines (see the file's comment).
void print_peak() {
  const int all = at::get_num_threads();
  for (const int threads : {1, all}) {
    at::set_num_threads(threads);
    double best = 0;
    std::string best_impl;
    std::int64_t best_n = 0;
    for (const std::int64_t n : {1024, 2048}) {
      const at::Tensor a = at::randn({n, n}), b = at::randn({n, n});
      const double flops = 2.0 * static_cast<double>(n * n * n);
      std::vector<std::pair<std::string, std::function<void()>>> kernels{{"aten", [&] { at::mm(a, b); }}};
      if (dtrain::nn::onednn_matmul_available()) kernels.push_back({"onednn", [&] { dtrain::nn::onednn_mm(a, b); }});
      for (const auto& [impl, f] : kernels) {
        f();  // warm-up: first-touch of the output, oneDNN's primitive cache
        std::vector<double> us;
        for (int r = 0; r < 5; ++r) {
          const auto t = Clock::now();
          f();
          us.push_back(ms_since(t) * 1000.0);
        }
        const double gflops = flops / dtrain::bench::percentile(us, 0.0) / 1e3;  // fastest run: a peak
        std::printf("{\"case\": \"peak_run\", \"threads\": %d, \"impl\": \"%s\", \"n\": %lld, \"gflops\": %.1f}\n",
                    threads, impl.c_str(), static_cast<long long>(n), gflops);
        if (gflops > best) best = gflops, best_impl = impl, best_n = n;
      }
    }
    std::printf("{\"case\": \"peak\", \"threads\": %d, \"gflops\": %.1f, \"impl\": \"%s\", \"n\": %lld}\n", threads,
                best, best_impl.c_str(), static_cast<long long>(best_n));
    if (all == 1) break;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--peak") {
    print_peak();
    return 0;
  }
  at::set_num_threads(1);
  const std::int64_t tokens = 12 * 64, width = 128;
  std::vector<Case> cases;
  auto add = [&](const std::string& layer, std::int64_t in, std::int64_t out) {
    const at::Tensor x = at::randn({tokens, in}), w = at::randn({out, in}), dy = at::randn({tokens, out});
    cases.push_back({layer + ".fwd", x, w.t()});  // x W^T
    cases.push_back({layer + ".dx", dy, w});      // dy W
    cases.push_back({layer + ".dw", dy.t(), x});  // dy^T x
  };
  add("attn", width, 3 * width);
  add("proj", width, width);
  add("fc", width, 4 * width);
  add("mlp_proj", 4 * width, width);
  add("head", width, 65);
  if (!dtrain::nn::onednn_matmul_available()) {
    std::fprintf(stderr,
                 "matmul: LibTorch's oneDNN matmul does not run on this CPU: dtrain::nn::linear is at::linear here\n");
  }
  for (const auto& c : cases) {
    const double flops = 2.0 * static_cast<double>(c.a.size(0) * c.a.size(1) * c.b.size(1));
    const double aten = median_us([&] { at::mm(c.a, c.b); });
    const double ours = dtrain::nn::onednn_matmul_available() ? median_us([&] { dtrain::nn::onednn_mm(c.a, c.b); })
                                                              : aten;  // linear() is at::mm here
    for (const auto& [impl, us] : {std::pair{"dtrain", ours}, std::pair{"aten", aten}}) {
      std::printf("{\"case\": \"%s\", \"impl\": \"%s\", \"us\": %.1f, \"gflops\": %.1f}\n", c.name.c_str(), impl, us,
                  flops / us / 1e3);
    }
  }
  return 0;
}
