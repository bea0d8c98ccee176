// Step time (forward, backward, SGD step) of one process driving k replicas:
// dtrain::DataParallel against LibTorch's torch::nn::parallel::data_parallel
// on the same replicas, and against a single replica (with one intra-op
// thread, and with k). Prints one JSON line per (model, implementation).
//
//   bench_data_parallel [--steps 60] [--replicas 2] [--devices cpu,cpu]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/parallel/data_parallel.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>

#include "dtrain/comm/device.h"
#include "dtrain/parallel/data_parallel/data_parallel.h"

namespace F = torch::nn::functional;

namespace {

// Per-op overhead matters little here: 784-2048-2048-10, batch 256.
struct MlpImpl : torch::nn::Cloneable<MlpImpl> {
  MlpImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(784, 2048));
    fc2 = register_module("fc2", torch::nn::Linear(2048, 2048));
    fc3 = register_module("fc3", torch::nn::Linear(2048, 10));
  }
  at::Tensor forward(at::Tensor x) { return fc3(at::relu(fc2(at::relu(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

// The example's CNN (two conv blocks, two linear layers), batch 128.
struct CnnImpl : torch::nn::Cloneable<CnnImpl> {
  CnnImpl() { reset(); }
  void reset() override {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)));
    fc1 = register_module("fc1", torch::nn::Linear(64 * 7 * 7, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 10));
  }
  at::Tensor forward(at::Tensor x) {
    x = F::max_pool2d(F::relu(conv1(x)), F::MaxPool2dFuncOptions(2));
    x = F::max_pool2d(F::relu(conv2(x)), F::MaxPool2dFuncOptions(2));
    return fc2(F::relu(fc1(x.flatten(1))));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Cnn);

struct Timing {
  double p50_ms = 0, p95_ms = 0;
};

// Times `steps` calls of step() after 5 warm-up calls.
Timing time_steps(int steps, const std::function<void()>& step) {
  for (int i = 0; i < 5; ++i) step();
  std::vector<double> ms;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms[std::min(ms.size() - 1, ms.size() * 95 / 100)]};
}

template <typename Model>
void bench_model(const std::string& name, const at::Tensor& x, const at::Tensor& y, int steps,
                 const std::vector<c10::Device>& devices) {
  const auto batch = x.size(0);
  auto report = [&](const std::string& impl, const Timing& t, const std::string& note = "") {
    nlohmann::json line{{"case", name},
                        {"impl", impl},
                        {"replicas", devices.size()},
                        {"batch", batch},
                        {"p50_ms", t.p50_ms},
                        {"p95_ms", t.p95_ms},
                        {"samples_per_second", t.p50_ms > 0 ? 1000.0 * static_cast<double>(batch) / t.p50_ms : 0.0}};
    if (!note.empty()) line["note"] = note;
    std::cout << line.dump() << std::endl;
  };
  auto train_step = [&](torch::optim::SGD& opt, const std::function<at::Tensor(const at::Tensor&)>& fwd) {
    opt.zero_grad();
    F::cross_entropy(fwd(x), y.to(devices.front())).backward();
    opt.step();
  };

  {  // a single replica, one intra-op thread, then one thread per replica
    torch::manual_seed(0);
    Model m;
    m->to(devices.front());
    torch::optim::SGD opt(m->parameters(), 0.01);
    at::set_num_threads(1);
    report("single", time_steps(steps, [&] {
             train_step(opt, [&](const at::Tensor& in) { return m(in.to(devices.front())); });
           }));
    at::set_num_threads(static_cast<int>(devices.size()));
    report("single_intraop_threads",
           time_steps(steps, [&] { train_step(opt, [&](const at::Tensor& in) { return m(in.to(devices.front())); }); }),
           "one replica, " + std::to_string(devices.size()) + " intra-op threads");
    at::set_num_threads(1);
  }
  {
    torch::manual_seed(0);
    Model m;
    dtrain::DataParallel dp(m, {.devices = devices});
    torch::optim::SGD opt(dp->parameters(), 0.01);
    report("dtrain_dp", time_steps(steps, [&] { train_step(opt, [&](const at::Tensor& in) { return dp(in); }); }));
  }
  {
    torch::manual_seed(0);
    Model m;
    m->to(devices.front());
    torch::optim::SGD opt(m->parameters(), 0.01);
    try {
      report("libtorch_data_parallel", time_steps(steps, [&] {
               train_step(opt, [&](const at::Tensor& in) {
                 return torch::nn::parallel::data_parallel(m, in, devices, devices.front());
               });
             }));
    } catch (const std::exception& e) {
      std::string what = e.what();
      what = what.substr(0, what.find('\n'));
      std::cout << nlohmann::json{{"case", name}, {"impl", "libtorch_data_parallel"}, {"error", what}}.dump()
                << std::endl;
    }
  }
  {
    // LibTorch's data_parallel without its CUDA-only Scatter/Gather: its
    // replicate() (a fresh clone per call, gradient edges to the original)
    // and parallel_apply() (replicas on at::parallel_for, so with k intra-op
    // threads, its best case), with narrow/cat for scatter and gather.
    torch::manual_seed(0);
    Model m;
    m->to(devices.front());
    torch::optim::SGD opt(m->parameters(), 0.01);
    const auto k = static_cast<std::int64_t>(devices.size());
    at::set_num_threads(static_cast<int>(k));
    report("libtorch_replicate_parallel_apply",
           time_steps(steps,
                      [&] {
                        train_step(opt, [&](const at::Tensor& in) {
                          auto replicas = torch::nn::parallel::replicate(m, devices);
                          std::vector<at::Tensor> chunks;
                          for (std::int64_t i = 0; i < k; ++i) {
                            const auto size = in.size(0) / k + (i < in.size(0) % k ? 1 : 0);
                            const auto offset = i * (in.size(0) / k) + std::min(i, in.size(0) % k);
                            chunks.push_back(in.narrow(0, offset, size).to(devices[static_cast<std::size_t>(i)]));
                          }
                          auto outs = torch::nn::parallel::parallel_apply(replicas, chunks, devices);
                          for (auto& o : outs) o = o.to(devices.front());
                          return at::cat(outs);
                        });
                      }),
           "replicate + parallel_apply per call, " + std::to_string(k) + " intra-op threads");
    at::set_num_threads(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"DataParallel step time"};
  int steps = 60;
  std::string device_spec = "cpu,cpu";
  app.add_option("--steps", steps)->check(CLI::Range(1, 100000));
  app.add_option("--devices", device_spec, "Replica devices, e.g. cpu,cpu or cuda:0,cuda:1");
  CLI11_PARSE(app, argc, argv);
  const auto devices = dtrain::parse_devices(device_spec);
  torch::manual_seed(1);
  bench_model<Mlp>("mlp_784x2048x2048", at::randn({256, 784}), at::randint(0, 10, {256}), steps, devices);
  bench_model<Cnn>("cnn_fashion_mnist", at::randn({128, 1, 28, 28}), at::randint(0, 10, {128}), steps, devices);
  return 0;
}
