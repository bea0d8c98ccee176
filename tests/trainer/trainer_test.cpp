// The Trainer loop:
//   - a run stopped at step 7 and resumed from its step-6 checkpoint (fresh
//     weights, other seeds) ends bit-identical to an uninterrupted one, with
//     dropout, bf16 autocast, a GradScaler, accumulation, clipping and a
//     warm-up/cosine schedule all in play;
//   - DDP over 2 rank threads with accumulation and clipping equals one
//     process on the union of the ranks' micro-batches (fp32, rtol 1e-5);
//   - the trace files of that run: per step, data wait < forward < backward <
//     optimizer inside the step span, and every communication bucket inside a
//     backward span of its step;
//   - an error names the step it happened at;
//   - metrics: TensorBoard's own event reader (the venv's tensorboard) finds
//     the scalars of the JSON lines, with the same steps and values;
//   - ZeroStrategy, stages 1-3 on 2 rank threads (AdamW with weight decay,
//     accumulation, clipping), equals one process on the union (rtol 1e-5);
//     a stage-2 run saved on 2 ranks and resumed on 3 (micro-batches 6 -> 4
//     per rank: the same global batches) equals the uninterrupted run;
//   - a StepStream (batches a function of the global step) with fixed
//     evaluation batches, under ZeRO-3 and HSDP, equals one process.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "dtrain/comm/mesh.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/data/loader.h"
#include "dtrain/error.h"
#include "dtrain/parallel/pipeline/pipeline.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "dtrain/trainer/pipeline_strategy.h"
#include "dtrain/trainer/trainer.h"
#include "dtrain/trainer/zero_strategy.h"
#include "ranks.h"

namespace fs = std::filesystem;

namespace {
struct NetImpl : torch::nn::Module {
  explicit NetImpl(double dropout) : p(dropout) {
    a = register_module("a", torch::nn::Linear(12, 32));
    b = register_module("b", torch::nn::Linear(32, 5));
  }
  at::Tensor forward(const at::Tensor& x) { return b(at::dropout(at::relu(a(x)), p, is_training())); }
  torch::nn::Linear a{nullptr}, b{nullptr};
  double p;
};
TORCH_MODULE(Net);

// Fixed random examples: 12 features, 5 classes.
class Blobs : public dtrain::data::Dataset<dtrain::data::TensorExample> {
 public:
  explicit Blobs(std::int64_t n) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
    x_ = at::randn({n, 12}, gen);
    y_ = at::randint(0, 5, {n}, gen);
  }
  std::int64_t size() const override { return x_.size(0); }
  dtrain::data::TensorExample get(std::int64_t i) const override { return {x_[i], y_[i]}; }

 private:
  at::Tensor x_, y_;
};

fs::path temp_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("dtrain-trainer-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir;
}

at::Tensor flat(torch::nn::Module& m) {
  std::vector<at::Tensor> parts;
  for (const auto& p : m.parameters()) parts.push_back(p.detach().reshape(-1));
  return at::cat(parts);
}

// A training run of `max_steps` from a model made after seeding `seed`.
at::Tensor train_single(std::uint64_t seed, dtrain::TrainerOptions options) {
  torch::manual_seed(seed);
  Net net(0.2);
  torch::optim::Adam opt(net->parameters(), 1e-2);
  auto strategy = std::make_shared<dtrain::SingleDeviceStrategy<Net>>(net, c10::kCPU);
  dtrain::Trainer trainer(strategy, opt, std::make_shared<Blobs>(200), options);
  trainer.set_schedule(std::make_shared<dtrain::WarmupCosineLR>(
      opt, dtrain::WarmupCosineOptions{.warmup_steps = 3, .total_steps = 12, .start_factor = 0.1}));
  trainer.set_eval_dataset(std::make_shared<Blobs>(50));
  trainer.fit();
  return flat(*net);
}
}  // namespace

TEST(Trainer, ResumeEqualsUninterruptedBitForBit) {
  const auto dir = temp_dir("resume");
  const dtrain::TrainerOptions base{.epochs = 3,
                                    .max_steps = 10,
                                    .batch_size = 8,
                                    .accumulate = 2,
                                    .seed = 3,
                                    .amp_dtype = at::kBFloat16,
                                    .grad_scaler = true,
                                    .clip_norm = 0.5,
                                    .eval_every = 4,
                                    .progress = false};
  const at::Tensor reference = train_single(1, base);

  auto interrupted = base;
  interrupted.max_steps = 7;  // 12 steps per epoch: stops mid-epoch
  interrupted.checkpoint_dir = dir;
  interrupted.checkpoint_every = 3;
  train_single(1, interrupted);
  ASSERT_TRUE(fs::exists(dir / "step_7")) << "the end of a run is checkpointed";
  fs::remove_all(dir / "step_7");  // as if it had crashed after step 7: resume from step 6
  auto resumed = base;
  resumed.checkpoint_dir = dir;
  resumed.checkpoint_every = 3;
  const at::Tensor got = train_single(99, resumed);  // other weights and generator: all from step 6
  EXPECT_TRUE(at::equal(got, reference)) << (got - reference).abs().max();
  fs::remove_all(dir);
}

TEST(Trainer, DdpEqualsOneProcessOnTheUnionAndTracesNest) {
  const auto dir = temp_dir("ddp");
  const dtrain::TrainerOptions options{
      .epochs = 1, .max_steps = 4, .batch_size = 6, .accumulate = 2, .seed = 5, .clip_norm = 0.3, .progress = false};
  // Rank threads share the default generator: every model copies one initialisation.
  torch::manual_seed(7);
  Net init(0.0);
  auto copy_init = [&](Net& net) {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < net->parameters().size(); ++i) net->parameters()[i].copy_(init->parameters()[i]);
  };
  // One process: micro-batches twice as large (the union of both ranks').
  Net single(0.0);
  copy_init(single);
  {
    torch::optim::SGD opt(single->parameters(), 0.1);
    auto o = options;
    o.batch_size *= 2;
    dtrain::Trainer(std::make_shared<dtrain::SingleDeviceStrategy<Net>>(single, c10::kCPU), opt,
                    std::make_shared<Blobs>(96), o)
        .fit();
  }
  const at::Tensor expected = flat(*single);
  dtrain::testing::run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(30)});
    Net net(0.0);
    copy_init(net);
    torch::optim::SGD opt(net->parameters(), 0.1);
    auto o = options;
    o.trace_file = dir / "trace.json";
    // Small buckets: several per backward.
    auto strategy = std::make_shared<dtrain::DdpStrategy<Net>>(
        net, group, c10::kCPU, c10::kCPU, dtrain::DDPOptions{.bucket_cap_mb = 0.0005, .first_bucket_cap_mb = 0.0005});
    dtrain::Trainer(strategy, opt, std::make_shared<Blobs>(96), o).fit();
    EXPECT_TRUE(at::allclose(flat(*net), expected, 1e-5, 1e-6)) << "rank " << rank;
  });

  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream in(dir / ("trace.rank" + std::to_string(rank) + ".json"));
    ASSERT_TRUE(in) << "no trace for rank " << rank;
    const auto events = nlohmann::json::parse(in)["traceEvents"];
    std::map<std::int64_t, std::vector<nlohmann::json>> train, comm;
    for (const auto& e : events) {
      if (e["ph"] != "X") continue;
      EXPECT_EQ(e["pid"], rank);
      (e["tid"] == 0 ? train : comm)[e["args"]["step"].get<std::int64_t>()].push_back(e);
    }
    ASSERT_EQ(train.size(), 4u);
    std::size_t max_buckets = 0;  // the first backward has one bucket; later ones, rebuilt in order, several
    for (auto& [step, spans] : train) {
      // By start, the enclosing (longer) span first.
      std::sort(spans.begin(), spans.end(), [](const auto& x, const auto& y) {
        return std::make_pair(x["ts"].template get<std::int64_t>(), -x["dur"].template get<std::int64_t>()) <
               std::make_pair(y["ts"].template get<std::int64_t>(), -y["dur"].template get<std::int64_t>());
      });
      const auto& outer = spans.front();
      ASSERT_EQ(outer["name"], "step") << spans.size();
      const auto end_of = [](const nlohmann::json& e) {
        return e["ts"].get<std::int64_t>() + e["dur"].get<std::int64_t>();
      };
      std::vector<std::string> names;
      std::int64_t previous_end = outer["ts"];
      std::vector<std::pair<std::int64_t, std::int64_t>> backwards;
      for (size_t i = 1; i < spans.size(); ++i) {
        names.push_back(spans[i]["name"]);
        EXPECT_GE(spans[i]["ts"].get<std::int64_t>(), previous_end) << spans[i];  // in order, not overlapping
        previous_end = end_of(spans[i]);
        EXPECT_LE(previous_end, end_of(outer));
        if (spans[i]["name"] == "backward") backwards.emplace_back(spans[i]["ts"], end_of(spans[i]));
      }
      EXPECT_EQ(names, (std::vector<std::string>{"data wait", "forward", "backward", "data wait", "forward", "backward",
                                                 "optimizer"}))
          << "step " << step;
      // Buckets: only in the synchronising (second) backward, inside it.
      ASSERT_GE(comm[step].size(), 1u) << "step " << step;
      max_buckets = std::max(max_buckets, comm[step].size());
      for (const auto& bucket : comm[step]) {
        EXPECT_EQ(bucket["cat"], "comm");
        EXPECT_GE(bucket["ts"].get<std::int64_t>(), backwards.at(1).first) << bucket;
        EXPECT_LE(end_of(bucket), backwards.at(1).second) << bucket;
      }
    }
    EXPECT_GE(max_buckets, 2u);
  }
  fs::remove_all(dir);
}

TEST(Trainer, TensorBoardReadsTheMetrics) {
  const auto dir = temp_dir("metrics");
  train_single(2, {.epochs = 1,
                   .max_steps = 9,
                   .batch_size = 8,
                   .clip_norm = 1.0,
                   .eval_every = 5,
                   .progress = false,
                   .log_every = 2,
                   .metrics_jsonl = dir / "metrics.jsonl",
                   .tensorboard_dir = dir / "tb"});
  // JSON lines: {"step": s, "train/loss": ..., ...}.
  std::map<std::string, std::map<std::int64_t, double>> expected;
  std::ifstream lines(dir / "metrics.jsonl");
  for (std::string line; std::getline(lines, line);) {
    const auto j = nlohmann::json::parse(line);
    for (const auto& [key, value] : j.items()) {
      if (key != "step") expected[key][j["step"].get<std::int64_t>()] = value.get<double>();
    }
  }
  for (const char* tag : {"train/loss", "train/lr", "train/grad_norm", "train/examples_per_second",
                          "train/data_wait_share", "eval/loss", "eval/accuracy"}) {
    EXPECT_TRUE(expected.count(tag)) << tag;
  }
  EXPECT_EQ(expected["train/loss"].size(), 5u);     // steps 2, 4, 6, 8, 9
  EXPECT_EQ(expected["eval/accuracy"].size(), 2u);  // steps 5, 9

  const std::string script =
      "import json, sys\n"
      "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
      "acc = EventAccumulator(sys.argv[1]); acc.Reload()\n"
      "print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()['scalars']}))\n";
  std::ofstream(dir / "read.py") << script;
  const std::string cmd = std::string(DTRAIN_PYTHON) + " " + (dir / "read.py").string() + " " + (dir / "tb").string();
  FILE* pipe = ::popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  ASSERT_EQ(::pclose(pipe), 0) << out;
  const auto read = nlohmann::json::parse(out);
  ASSERT_EQ(read.size(), expected.size()) << out;
  for (const auto& [tag, values] : expected) {
    ASSERT_TRUE(read.contains(tag)) << tag << ": " << out;
    ASSERT_EQ(read[tag].size(), values.size()) << tag;
    for (const auto& point : read[tag]) {
      const auto step = point[0].get<std::int64_t>();
      ASSERT_TRUE(values.count(step)) << tag << " step " << step;
      EXPECT_FLOAT_EQ(point[1].get<float>(), static_cast<float>(values.at(step))) << tag << " step " << step;
    }
  }
  fs::remove_all(dir);
}

// An error in the loop is logged with the step it happened at and rethrown.
TEST(Trainer, AnErrorNamesTheStep) {
  torch::manual_seed(0);
  Net net(0.0);
  torch::optim::SGD opt(net->parameters(), 0.1);
  dtrain::Trainer trainer(std::make_shared<dtrain::SingleDeviceStrategy<Net>>(net, c10::kCPU), opt,
                          std::make_shared<Blobs>(64), {.batch_size = 8, .progress = false});
  int calls = 0;
  trainer.set_loss([&](const at::Tensor& output, const at::Tensor& target) {
    DTRAIN_CHECK(++calls < 3, DataError, "a bad batch (simulated).", "none");
    return torch::nn::functional::cross_entropy(output, target);
  });
  testing::internal::CaptureStderr();
  EXPECT_THROW(trainer.fit(), dtrain::DataError);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("training failed at step 2: "), std::string::npos) << err;
  EXPECT_NE(err.find("a bad batch (simulated)"), std::string::npos) << err;
}

namespace {
// The first `n` examples of `all`.
class FirstOf : public dtrain::data::Dataset<dtrain::data::TensorExample> {
 public:
  FirstOf(std::shared_ptr<const Blobs> all, std::int64_t n) : all_(std::move(all)), n_(n) {}
  std::int64_t size() const override { return n_; }
  dtrain::data::TensorExample get(std::int64_t i) const override { return all_->get(i); }

 private:
  std::shared_ptr<const Blobs> all_;
  std::int64_t n_;
};
}  // namespace

// eval_limit evaluates the first N examples only, in batches that do not
// divide them: the same loss, accuracy and count as the whole of a set of
// those N; a limit past the set's size is the whole set; a negative one is
// refused.
TEST(Trainer, EvalLimitEvaluatesTheFirstExamplesOnly) {
  torch::manual_seed(0);
  Net net(0.0);
  torch::optim::SGD opt(net->parameters(), 0.1);
  auto strategy = std::make_shared<dtrain::SingleDeviceStrategy<Net>>(net, c10::kCPU);
  const auto all = std::make_shared<Blobs>(50);
  auto evaluate = [&](std::shared_ptr<const dtrain::data::Dataset<dtrain::data::TensorExample>> set,
                      std::int64_t limit) {
    dtrain::Trainer trainer(strategy, opt, std::make_shared<Blobs>(8),
                            {.eval_batch_size = 7, .eval_limit = limit, .progress = false});
    trainer.set_eval_dataset(std::move(set));
    return trainer.evaluate();
  };
  const auto limited = evaluate(all, 17);
  const auto want = evaluate(std::make_shared<FirstOf>(all, 17), 0);
  EXPECT_EQ(limited.examples, 17);
  EXPECT_EQ(want.examples, 17);
  EXPECT_DOUBLE_EQ(limited.loss, want.loss);
  EXPECT_DOUBLE_EQ(limited.accuracy, want.accuracy);
  const auto whole = evaluate(all, 0);
  EXPECT_EQ(whole.examples, 50);
  EXPECT_NE(whole.loss, limited.loss);
  EXPECT_EQ(evaluate(all, 500).examples, 50);
  EXPECT_THROW(evaluate(all, -1), dtrain::ConfigError);
}

namespace {
// Parameter counts 416 and 165: not divisible by 2 or 3 ranks.
torch::nn::Sequential zero_net() {
  return torch::nn::Sequential(torch::nn::Linear(12, 32), torch::nn::ReLU(), torch::nn::Linear(32, 5));
}

void copy_parameters(torch::nn::Module& to, torch::nn::Module& from) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < to.parameters().size(); ++i) to.parameters()[i].copy_(from.parameters()[i]);
}

torch::optim::AdamW zero_test_optimizer(std::vector<at::Tensor> parameters) {
  return torch::optim::AdamW(std::move(parameters), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
}

const dtrain::TrainerOptions kZeroOptions{
    .epochs = 2, .max_steps = 6, .batch_size = 12, .accumulate = 2, .seed = 5, .clip_norm = 0.3, .progress = false};

// One process on global micro-batches of 12, from `init`'s weights: 4 steps an epoch.
at::Tensor zero_reference(torch::nn::Sequential& init) {
  auto net = zero_net();
  copy_parameters(*net, *init);
  auto opt = zero_test_optimizer(net->parameters());
  dtrain::Trainer(std::make_shared<dtrain::SingleDeviceStrategy<torch::nn::Sequential>>(net, c10::kCPU), opt,
                  std::make_shared<Blobs>(96), kZeroOptions)
      .fit();
  return flat(*net);
}

// `world` rank threads train with ZeroStrategy at `stage` (micro-batch 12 /
// world per rank); returns rank 0's full parameters after fit().
at::Tensor zero_run(int world, int stage, torch::nn::Sequential& init, dtrain::TrainerOptions options) {
  options.batch_size = kZeroOptions.batch_size / world;
  std::vector<at::Tensor> results(static_cast<std::size_t>(world));
  dtrain::testing::run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(60)});
    auto net = zero_net();
    copy_parameters(*net, *init);
    auto sdp = std::make_shared<dtrain::ShardedDataParallel>(net, group, dtrain::ZeroOptions{.stage = stage});
    auto opt = zero_test_optimizer(sdp->parameters());
    auto strategy = std::make_shared<dtrain::ZeroStrategy>(sdp, c10::kCPU);
    EXPECT_EQ(strategy->name(), "zero" + std::to_string(stage));
    dtrain::Trainer(strategy, opt, std::make_shared<Blobs>(96), options).fit();
    at::Tensor full;
    {
      auto gathered = sdp->full_parameters();
      full = flat(*net).clone();
    }
    results[static_cast<std::size_t>(rank)] = full;
  });
  for (int r = 1; r < world; ++r) EXPECT_TRUE(at::equal(results[0], results[static_cast<std::size_t>(r)])) << r;
  return results[0];
}
}  // namespace

TEST(ZeroTrainer, StagesOneToThreeEqualOneProcessOnTheUnion) {
  torch::manual_seed(11);
  auto init = zero_net();
  const at::Tensor expected = zero_reference(init);
  for (int stage = 1; stage <= 3; ++stage) {
    const at::Tensor got = zero_run(2, stage, init, kZeroOptions);
    EXPECT_TRUE(at::allclose(got, expected, 1e-5, 1e-6)) << "stage " << stage << ": " << (got - expected).abs().max();
  }
}

TEST(ZeroTrainer, SavedOnTwoRanksResumesOnThreeEqualToUninterrupted) {
  const auto dir = temp_dir("zero-reshard");
  torch::manual_seed(12);
  auto init = zero_net();
  const at::Tensor expected = zero_reference(init);
  auto first = kZeroOptions;
  first.max_steps = 3;  // stops mid-epoch 0; checkpoint at step 3
  first.checkpoint_dir = dir;
  first.checkpoint_every = 3;
  zero_run(2, 2, init, first);
  torch::manual_seed(99);
  auto other = zero_net();  // other initial weights: everything must come from the checkpoint
  auto second = kZeroOptions;
  second.checkpoint_dir = dir;
  second.checkpoint_every = 3;
  const at::Tensor got = zero_run(3, 2, other, second);
  EXPECT_TRUE(at::allclose(got, expected, 1e-5, 1e-6)) << (got - expected).abs().max();
  fs::remove_all(dir);
}

// A finished run resumed on another world size trains nothing again (Note
// [An epoch's tail]): 3 ranks over 95 examples leave 2 out (95 = 3 x 31 + 2),
// which 2 ranks would take as one more step of the ended epoch.
TEST(ZeroTrainer, AFinishedRunResumedOnAnotherWorldSizeTrainsNothingAgain) {
  const auto dir = temp_dir("zero-finished");
  auto options = kZeroOptions;
  options.epochs = 1;
  options.max_steps = 0;
  options.accumulate = 1;
  options.train_limit = 95;
  options.checkpoint_dir = dir;
  options.checkpoint_every = 3;
  torch::manual_seed(12);
  auto init = zero_net();
  const at::Tensor finished = zero_run(3, 2, init, options);
  torch::manual_seed(99);
  auto other = zero_net();  // other initial weights: everything must come from the checkpoint
  const at::Tensor resumed = zero_run(2, 2, other, options);
  EXPECT_TRUE(at::equal(resumed, finished)) << (resumed - finished).abs().max();
  fs::remove_all(dir);
}

namespace {

// A step-indexed stream over Blobs(96): step s's global micro-batch m is
// examples (s * 24 + m * 12 + i) % 96 for i < 12, data rank r reading its
// contiguous share.
std::shared_ptr<dtrain::StepStream> blob_stream() {
  auto blobs = std::make_shared<Blobs>(96);
  return std::make_shared<dtrain::StepStream>([blobs](const dtrain::StepStream::Request& r) {
    std::vector<std::int64_t> indices;
    const std::int64_t global = r.batch_size * r.data_world;
    for (std::int64_t i = 0; i < r.batch_size; ++i)
      indices.push_back((r.step * global * r.accumulate + r.micro * global + r.data_rank * r.batch_size + i) % 96);
    return dtrain::data::collate_tensors(blobs->get_many(indices));
  });
}

// Three fixed evaluation batches of 10 (uneven over 2 and 4 ranks).
dtrain::data::TensorBatch eval_blob(std::int64_t k) {
  static const Blobs blobs(30);
  std::vector<std::int64_t> indices;
  for (std::int64_t i = 0; i < 10; ++i) indices.push_back(k * 10 + i);
  return dtrain::data::collate_tensors(blobs.get_many(indices));
}

struct StreamRun {
  at::Tensor parameters;
  std::vector<dtrain::EvalResult> evals;  // rank 0's, in order
};

const dtrain::TrainerOptions kStreamOptions{.max_steps = 5,
                                            .batch_size = 12,
                                            .accumulate = 2,
                                            .clip_norm = 0.3,
                                            .eval_every = 2,
                                            .eval_at_start = true,
                                            .progress = false};

StreamRun stream_reference(torch::nn::Sequential& init) {
  auto net = zero_net();
  copy_parameters(*net, *init);
  auto opt = zero_test_optimizer(net->parameters());
  dtrain::Trainer trainer(std::make_shared<dtrain::SingleDeviceStrategy<torch::nn::Sequential>>(net, c10::kCPU), opt,
                          blob_stream(), kStreamOptions);
  StreamRun result;
  trainer.set_eval_batches(3, eval_blob);
  trainer.on_eval([&](const dtrain::EvalReport& r) { result.evals.push_back(r.eval); });
  const auto summary = trainer.fit();
  EXPECT_EQ(summary.steps, 5);
  result.parameters = flat(*net);
  return result;
}

// ZeRO-3 on `replicas` x `shards` rank threads (HSDP when replicas > 1).
StreamRun stream_zero3(torch::nn::Sequential& init, int replicas, int shards) {
  const int world = replicas * shards;
  std::vector<StreamRun> results(static_cast<std::size_t>(world));
  dtrain::testing::run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(60)});
    dtrain::dist::DeviceMesh mesh(group, {{"dp_replicate", replicas}, {"dp_shard", shards}});
    auto net = zero_net();
    copy_parameters(*net, *init);
    dtrain::ZeroOptions zero{.stage = 3};
    if (replicas > 1) zero.replicate_group = mesh["dp_replicate"];
    auto sdp = std::make_shared<dtrain::ShardedDataParallel>(net, mesh["dp_shard"], zero);
    auto opt = zero_test_optimizer(sdp->parameters());
    auto strategy = std::make_shared<dtrain::ZeroStrategy>(sdp, c10::kCPU, group);
    EXPECT_TRUE(strategy->collective_forward());
    EXPECT_EQ(strategy->data_rank(), rank);
    EXPECT_EQ(strategy->data_world(), world);
    auto options = kStreamOptions;
    options.batch_size = kStreamOptions.batch_size / world;
    dtrain::Trainer trainer(strategy, opt, blob_stream(), options);
    auto& mine = results[static_cast<std::size_t>(rank)];
    trainer.set_eval_batches(3, eval_blob);
    trainer.on_eval([&](const dtrain::EvalReport& r) { mine.evals.push_back(r.eval); });
    trainer.fit();
    auto gathered = sdp->full_parameters();
    mine.parameters = flat(*net).clone();
  });
  return results[0];
}

void expect_same_stream_run(const StreamRun& got, const StreamRun& want, const std::string& what) {
  EXPECT_TRUE(at::allclose(got.parameters, want.parameters, 1e-5, 1e-6))
      << what << ": " << (got.parameters - want.parameters).abs().max();
  // At step 0 (eval_at_start), 2, 4 and the end (5).
  ASSERT_EQ(want.evals.size(), 4u);
  ASSERT_EQ(got.evals.size(), want.evals.size()) << what;
  for (std::size_t i = 0; i < want.evals.size(); ++i) {
    EXPECT_EQ(got.evals[i].examples, 30) << what << " evaluation " << i;
    EXPECT_NEAR(got.evals[i].loss, want.evals[i].loss, 1e-5 * std::abs(want.evals[i].loss)) << what << " " << i;
    EXPECT_NEAR(got.evals[i].accuracy, want.evals[i].accuracy, 1e-12) << what << " " << i;
  }
}

}  // namespace

// A StepStream (batches a function of the step) under ZeRO-3 on 2 ranks and
// HSDP 2 x 2 equals one process; the 3 evaluation batches split unevenly over
// the ranks, so ZeRO-3's collective evaluation forward must run as often on
// every rank (it hung before) and count each batch once.
TEST(StreamTrainer, Zero3AndHsdpWithUnevenEvaluationEqualOneProcess) {
  torch::manual_seed(13);
  auto init = zero_net();
  const StreamRun want = stream_reference(init);
  expect_same_stream_run(stream_zero3(init, 1, 2), want, "zero3 x 2");
  expect_same_stream_run(stream_zero3(init, 2, 2), want, "hsdp 2 x 2");
}

TEST(StreamTrainer, AnEndlessSourceNeedsMaxSteps) {
  auto net = zero_net();
  auto opt = zero_test_optimizer(net->parameters());
  dtrain::Trainer trainer(std::make_shared<dtrain::SingleDeviceStrategy<torch::nn::Sequential>>(net, c10::kCPU), opt,
                          blob_stream(), {.progress = false});
  try {
    trainer.fit();
    FAIL() << "an endless source without max_steps trained";
  } catch (const dtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("max_steps"), std::string::npos) << e.what();
  }
}

namespace {

const dtrain::TrainerOptions kPipelineOptions{
    .epochs = 2, .max_steps = 6, .batch_size = 12, .accumulate = 1, .seed = 5, .clip_norm = 0.3, .progress = false};

struct PipelineRunResult {
  std::map<std::string, at::Tensor> parameters;  // by name in zero_net(), from the stage that holds each
  double eval_loss = 0;
  std::int64_t eval_examples = 0;
};

// One process on global batches of 12, with evaluation on 30 examples.
PipelineRunResult pipeline_reference(torch::nn::Sequential& init,
                                     const dtrain::TrainerOptions& options = kPipelineOptions) {
  auto net = zero_net();
  copy_parameters(*net, *init);
  auto opt = zero_test_optimizer(net->parameters());
  dtrain::Trainer trainer(std::make_shared<dtrain::SingleDeviceStrategy<torch::nn::Sequential>>(net, c10::kCPU), opt,
                          std::make_shared<Blobs>(96), options);
  trainer.set_eval_dataset(std::make_shared<Blobs>(30));
  const auto summary = trainer.fit();
  PipelineRunResult result{.eval_loss = summary.last_eval->loss, .eval_examples = summary.last_eval->examples};
  for (const auto& item : net->named_parameters()) result.parameters[item.key()] = item.value().detach().clone();
  return result;
}

// 4 rank threads as 2 replicas x 2 stages (Linear+ReLU | Linear), batches of
// 6 per replica in 2 micro-batches, the replicas reduced by `reduction`.
PipelineRunResult pipeline_run(torch::nn::Sequential& init, const dtrain::pipeline::StageSyncFactory& reduction,
                               dtrain::TrainerOptions options) {
  constexpr int kWorld = 4;
  options.batch_size = kPipelineOptions.batch_size / 2;
  PipelineRunResult result;
  std::mutex mutex;
  dtrain::testing::run_rank_threads(kWorld, [&](int rank, dtrain::dist::Store store) {
    auto world = dtrain::dist::init_process_group(store, rank, kWorld, {.timeout = std::chrono::seconds(60)});
    dtrain::dist::DeviceMesh mesh(world, {{"pp", 2}, {"dp_replicate", 2}});
    auto net = zero_net();
    copy_parameters(*net, *init);
    const auto stages = dtrain::pipeline::split_stages(net, {0, 0, 1});
    auto loss = [](const at::Tensor& out, const at::Tensor& y) { return torch::nn::functional::cross_entropy(out, y); };
    auto pipe = std::make_shared<dtrain::pipeline::Pipeline>(
        std::vector<dtrain::pipeline::PipelineStage>{{.module = stages[mesh.coordinate("pp")]}}, mesh["pp"],
        dtrain::pipeline::PipelineOptions{.micro_batches = 2,
                                          .data_parallel_group = mesh.join({"dp_replicate", "dp_shard"}),
                                          .stage_sync = reduction},
        loss);
    auto strategy = std::make_shared<dtrain::PipelineStrategy>(pipe, mesh);
    EXPECT_EQ(strategy->data_world(), 2);
    auto opt = zero_test_optimizer(strategy->parameters());
    dtrain::Trainer trainer(strategy, opt, std::make_shared<Blobs>(96), options);
    trainer.set_eval_dataset(std::make_shared<Blobs>(30));
    const auto summary = trainer.fit();
    const auto full = strategy->full_parameters();  // ZeRO-3: gathered while it lives
    std::lock_guard<std::mutex> lock(mutex);
    if (rank == 0) {
      result.eval_loss = summary.last_eval->loss;
      result.eval_examples = summary.last_eval->examples;
    }
    if (mesh.coordinate("dp_replicate") != 0) return;
    for (const auto& item : stages[mesh.coordinate("pp")]->named_parameters())
      result.parameters[item.key()] = item.value().detach().clone();
  });
  return result;
}

void expect_same_training(const PipelineRunResult& got, const PipelineRunResult& want, const std::string& what) {
  ASSERT_EQ(got.parameters.size(), want.parameters.size()) << what;
  for (const auto& [name, value] : want.parameters) {
    const at::Tensor& mine = got.parameters.at(name);
    EXPECT_TRUE(at::allclose(mine, value, 1e-5, 1e-6)) << what << " " << name << ": " << (mine - value).abs().max();
  }
  EXPECT_EQ(got.eval_examples, want.eval_examples) << what;
  EXPECT_NEAR(got.eval_loss, want.eval_loss, 1e-5) << what;
}

}  // namespace

// The Trainer over a 2 x 2 data x pipeline mesh, stages reduced by DDP, ZeRO-2,
// ZeRO-3 or one all-reduce, equals the single-process Trainer on the global batches
// (parameters after 6 steps with clipping, and the evaluation, whose 30
// examples do not split into whole micro-batches on every replica).
TEST(PipelineTrainer, DataTimesPipelineEqualsOneProcess) {
  torch::manual_seed(13);
  auto init = zero_net();
  const PipelineRunResult expected = pipeline_reference(init);
  expect_same_training(pipeline_run(init, dtrain::pipeline::ddp_stage_sync(), kPipelineOptions), expected, "ddp");
  expect_same_training(pipeline_run(init, dtrain::pipeline::zero_stage_sync({.stage = 2}), kPipelineOptions), expected,
                       "zero2");
  expect_same_training(pipeline_run(init, dtrain::pipeline::allreduce_stage_sync(), kPipelineOptions), expected,
                       "all-reduce");
  expect_same_training(pipeline_run(init, dtrain::pipeline::zero_stage_sync({.stage = 3}), kPipelineOptions), expected,
                       "zero3");
}

// With a GradScaler (fp32, so scaling by powers of two is exact): each stage
// scales its micro-batch losses, found-inf is combined over the world, and
// sharded stages unscale their shards; still the single-process run with the
// same scaler.
TEST(PipelineTrainer, WithAGradScalerEqualsOneProcess) {
  torch::manual_seed(15);
  auto init = zero_net();
  auto options = kPipelineOptions;
  options.grad_scaler = true;
  const PipelineRunResult expected = pipeline_reference(init, options);
  expect_same_training(pipeline_run(init, dtrain::pipeline::ddp_stage_sync(), options), expected, "ddp + scaler");
  expect_same_training(pipeline_run(init, dtrain::pipeline::zero_stage_sync({.stage = 2}), options), expected,
                       "zero2 + scaler");
}

// Saved at step 3 (per-rank parts) and resumed from other initial weights:
// ends where an uninterrupted run does.
TEST(PipelineTrainer, ResumedEqualsUninterrupted) {
  const auto dir = temp_dir("pipeline-resume");
  torch::manual_seed(14);
  auto init = zero_net();
  const PipelineRunResult expected = pipeline_reference(init);
  auto first = kPipelineOptions;
  first.max_steps = 3;
  first.checkpoint_dir = dir;
  first.checkpoint_every = 3;
  pipeline_run(init, dtrain::pipeline::zero_stage_sync({.stage = 2}), first);
  torch::manual_seed(98);
  auto other = zero_net();
  auto second = kPipelineOptions;
  second.checkpoint_dir = dir;
  second.checkpoint_every = 3;
  expect_same_training(pipeline_run(other, dtrain::pipeline::zero_stage_sync({.stage = 2}), second), expected,
                       "resumed");
  fs::remove_all(dir);
}

TEST(PipelineTrainer, AccumulationIsRefusedWithAClearError) {
  dtrain::testing::run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto world = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(30)});
    dtrain::dist::DeviceMesh mesh(world, {{"pp", 2}});
    auto net = zero_net();
    const auto stages = dtrain::pipeline::split_stages(net, {0, 0, 1});
    auto pipe = std::make_shared<dtrain::pipeline::Pipeline>(
        std::vector<dtrain::pipeline::PipelineStage>{{.module = stages[rank]}}, mesh["pp"],
        dtrain::pipeline::PipelineOptions{.micro_batches = 2},
        [](const at::Tensor& out, const at::Tensor& y) { return torch::nn::functional::cross_entropy(out, y); });
    auto strategy = std::make_shared<dtrain::PipelineStrategy>(pipe, mesh);
    auto opt = zero_test_optimizer(strategy->parameters());
    auto options = kPipelineOptions;
    options.accumulate = 2;
    try {
      dtrain::Trainer trainer(strategy, opt, std::make_shared<Blobs>(96), options);
      ADD_FAILURE() << "accumulate 2 was accepted";
    } catch (const dtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("micro-batches"), std::string::npos) << e.what();
    }
  });
}
