// Trains a character-level GPT (nanoGPT's shakespeare_char) on the complete
// works of Shakespeare and prints a generated sample and the val loss.
//
//   gpt [--strategy auto|single|dp|model-parallel|ddp|ddp-model-parallel|zero1|zero2|zero3|pipeline] [--devices all]
//       [--pp-schedule gpipe|1f1b|interleaved|zb] [--micro-batches 4] [--pp-size 0]
//       [--dp-reduce ddp|zero1|zero2|zero3|allreduce] (pipeline_cli.h)
//       [--plan FILE | --dp-replicate N --dp-shard N --pp N --tp N [--sequence-parallel] --cp N --zero-stage K]
//       [--cp-exchange ring|allgather]
//       [--global-batch-size G]
//       [--max-iters 2000] [--eval-interval 250] [--eval-iters 20] [--batch-size 12]
//       [--block-size 64] [--n-layer 4] [--n-head 4] [--n-embd 128] [--dropout 0]
//       [--lr 1e-3] [--min-lr 1e-4] [--warmup-iters 100] [--weight-decay 0.1]
//       [--grad-clip 1] [--accumulate 1] [--amp none|bf16] [--seed 1337]
//       [--checkpoint-dir D] [--data-dir ~/.cache/dtrain/shakespeare_char]
//       [--sample-log FILE] [--ft-replay FILE]
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
// zero1-3: ZeRO stages 1-3 (ShardedDataParallel, one process per rank;
// blocks are the units, the embedding and the head that reads its weight
// stay in the root unit); pipeline (the layers cut into stages,
// pipeline_stages.h, --pp-size pipelines replicated over the rest of the
// world, their stages averaged by --dp-reduce; --save-params writes each
// stage's parameters of the first replica to FILE.stage<s>); tp (a plan with
// --tp: the blocks split the Megatron way, tensor_parallel.h, DDP over
// dp_replicate); cp (a plan with --cp: every sequence split over the cp
// ranks, zig-zag, attention by a K/V ring, context_parallel.h; DDP over
// dp_replicate x cp). --strategy names are shorthands for plans
// (examples::plan_to_run), and a plan (--plan or the degree flags) runs as it is.
//
// dtrain::parallelize turns the plan into the Trainer's strategy, given the
// GPT's parts (gpt_parts: its layers, its ZeRO units, pipeline cut and tie,
// tensor- and context-parallel splits and losses); dtrain::Trainer trains
// it. This file holds the model's parts, its data (a StepStream of random
// windows, a function of the global step only, and fixed val batches), the
// schedule, and its flags; the loop, clipping, evaluation, checkpoints and
// the progress bar are the Trainer's, the full weights for the sample and
// exports parallelize's (Parallelized::full_weights).
//
// Started by `dtrain run --ft-replicas N`, it trains as one fault-tolerant
// replica group (docs/fault_tolerance.md): the Trainer's
// TrainerOptions::fault_tolerance, the plan inside the group (e.g. --strategy
// zero2 over the group's ranks), each group's rank 0 printing and writing
// --save-params FILE.replica<g>. --ft-replay FILE replays such a job's
// recorded membership ({"replicas": G, "members": [[0, 1, ...], ...]}, one
// list per step) as its reference run (TrainerFtReplay). --sample-log FILE:
// the Trainer's record of what each step trained on (per data rank; under
// fault tolerance with the step's replica groups).
//
// Progress goes to stderr; stdout gets a JSON line per evaluation, the sample,
// and last {"event":"done","val_loss":...,"tokens_per_second":...,...} with
// the mean step-time breakdown (forward, backward, optimizer; a pipeline's
// fused forward and backward count as forward).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/utils.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>

#include "context_parallel.h"
#include "corpus.h"
#include "dtrain/dtrain.h"
#include "dtrain/nn/attention.h"
#include "dtrain/trainer/parallelize.h"
#include "fused_adamw.h"
#include "hf_export.h"
#include "model.h"
#include "pipeline_stages.h"
#include "plan_cli.h"
#include "run_stats.h"
#include "sample.h"
#include "tensor_parallel.h"
#include "zero_strategy.h"

namespace {

struct Options {
  std::string strategy = "auto";  // plan_cli.h, strategy_for
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
  std::string sample_log;   // TrainerOptions::sample_log
  std::string ft_replay;    // a fault-tolerant job's membership to replay (TrainerFtReplay)
  int ft_max_retries = -1;  // TrainerFaultTolerance::max_retries (-1: no limit)
  std::int64_t sample_tokens = 500;
  double temperature = 0.8;
  std::int64_t top_k = 200;
  bool ddp_shared_memory = true;                 // DDP's intra-host shared-memory all-reduce (else Gloo)
  std::string save_params;                       // write the final parameters here (raw float32, in order) for tests
  std::string export_hf;                         // write a Hugging Face GPT-2 folder here after training (hf_export.h)
  std::string init_from_hf;                      // start from this Hugging Face GPT-2 folder's weights and sizes
  examples::PipelineCli pipeline;                // --strategy pipeline (pipeline_strategy.h)
  examples::PlanCli plan;                        // --plan or the degrees; --global-batch-size
  dtrain::ParallelPlan parallel;                 // what runs: the plan, or the one --strategy stands for (plan_cli.h)
  examples::Resolved resolved;                   // the strategy and pipeline flags it came from
  bool sequence_parallel = false;                // under tp (from a plan)
  std::string cp_exchange = "ring";              // ring | allgather (context_parallel.h)
  std::optional<dtrain::ParallelPlan> run_plan;  // what runs, for the memory pre-flight (plan_cli.h)
  std::optional<dtrain::MemoryCheck> memory_check;  // the Trainer's pre-flight (ranks with a plan)
};

// nanoGPT's get_lr: linear warm-up, cosine decay to min_lr, then min_lr.
class GptSchedule : public dtrain::ScheduledLR {
 public:
  GptSchedule(torch::optim::Optimizer& optimizer, const Options& o) : ScheduledLR(optimizer), o_(o) { apply_initial(); }

 protected:
  double lr_at(double /*base_lr*/, std::int64_t it) const override {
    const std::int64_t decay_iters = o_.lr_decay_iters > 0 ? o_.lr_decay_iters : o_.max_iters;
    if (it < o_.warmup_iters) return o_.lr * static_cast<double>(it + 1) / static_cast<double>(o_.warmup_iters + 1);
    if (it > decay_iters) return o_.min_lr;
    const double ratio = static_cast<double>(it - o_.warmup_iters) / static_cast<double>(decay_iters - o_.warmup_iters);
    return o_.min_lr + 0.5 * (1.0 + std::cos(M_PI * ratio)) * (o_.lr - o_.min_lr);
  }

 private:
  Options o_;
};

bool distributed(const std::string& s) {
  return s == "ddp" || s == "ddp-model-parallel" || s == "zero1" || s == "zero2" || s == "zero3" || s == "pipeline" ||
         s == "tp" || s == "cp";
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
  if (opt.strategy != "ddp-model-parallel") {
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

// Raw float32 parameters in order (tests compare strategies with it).
void write_params(const std::string& path, const torch::nn::Module& module) {
  std::ofstream out(path, std::ios::binary);
  for (const auto& p : module.parameters()) {
    const at::Tensor t = p.detach().to(at::kCPU, at::kFloat).contiguous();
    out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  }
}

// Under a pipeline, the first replica's stages each write FILE.stage<s>
// (their concatenation in stage order is single's file).
void write_stage_params(dtrain::pipeline::Pipeline& pipe, dtrain::dist::DeviceMesh& mesh, const std::string& file) {
  if (mesh.join({"dp_replicate", "dp_shard"}).rank() != 0) return;
  const auto stages = pipe.schedule().stages_of_rank(pipe.group().rank());
  for (std::size_t k = 0; k < stages.size(); ++k)
    write_params(file + ".stage" + std::to_string(stages[k]), *pipe.stages()[k].module);
}

// The GPT for dtrain::parallelize: its layers (initialised from --seed or
// --init-from-hf), held as Gpt holds them ("layers"), and its own parts: the
// embedding and head in ZeRO's root unit (the head reads the embedding's
// weight), the pipeline cut with that tie (pipeline_stages.h), the Megatron
// split (tensor_parallel.h) and the zig-zag split (context_parallel.h) with
// their losses.
dtrain::ModelParts gpt_parts(const Options& opt) {
  dtrain::ModelParts parts{.name = "layers", .loss = gpt::lm_loss};
  parts.layers = [&opt] {
    torch::nn::Sequential layers = gpt::gpt_layers(opt.model);
    gpt::init_weights(*layers, opt.model.n_layer, opt.seed);
    if (!opt.init_from_hf.empty()) gpt::load_hf(*layers, opt.model, opt.init_from_hf);
    return layers;
  };
  parts.retie = [](torch::nn::Sequential& copy) {
    copy->ptr<gpt::HeadImpl>(copy->size() - 1)->embed = gpt::Embed(copy->ptr<gpt::EmbedImpl>(0));
  };
  parts.zero_unit = gpt::is_zero_unit;
  parts.pipeline_stages = [](const torch::nn::Sequential& layers, const dtrain::StageCut& cut) {
    return gpt::pipeline_stages(layers, cut.ranks, cut.stages_per_rank, cut.rank, cut.stage_of_layer);
  };
  const auto exchange =
      opt.cp_exchange == "allgather" ? dtrain::nn::cp::KvExchange::kAllGather : dtrain::nn::cp::KvExchange::kRing;
  parts.tp.split = [&opt, exchange](const torch::nn::Sequential& full, dtrain::dist::DeviceMesh& mesh) {
    // Dropout streams (Note [TP dropout]): the replicated one shared by the
    // tp group, seeded per data-parallel replica like the other strategies'
    // per-rank seeds; the tensor-parallel one per tp rank on top of it.
    const int replica = mesh.join({"dp_replicate", "dp_shard"}).rank();
    const std::uint64_t dropout_seed = opt.seed + 7919 * static_cast<std::uint64_t>(replica);
    auto rng =
        std::make_shared<dtrain::nn::RngTracker>(dtrain::nn::RngTracker::for_tp(dropout_seed, mesh.coordinate("tp")));
    gpt::TpOptions tp{.sequence_parallel = opt.sequence_parallel, .rng = rng, .exchange = exchange};
    if (mesh.size("cp") > 1) tp.cp = mesh["cp"];  // tp x cp: the split cuts every sequence too
    return gpt::apply_tp(full, mesh, tp);
  };
  parts.tp.loss = [vocab = opt.model.vocab_size](dtrain::dist::DeviceMesh& mesh) -> dtrain::ModelLossFn {
    return [tp = mesh["tp"], vocab](const at::Tensor& logits, const at::Tensor& target) {
      return gpt::tp_lm_loss(logits, target, tp, vocab);
    };
  };
  parts.cp.split = [&opt, exchange](const torch::nn::Sequential& full, dtrain::dist::DeviceMesh& mesh) {
    // Dropout (Note [CP dropout]): one generator per data-parallel replica,
    // seeded alike on its cp ranks (as tp's replicated stream), each keeping
    // its rows of the whole sequence's masks.
    const int replica = mesh.join({"dp_replicate", "dp_shard"}).rank();
    const std::uint64_t dropout_seed = opt.seed + 7919 * static_cast<std::uint64_t>(replica);
    return gpt::apply_cp(
        full, mesh["cp"],
        {.exchange = exchange, .dropout_generator = at::make_generator<at::CPUGeneratorImpl>(dropout_seed)});
  };
  parts.cp.targets = [](const at::Tensor& target, dtrain::dist::DeviceMesh& mesh) {
    return gpt::cp_targets(target, mesh["cp"]);
  };
  parts.cp.loss = [](dtrain::dist::DeviceMesh& mesh) -> dtrain::ModelLossFn {
    return [cp = mesh["cp"]](const at::Tensor& logits, const at::Tensor& target) {
      return gpt::cp_lm_loss(logits, target, cp);
    };
  };
  return parts;
}

// AdamW with weight decay on matrices and embeddings only (nanoGPT's two groups).
std::unique_ptr<torch::optim::AdamW> make_optimizer(const Options& opt, const std::vector<at::Tensor>& params,
                                                    const std::function<bool(const at::Tensor&)>& is_matrix) {
  std::vector<at::Tensor> decay, no_decay;
  for (const auto& p : params) (is_matrix(p) ? decay : no_decay).push_back(p);
  const auto adamw = torch::optim::AdamWOptions(opt.lr).betas({0.9, opt.beta2}).eps(1e-8);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(adamw).weight_decay(opt.weight_decay)));
  groups.emplace_back(
      no_decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(adamw).weight_decay(0.0)));
  if (opt.optimizer == "fused") return std::make_unique<gpt::FusedAdamW>(groups, adamw);
  return std::make_unique<torch::optim::AdamW>(groups, adamw);
}

gpt::SampleOptions sample_options(const Options& opt) {
  return {.tokens = opt.sample_tokens,
          .block_size = opt.model.block_size,
          .temperature = opt.temperature,
          .top_k = opt.top_k,
          .seed = opt.seed};
}

// The launcher's restart tests: DTRAIN_GPT_KILL_LAST_STAGE_AT=N makes the
// pipeline's last stage SIGKILL itself after step N of the first attempt.
std::function<void(std::int64_t)> kill_switch(const dtrain::Parallelized& run) {
  const char* at = std::getenv("DTRAIN_GPT_KILL_LAST_STAGE_AT");
  if (at == nullptr || !run.pipeline || dtrain::dist::read_env_contract().restart_count != 0) return nullptr;
  const auto& schedule = run.pipeline->schedule();
  if (schedule.rank_of_stage(schedule.stage_count() - 1) != run.mesh->coordinate("pp")) return nullptr;
  const std::int64_t n = std::atoll(at);
  return [n](std::int64_t step) {
    if (step == n) std::raise(SIGKILL);
  };
}

// Under `dtrain run --ft-replicas N`, one fault-tolerant replica group; with
// --ft-replay, the reference run of such a job's recorded membership.
std::optional<dtrain::TrainerFaultTolerance> fault_tolerance(const Options& opt) {
  if (!opt.ft_replay.empty()) {
    std::ifstream in(opt.ft_replay);
    DTRAIN_CHECK(in.good(), ConfigError, "cannot read --ft-replay " << opt.ft_replay << ".",
                 "give a JSON file {\"replicas\": G, \"members\": [[0, 1], ...]}");
    const auto j = nlohmann::json::parse(in);
    return dtrain::TrainerFaultTolerance{
        .replay = dtrain::TrainerFtReplay{.replicas = j.at("replicas").get<int>(),
                                          .members = j.at("members").get<std::vector<std::vector<int>>>()}};
  }
  if (dtrain::ft::launched_fault_tolerant()) {
    return dtrain::TrainerFaultTolerance{
        .max_retries = opt.ft_max_retries < 0 ? std::nullopt : std::optional<int>(opt.ft_max_retries)};
  }
  return std::nullopt;
}

int train(const Options& opt, Placement& where, const gpt::Corpus& corpus) {
  const dtrain::Parallelized run = dtrain::parallelize(gpt_parts(opt), opt.parallel, where.group,
                                                       examples::parallelize_options(opt.resolved, where.devices));
  dtrain::Strategy& s = *run.strategy;
  const bool lead = where.rank == 0;
  const auto params = s.parameters();
  auto optimizer = make_optimizer(opt, params, run.is_matrix);
  auto schedule = std::make_shared<GptSchedule>(*optimizer, opt);
  const std::int64_t data_world = s.data_world();
  const std::int64_t global = opt.batch_size * data_world * opt.accumulate;  // sequences per step
  DTRAIN_LOG(kInfo) << opt.strategy << " training on " << dtrain::format_devices(where.devices) << ": "
                    << std::accumulate(params.begin(), params.end(), std::int64_t{0},
                                       [](std::int64_t n, const at::Tensor& p) { return n + p.numel(); })
                    << " parameters, " << global << " sequences of " << opt.model.block_size << " per step, "
                    << opt.max_iters << " steps";

  // Step s's global batch: batch x data_world x accumulate windows drawn from
  // the step's seed; micro-batch m of data rank r is its slice [m][r].
  auto source = std::make_shared<dtrain::StepStream>([&](const dtrain::StepStream::Request& r) {
    const std::int64_t per_micro = r.batch_size * r.data_world;
    const auto offsets =
        gpt::draw_windows(corpus.train->size(), per_micro * r.accumulate, gpt::train_batch_seed(opt.seed, r.step));
    const std::int64_t first = r.micro * per_micro + r.data_rank * r.batch_size;
    auto b = gpt::make_batch(*corpus.train, offsets.slice(0, first, first + r.batch_size));
    return dtrain::data::TensorBatch{std::move(b.data), std::move(b.target)};
  });
  dtrain::Trainer trainer(
      run.strategy, *optimizer, source,
      {.max_steps = opt.max_iters,
       .batch_size = opt.batch_size,
       .accumulate = opt.accumulate,
       .amp_dtype = opt.amp == "bf16" ? std::optional<c10::ScalarType>(at::kBFloat16) : std::nullopt,
       .clip_norm = opt.grad_clip,
       .eval_every = opt.eval_interval,
       .eval_at_start = true,
       .checkpoint_dir = opt.checkpoint_dir,
       .checkpoint_every = opt.eval_interval,
       .progress = lead,
       .log_every = 1,
       .sample_log = opt.sample_log,
       .fault_tolerance = fault_tolerance(opt),
       .memory_check = opt.memory_check});
  trainer.set_loss(run.loss);
  trainer.set_schedule(schedule);
  // Checkpoints record how the GPT maps onto Hugging Face's GPT-2, so that
  // `dtrain ckpt convert --to hf` turns them into a folder transformers loads.
  trainer.add_checkpoint_state(dtrain::checkpoint::kHfMappingState,
                               dtrain::checkpoint::hf_mapping_state(gpt::hf_mapping(opt.model)));
  // Val batch k: batch x data_world windows from val_batch_seed(k), the same
  // under every plan of one global batch.
  trainer.set_eval_batches(opt.eval_iters, [&](std::int64_t k) {
    auto b = gpt::make_batch(*corpus.val, gpt::draw_windows(corpus.val->size(), opt.batch_size * data_world,
                                                            gpt::val_batch_seed(opt.seed, k)));
    return dtrain::data::TensorBatch{std::move(b.data), std::move(b.target)};
  });
  trainer.on_eval([&](const dtrain::EvalReport& r) {
    if (!lead) return;
    std::cout << nlohmann::json{{"event", "eval"},
                                {"step", r.step},
                                {"train_loss", r.step > 0 ? r.train_loss : NAN},
                                {"val_loss", r.eval.loss}}
                     .dump()
              << std::endl;
  });
  auto kill = kill_switch(run);
  gpt::RunStats stats;
  const bool measure = gpt::RunStats::requested();
  if (kill || measure)
    trainer.on_step([kill, measure, &stats](const dtrain::StepReport& r) {
      if (measure) stats.step();
      if (kill) kill(r.step);
    });
  const dtrain::TrainSummary summary = trainer.fit();

  // Collective where the weights are sharded, split or pipelined: every rank
  // takes part, then rank 0 reads the whole model alone.
  if (!opt.save_params.empty()) {
    auto full = run.full_weights();
    // Every replica group's rank 0 writes its own.
    const std::string file =
        dtrain::ft::launched_fault_tolerant()
            ? opt.save_params + ".replica" + std::to_string(dtrain::ft::lighthouse_from_env().replica_id)
            : opt.save_params;
    if (run.pipeline && run.mesh->size("tp") == 1) {  // tp stages hold parts: the assembled whole below
      write_stage_params(*run.pipeline, *run.mesh, file);
    } else if (lead) {
      write_params(file, *run.whole);
    }
  }
  if (!opt.export_hf.empty()) {
    auto full = run.full_weights();
    if (lead) {
      const auto start = std::chrono::steady_clock::now();
      gpt::export_hf(*run.whole, opt.model, opt.export_hf);
      DTRAIN_LOG(kInfo) << "exported a Hugging Face GPT-2 folder to " << opt.export_hf << " in "
                        << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() << " s";
    }
  }
  std::string sample;
  if (opt.sample_tokens > 0) {
    auto full = run.full_weights();
    if (lead) {
      s.module().eval();
      run.whole->eval();
      sample = gpt::generate(sample_options(opt), corpus, run.forward_whole, s.input_device());
      run.whole->train();
      s.module().train();
    }
  }
  if (measure) stats.print(where.rank);
  if (where.group) where.group->barrier();
  if (!lead) return 0;
  if (!sample.empty()) gpt::print_sample(std::cout, sample_options(opt), sample);
  const double steps = static_cast<double>(summary.examples) / static_cast<double>(global);
  const double n = steps > 0 ? steps : 1.0;
  nlohmann::json done{
      {"event", "done"},
      {"strategy", opt.strategy},
      {"world_size", where.world},
      {"steps", summary.steps},
      {"val_loss", summary.last_eval ? summary.last_eval->loss : NAN},
      {"val_unigram_entropy", corpus.val_unigram_entropy},
      {"val_bigram_entropy", corpus.val_bigram_entropy},
      {"tokens_per_second", summary.train_seconds > 0
                                ? static_cast<double>(summary.examples * opt.model.block_size) / summary.train_seconds
                                : 0.0},
      {"train_seconds", summary.train_seconds},
      {"linear_kernel", dtrain::nn::linear_kernel_name()},
      {"step_ms",
       {{"forward", summary.step_times.forward * 1e3 / n},
        {"backward", summary.step_times.backward * 1e3 / n},
        {"optimizer", summary.step_times.optimizer * 1e3 / n}}}};
  if (run.pipeline) {
    done["schedule"] = opt.pipeline.schedule;
    done["mesh"] = run.mesh->describe();
    done["dp_reduce"] = data_world > 1 ? opt.pipeline.dp_reduce : "none";
  }
  std::cout << done.dump() << std::endl;
  return 0;
}

// The world's size as the launcher gave it (1 when not launched).
int launched_world() {
  return dtrain::dist::launched_by_launcher() ? dtrain::dist::read_env_contract().world_size : 1;
}

// A plan given by --plan or the degree flags picks the strategy that runs it
// (plan_cli.h); a global batch sets the per-rank batch.
void apply_plan(Options& opt) {
  opt.strategy = examples::strategy_for(opt.strategy, opt.plan, launched_world());
  const auto r = examples::resolve_run(opt.plan, opt.strategy, opt.pipeline, opt.batch_size, opt.accumulate,
                                       launched_world(), distributed(opt.strategy),
                                       {.layers = opt.model.n_layer + 2,
                                        .heads = opt.model.n_head,
                                        .width = opt.model.n_embd,
                                        .seq = opt.model.block_size});
  opt.strategy = r.strategy;
  examples::warn_if_unshared(opt.strategy, distributed(opt.strategy), launched_world());
  opt.pipeline = r.pipeline;
  opt.sequence_parallel = r.sequence_parallel;
  opt.batch_size = r.batch_size;
  opt.model.recompute = r.recompute;
  opt.model.recompute_every = r.recompute_every;
  opt.run_plan = examples::plan_of_run(r, launched_world(), opt.accumulate);
  opt.parallel = examples::plan_to_run(r, launched_world(), opt.accumulate);
  opt.resolved = r;
  if (r.plan && dtrain::dist::launched_by_launcher() && dtrain::dist::read_env_contract().rank == 0) {
    DTRAIN_LOG(kInfo) << "parallelism plan (--strategy " << opt.strategy << "):\n" << r.plan->table();
  }
}

int run(Options opt) {
  std::int64_t hf_vocab = 0;
  if (!opt.init_from_hf.empty()) {
    opt.model = gpt::config_from_hf(opt.init_from_hf);  // its sizes, context, biases and GELU
    hf_vocab = opt.model.vocab_size;
    DTRAIN_LOG(kInfo) << "starting from " << opt.init_from_hf << ": " << opt.model.n_layer << " layers, "
                      << opt.model.n_head << " heads, width " << opt.model.n_embd << ", context "
                      << opt.model.block_size;
  }
  apply_plan(opt);
  DTRAIN_CHECK(opt.strategy != "pipeline" || opt.accumulate == 1, ConfigError,
               "--accumulate " << opt.accumulate << " with --strategy pipeline: a pipeline's micro-batches are its "
                               << "accumulation.",
               "use --micro-batches instead");
  Placement where = place(opt);
  at::set_num_threads(distributed(opt.strategy) ? 1 : at::get_num_threads());
  torch::manual_seed(opt.seed + static_cast<std::uint64_t>(where.rank));  // dropout masks
  const gpt::Corpus corpus = gpt::load_corpus(opt.data_dir, opt.model.block_size);
  opt.model.vocab_size = static_cast<std::int64_t>(corpus.vocab.size());
  DTRAIN_CHECK(opt.init_from_hf.empty() || opt.model.vocab_size == hf_vocab, ConfigError,
               opt.init_from_hf << " has a vocabulary of " << hf_vocab << ", the corpus " << opt.model.vocab_size
                                << " characters.",
               "give a GPT-2 folder made for this corpus (vocab_size " << opt.model.vocab_size << ")");
  if (opt.run_plan) {  // on an accelerator the Trainer asks the device (MemoryCheck::runs_on)
    const auto& m = opt.model;
    // dtrain::nn::causal_attention materialises the scores where it runs on
    // oneDNN; --tp and --cp keep their flash kernels.
    const bool materialized = dtrain::nn::attention_materializes_scores(m.block_size) && m.dropout == 0 &&
                              opt.run_plan->tp == 1 && opt.run_plan->cp == 1;
    const auto spec = dtrain::plan::ModelSpec::parse(
        "gpt:layers=" + std::to_string(m.n_layer) + ",hidden=" + std::to_string(m.n_embd) +
        ",heads=" + std::to_string(m.n_head) + ",seq=" + std::to_string(m.block_size) +
        ",vocab=" + std::to_string(m.vocab_size) + ",attention=" + (materialized ? "materialized" : "flash") +
        ",kernels=eager,dropout=" + (m.dropout > 0 ? "1" : "0") + ",bias=" + (m.bias ? "1" : "0"));
    opt.memory_check = examples::memory_check(opt.plan, *opt.run_plan, spec, opt.batch_size, opt.amp == "bf16");
  }
  if (gpt::RunStats::requested()) gpt::RunStats{}.start();  // counts from the model's construction on
  return train(opt, where, corpus);
}

}  // namespace

int main(int argc, char** argv) {
  dtrain::retain_freed_host_memory();  // no page faults per step after an evaluation (host_memory.h)
  CLI::App app{"Train a character-level GPT on Shakespeare with dtrain (nanoGPT's shakespeare_char)."};
  Options opt;
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // scripts add defaults, users override
  examples::add_strategy_option(app, opt.strategy);
  opt.pipeline.add_to(app);
  opt.plan.add_to(app);
  app.add_option(
         "--cp-exchange", opt.cp_exchange,
         "How K/V blocks reach the other ranks under --cp: a ring (overlapped with attention) or one all-gather")
      ->check(CLI::IsMember({"ring", "allgather"}))
      ->capture_default_str();
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
  app.add_option("--amp", opt.amp, "Mixed precision: none, or bf16 (CPU autocast)")
      ->check(CLI::IsMember({"none", "bf16"}))
      ->capture_default_str();
  app.add_option("--seed", opt.seed, "Seed of the weights, the batch order and the sample")->capture_default_str();
  app.add_option("--data-dir", opt.data_dir, "Folder with train.bin, val.bin, meta.json (scripts/setup.sh builds it)")
      ->capture_default_str();
  app.add_option("--checkpoint-dir", opt.checkpoint_dir,
                 "Save checkpoints here every --eval-interval and resume from the newest");
  app.add_option("--sample-log", opt.sample_log,
                 "Append what each step trained on to FILE (one file per data rank, JSON lines)");
  app.add_option("--ft-replay", opt.ft_replay,
                 "Replay a fault-tolerant job's per-step membership from this JSON file (its reference run)");
  app.add_option("--ft-max-retries", opt.ft_max_retries,
                 "Under dtrain run --ft-replicas: stop with an error once more than N steps in a row abort "
                 "(-1: retry without limit)")
      ->check(CLI::Range(-1, 1 << 30))
      ->capture_default_str();
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
  app.add_option("--export-hf", opt.export_hf,
                 "After training, write a Hugging Face GPT-2 folder (config.json, model.safetensors) here");
  app.add_option(
      "--init-from-hf", opt.init_from_hf,
      "Start from this Hugging Face GPT-2 folder (its sizes replace --n-layer/--n-head/--n-embd/--block-size)");
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
