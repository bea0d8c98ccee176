// The examples' --strategy pipeline options, one copy for examples/gpt and
// examples/fashion_mnist: the flags, and their reading into a pipeline x data
// mesh (dims pp and dp_replicate, or dp_shard when stages are sharded) and
// the Pipeline's options.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm/mesh.h"
#include "dtrain/error.h"
#include "dtrain/parallel/pipeline/pipeline.h"

namespace examples {

struct PipelineCli {
  std::string schedule = "1f1b";  // --pp-schedule
  int micro_batches = 4;          // --micro-batches
  int pp_size = 0;                // --pp-size: ranks per pipeline; 0: the whole world
  std::string dp_reduce = "ddp";  // --dp-reduce: how replicas of a stage average gradients

  void add_to(CLI::App& app) {
    app.add_option("--pp-schedule", schedule, "Pipeline schedule (--strategy pipeline)")
        ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zb"}))
        ->capture_default_str();
    app.add_option("--micro-batches", micro_batches,
                   "Pipeline micro-batches per batch (--strategy pipeline; divides the batch size)")
        ->check(CLI::Range(1, 4096))
        ->capture_default_str();
    app.add_option("--pp-size", pp_size, "Ranks per pipeline (0: all; the rest replicate it, DP x PP)")
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
    app.add_option(
           "--dp-reduce", dp_reduce,
           "DP x PP: how each stage's gradients are averaged over its replicas (ddp: bucketed, overlapped; "
           "zero1/zero2/zero3: sharded optimizer state / and gradients / and parameters; allreduce: once after the "
           "schedule)")
        ->check(CLI::IsMember({"ddp", "zero1", "zero2", "zero3", "allreduce"}))
        ->capture_default_str();
  }

  dtrain::pipeline::ScheduleKind kind() const { return dtrain::pipeline::parse_schedule_kind(schedule); }
  // Stages per rank: two for the interleaved schedule, one otherwise.
  int stages_per_rank() const { return kind() == dtrain::pipeline::ScheduleKind::kInterleaved1F1B ? 2 : 1; }

  // Pipelines of pp_size ranks, replicated over the rest of a world of
  // `world` ranks: on dp_shard where --dp-reduce shards, else dp_replicate.
  std::vector<dtrain::dist::MeshDim> mesh_dims(int world) const {
    const int pp = pp_size > 0 ? pp_size : world;
    DTRAIN_CHECK(world % pp == 0, ConfigError,
                 "--pp-size " << pp << " does not divide the world of " << world << " ranks",
                 "run a multiple of --pp-size ranks");
    return {{"pp", pp}, {dp_reduce.rfind("zero", 0) == 0 ? "dp_shard" : "dp_replicate", world / pp}};
  }

  // The schedule and micro-batches; with replicas, their data group and --dp-reduce.
  dtrain::pipeline::PipelineOptions options(dtrain::dist::DeviceMesh& mesh) const {
    dtrain::pipeline::PipelineOptions result{.schedule = kind(), .micro_batches = micro_batches};
    if (auto& data = mesh.join({"dp_replicate", "dp_shard"}); data.size() > 1) {
      result.data_parallel_group = data;
      result.stage_sync = dtrain::pipeline::stage_sync_named(dp_reduce);
    }
    return result;
  }
};

}  // namespace examples
