// Trains a character-level GPT (nanoGPT's shakespeare_char) on the complete
// works of Shakespeare and prints a generated sample and the val loss.
//
//   gpt [--strategy single|dp|model-parallel|ddp|ddp-model-parallel|zero1|zero2|zero3|pipeline] [--devices all]
//       [--pp-schedule gpipe|1f1b|interleaved|zb] [--micro-batches 4] [--pp-size 0]
//       [--dp-reduce ddp|zero1|zero2|allreduce] (pipeline_strategy.h)
//       [--plan FILE | --dp-replicate N --dp-shard N --pp N --zero-stage K] [--global-batch-size G]
//       [--max-iters 2000] [--eval-interval 250] [--eval-iters 20] [--batch-size 12]
//       [--block-size 64] [--n-layer 4] [--n-head 4] [--n-embd 128] [--dropout 0]
//       [--lr 1e-3] [--min-lr 1e-4] [--warmup-iters 100] [--weight-decay 0.1]
//       [--grad-clip 1] [--accumulate 1] [--amp none|bf16] [--seed 1337]
//       [--checkpoint-dir D] [--data-dir ~/.cache/dtrain/shakespeare_char]
//
// Defaults are nanoGPT's CPU run of shakespeare_char (README: 4 layers, 4
// heads, width 128, context 64, batch 12, 2000 iterations, dropout 0). AdamW
// (betas 0.9/0.99, decay on matrices and embeddings only), linear warm-up then
// cosine decay to --min-lr, gradients clipped to norm --grad-clip.
// --batch-size is per rank and per micro-step: a step trains on
// batch x accumulate x world sequences (see corpus.h, Note [GPT batches]).
// Strategies as in examples/fashion_mnist: single; dp (each batch split over
// --devices); model-parallel (the blocks placed over --devices); ddp and
// ddp-model-parallel (one process per rank under `dtrain run`/torchrun);
// zero1-3: ZeRO stages 1-3 (ShardedDataParallel, one process per rank).
//
// Progress goes to stderr; stdout gets a JSON line per evaluation, the sample,
// and last {"event":"done","val_loss":...,"tokens_per_second":...,...} with
// the mean step-time breakdown (forward, backward, optimizer; under DDP also
// the backward's exposed communication).
#include <ATen/ATen.h>
#include <torch/utils.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>

#include "corpus.h"
#include "dtrain/dtrain.h"
#include "fused_adamw.h"
#include "model.h"
#include "pipeline_strategy.h"
#include "plan_cli.h"
#include "sample.h"
#include "zero_strategy.h"

namespace {

struct Options {
  std::string strategy = "single";
  std::string devices = "all";
  std::int64_t max_iters = 2000;
  std::int64_t eval_interval = 250;
  std::int64_t eval_iters = 20;
  std::int64_t batch_size = 12;
  int accumulate = 1;
  gpt::GptConfig model{.block_size = 64, .n_layer = 4, .n_head = 4, .n_embd = 128, .dropout = 0.0};
  double lr = 1e-3;
  double min_lr = 1e-4;
  std::int64_t warmup_iters = 100;
  std::int64_t lr_decay_iters = 0;  // 0: max_iters
  double weight_decay = 0.1;
  double beta2 = 0.99;
  double grad_clip = 1.0;
  std::string amp = "none";
  std::string optimizer = "fused";  // fused | torch (torch::optim::AdamW)
  std::uint64_t seed = 1337;
  std::string data_dir = gpt::default_data_dir();
  std::string checkpoint_dir;
  std::int64_t sample_tokens = 500;
  double temperature = 0.8;
  std::int64_t top_k = 200;
  bool ddp_shared_memory = true;   // DDP's intra-host shared-memory all-reduce (else Gloo)
  std::string save_params;         // write the final parameters here (raw float32, in order) for tests
  examples::PipelineCli pipeline;  // --strategy pipeline (pipeline_strategy.h)
  examples::PlanCli plan;          // --plan or the degrees; --global-batch-size
  int hsdp_replicas = 1;           // zero1-3 on a dp_replicate x dp_shard mesh (from a plan)
};

// nanoGPT's get_lr: linear warm-up, cosine decay to min_lr, then min_lr.
double learning_rate(const Options& o, std::int64_t it) {
  const std::int64_t decay_iters = o.lr_decay_iters > 0 ? o.lr_decay_iters : o.max_iters;
  if (it < o.warmup_iters) return o.lr * static_cast<double>(it + 1) / static_cast<double>(o.warmup_iters + 1);
  if (it > decay_iters) return o.min_lr;
  const double ratio = static_cast<double>(it - o.warmup_iters) / static_cast<double>(decay_iters - o.warmup_iters);
  return o.min_lr + 0.5 * (1.0 + std::cos(M_PI * ratio)) * (o.lr - o.min_lr);
}

bool distributed(const std::string& s) {
  return s == "ddp" || s == "ddp-model-parallel" || gpt::is_zero_strategy(s);
}

// Where this process trains and which ranks it trains with.
struct Placement {
  std::vector<c10::Device> devices;
  int rank = 0;
  int world = 1;
  std::optional<dtrain::dist::ProcessGroup> group;
};

Placement place(const Options& opt) {
  if (!distributed(opt.strategy)) {
    auto devices = dtrain::parse_devices(opt.devices);
    if (opt.strategy == "single") devices.erase(devices.begin() + 1, devices.end());
    return {.devices = devices};
  }
  DTRAIN_CHECK(dtrain::dist::launched_by_launcher(), ConfigError,
               "--strategy " << opt.strategy << " runs one process per rank, but RANK and WORLD_SIZE are not set.",
               "start it through a launcher: dtrain run --nproc-per-node 2 gpt --strategy " << opt.strategy);
  const auto env = dtrain::dist::read_env_contract();
  std::vector<c10::Device> devices;
  if (opt.strategy == "ddp" || gpt::is_zero_strategy(opt.strategy)) {
    devices = {dtrain::device_for_local_rank(opt.devices, env.local_rank, env.local_world_size)};
  } else {
    devices = dtrain::parse_devices(opt.devices);
    if (devices.front().is_cuda()) {  // a node's GPUs are shared out among its ranks
      const auto per_rank = devices.size() / static_cast<std::size_t>(env.local_world_size);
      DTRAIN_CHECK(per_rank >= 1, DeviceError,
                   env.local_world_size << " ranks cannot share the " << devices.size() << " devices of --devices "
                                        << opt.devices << ".",
                   "list at least one device per rank");
      const auto first = devices.begin() + static_cast<std::ptrdiff_t>(per_rank) * env.local_rank;
      devices = std::vector<c10::Device>(first, first + static_cast<std::ptrdiff_t>(per_rank));
    }
  }
  auto group = dtrain::dist::init_process_group(
      env, {.device = devices.front(), .intra_host_shared_memory = opt.ddp_shared_memory});
  return {.devices = devices, .rank = env.rank, .world = env.world_size, .group = std::move(group)};
}

// What the loop drives: the module (parameters, mode, checkpoints), the
// strategy's forward, and the strategy's way to skip gradient sync.
struct Trainee {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;  // training forward (through DDP/DP)
  std::function<at::Tensor(const at::Tensor&)> plain;    // evaluation (no DDP)
  // Whether `plain` is collective (ZeRO gathers parameters in forward): then
  // every rank runs the same number of evaluation forwards.
  bool collective_forward = false;
  // Sampling on rank 0 alone, after full_parameters() where that is set:
  // a forward that needs no other rank (empty: `plain`).
  std::function<at::Tensor(const at::Tensor&)> local;
  // Runs a micro-step's forward and backward without gradient sync (DDP's
  // no_sync); empty where there is nothing to skip.
  std::function<void(const std::function<void()>&)> without_sync;
  c10::Device input_device{c10::kCPU};
  // Sharded strategies (ZeRO): what the optimizer steps on (empty: the
  // module's parameters), which of those decay, global-norm clipping, and a
  // collective that makes the module's parameters full (before saving them).
  std::vector<at::Tensor> params;
  std::function<bool(const at::Tensor&)> decays;
  std::function<void(double)> clip;
  std::function<void()> full_parameters;
  // Sharded strategies' own checkpoints (each rank writes its shard): save at
  // a step; load the newest, returning its step.
  std::function<void(torch::optim::Optimizer&, std::int64_t)> save_checkpoint;
  std::function<std::optional<std::int64_t>(torch::optim::Optimizer&)> load_checkpoint;
};

// --amp bf16: autocast to bf16 on the device type the batch goes to (CPU or
// CUDA) for the forward and the loss; DataParallel's replica threads inherit it.
std::optional<dtrain::amp::Autocast> bf16_autocast(const Options& opt, c10::Device device) {
  if (opt.amp != "bf16") return std::nullopt;
  return std::optional<dtrain::amp::Autocast>(std::in_place, device.type(),
                                              dtrain::amp::AutocastOptions{.dtype = at::kBFloat16});
}

// Mean val loss over the fixed val batches (of batch x world sequences, so
// every strategy of one global batch evaluates the same); under DDP the ranks
// share them.
double evaluate(const Options& opt, const gpt::Corpus& corpus, Placement& where, Trainee& model) {
  torch::NoGradGuard no_grad;
  model.module->eval();
  double sum = 0;
  // A collective forward runs as often on every rank: a rank past the last
  // batch evaluates one again and leaves it out of the sum.
  const std::int64_t rounds = (opt.eval_iters + where.world - 1) / where.world;
  for (std::int64_t round = 0; round < rounds; ++round) {
    const std::int64_t k = round * where.world + where.rank;
    if (k >= opt.eval_iters && !model.collective_forward) break;
    const auto offsets = gpt::draw_windows(corpus.val->size(), opt.batch_size * where.world,
                                           gpt::val_batch_seed(opt.seed, std::min(k, opt.eval_iters - 1)));
    const auto batch = gpt::make_batch(*corpus.val, offsets);
    const auto autocast = bf16_autocast(opt, model.input_device);
    const double loss = gpt::lm_loss(model.plain(batch.data.to(model.input_device)), batch.target).item<double>();
    if (k < opt.eval_iters) sum += loss;
  }
  model.module->train();
  if (where.group) {
    at::Tensor total = at::full({1}, sum, at::kDouble);
    where.group->all_reduce(total).wait();
    sum = total.item<double>();
  }
  return sum / static_cast<double>(opt.eval_iters);
}

gpt::SampleOptions sample_options(const Options& opt) {
  return {.tokens = opt.sample_tokens,
          .block_size = opt.model.block_size,
          .temperature = opt.temperature,
          .top_k = opt.top_k,
          .seed = opt.seed};
}

// Mean milliseconds per step of each phase, from step `skip` on.
struct Breakdown {
  double forward = 0, backward = 0, optimizer = 0;
  std::int64_t steps = 0;
};

// AdamW with weight decay on matrices and embeddings only (nanoGPT's two groups).
std::unique_ptr<torch::optim::AdamW> make_optimizer(const Options& opt, const std::vector<at::Tensor>& params,
                                                    const std::function<bool(const at::Tensor&)>& decays) {
  std::vector<at::Tensor> decay, no_decay;
  for (const auto& p : params) ((decays ? decays(p) : p.dim() >= 2) ? decay : no_decay).push_back(p);
  const auto adamw = torch::optim::AdamWOptions(opt.lr).betas({0.9, opt.beta2}).eps(1e-8);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(adamw).weight_decay(opt.weight_decay)));
  groups.emplace_back(
      no_decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(adamw).weight_decay(0.0)));
  if (opt.optimizer == "fused") return std::make_unique<gpt::FusedAdamW>(groups, adamw);
  return std::make_unique<torch::optim::AdamW>(groups, adamw);
}

// One optimizer step: --accumulate micro-steps of this rank's share of the
// step's global batch, then clipping and AdamW. Times in milliseconds.
struct StepResult {
  double loss = 0, forward_ms = 0, backward_ms = 0, optimizer_ms = 0;
};

StepResult train_step(const Options& opt, const Placement& where, Trainee& model, const gpt::Corpus& corpus,
                      torch::optim::AdamW& optimizer, std::int64_t step) {
  using Clock = std::chrono::steady_clock;
  auto ms_since = [](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  };
  const std::int64_t per_micro = opt.batch_size * where.world;
  const auto offsets =
      gpt::draw_windows(corpus.train->size(), per_micro * opt.accumulate, gpt::train_batch_seed(opt.seed, step));
  StepResult r;
  for (int micro = 0; micro < opt.accumulate; ++micro) {
    const std::int64_t first = micro * per_micro + where.rank * opt.batch_size;
    const auto batch = gpt::make_batch(*corpus.train, offsets.slice(0, first, first + opt.batch_size));
    auto forward_backward = [&] {
      auto t = Clock::now();
      at::Tensor loss;
      {
        const auto autocast = bf16_autocast(opt, model.input_device);
        loss = gpt::lm_loss(model.forward(batch.data.to(model.input_device)), batch.target) / opt.accumulate;
      }
      r.forward_ms += ms_since(t);
      t = Clock::now();
      loss.backward();
      r.backward_ms += ms_since(t);
      r.loss += loss.item<double>();
    };
    // Gradients are synchronised on the last micro-step only.
    if (micro + 1 < opt.accumulate && model.without_sync) {
      model.without_sync(forward_backward);
    } else {
      forward_backward();
    }
  }
  const auto t = Clock::now();
  if (opt.grad_clip > 0 && model.clip) {
    model.clip(opt.grad_clip);
  } else if (opt.grad_clip > 0) {
    gpt::clip_grad_norm(model.module->parameters(), opt.grad_clip);
  }
  optimizer.step();
  optimizer.zero_grad();
  r.optimizer_ms = ms_since(t);
  return r;
}

// Raw float32 parameters in order (tests compare strategies with it).
void write_params(const std::string& path, torch::nn::Module& module) {
  std::ofstream out(path, std::ios::binary);
  for (const auto& p : module.parameters()) {
    const at::Tensor t = p.detach().to(at::kCPU, at::kFloat).contiguous();
    out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  }
}

int train(const Options& opt, Placement& where, Trainee& model, const gpt::Corpus& corpus) {
  const bool lead = where.rank == 0;
  const auto params = model.params.empty() ? model.module->parameters() : model.params;
  auto optimizer = make_optimizer(opt, params, model.decays);

  std::optional<dtrain::Checkpointer> checkpoints;
  dtrain::TrainingState state;
  if (!opt.checkpoint_dir.empty() && model.load_checkpoint) {
    if (auto step = model.load_checkpoint(*optimizer)) {
      state.step = *step;
      DTRAIN_LOG(kInfo) << "resumed at step " << state.step;
    }
  } else if (!opt.checkpoint_dir.empty()) {
    checkpoints.emplace(dtrain::CheckpointOptions{.dir = opt.checkpoint_dir}, where.group);
    if (auto resumed = checkpoints->load_latest(*model.module, *optimizer)) {
      state = *resumed;
      DTRAIN_LOG(kInfo) << "resumed at step " << state.step;
    }
  }
  const std::int64_t global = opt.batch_size * where.world * opt.accumulate;  // sequences per step
  DTRAIN_LOG(kInfo) << opt.strategy << " training on " << dtrain::format_devices(where.devices) << ": "
                    << std::accumulate(params.begin(), params.end(), std::int64_t{0},
                                       [](std::int64_t n, const at::Tensor& p) { return n + p.numel(); })
                    << " parameters, " << global << " sequences of " << opt.model.block_size << " per step, "
                    << opt.max_iters << " steps";

  dtrain::Progress progress(opt.max_iters, {.label = "train", .enabled = lead});
  Breakdown times;
  const std::int64_t skip = std::min<std::int64_t>(10, opt.max_iters / 10);  // warm-up steps left out of the breakdown
  double train_seconds = 0, loss_sum = 0, val_loss = NAN;
  std::int64_t loss_count = 0, steps_trained = 0;
  auto report_eval = [&](std::int64_t step) {
    val_loss = evaluate(opt, corpus, where, model);
    if (!lead) return;
    const double train_loss = loss_count > 0 ? loss_sum / static_cast<double>(loss_count) : NAN;
    std::cout
        << nlohmann::json{{"event", "eval"}, {"step", step}, {"train_loss", train_loss}, {"val_loss", val_loss}}.dump()
        << std::endl;
    loss_sum = 0;
    loss_count = 0;
  };
  for (std::int64_t step = state.step; step < opt.max_iters; ++step) {
    if (step % opt.eval_interval == 0) report_eval(step);
    const auto start = std::chrono::steady_clock::now();
    const double lr = learning_rate(opt, step);
    for (auto& group : optimizer->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    const StepResult r = train_step(opt, where, model, corpus, *optimizer, step);
    train_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (step >= skip) {
      times.forward += r.forward_ms;
      times.backward += r.backward_ms;
      times.optimizer += r.optimizer_ms;
      ++times.steps;
    }
    ++steps_trained;
    loss_sum += r.loss;
    ++loss_count;
    state.step = step + 1;
    char status[64];
    std::snprintf(status, sizeof status, "loss %.4f lr %.2e", r.loss, lr);
    progress.update(step + 1, status);
    if (checkpoints && state.step % opt.eval_interval == 0) checkpoints->save(state, *model.module, *optimizer);
    if (model.save_checkpoint && !opt.checkpoint_dir.empty() && state.step % opt.eval_interval == 0) {
      model.save_checkpoint(*optimizer, state.step);
    }
  }
  progress.finish();
  report_eval(opt.max_iters);
  if (checkpoints && opt.max_iters % opt.eval_interval != 0) checkpoints->save(state, *model.module, *optimizer);
  if (model.save_checkpoint && !opt.checkpoint_dir.empty() && opt.max_iters % opt.eval_interval != 0) {
    model.save_checkpoint(*optimizer, state.step);
  }
  // Collective where set: every rank takes part, then rank 0 reads and
  // samples alone through `local`.
  const bool sampling = opt.sample_tokens > 0;
  if ((!opt.save_params.empty() || sampling) && model.full_parameters) model.full_parameters();
  if (!opt.save_params.empty() && lead) write_params(opt.save_params, *model.module);
  std::string sample;
  if (lead && sampling) {
    model.module->eval();
    sample = gpt::generate(sample_options(opt), corpus, model.local ? model.local : model.plain, model.input_device);
    model.module->train();
  }
  if (where.group) where.group->barrier();
  if (!lead) return 0;
  if (!sample.empty()) gpt::print_sample(std::cout, sample_options(opt), sample);
  const double n = times.steps > 0 ? static_cast<double>(times.steps) : 1.0;
  std::cout << nlohmann::json{{"event", "done"},
                              {"strategy", opt.strategy},
                              {"world_size", where.world},
                              {"steps", state.step},
                              {"val_loss", val_loss},
                              {"val_unigram_entropy", corpus.val_unigram_entropy},
                              {"val_bigram_entropy", corpus.val_bigram_entropy},
                              {"tokens_per_second",
                               static_cast<double>(global * opt.model.block_size * steps_trained) / train_seconds},
                              {"train_seconds", train_seconds},
                              {"step_ms",
                               {{"forward", times.forward / n},
                                {"backward", times.backward / n},
                                {"optimizer", times.optimizer / n}}}}
                   .dump()
            << std::endl;
  return 0;
}

// Trains `module` as it is, or through DDP when this process is a rank.
template <typename Holder>
int train_plain_or_ddp(const Options& opt, Placement& where, Trainee& model, Holder& module,
                       const gpt::Corpus& corpus) {
  model.plain = [&](const at::Tensor& x) { return module(x); };
  if (!where.group) {
    model.forward = model.plain;
    return train(opt, where, model, corpus);
  }
  dtrain::DistributedDataParallel ddp(module, *where.group);
  model.forward = [&](const at::Tensor& x) { return ddp(x); };
  model.without_sync = [&](const std::function<void()>& body) {
    auto guard = ddp.no_sync();
    body();
  };
  return train(opt, where, model, corpus);
}

// The world's size as the launcher gave it (1 when not launched).
int launched_world() {
  return dtrain::dist::launched_by_launcher() ? dtrain::dist::read_env_contract().world_size : 1;
}

// A plan given by --plan or the degree flags picks the strategy that runs
// it (--strategy names are shorthands for plans: ddp is dp_replicate = world,
// zeroK dp_shard = world at stage K, pipeline pp = --pp-size). A global batch
// sets the per-rank (per-replica under a pipeline) batch.
void apply_plan(Options& opt) {
  const int world = launched_world();
  int data_parallel = distributed(opt.strategy) ? world : 1;
  if (opt.strategy == "pipeline") data_parallel = world / (opt.pipeline.pp_size > 0 ? opt.pipeline.pp_size : world);
  if (opt.plan.given()) {
    const dtrain::ParallelPlan plan = opt.plan.resolve(world, opt.pipeline,
                                                       {.layers = opt.model.n_layer + 2,
                                                        .heads = opt.model.n_head,
                                                        .width = opt.model.n_embd,
                                                        .seq = opt.model.block_size},
                                                       opt.accumulate);
    if (plan.pp > 1) {
      opt.strategy = "pipeline";
      opt.pipeline.pp_size = plan.pp;
      opt.pipeline.schedule = plan.pipeline.schedule;
      opt.pipeline.micro_batches = plan.pipeline.micro_batches;
      opt.pipeline.dp_reduce = plan.dp_shard > 1 ? "zero" + std::to_string(plan.zero_stage) : "ddp";
    } else if (plan.dp_shard > 1) {
      opt.strategy = "zero" + std::to_string(plan.zero_stage);
      opt.hsdp_replicas = plan.dp_replicate;
    } else {
      opt.strategy = plan.dp_replicate > 1 ? "ddp" : "single";
    }
    data_parallel = plan.data_parallel();
    if (dtrain::dist::launched_by_launcher() && dtrain::dist::read_env_contract().rank == 0) {
      DTRAIN_LOG(kInfo) << "parallelism plan (--strategy " << opt.strategy << "):\n" << plan.table();
    }
  }
  if (opt.plan.global_batch > 0) {
    const std::int64_t per = static_cast<std::int64_t>(data_parallel) * opt.accumulate;
    DTRAIN_CHECK(opt.plan.global_batch % per == 0, ConfigError,
                 "--global-batch-size " << opt.plan.global_batch << " does not split over " << data_parallel
                                        << " data-parallel ranks x --accumulate " << opt.accumulate << ".",
                 "choose a multiple of " << per);
    opt.batch_size = opt.plan.global_batch / per;
  }
}

int run(Options opt) {
  apply_plan(opt);
  if (opt.strategy == "pipeline") {
    const gpt::Corpus corpus = gpt::load_corpus(opt.data_dir, opt.model.block_size);
    opt.model.vocab_size = static_cast<std::int64_t>(corpus.vocab.size());
    return gpt::train_pipeline(
        {.model = opt.model,
         .pipeline = opt.pipeline,
         .batch_size = opt.batch_size,
         .max_iters = opt.max_iters,
         .eval_interval = opt.eval_interval,
         .eval_iters = opt.eval_iters,
         .seed = opt.seed,
         .grad_clip = opt.grad_clip,
         .save_params = opt.save_params,
         .checkpoint_dir = opt.checkpoint_dir,
         .sample = sample_options(opt),
         .learning_rate = [&](std::int64_t it) { return learning_rate(opt, it); },
         .make_optimizer = [&](const auto& params, const auto& decays) { return make_optimizer(opt, params, decays); }},
        corpus);
  }
  Placement where = place(opt);
  at::set_num_threads(distributed(opt.strategy) ? 1 : at::get_num_threads());
  torch::manual_seed(opt.seed + static_cast<std::uint64_t>(where.rank));  // dropout masks
  const gpt::Corpus corpus = gpt::load_corpus(opt.data_dir, opt.model.block_size);
  opt.model.vocab_size = static_cast<std::int64_t>(corpus.vocab.size());
  const c10::Device first = where.devices.front();
  if (opt.strategy == "model-parallel" || opt.strategy == "ddp-model-parallel") {
    dtrain::ModelParallel split(gpt::gpt_layers(opt.model), dtrain::ModelParallelOptions{.devices = where.devices});
    gpt::init_weights(*split, opt.model.n_layer, opt.seed);
    if (where.rank == 0) {
      DTRAIN_LOG(kInfo) << "layers placed on " << dtrain::format_devices(split->device_of_layer());
    }
    Trainee model{.module = split.ptr(), .input_device = first};
    return train_plain_or_ddp(opt, where, model, split, corpus);
  }
  gpt::Gpt net(opt.model);
  gpt::init_weights(*net, opt.model.n_layer, opt.seed);
  net->to(first);
  Trainee model{.module = net.ptr(), .input_device = first};
  if (opt.strategy == "dp") {
    dtrain::DataParallel dp(net, {.devices = where.devices});
    model.forward = [&](const at::Tensor& x) { return dp(x); };
    model.plain = [&](const at::Tensor& x) { return net(x); };
    return train(opt, where, model, corpus);
  }
  if (gpt::is_zero_strategy(opt.strategy)) {
    // HSDP: ZeRO over dp_shard, replicas of it over dp_replicate (ranks
    // row-major, so a rank's data-parallel index is its world rank).
    std::optional<dtrain::dist::DeviceMesh> mesh;
    dtrain::ZeroOptions zero = gpt::zero_options(opt.strategy);
    dtrain::dist::ProcessGroup shard_group = *where.group;
    if (opt.hsdp_replicas > 1) {
      mesh.emplace(*where.group, std::vector<dtrain::dist::MeshDim>{{"dp_replicate", opt.hsdp_replicas},
                                                                    {"dp_shard", where.world / opt.hsdp_replicas}});
      shard_group = (*mesh)["dp_shard"];
      zero.replicate_group = (*mesh)["dp_replicate"];
    }
    dtrain::ShardedDataParallel sdp(net, shard_group, zero);
    std::optional<dtrain::ShardedCheckpointer> sharded;  // resharding checkpoints: any world size resumes
    auto sharded_for = [&](torch::optim::Optimizer& o) -> dtrain::ShardedCheckpointer& {
      if (!sharded) sharded.emplace(dtrain::ShardedCheckpointOptions{.dir = opt.checkpoint_dir}, sdp, o);
      return *sharded;
    };
    model.save_checkpoint = [&](torch::optim::Optimizer& o, std::int64_t step) { sharded_for(o).save(step); };
    model.load_checkpoint = [&](torch::optim::Optimizer& o) -> std::optional<std::int64_t> {
      auto info = sharded_for(o).load_latest();
      return info ? std::optional<std::int64_t>(info->step) : std::nullopt;
    };
    std::optional<dtrain::ShardedDataParallel::FullParameters> full;
    model.forward = [&](const at::Tensor& x) { return sdp(x); };
    model.plain = model.forward;  // evaluation runs without grad: stage 3 gathers unit by unit
    model.collective_forward = true;
    model.local = [&](const at::Tensor& x) { return net(x); };  // after full_parameters()
    model.without_sync = [&](const std::function<void()>& body) {
      auto guard = sdp.no_sync();
      body();
    };
    model.params = sdp.parameters();
    model.decays = gpt::zero_decays(sdp);
    model.clip = [&](double max_norm) { dtrain::clip_grad_norm_(sdp.gradients(), max_norm); };
    model.full_parameters = [&] { full.emplace(sdp); };
    return train(opt, where, model, corpus);
  }
  return train_plain_or_ddp(opt, where, model, net, corpus);
}

}  // namespace

int main(int argc, char** argv) {
  dtrain::retain_freed_host_memory();  // no page faults per step after an evaluation (host_memory.h)
  CLI::App app{"Train a character-level GPT on Shakespeare with dtrain (nanoGPT's shakespeare_char)."};
  Options opt;
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // scripts add defaults, users override
  app.add_option("--strategy", opt.strategy, "Parallelism strategy")
      ->check(CLI::IsMember(
          {"single", "dp", "model-parallel", "ddp", "ddp-model-parallel", "zero1", "zero2", "zero3", "pipeline"}))
      ->capture_default_str();
  opt.pipeline.add_to(app);
  opt.plan.add_to(app);
  app.add_option("--devices", opt.devices, "Devices (cpu, cuda, cuda:N, all; cpu,cpu for two CPU replicas or stages)")
      ->capture_default_str();
  app.add_option("--max-iters", opt.max_iters, "Optimizer steps")
      ->check(CLI::Range(1, 10000000))
      ->capture_default_str();
  app.add_option("--eval-interval", opt.eval_interval, "Steps between val-loss evaluations (and checkpoints)")
      ->check(CLI::Range(1, 10000000))
      ->capture_default_str();
  app.add_option("--eval-iters", opt.eval_iters, "Val batches per evaluation")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--batch-size", opt.batch_size, "Sequences per rank and micro-step")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--accumulate", opt.accumulate, "Micro-steps per optimizer step (gradient accumulation)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--block-size", opt.model.block_size, "Context length")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--n-layer", opt.model.n_layer, "Transformer blocks")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--n-head", opt.model.n_head, "Attention heads")->check(CLI::Range(1, 1024))->capture_default_str();
  app.add_option("--n-embd", opt.model.n_embd, "Width")->check(CLI::Range(1, 65536))->capture_default_str();
  app.add_option("--dropout", opt.model.dropout, "Dropout")->check(CLI::Range(0.0, 0.99))->capture_default_str();
  app.add_flag("--bias", opt.model.bias, "Biases in Linear and LayerNorm layers");
  app.add_option("--lr", opt.lr, "Peak learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--min-lr", opt.min_lr, "Learning rate at the end of the cosine decay")->capture_default_str();
  app.add_option("--warmup-iters", opt.warmup_iters, "Linear warm-up steps")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--lr-decay-iters", opt.lr_decay_iters, "Steps of cosine decay (0: --max-iters)")
      ->capture_default_str();
  app.add_option("--weight-decay", opt.weight_decay, "AdamW weight decay (matrices and embeddings)")
      ->capture_default_str();
  app.add_option("--beta2", opt.beta2, "AdamW beta2")->capture_default_str();
  app.add_option("--grad-clip", opt.grad_clip, "Clip gradients to this global norm (0: off)")->capture_default_str();
  app.add_option("--optimizer", opt.optimizer, "AdamW implementation: fused (one ATen kernel per group) or torch")
      ->check(CLI::IsMember({"fused", "torch"}))
      ->capture_default_str();
  app.add_option("--amp", opt.amp, "Mixed precision: none, or bf16 (autocast on the model's device)")
      ->check(CLI::IsMember({"none", "bf16"}))
      ->capture_default_str();
  app.add_option("--seed", opt.seed, "Seed of the weights, the batch order and the sample")->capture_default_str();
  app.add_option("--data-dir", opt.data_dir, "Folder with train.bin, val.bin, meta.json (scripts/setup.sh builds it)")
      ->capture_default_str();
  app.add_option("--checkpoint-dir", opt.checkpoint_dir,
                 "Save checkpoints here every --eval-interval and resume from the newest");
  app.add_option("--sample-tokens", opt.sample_tokens, "Characters to generate at the end (0: none)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--temperature", opt.temperature, "Sampling temperature")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--top-k", opt.top_k, "Sample among the k likeliest characters (0: all)")->capture_default_str();
  app.add_flag("--ddp-shared-memory,!--ddp-gloo", opt.ddp_shared_memory,
               "DDP all-reduce between this host's ranks: shared memory (default) or Gloo");
  app.add_option("--save-params", opt.save_params, "Write the final parameters (raw float32, in order) to this file");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  // Uncaught errors and fatal signals reach the launcher's error file.
  return dtrain::elastic::run_recording_errors(
      [&] {
        DTRAIN_CHECK(opt.model.n_embd % opt.model.n_head == 0, ConfigError,
                     "--n-embd " << opt.model.n_embd << " is not a multiple of --n-head " << opt.model.n_head << ".",
                     "pick a width divisible by the head count");
        return run(opt);
      },
      "gpt");
}
