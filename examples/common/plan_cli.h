// The examples' parallelism-plan options, one copy for examples/gpt and
// examples/fashion_mnist: a plan file (--plan FILE, dtrain::ParallelPlan's
// JSON) or the degrees as flags (--dp-replicate, --dp-shard, --pp, --tp,
// --sequence-parallel, --cp, --zero-stage, --recompute; the pipeline's schedule and micro-batches come
// from pipeline_cli.h), and the global batch (--global-batch-size, else a
// plan file's global_batch: per-rank batch = global / (data-parallel ranks x
// --accumulate)). The
// plan is checked against the world and the model before anything is built
// (ParallelPlan::validate), so a plan that cannot run fails with what to
// change; resolve_run maps it onto the strategy that runs it.
#pragma once

#include <ATen/ATen.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <exception>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "dtrain/plan/plan.h"
#include "dtrain/trainer/memory_check.h"
#include "dtrain/trainer/parallelize.h"
#include "pipeline_cli.h"

namespace examples {

struct PlanCli {
  std::string file;      // --plan
  int dp_replicate = 0;  // 0: not given
  int dp_shard = 0;
  int pp = 0;
  int tp = 0;
  bool sequence_parallel = false;
  int cp = 0;
  int zero_stage = -1;  // -1: not given (3 where dp_shard > 1)
  std::string recompute = "none";
  int recompute_every = 1;
  std::int64_t global_batch = 0;  // --global-batch-size; 0: from --batch-size
  bool no_memory_check = false;   // --no-memory-check: skip the pre-flight (memory_check)
  std::string memory_limit;       // --memory-limit: bytes per rank for the pre-flight

  void add_to(CLI::App& app) {
    app.add_option("--plan", file, "Parallelism plan file (JSON, as dtrain::ParallelPlan::to_json writes)");
    app.add_option("--dp-replicate", dp_replicate,
                   "Data-parallel replicas averaging gradients (DDP; HSDP with --dp-shard)")
        ->check(CLI::PositiveNumber);
    app.add_option("--dp-shard", dp_shard, "Data-parallel ranks sharding the model (ZeRO, --zero-stage)")
        ->check(CLI::PositiveNumber);
    app.add_option("--pp", pp, "Pipeline stages' ranks (the rest of the world replicates the pipeline)")
        ->check(CLI::PositiveNumber);
    app.add_option("--tp", tp, "Tensor-parallel ranks splitting every layer (Megatron's split)")
        ->check(CLI::PositiveNumber);
    app.add_flag("--sequence-parallel", sequence_parallel,
                 "Sequence parallelism over --tp (LayerNorm and residual regions hold 1/tp of the sequence)");
    app.add_option("--cp", cp, "Context-parallel ranks splitting every sequence (ring attention, zig-zag split)")
        ->check(CLI::PositiveNumber);
    app.add_option("--zero-stage", zero_stage, "ZeRO stage over --dp-shard (default 3 where it is above 1)")
        ->check(CLI::Range(0, 3));
    app.add_option("--recompute", recompute, "Activation recompute")
        ->check(CLI::IsMember({"none", "selective", "full"}))
        ->capture_default_str();
    app.add_option("--recompute-every", recompute_every, "Recompute blocks 0, k, 2k, ... (with --recompute)")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    app.add_option("--global-batch-size", global_batch,
                   "Sequences per optimizer step over all ranks (the per-rank batch follows from the plan)")
        ->check(CLI::PositiveNumber);
    app.add_flag("--no-memory-check", no_memory_check,
                 "Train even when the planner predicts the plan's peak memory per rank exceeds the limit");
    app.add_option("--memory-limit", memory_limit,
                   "Memory per rank for the pre-flight check (e.g. 300M, 2G; default $DTRAIN_MEMORY_LIMIT, else the "
                   "host's available memory / local ranks)");
  }

  // Whether the plan comes from these options rather than --strategy.
  bool given() const {
    return !file.empty() || dp_replicate > 0 || dp_shard > 0 || pp > 0 || tp > 0 || cp > 0 || sequence_parallel ||
           zero_stage >= 0;
  }

  // The plan of these options on a world of `world` ranks: the file's, or
  // the degrees given with the rest of the world on dp_replicate (on
  // dp_shard when only a ZeRO stage is given). Validated.
  dtrain::ParallelPlan resolve(int world, const PipelineCli& pipeline, const dtrain::PlanContext::Model& model,
                               int accumulate) const {
    dtrain::ParallelPlan plan;
    if (!file.empty()) {
      std::ifstream in(file);
      DTRAIN_CHECK(in.good(), ConfigError, "cannot read the plan file " << file << ".", "check the path");
      std::stringstream text;
      text << in.rdbuf();
      plan = dtrain::ParallelPlan::from_json(text.str());
    } else {
      plan.pp = pp > 0 ? pp : 1;
      plan.tp = tp > 0 ? tp : 1;
      plan.sequence_parallel = sequence_parallel;
      plan.cp = cp > 0 ? cp : 1;
      plan.dp_shard = dp_shard > 0 ? dp_shard : 1;
      plan.zero_stage = zero_stage >= 0 ? zero_stage : (plan.dp_shard > 1 ? 3 : 0);
      if (dp_shard == 0 && zero_stage > 0) plan.dp_shard = 0;  // the rest of the world shards
      plan.dp_replicate = dp_replicate > 0 ? dp_replicate : 0;
      const int given = plan.pp * plan.tp * plan.cp * std::max(plan.dp_shard, 1) * std::max(plan.dp_replicate, 1);
      DTRAIN_CHECK(given > 0 && world % given == 0, ConfigError,
                   "the degrees given make " << given << " ranks, which do not divide the world of " << world << ".",
                   "give degrees whose product divides the number of ranks");
      if (plan.dp_shard == 0) {
        plan.dp_shard = world / given;
      } else if (plan.dp_replicate == 0) {
        plan.dp_replicate = world / given;
      }
      if (plan.dp_replicate == 0) plan.dp_replicate = 1;
      plan.pipeline = {.schedule = pipeline.schedule,
                       .stages_per_rank = pipeline.stages_per_rank(),
                       .micro_batches = pipeline.micro_batches};
      plan.recompute = dtrain::parse_recompute(recompute);
      plan.recompute_every = recompute_every;
    }
    if (global_batch > 0) plan.global_batch = global_batch;
    plan.accumulate = accumulate;
    plan.validate({.world = world, .model = model});
    return plan;
  }
};

// --strategy auto (the examples' default): the plan's own strategy where
// --plan or a degree flag is given (resolve_run), else ddp over a launched
// world of more than one rank, else single. So `dtrain run --nproc-per-node 2
// gpt` trains one model on two ranks, not two unrelated copies.
inline std::string strategy_for(const std::string& strategy, const PlanCli& cli, int world) {
  if (strategy != "auto") return strategy;
  return world > 1 && !cli.given() ? "ddp" : "single";
}

// --strategy, the same names in both examples (a plan's degrees describe
// any other; default auto, strategy_for).
inline void add_strategy_option(CLI::App& app, std::string& strategy) {
  app.add_option("--strategy", strategy,
                 "Parallelism strategy (auto: a plan's own, else ddp under a launcher of more than one rank, else "
                 "single)")
      ->check(CLI::IsMember({"auto", "single", "dp", "model-parallel", "ddp", "ddp-model-parallel", "zero1", "zero2",
                             "zero3", "pipeline"}))
      ->capture_default_str();
}

// An in-process strategy (single, dp, model-parallel: `distributed` false)
// asked for under a launched world of more than one rank trains a copy of
// the model per rank, each with its own data and no gradient shared: said
// once, by rank 0, as it is rarely what was meant.
inline void warn_if_unshared(const std::string& strategy, bool distributed, int world) {
  if (distributed || world <= 1 || dtrain::dist::read_env_contract().rank != 0) return;
  DTRAIN_LOG(kWarning) << "--strategy " << strategy << " under a launched world of " << world
                       << " ranks: each rank trains a copy of its own and no gradient is shared; for one model over "
                       << "the ranks leave --strategy out (ddp) or give a distributed one (ddp, zero1-3, pipeline, "
                       << "or a plan)";
}

// What the examples run for their flags: the strategy a plan names (pp > 1:
// pipeline, of the tp/cp split where tp or cp > 1, its replicas reduced by
// ZeRO where dp_shard > 1, else DDP; tp > 1: tp, with cp inside it, ZeRO
// over dp_shard or DDP over dp_replicate; cp > 1: cp, ZeRO over dp_shard x
// cp or DDP over dp_replicate x cp; dp_shard > 1: zeroK, HSDP with
// dp_replicate > 1; dp_replicate > 1: ddp; else single; dtrain::parallelize
// builds each), and the per-rank (per-replica under a pipeline) batch a
// global batch sets. --strategy names are shorthands for plans.
struct Resolved {
  std::string strategy;
  PipelineCli pipeline;
  int hsdp_replicas = 1;                                   // zeroK over dp_replicate x dp_shard
  int tp = 1;                                              // strategy "tp": its degree
  bool sequence_parallel = false;                          // and sequence parallelism
  int cp = 1;                                              // strategy "cp": its degree
  std::int64_t batch_size = 0;                             // per data-parallel rank and micro-step
  dtrain::Recompute recompute = dtrain::Recompute::kNone;  // for the program's model to apply
  int recompute_every = 1;
  std::optional<dtrain::ParallelPlan> plan;  // when --plan or the degrees were given
};

// `world`: the launcher's world size (1 without one); `distributed`: whether
// `strategy` runs one process per rank.
inline Resolved resolve_run(const PlanCli& cli, const std::string& strategy, const PipelineCli& pipeline,
                            std::int64_t batch_size, int accumulate, int world, bool distributed,
                            const dtrain::PlanContext::Model& model) {
  Resolved r{.strategy = strategy,
             .pipeline = pipeline,
             .batch_size = batch_size,
             .recompute = dtrain::parse_recompute(cli.recompute),
             .recompute_every = cli.recompute_every};
  int data_parallel = distributed ? world : 1;
  if (strategy == "pipeline") data_parallel = world / (pipeline.pp_size > 0 ? pipeline.pp_size : world);
  if (cli.given()) {
    const dtrain::ParallelPlan plan = cli.resolve(world, pipeline, model, accumulate);
    if (plan.pp > 1) {
      r.strategy = "pipeline";
      r.pipeline.pp_size = plan.pp;
      r.pipeline.schedule = plan.pipeline.schedule;
      r.pipeline.micro_batches = plan.pipeline.micro_batches;
      r.pipeline.dp_reduce = plan.dp_shard > 1 ? "zero" + std::to_string(plan.zero_stage) : "ddp";
    } else if (plan.tp > 1) {  // with cp, ZeRO over dp_shard or DDP over dp_replicate (parallelize.h)
      r.strategy = "tp";
      r.tp = plan.tp;
      r.sequence_parallel = plan.sequence_parallel;
    } else if (plan.cp > 1) {  // ZeRO over dp_shard x cp or DDP over dp_replicate x cp
      r.strategy = "cp";
      r.cp = plan.cp;
    } else if (plan.dp_shard > 1) {
      r.strategy = "zero" + std::to_string(plan.zero_stage);
      r.hsdp_replicas = plan.dp_replicate;
    } else {
      r.strategy = plan.dp_replicate > 1 ? "ddp" : "single";
    }
    data_parallel = plan.data_parallel();
    r.recompute = plan.recompute;
    r.recompute_every = plan.recompute_every;
    r.plan = plan;
  }
  // The global batch: --global-batch-size, else the plan file's
  // global_batch (validate() has checked that it splits), else batch_size
  // per rank stands.
  const std::int64_t global = cli.global_batch > 0 ? cli.global_batch : r.plan ? r.plan->global_batch : 0;
  if (global > 0) {
    const std::int64_t per = static_cast<std::int64_t>(data_parallel) * accumulate;
    DTRAIN_CHECK(global % per == 0, ConfigError,
                 "a global batch of " << global << " sequences ("
                                      << (cli.global_batch > 0 ? "--global-batch-size" : "the plan's global_batch")
                                      << ") does not split over " << data_parallel
                                      << " data-parallel ranks x --accumulate " << accumulate << ".",
                 "choose a multiple of " << per);
    r.batch_size = global / per;
  }
  // A --strategy that says otherwise than the plan would be dropped silently.
  DTRAIN_CHECK(!cli.given() || strategy == "single" || strategy == r.strategy, ConfigError,
               "--strategy " << strategy
                             << " and the plan given (--plan or the degree flags) disagree: the plan runs as "
                             << r.strategy << ".",
               "give one of them (the degree flags describe any strategy: e.g. --dp-shard N --zero-stage K for zeroK)");
  // Before any step: the schedule would find this out at the first batch.
  DTRAIN_CHECK(r.strategy != "pipeline" || r.pipeline.micro_batches < 1 || r.batch_size % r.pipeline.micro_batches == 0,
               ConfigError,
               r.pipeline.micro_batches << " micro-batches do not divide a pipeline's batch of " << r.batch_size
                                        << " sequences per step.",
               "choose --micro-batches dividing " << r.batch_size << ", or a batch size that is a multiple of "
                                                  << r.pipeline.micro_batches);
  return r;
}

// The plan a run executes, for the memory pre-flight: the resolved plan,
// or for the --strategy shorthands single, ddp and zero1-3 the plan they
// stand for; nullopt for the others (their plans are built by the program).
inline std::optional<dtrain::ParallelPlan> plan_of_run(const Resolved& r, int world, int accumulate) {
  if (r.plan) return r.plan;
  dtrain::ParallelPlan p;
  if (r.strategy == "ddp") {
    p.dp_replicate = world;
  } else if (r.strategy.rfind("zero", 0) == 0 && r.strategy.size() == 5) {
    p.zero_stage = r.strategy[4] - '0';
    p.dp_replicate = r.hsdp_replicas;
    p.dp_shard = world / r.hsdp_replicas;
  } else if (r.strategy != "single") {
    return std::nullopt;
  }
  p.recompute = r.recompute;
  p.recompute_every = r.recompute_every;
  p.accumulate = accumulate;
  return p;
}

// The plan a run trains under (dtrain::parallelize's): the resolved plan, or
// the one a --strategy shorthand stands for: single, dp, model-parallel one
// process (dp and model-parallel split over its devices:
// dtrain::LocalSplit); ddp, ddp-model-parallel dp_replicate over the world;
// zeroK dp_shard (HSDP over the plan's replicas); pipeline pp = --pp-size
// (the world by default), its replicas on dp_shard under --dp-reduce zeroK,
// else on dp_replicate. Not validated: a shorthand runs what it always ran.
inline dtrain::ParallelPlan plan_to_run(const Resolved& r, int world, int accumulate) {
  if (r.plan) return *r.plan;
  dtrain::ParallelPlan p;
  if (r.strategy == "ddp" || r.strategy == "ddp-model-parallel") {
    p.dp_replicate = world;
  } else if (r.strategy.rfind("zero", 0) == 0 && r.strategy.size() == 5) {
    p.zero_stage = r.strategy[4] - '0';
    p.dp_replicate = r.hsdp_replicas;
    p.dp_shard = world / r.hsdp_replicas;
  } else if (r.strategy == "pipeline") {
    const auto dims = r.pipeline.mesh_dims(world);  // checks that --pp-size divides the world
    p.pp = dims[0].size;
    if (dims[1].name == "dp_shard") {
      p.dp_shard = dims[1].size;
      p.zero_stage = r.pipeline.dp_reduce.back() - '0';
    } else {
      p.dp_replicate = dims[1].size;
    }
    p.pipeline = {.schedule = r.pipeline.schedule,
                  .stages_per_rank = r.pipeline.stages_per_rank(),
                  .micro_batches = r.pipeline.micro_batches};
  }
  p.recompute = r.recompute;
  p.recompute_every = r.recompute_every;
  p.accumulate = accumulate;
  return p;
}

// How a --strategy shorthand uses one process's devices (dp: DataParallel;
// model-parallel, ddp-model-parallel: the layers placed over them), and the
// stage sync --dp-reduce allreduce asks for (the plan's otherwise): the rest
// of dtrain::ParallelizeOptions.
inline dtrain::ParallelizeOptions parallelize_options(const Resolved& r, std::vector<c10::Device> devices) {
  dtrain::ParallelizeOptions o{.devices = std::move(devices)};
  if (r.strategy == "dp") o.local = dtrain::LocalSplit::kDataParallel;
  if (r.strategy == "model-parallel" || r.strategy == "ddp-model-parallel")
    o.local = dtrain::LocalSplit::kModelParallel;
  if (r.strategy == "pipeline" && r.pipeline.dp_reduce == "allreduce")
    o.stage_sync = dtrain::pipeline::allreduce_stage_sync();
  return o;
}

// Note [Memory pre-flight]
// What the Trainer's memory pre-flight (TrainerOptions::memory_check,
// dtrain/trainer/memory_check.h: the ranks agree on the least limit, then
// every rank compares the planner's peak with it) checks for the examples:
// the plan that runs, the model, --memory-limit, and --no-memory-check to
// turn it off. `batch_size` is per data-parallel rank and micro-step of
// accumulation; a pipeline splits it into its micro-batches (the planner's
// micro-batch is batch_size / micro_batches), so they do not multiply it.
// On an accelerator the Trainer reads the device's own free memory
// (MemoryCheck::runs_on).
inline dtrain::MemoryCheck memory_check(const PlanCli& cli, dtrain::ParallelPlan plan,
                                        const dtrain::plan::ModelSpec& model, std::int64_t batch_size, bool bf16) {
  plan.global_batch = batch_size * plan.data_parallel() * plan.accumulate;
  plan.precision = bf16 ? "bf16" : "fp32";
  return {.plan = plan, .model = model, .limit = cli.memory_limit, .enabled = !cli.no_memory_check};
}

}  // namespace examples
