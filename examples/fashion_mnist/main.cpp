// Trains a small CNN on Fashion-MNIST with dtrain::Trainer and reports test accuracy.
//
//   fashion_mnist [--strategy auto|single|dp|model-parallel|ddp|ddp-model-parallel|zero1|zero2|zero3|pipeline]
//                 [--pp-schedule gpipe|1f1b|interleaved|zb] [--micro-batches 4] [--pp-size 0]
//                 [--dp-reduce ddp|zero1|zero2|zero3|allreduce] [--devices all] [--epochs 2]
//                 [--plan FILE | --dp-replicate N --dp-shard N --pp N --zero-stage K] [--global-batch-size G]
//                 [--batch-size 64] [--lr 1e-3] [--seed 0] [--dropout 0.25]
//                 [--amp off|bf16|fp16] [--accumulate 1] [--clip-norm 0]
//                 [--checkpoint-dir DIR [--checkpoint-every N]] [--tensorboard DIR] [--trace FILE]
//                 [--sample-log FILE] [--train-limit N] [--test-limit N]
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
//   zero1|zero2|zero3   ddp's processes and data, with ShardedDataParallel (ZeRO): the optimizer
//                       state (1), also the gradients (2), also the parameters (3) split over
//                       the ranks; checkpoints reshard onto another number of ranks
//   pipeline            one process per rank, the layers cut into one stage per rank (two when
//                       interleaved) by the placement planner; every batch of --batch-size runs
//                       as --micro-batches micro-batches through --pp-schedule (the Trainer's
//                       PipelineStrategy; --accumulate must stay 1); with --pp-size P below the
//                       world, a data x pipeline mesh whose stage replicas are averaged by
//                       --dp-reduce
// A plan (--plan FILE or the degree flags, examples/common/plan_cli.h) runs
// through dtrain::parallelize: pp > 1 the pipeline, dp_shard > 1 ZeRO (HSDP
// with dp_replicate > 1), dp_replicate > 1 DDP; --strategy names are
// shorthands for plans; --global-batch-size sets the per-rank batch.
// After the model is built, each rank seeds its generators with seed + rank
// (dropout masks differ per rank); checkpoints restore each rank's own.
//
// Progress goes to stderr (a bar on a terminal, periodic lines otherwise);
// stdout gets one JSON line per epoch and a final
//   {"event":"done","test_accuracy":...,"train_seconds":...,"samples_per_second":...}
#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <CLI/CLI.hpp>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "dtrain/dtrain.h"
#include "model.h"
#include "placement.h"
#include "plan_cli.h"

namespace {

struct Options {
  std::string strategy = "auto";  // plan_cli.h, strategy_for
  std::string devices = "all";
  examples::PipelineCli pipeline;  // --strategy pipeline
  examples::PlanCli plan;          // --plan or the degrees; --global-batch-size
  int epochs = 2;
  std::int64_t batch_size = 64;
  double lr = 1e-3;
  double dropout = 0.25;
  std::uint64_t seed = 0;
  std::string data_dir = dtrain::data::kFashionMnistDefaultDir;
  std::int64_t train_limit = 0;  // 0: the whole training set
  std::int64_t test_limit = 0;   // 0: the whole test set
  int num_workers = 0;
  bool tune_workers = false;
  std::string checkpoint_dir;         // resume from / save to here ("" = no checkpoints)
  std::int64_t checkpoint_every = 0;  // steps between checkpoints; 0 = at the end of each epoch
  std::string amp = "off";
  int accumulate = 1;
  double clip_norm = 0;
  std::string tensorboard;
  std::string trace;
  std::string sample_log;
};

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

int run(Options opt) {
  const int launched_world = dtrain::dist::launched_by_launcher() ? dtrain::dist::read_env_contract().world_size : 1;
  opt.strategy = examples::strategy_for(opt.strategy, opt.plan, launched_world);
  const auto resolved = examples::resolve_run(opt.plan, opt.strategy, opt.pipeline, opt.batch_size, opt.accumulate,
                                              launched_world, distributed(opt.strategy),
                                              {.layers = static_cast<std::int64_t>(small_cnn_layers()->size())});
  DTRAIN_CHECK(resolved.recompute == dtrain::Recompute::kNone, ConfigError,
               "recompute " << dtrain::to_string(resolved.recompute) << ": this example's small CNN has no "
                            << "activation recompute (its activations are a few MB).",
               "set recompute none; examples/gpt applies it to its blocks");
  DTRAIN_CHECK(resolved.tp == 1, ConfigError,
               "tp " << resolved.tp << ": this example's small CNN has no tensor-parallel split.",
               "set tp 1; examples/gpt trains under --tp");
  DTRAIN_CHECK(resolved.cp == 1, ConfigError,
               "cp " << resolved.cp << ": this example's images have no sequence to split.",
               "set cp 1; examples/gpt trains under --cp");
  opt.strategy = resolved.strategy;
  examples::warn_if_unshared(opt.strategy, distributed(opt.strategy), launched_world);
  opt.pipeline = resolved.pipeline;
  opt.batch_size = resolved.batch_size;
  if (resolved.plan && dtrain::dist::launched_by_launcher() && dtrain::dist::read_env_contract().rank == 0) {
    DTRAIN_LOG(kInfo) << "parallelism plan (--strategy " << opt.strategy << "):\n" << resolved.plan->table();
  }
  Placement where = place({.strategy = opt.strategy, .devices = opt.devices});
  // The plan (or the one --strategy stands for) applied to the CNN's layers;
  // every rank builds them from the same seed.
  torch::manual_seed(opt.seed);
  const dtrain::Parallelized parallel =
      dtrain::parallelize({.layers = [&] { return small_cnn_layers(opt.dropout); }},
                          examples::plan_to_run(resolved, launched_world, opt.accumulate), where.group,
                          examples::parallelize_options(resolved, where.devices));
  const std::shared_ptr<dtrain::Strategy> strategy = parallel.strategy;
  torch::manual_seed(opt.seed + static_cast<std::uint64_t>(where.rank));
  auto train = std::make_shared<dtrain::data::FashionMnist>(opt.data_dir, dtrain::data::Split::kTrain);
  auto test = std::make_shared<dtrain::data::FashionMnist>(opt.data_dir, dtrain::data::Split::kTest);
  const std::int64_t n = opt.train_limit > 0 ? std::min(opt.train_limit, train->size()) : train->size();
  const std::int64_t per_rank = n / strategy->data_world();
  DTRAIN_CHECK(per_rank > 0, ConfigError,
               n << " training examples cannot be shared by " << strategy->data_world() << " data-parallel ranks.",
               "raise --train-limit or use fewer ranks");
  if (opt.tune_workers) {
    const auto tuning = dtrain::data::tune_num_workers(
        [&](int workers) {
          auto sampler = std::make_shared<dtrain::data::DistributedSampler>(
              dtrain::data::DistributedSamplerOptions{.dataset_size = n,
                                                      .num_replicas = strategy->data_world(),
                                                      .rank = strategy->data_rank(),
                                                      .seed = opt.seed,
                                                      .drop_last = true});
          return dtrain::data::make_tensor_loader(train, sampler,
                                                  {.batch_size = opt.batch_size, .num_workers = workers});
        },
        4, 100);
    opt.num_workers = tuning.best;
    if (where.rank == 0) {
      nlohmann::json rates = nlohmann::json::object();
      for (const auto& [w, rate] : tuning.samples_per_second) rates[std::to_string(w)] = rate;
      std::cout
          << nlohmann::json{{"event", "tune_workers"}, {"best", opt.num_workers}, {"samples_per_second", rates}}.dump()
          << std::endl;
    }
  }
  DTRAIN_LOG(kInfo) << opt.strategy << " training on " << dtrain::format_devices(where.devices) << ": " << per_rank
                    << " examples per rank, " << opt.epochs << " epochs, batch " << opt.batch_size << " per rank";

  torch::optim::Adam optimizer(strategy->parameters(), torch::optim::AdamOptions(opt.lr));
  std::optional<c10::ScalarType> amp;
  if (opt.amp == "bf16") amp = at::kBFloat16;
  if (opt.amp == "fp16") amp = at::kHalf;
  dtrain::Trainer trainer(strategy, optimizer, train,
                          {.epochs = opt.epochs,
                           .batch_size = opt.batch_size,
                           .accumulate = opt.accumulate,
                           .seed = opt.seed,
                           .num_workers = opt.num_workers,
                           .train_limit = opt.train_limit,
                           .amp_dtype = amp,
                           .clip_norm = opt.clip_norm,
                           // 256, not the Trainer's 1000: this CNN's activations at 1000 images
                           // (100 MB for conv1's) leave the caches; on one CPU thread this program
                           // evaluated the 10,000 test images in 4.7 s at 256 against 6.0 s at
                           // 1000 (the same CNN in Python torch: 3.4 s at 100-250, 5.9 s at 1000;
                           // torch 2.15, AMD EPYC Zen 4, 2026-12-02).
                           .eval_batch_size = 256,
                           .eval_limit = opt.test_limit,
                           .checkpoint_dir = opt.checkpoint_dir,
                           .checkpoint_every = opt.checkpoint_every,
                           .tensorboard_dir = opt.tensorboard,
                           .trace_file = opt.trace,
                           .sample_log = opt.sample_log});
  trainer.set_loss(parallel.loss);
  trainer.set_eval_dataset(test);
  trainer.on_eval([&](const dtrain::EvalReport& report) {
    if (where.rank != 0) return;
    std::cout << nlohmann::json{{"event", "epoch"},
                                {"epoch", report.epoch + 1},
                                {"train_loss", report.train_loss},
                                {"test_accuracy", report.eval.accuracy}}
                     .dump()
              << std::endl;
  });
  const auto summary = trainer.fit();
  if (where.group) where.group->barrier();
  const auto full = strategy->full_parameters();  // collective: ZeRO gathers its shards
  if (where.rank == 0) {
    std::cout << nlohmann::json{{"event", "done"},
                                {"strategy", opt.strategy},
                                {"world_size", where.world},
                                {"steps", summary.steps},
                                {"params_fnv", params_fingerprint(strategy->module())},
                                {"test_accuracy", summary.last_eval ? summary.last_eval->accuracy : 0.0},
                                {"test_loss", summary.last_eval ? summary.last_eval->loss : 0.0},
                                {"train_seconds", summary.train_seconds},
                                {"samples_per_second", static_cast<double>(summary.examples) / summary.train_seconds}}
                     .dump()
              << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train a small CNN on Fashion-MNIST with dtrain."};
  Options opt;
  examples::add_strategy_option(app, opt.strategy);
  opt.pipeline.add_to(app);
  opt.plan.add_to(app);
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
  app.add_option("--dropout", opt.dropout, "Dropout before the last layer")
      ->check(CLI::Range(0.0, 0.99))
      ->capture_default_str();
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
  app.add_option("--amp", opt.amp, "Autocast the forward: bf16 (CPU or CUDA) or fp16 (CUDA, with a GradScaler)")
      ->check(CLI::IsMember({"off", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--accumulate", opt.accumulate, "Micro-batches of --batch-size per optimizer step")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--clip-norm", opt.clip_norm, "Clip gradients to this global norm (0: no clipping)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--tensorboard", opt.tensorboard, "Write metrics as TensorBoard event files into this directory");
  app.add_option("--trace", opt.trace, "Write a Chrome trace timeline (one file per rank: NAME.rank<R>.json)");
  app.add_option("--sample-log", opt.sample_log,
                 "Append the examples each step trained on (JSON lines, one file per rank: NAME.rank<R>.EXT)");
  app.add_option("--test-limit", opt.test_limit, "Evaluate on the first N test examples only (0: all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--train-limit", opt.train_limit, "Train on the first N examples only (0: all)")
      ->check(CLI::NonNegativeNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  // Uncaught errors and fatal signals reach the launcher's error file.
  return dtrain::elastic::run_recording_errors([&] { return run(opt); }, "fashion_mnist");
}
