// Trains a small CNN on Fashion-MNIST and reports test accuracy.
//
//   fashion_mnist [--strategy single|dp|model-parallel|ddp|ddp-model-parallel]
//                 [--devices all] [--epochs 2] [--batch-size 64] [--lr 1e-3] [--seed 0]
//                 [--data-dir /usr/share/datasets/fashion-mnist]
//
// Strategies (--devices picks the devices; on CPU repeat cpu, e.g. cpu,cpu):
//   single              one device
//   dp                  DataParallel: each batch of --batch-size is split over the devices
//   model-parallel      the layers placed over the devices (balanced parameter memory)
//   ddp                 one process per rank under a launcher (RANK, WORLD_SIZE, MASTER_ADDR,
//                       MASTER_PORT, LOCAL_RANK): each rank trains on its share of every epoch
//                       with per-rank batches of --batch-size; DistributedDataParallel averages
//                       gradients. Rank 0 reports.
//   ddp-model-parallel  the hybrid: ddp, with each rank's model placed over its share of the
//                       devices (CUDA devices are divided among a node's ranks; CPU lists are
//                       used whole by every rank)
//
// Progress goes to stderr (a bar on a terminal, periodic lines otherwise);
// stdout gets one JSON line per epoch and a final
//   {"event":"done","test_accuracy":...,"train_seconds":...,"samples_per_second":...}
#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include <memory>
#include "dtrain/dtrain.h"
#include "model.h"

namespace {

struct Options {
  std::string strategy = "single";
  std::string devices = "all";
  int epochs = 2;
  int batch_size = 64;
  double lr = 1e-3;
  std::uint64_t seed = 0;
  std::string data_dir = dtrain::data::kFashionMnistDefaultDir;
  std::int64_t train_limit = 0;  // 0: the whole training set
  int num_workers = 0;
  bool tune_workers = false;
  std::string checkpoint_dir;         // resume from / save to here ("" = no checkpoints)
  std::int64_t checkpoint_every = 0;  // steps between checkpoints; 0 = at the end of each epoch
};

// What the training loop drives: the module (parameters, checkpoints, mode)
// and the strategy's forward, plus where inputs go and outputs come out.
struct Trainee {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
  c10::Device input_device{c10::kCPU};
  c10::Device output_device{c10::kCPU};
};

double evaluate(Trainee& model, const dtrain::data::FashionMnist& test) {
  torch::NoGradGuard no_grad;
  model.module->eval();
  const auto all = test.all();
  std::int64_t correct = 0;
  for (std::int64_t start = 0; start < test.size(); start += 1000) {
    const auto end = std::min(start + 1000, test.size());
    auto logits = model.forward(all.images.slice(0, start, end).to(model.input_device));
    correct += logits.argmax(1).eq(all.labels.slice(0, start, end).to(model.output_device)).sum().item<std::int64_t>();
  }
  model.module->train();
  return static_cast<double>(correct) / static_cast<double>(test.size());
}

// FNV-1a over every parameter's bytes: equal exactly when the parameters are.
std::string params_fingerprint(torch::nn::Module& model) {
  std::uint64_t h = 1469598103934665603ULL;
  for (const auto& p : model.parameters()) {
    const at::Tensor t = p.detach().cpu().contiguous();
    const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
    for (std::size_t i = 0; i < t.nbytes(); ++i) {
      h ^= bytes[i];
      h *= 1099511628211ULL;
    }
  }
  char text[20];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h));
  return text;
}

bool distributed(const std::string& strategy) {
  return strategy == "ddp" || strategy == "ddp-model-parallel";
}

// Where this process trains and which share of the data it sees.
struct Placement {
  std::vector<c10::Device> devices;  // this process's devices
  int rank = 0;
  int world = 1;
  std::optional<dtrain::dist::ProcessGroup> group;  // ddp only
};

Placement place(const Options& opt) {
  if (!distributed(opt.strategy)) {
    auto devices = dtrain::parse_devices(opt.devices);
    if (opt.strategy == "single") {
      DTRAIN_CHECK(
          devices.size() == 1 || opt.devices == "all", ConfigError,
          "--strategy single trains on one device, but --devices " << opt.devices << " lists " << devices.size() << ".",
          "pass a single device, e.g. --devices cpu or --devices cuda:0, or use --strategy dp");
      devices.erase(devices.begin() + 1, devices.end());
    }
    return {.devices = devices};
  }
  DTRAIN_CHECK(dtrain::dist::launched_by_launcher(), ConfigError,
               "--strategy " << opt.strategy << " runs one process per rank, but RANK and WORLD_SIZE are not set.",
               "start it through a launcher: dtrain run --nproc-per-node 2 fashion_mnist --strategy "
                   << opt.strategy << " (or torchrun)");
  const auto env = dtrain::dist::read_env_contract();
  std::vector<c10::Device> devices;
  if (opt.strategy == "ddp") {
    devices = {dtrain::device_for_local_rank(opt.devices, env.local_rank, env.local_world_size)};
  } else {
    devices = dtrain::parse_devices(opt.devices);
    if (devices.front().is_cuda()) {
      const auto per_rank = devices.size() / static_cast<std::size_t>(env.local_world_size);
      DTRAIN_CHECK(per_rank >= 1, DeviceError,
                   env.local_world_size << " ranks on this node cannot share the " << devices.size()
                                        << " devices of --devices " << opt.devices << ".",
                   "list at least one device per rank, or lower --nproc-per-node");
      const auto first = devices.begin() + static_cast<std::ptrdiff_t>(per_rank) * env.local_rank;
      devices = std::vector<c10::Device>(first, first + static_cast<std::ptrdiff_t>(per_rank));
    }
  }
  auto group = dtrain::dist::init_process_group(env, {.device = devices.front()});
  return {.devices = devices, .rank = env.rank, .world = env.world_size, .group = std::move(group)};
}

int train(const Options& opt, Placement& where, Trainee& model) {
  auto train = std::make_shared<dtrain::data::FashionMnist>(opt.data_dir, dtrain::data::Split::kTrain);
  const dtrain::data::FashionMnist test(opt.data_dir, dtrain::data::Split::kTest);
  const std::int64_t n = opt.train_limit > 0 ? std::min(opt.train_limit, train->size()) : train->size();
  // Each epoch every rank shuffles the same way (seed + epoch) and reads every
  // world-th example; the tail that does not divide evenly is dropped so all
  // ranks run the same number of steps.
  auto make_loader = [&](int workers) {
    auto sampler = std::make_shared<dtrain::data::DistributedSampler>(dtrain::data::DistributedSamplerOptions{
        .dataset_size = n, .num_replicas = where.world, .rank = where.rank, .seed = opt.seed, .drop_last = true});
    return dtrain::data::make_tensor_loader(train, sampler, {.batch_size = opt.batch_size, .num_workers = workers});
  };
  int workers = opt.num_workers;
  if (opt.tune_workers) {
    const auto tuning = dtrain::data::tune_num_workers(make_loader, 4, 100);
    workers = tuning.best;
    if (where.rank == 0) {
      nlohmann::json rates = nlohmann::json::object();
      for (const auto& [w, rate] : tuning.samples_per_second) rates[std::to_string(w)] = rate;
      std::cout << nlohmann::json{{"event", "tune_workers"}, {"best", workers}, {"samples_per_second", rates}}.dump()
                << std::endl;
    }
  }
  auto loader = make_loader(workers);
  const std::int64_t per_rank = n / where.world;
  DTRAIN_CHECK(per_rank > 0, ConfigError, n << " training examples cannot be shared by " << where.world << " ranks.",
               "raise --train-limit or use fewer ranks");
  const bool lead = where.rank == 0;

  torch::optim::Adam optimizer(model.module->parameters(), torch::optim::AdamOptions(opt.lr));
  std::optional<dtrain::Checkpointer> checkpoints;
  dtrain::TrainingState progress_state;
  int first_epoch = 1;
  if (!opt.checkpoint_dir.empty()) {
    checkpoints.emplace(dtrain::CheckpointOptions{.dir = opt.checkpoint_dir}, where.group);
    if (auto resumed = checkpoints->load_latest(*model.module, optimizer)) {
      progress_state = *resumed;
      loader->load_state(resumed->sampler);
      first_epoch = static_cast<int>(resumed->sampler.epoch) + 1;
    }
  }
  DTRAIN_LOG(kInfo) << opt.strategy << " training on " << dtrain::format_devices(where.devices) << ": " << per_rank
                    << " examples per rank, " << opt.epochs << " epochs, batch " << opt.batch_size << " per rank";
  double train_seconds = 0;
  double accuracy = 0;
  for (int epoch = first_epoch; epoch <= opt.epochs; ++epoch) {
    loader->start_epoch(epoch - 1);
    const std::int64_t steps_per_epoch = loader->remaining();
    if (steps_per_epoch == 0) continue;  // resumed at the end of this epoch
    dtrain::Progress progress(steps_per_epoch, {.label = "epoch " + std::to_string(epoch), .enabled = lead});
    const auto start = std::chrono::steady_clock::now();
    double loss_sum = 0;
    std::int64_t step = 0;
    for (; auto batch = loader->next(); ++step) {
      optimizer.zero_grad();
      at::Tensor loss = torch::nn::functional::cross_entropy(model.forward(batch->data.to(model.input_device)),
                                                             batch->target.to(model.output_device));
      loss.backward();
      optimizer.step();
      loss_sum += loss.item<double>();
      ++progress_state.step;
      if (checkpoints && opt.checkpoint_every > 0 && progress_state.step % opt.checkpoint_every == 0) {
        progress_state.sampler = loader->state();
        checkpoints->save(progress_state, *model.module, optimizer);
        DTRAIN_LOG(kDebug) << "checkpoint at step " << progress_state.step << ", parameters "
                           << params_fingerprint(*model.module);
      }
      if (step % 20 == 0) {
        char status[48];
        std::snprintf(status, sizeof status, "loss %.4f", loss_sum / static_cast<double>(step + 1));
        progress.update(step + 1, status);
      }
    }
    const double mean_loss = loss_sum / static_cast<double>(steps_per_epoch);
    progress.finish("loss " + std::to_string(mean_loss));
    train_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (checkpoints && opt.checkpoint_every == 0) {
      progress_state.sampler = loader->state();
      checkpoints->save(progress_state, *model.module, optimizer);
    }
    if (!lead) continue;
    accuracy = evaluate(model, test);
    std::cout << nlohmann::json{{"event", "epoch"},
                                {"epoch", epoch},
                                {"train_loss", mean_loss},
                                {"test_accuracy", accuracy}}
                     .dump()
              << std::endl;
  }
  if (where.group) where.group->barrier();
  if (lead) {
    std::cout << nlohmann::json{{"event", "done"},
                                {"strategy", opt.strategy},
                                {"world_size", where.world},
                                {"steps", progress_state.step},
                                {"params_fnv", params_fingerprint(*model.module)},
                                {"test_accuracy", accuracy},
                                {"train_seconds", train_seconds},
                                {"samples_per_second",
                                 static_cast<double>(per_rank * where.world * opt.epochs) / train_seconds}}
                     .dump()
              << std::endl;
  }
  return 0;
}

// Trains `module` as it is, or wrapped in DDP when this process is a rank of a
// group (evaluation bypasses DDP: it runs only on rank 0).
template <typename Holder>
int train_plain_or_ddp(const Options& opt, Placement& where, Trainee& model, Holder& module) {
  if (!where.group) {
    model.forward = [&](const at::Tensor& x) { return module(x); };
    return train(opt, where, model);
  }
  dtrain::DistributedDataParallel ddp(module, *where.group);
  model.forward = [&](const at::Tensor& x) { return module->is_training() ? ddp(x) : module(x); };
  return train(opt, where, model);
}

int run(const Options& opt) {
  Placement where = place(opt);
  torch::manual_seed(opt.seed);
  const c10::Device first = where.devices.front();
  if (opt.strategy == "model-parallel" || opt.strategy == "ddp-model-parallel") {
    dtrain::ModelParallel split(small_cnn_layers(), dtrain::ModelParallelOptions{.devices = where.devices});
    if (where.rank == 0) {
      DTRAIN_LOG(kInfo) << "layers placed on " << dtrain::format_devices(split->device_of_layer());
    }
    Trainee model{split.ptr(), nullptr, first, split->output_device()};
    return train_plain_or_ddp(opt, where, model, split);
  }
  SmallCnn net;
  net->to(first);
  Trainee model{net.ptr(), nullptr, first, first};
  if (opt.strategy == "dp") {
    dtrain::DataParallel dp(net, {.devices = where.devices});
    model.forward = [&](const at::Tensor& x) { return dp(x); };
    return train(opt, where, model);
  }
  return train_plain_or_ddp(opt, where, model, net);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train a small CNN on Fashion-MNIST with dtrain."};
  Options opt;
  app.add_option("--strategy", opt.strategy, "Parallelism strategy")
      ->check(CLI::IsMember({"single", "dp", "model-parallel", "ddp", "ddp-model-parallel"}))
      ->capture_default_str();
  app.add_option("--devices", opt.devices,
                 "Devices: cpu, cuda, cuda:N, N, or all, comma-separated (cpu,cpu gives two CPU replicas or stages)")
      ->capture_default_str();
  app.add_option("--epochs", opt.epochs, "Passes over the training set")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_option("--batch-size", opt.batch_size, "Examples per step")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--lr", opt.lr, "Adam learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--seed", opt.seed, "Seed for initialisation and shuffling")->capture_default_str();
  app.add_option("--data-dir", opt.data_dir, "Directory with the Fashion-MNIST IDX files")->capture_default_str();
  app.add_option("--num-workers", opt.num_workers,
                 "DataLoader worker threads per rank (0: load in the training thread)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  app.add_flag("--tune-workers", opt.tune_workers, "Measure 0..4 workers first and use the fastest");
  app.add_option("--checkpoint-dir", opt.checkpoint_dir,
                 "Save checkpoints here and, when one exists, resume from the newest complete one");
  app.add_option("--checkpoint-every", opt.checkpoint_every, "Steps between checkpoints (0: end of each epoch)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--train-limit", opt.train_limit, "Train on the first N examples only (0: all)")
      ->check(CLI::NonNegativeNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  // Uncaught errors and fatal signals reach the launcher's error file.
  return dtrain::elastic::run_recording_errors([&] {
    try {
      return run(opt);
    } catch (const dtrain::Error& e) {
      dtrain::elastic::write_error_file(e.what());
      std::cerr << "fashion_mnist: error: " << e.what() << std::endl;
      return 1;
    }
  });
}
