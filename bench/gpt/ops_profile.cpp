// Where a single-process GPT training step spends its time, op by op: the
// model of bench/gpt (examples/gpt/model.h, nanoGPT's CPU config: 4 layers,
// width 128, 12 x 64 tokens), FusedAdamW and clipping as examples/gpt runs
// them, one intra-op thread, under LibTorch's profiler (kineto, CPU). Prints
// one JSON line per ATen op, slowest first, with its self time per step
// (time inside the op minus the ops it calls) and calls per step, then a total:
//   {"op": "aten::gelu", "self_us_per_step": ..., "calls_per_step": ..., "share": ...}
// Self times make the non-matmul share of a step visible (issue 29, item 3).
// Last, one layer's attention and one layer's GELU alone, ATen's kernel
// against dtrain's (medians of 200 runs):
//   {"op": "causal_attention" | "gelu", "impl": "aten" | "dtrain", "forward_us": ..., "forward_backward_us": ...}
// The profiler adds ~1 us per op: compare figures of this tool with each
// other, and step times with bench/gpt's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dtrain/amp/autocast.h"
#include "dtrain/host_memory.h"
#include "dtrain/nn/attention.h"
#include "dtrain/nn/gelu.h"
#include "fused_adamw.h"
#include "model.h"

namespace {

namespace prof = torch::autograd::profiler;

struct OpTime {
  double self_ns = 0;
  std::int64_t calls = 0;
};

// Self time of every CPU op: its duration minus its direct children's
// (events of one thread nest; the stack holds the open ancestors).
std::map<std::string, OpTime> self_times(const std::vector<prof::KinetoEvent>& events) {
  std::vector<const prof::KinetoEvent*> cpu;
  for (const auto& e : events) {
    if (e.deviceType() == c10::DeviceType::CPU && e.durationNs() > 0) cpu.push_back(&e);
  }
  std::sort(cpu.begin(), cpu.end(), [](const auto* a, const auto* b) {
    return a->startThreadId() != b->startThreadId() ? a->startThreadId() < b->startThreadId()
           : a->startNs() != b->startNs()           ? a->startNs() < b->startNs()
                                                    : a->durationNs() > b->durationNs();
  });
  std::map<std::string, OpTime> out;
  std::vector<std::pair<const prof::KinetoEvent*, double>> stack;  // event, children's ns
  auto close = [&](std::uint64_t before, std::uint64_t thread, bool all) {
    while (!stack.empty() &&
           (all || stack.back().first->startThreadId() != thread || stack.back().first->endNs() <= before)) {
      const auto [e, children] = stack.back();
      stack.pop_back();
      auto& t = out[e->name()];
      t.self_ns += static_cast<double>(e->durationNs()) - children;
      t.calls += 1;
      if (!stack.empty()) stack.back().second += static_cast<double>(e->durationNs());
    }
  };
  for (const auto* e : cpu) {
    close(e->startNs(), e->startThreadId(), false);
    stack.emplace_back(e, 0.0);
  }
  close(0, 0, true);
  return out;
}

// Median microseconds of f over 200 runs after 20 warm-up runs: the
// attention micro timing, steadier than a whole step on a shared machine.
template <typename F>
double median_us(F&& f) {
  for (int i = 0; i < 20; ++i) f();
  std::vector<double> us;
  for (int i = 0; i < 200; ++i) {
    const auto t = std::chrono::steady_clock::now();
    f();
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count());
  }
  std::nth_element(us.begin(), us.begin() + 100, us.end());
  return us[100];
}

// One layer's causal attention at the model's shape (q, k, v views of one
// [B, T, 3C] product, as the GPT makes them), forward and forward + backward:
// ATen's kernel (at::scaled_dot_product_attention) and dtrain::nn::causal_attention.
void print_attention_timing(const gpt::GptConfig& c, std::int64_t batch) {
  const std::int64_t t = c.block_size, h = c.n_head, d = c.n_embd / c.n_head;
  const at::Tensor qkv = at::randn({batch, t, 3 * c.n_embd}).requires_grad_();
  const at::Tensor dy = at::randn({batch, h, t, d});
  auto views = [&] {
    auto parts = qkv.split(c.n_embd, 2);
    for (auto& m : parts) m = m.view({batch, t, h, d}).transpose(1, 2);
    return parts;
  };
  auto aten = [&] {
    const auto v = views();
    return at::scaled_dot_product_attention(v[0], v[1], v[2], {}, 0.0, /*is_causal=*/true);
  };
  auto ours = [&] {
    const auto v = views();
    return dtrain::nn::causal_attention(v[0], v[1], v[2]);
  };
  for (const auto& [name, f] : {std::pair<const char*, std::function<at::Tensor()>>{"aten", aten}, {"dtrain", ours}}) {
    const double fwd = median_us([&] {
      at::NoGradGuard no_grad;
      (void)f();
    });
    const double both = median_us([&] {
      f().backward(dy);
      qkv.mutable_grad().reset();
    });
    std::printf(
        "{\"op\": \"causal_attention\", \"impl\": \"%s\", \"forward_us\": %.1f, \"forward_backward_us\": %.1f}\n", name,
        fwd, both);
  }
}

// One layer's GELU at the model's shape ([B, T, 4C], the fc product's
// output), the training forward (with autograd recording) and forward +
// backward: ATen's (at::gelu) and dtrain::nn::gelu, which writes the
// derivative in forward and multiplies by it in backward.
void print_gelu_timing(const gpt::GptConfig& c, std::int64_t batch) {
  const at::Tensor x = at::randn({batch, c.block_size, 4 * c.n_embd}).requires_grad_();
  const at::Tensor dy = at::randn(x.sizes());
  const auto form = c.gelu_tanh ? "tanh" : "none";
  auto aten = [&] { return at::gelu(x, form); };
  auto ours = [&] { return dtrain::nn::gelu(x, form); };
  for (const auto& [name, f] : {std::pair<const char*, std::function<at::Tensor()>>{"aten", aten}, {"dtrain", ours}}) {
    const double fwd = median_us([&] { (void)f(); });
    const double both = median_us([&] {
      f().backward(dy);
      x.mutable_grad().reset();
    });
    std::printf("{\"op\": \"gelu\", \"impl\": \"%s\", \"forward_us\": %.1f, \"forward_backward_us\": %.1f}\n", name,
                fwd, both);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 20;
  // "bf16": forward and loss under CPU autocast (as examples/gpt --amp bf16).
  const bool bf16 = argc > 2 && std::string(argv[2]) == "bf16";
  at::set_num_threads(1);
  dtrain::retain_freed_host_memory();  // as examples/gpt: the step it profiles, not glibc's page faults
  gpt::GptConfig config;
  gpt::Gpt model(config);
  gpt::init_weights(*model, config.n_layer, 1337);
  gpt::FusedAdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::Tensor idx = at::randint(config.vocab_size, {12, config.block_size}, gen, at::kLong);
  const at::Tensor targets = at::randint(config.vocab_size, {12, config.block_size}, gen, at::kLong);
  auto step = [&] {
    opt.zero_grad();
    at::Tensor loss;
    {
      std::optional<dtrain::amp::Autocast> autocast;
      if (bf16) autocast.emplace(at::kCPU, dtrain::amp::AutocastOptions{.dtype = at::kBFloat16});
      loss = gpt::lm_loss(model->forward(idx), targets).to(at::kFloat);
    }
    loss.backward();
    gpt::clip_grad_norm(model->parameters(), 1.0);
    opt.step();
  };
  for (int i = 0; i < 10; ++i) step();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  const double plain_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / steps;

  const torch::profiler::impl::ProfilerConfig profiler(torch::profiler::impl::ProfilerState::KINETO);
  const std::set<torch::profiler::impl::ActivityType> activities{torch::profiler::impl::ActivityType::CPU};
  prof::prepareProfiler(profiler, activities);  // kineto's trace must exist before it starts
  prof::enableProfiler(profiler, activities);
  for (int i = 0; i < steps; ++i) step();
  const auto result = prof::disableProfiler();
  const auto ops = self_times(result->events());
  std::vector<std::pair<std::string, OpTime>> sorted(ops.begin(), ops.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.second.self_ns > b.second.self_ns; });
  double total = 0;
  for (const auto& [name, t] : sorted) total += t.self_ns;
  for (const auto& [name, t] : sorted) {
    if (t.self_ns / total < 0.002) continue;
    std::printf("{\"op\": \"%s\", \"self_us_per_step\": %.1f, \"calls_per_step\": %.1f, \"share\": %.4f}\n",
                name.c_str(), t.self_ns / 1e3 / steps, static_cast<double>(t.calls) / steps, t.self_ns / total);
  }
  std::printf(
      "{\"op\": \"total\", \"profiled_ms_per_step\": %.2f, \"step_ms_unprofiled\": %.2f, \"linear_kernel\": \"%s\"}\n",
      total / 1e6 / steps, plain_ms, dtrain::nn::linear_kernel_name());
  print_attention_timing(config, 12);
  print_gelu_timing(config, 12);
  return 0;
}
