// ParallelPlan: validation, the printed table, the JSON plan file (plan.h).
#include "dtrain/plan/plan.h"

#include <iomanip>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "dtrain/error.h"
#include "dtrain/parallel/pipeline/schedule.h"

namespace dtrain {

std::string to_string(Recompute r) {
  switch (r) {
    case Recompute::kNone: return "none";
    case Recompute::kSelective: return "selective";
    case Recompute::kFull: return "full";
  }
  return "?";
}

Recompute parse_recompute(const std::string& name) {
  for (auto r : {Recompute::kNone, Recompute::kSelective, Recompute::kFull})
    if (to_string(r) == name) return r;
  DTRAIN_CHECK(false, ConfigError, "unknown recompute mode '" << name << "'", "use one of none, selective, full");
}

std::int64_t ParallelPlan::local_batch() const {
  const std::int64_t per = static_cast<std::int64_t>(data_parallel()) * accumulate;
  return per > 0 ? global_batch / per : 0;
}

std::vector<dist::MeshDim> ParallelPlan::mesh_dims() const {
  std::vector<dist::MeshDim> dims;
  const int degrees[] = {pp, dp_replicate, dp_shard, cp, tp};
  for (std::size_t d = 0; d < dist::mesh_dim_names().size(); ++d)
    if (degrees[d] > 1) dims.push_back({dist::mesh_dim_names()[d], degrees[d]});
  return dims;
}

namespace {

std::string degrees_of(const ParallelPlan& p) {
  std::ostringstream s;
  s << "pp " << p.pp << " x dp_replicate " << p.dp_replicate << " x dp_shard " << p.dp_shard << " x cp " << p.cp
    << " x tp " << p.tp;
  return s.str();
}

void validate_values(const ParallelPlan& p) {
  const std::pair<const char*, int> degrees[] = {
      {"pp", p.pp}, {"dp_replicate", p.dp_replicate}, {"dp_shard", p.dp_shard}, {"cp", p.cp}, {"tp", p.tp}};
  for (const auto& [name, value] : degrees)
    DTRAIN_CHECK(value >= 1, ConfigError, "the plan's " << name << " degree is " << value << ".",
                 "give every degree at least 1 (1: that dimension is not split)");
  DTRAIN_CHECK(p.zero_stage >= 0 && p.zero_stage <= 3, ConfigError, "ZeRO stage " << p.zero_stage << " does not exist.",
               "choose zero_stage 0 (none), 1, 2 or 3");
  DTRAIN_CHECK(p.accumulate >= 1, ConfigError, "accumulate is " << p.accumulate << ".", "use 1 or more micro-steps");
  DTRAIN_CHECK(p.recompute_every >= 1, ConfigError, "recompute_every is " << p.recompute_every << ".",
               "recompute every k-th layer with k >= 1");
  DTRAIN_CHECK(p.precision == "fp32" || p.precision == "bf16" || p.precision == "fp16" || p.precision == "fp8",
               ConfigError, "unknown precision '" << p.precision << "'.", "use fp32, bf16, fp16 or fp8");
  DTRAIN_CHECK(p.global_batch >= 0, ConfigError, "global_batch is " << p.global_batch << ".",
               "give the sequences per step (0: the program decides)");
}

void validate_pipeline(const ParallelPlan& p, const PlanContext& c) {
  const PipelinePlan& pl = p.pipeline;
  const auto kind = pipeline::parse_schedule_kind(pl.schedule);
  const bool interleaved = kind == pipeline::ScheduleKind::kInterleaved1F1B;
  DTRAIN_CHECK(pl.micro_batches >= 1, ConfigError, "micro_batches is " << pl.micro_batches << ".",
               "use 1 or more micro-batches per step");
  DTRAIN_CHECK(interleaved ? pl.stages_per_rank >= 2 : pl.stages_per_rank == 1, ConfigError,
               "schedule " << pl.schedule << " with " << pl.stages_per_rank << " stages per rank.",
               (interleaved ? "the interleaved schedule runs 2 or more stages per rank"
                            : "only the interleaved schedule runs several stages per rank"));
  if (p.pp == 1) return;
  const std::int64_t stages = static_cast<std::int64_t>(p.pp) * pl.stages_per_rank;
  DTRAIN_CHECK(c.model.layers == 0 || stages <= c.model.layers, ConfigError,
               "pp " << p.pp << " x " << pl.stages_per_rank << " stages per rank makes " << stages
                     << " stages, but the model has " << c.model.layers << " layers.",
               "use at most " << c.model.layers << " stages in all");
  if (!pl.stage_of_layer.empty()) {
    DTRAIN_CHECK(
        c.model.layers == 0 || static_cast<std::int64_t>(pl.stage_of_layer.size()) == c.model.layers, ConfigError,
        "the plan's cut names " << pl.stage_of_layer.size() << " layers, the model has " << c.model.layers << ".",
        "give one stage index per layer");
    bool contiguous = pl.stage_of_layer.front() == 0;
    for (std::size_t l = 1; l < pl.stage_of_layer.size(); ++l) {
      const auto step = pl.stage_of_layer[l] - pl.stage_of_layer[l - 1];
      contiguous = contiguous && pl.stage_of_layer[l] >= pl.stage_of_layer[l - 1] && step <= 1;
    }
    DTRAIN_CHECK(contiguous && static_cast<std::int64_t>(pl.stage_of_layer.back()) == stages - 1, ConfigError,
                 "the plan's cut is not " << stages << " contiguous stages in order.",
                 "give stage indices 0.." << stages - 1 << ", each layer's equal to or one past the previous one's");
  }
  if (p.global_batch > 0) {
    DTRAIN_CHECK(p.local_batch() % pl.micro_batches == 0, ConfigError,
                 pl.micro_batches << " micro-batches do not divide a replica's batch of " << p.local_batch()
                                  << " sequences (global batch " << p.global_batch << " over " << p.data_parallel()
                                  << " data-parallel ranks).",
                 "choose micro_batches dividing " << p.local_batch());
  }
  DTRAIN_CHECK(p.accumulate == 1, ConfigError, "a pipeline plan with accumulate " << p.accumulate << ".",
               "a pipeline accumulates over its micro-batches: raise micro_batches instead");
}

// What the appliers of this build implement; a plan past them is refused by
// name rather than failing mid-run.
void validate_applied(const ParallelPlan& p) {
  // fp8 GEMMs are a planner precision (the device table's fp8 rates); no
  // applier in this build casts to fp8.
  DTRAIN_CHECK(p.precision != "fp8", ConfigError, "precision fp8: this build plans fp8 but does not train in it.",
               "use bf16 (or fp16, fp32) to run the plan");
  // dtrain::parallelize composes tensor (with or without sequence) and
  // context parallelism with DDP (dp_replicate), ZeRO 1-3 over dp_shard
  // (x cp), HSDP, pipelines of every schedule with DDP, ZeRO or HSDP per
  // stage, and each other (docs/tp.md, "Compositions";
  // tests/multirank/tp_*_test.cpp and tests/system/gpt_compose_test.cpp
  // against one process).
}

}  // namespace

void ParallelPlan::validate(const PlanContext& c) const {
  check_well_formed(c);
  validate_applied(*this);
}

void ParallelPlan::check_well_formed(const PlanContext& c) const {
  validate_values(*this);
  DTRAIN_CHECK(world() == c.world, ConfigError,
               "the plan's degrees (" << degrees_of(*this) << ") make " << world() << " ranks, but the world has "
                                      << c.world << ".",
               "choose degrees whose product is " << c.world);
  DTRAIN_CHECK(zero_stage == 0 || dp_shard > 1, ConfigError,
               "ZeRO stage " << zero_stage << " shards over dp_shard, which is 1 here.",
               "set dp_shard to the number of ranks to shard over, or zero_stage 0");
  DTRAIN_CHECK(dp_shard == 1 || zero_stage > 0, ConfigError,
               "dp_shard " << dp_shard << " with zero_stage 0 shards nothing.",
               "choose zero_stage 1, 2 or 3, or put these ranks on dp_replicate");
  DTRAIN_CHECK(!sequence_parallel || tp > 1, ConfigError, "sequence parallelism splits over tp, which is 1 here.",
               "set tp above 1, or sequence_parallel false");
  DTRAIN_CHECK(c.model.heads == 0 || c.model.heads % tp == 0, ConfigError,
               "tp " << tp << " does not divide the model's " << c.model.heads << " attention heads.",
               "choose a tp that divides " << c.model.heads);
  DTRAIN_CHECK(c.model.width == 0 || c.model.width % tp == 0, ConfigError,
               "tp " << tp << " does not divide the model's width " << c.model.width << ".",
               "choose a tp that divides " << c.model.width);
  DTRAIN_CHECK(c.model.seq == 0 || c.model.seq % (2 * cp) == 0 || cp == 1, ConfigError,
               "cp " << cp << " cannot split sequences of " << c.model.seq << " into " << 2 * cp << " balanced chunks.",
               "choose a cp with 2 x cp dividing " << c.model.seq);
  DTRAIN_CHECK(c.model.seq == 0 || !sequence_parallel || c.model.seq % (cp * tp) == 0, ConfigError,
               "sequence parallelism cannot split the "
                   << c.model.seq / cp << " positions a cp rank holds (sequences of " << c.model.seq << " over cp "
                   << cp << ") over tp " << tp << ".",
               "choose tp and cp with cp x tp dividing " << c.model.seq);
  if (global_batch > 0) {
    const std::int64_t per = static_cast<std::int64_t>(data_parallel()) * accumulate;
    DTRAIN_CHECK(global_batch % per == 0, ConfigError,
                 "a global batch of " << global_batch << " sequences does not split over " << data_parallel()
                                      << " data-parallel ranks x " << accumulate << " micro-steps.",
                 "choose a global batch that is a multiple of " << per);
  }
  validate_pipeline(*this, c);
}

std::string ParallelPlan::table() const {
  std::ostringstream s;
  auto row = [&](const std::string& k, const std::string& v) { s << std::left << std::setw(18) << k << v << "\n"; };
  std::string mesh;
  for (const auto& d : mesh_dims()) mesh += (mesh.empty() ? "" : " x ") + std::to_string(d.size) + " (" + d.name + ")";
  row("mesh", mesh.empty() ? "1 rank" : mesh);
  row("zero_stage", std::to_string(zero_stage));
  if (tp > 1) row("sequence_parallel", sequence_parallel ? "yes" : "no");
  if (pp > 1) {
    row("schedule", pipeline.schedule);
    row("stages_per_rank", std::to_string(pipeline.stages_per_rank));
    row("micro_batches", std::to_string(pipeline.micro_batches));
    std::string cut;
    for (auto s : pipeline.stage_of_layer) cut += (cut.empty() ? "" : ",") + std::to_string(s);
    row("cut", cut.empty() ? "planner" : cut);
  }
  row("recompute", to_string(recompute) + (recompute != Recompute::kNone && recompute_every > 1
                                               ? " every " + std::to_string(recompute_every) + " layers"
                                               : ""));
  row("precision", precision);
  row("global_batch", global_batch > 0 ? std::to_string(global_batch) : "set by the program");
  if (global_batch > 0) row("local_batch", std::to_string(local_batch()));
  row("accumulate", std::to_string(accumulate));
  return s.str();
}

std::string ParallelPlan::to_json() const {
  nlohmann::json j{{"pp", pp},
                   {"dp_replicate", dp_replicate},
                   {"dp_shard", dp_shard},
                   {"cp", cp},
                   {"tp", tp},
                   {"zero_stage", zero_stage},
                   {"sequence_parallel", sequence_parallel},
                   {"pipeline",
                    {{"schedule", pipeline.schedule},
                     {"stages_per_rank", pipeline.stages_per_rank},
                     {"micro_batches", pipeline.micro_batches},
                     {"stage_of_layer", pipeline.stage_of_layer}}},
                   {"recompute", to_string(recompute)},
                   {"recompute_every", recompute_every},
                   {"precision", precision},
                   {"global_batch", global_batch},
                   {"accumulate", accumulate}};
  return j.dump(2);
}

namespace {

void refuse_unknown(const nlohmann::json& j, const std::set<std::string>& known, const std::string& where) {
  for (const auto& item : j.items())
    DTRAIN_CHECK(known.count(item.key()) == 1, DataError, "unknown field '" << item.key() << "' in " << where << ".",
                 "check its spelling; the fields are those ParallelPlan::to_json writes");
}

template <typename T>
void read(const nlohmann::json& j, const char* key, T& into) {
  if (j.contains(key)) into = j.at(key).get<T>();
}

}  // namespace

ParallelPlan ParallelPlan::from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    DTRAIN_CHECK(false, DataError, "a plan file is not JSON: " << e.what(), "write it as ParallelPlan::to_json does");
  }
  DTRAIN_CHECK(j.is_object(), DataError, "a plan file holds " << j.type_name() << ", not an object.",
               "write it as ParallelPlan::to_json does");
  refuse_unknown(j,
                 {"pp", "dp_replicate", "dp_shard", "cp", "tp", "zero_stage", "sequence_parallel", "pipeline",
                  "recompute", "recompute_every", "precision", "global_batch", "accumulate"},
                 "the plan");
  ParallelPlan p;
  try {
    read(j, "pp", p.pp);
    read(j, "dp_replicate", p.dp_replicate);
    read(j, "dp_shard", p.dp_shard);
    read(j, "cp", p.cp);
    read(j, "tp", p.tp);
    read(j, "zero_stage", p.zero_stage);
    read(j, "sequence_parallel", p.sequence_parallel);
    read(j, "recompute_every", p.recompute_every);
    read(j, "precision", p.precision);
    read(j, "global_batch", p.global_batch);
    read(j, "accumulate", p.accumulate);
    if (j.contains("recompute")) p.recompute = parse_recompute(j.at("recompute").get<std::string>());
    if (j.contains("pipeline")) {
      const auto& pl = j.at("pipeline");
      DTRAIN_CHECK(pl.is_object(), DataError, "the plan's pipeline is " << pl.type_name() << ", not an object.",
                   "write it as ParallelPlan::to_json does");
      refuse_unknown(pl, {"schedule", "stages_per_rank", "micro_batches", "stage_of_layer"}, "the plan's pipeline");
      read(pl, "schedule", p.pipeline.schedule);
      read(pl, "stages_per_rank", p.pipeline.stages_per_rank);
      read(pl, "micro_batches", p.pipeline.micro_batches);
      read(pl, "stage_of_layer", p.pipeline.stage_of_layer);
    }
  } catch (const nlohmann::json::exception& e) {
    DTRAIN_CHECK(false, DataError, "a plan file has a field of the wrong type: " << e.what(),
                 "write it as ParallelPlan::to_json does");
  }
  validate_values(p);
  return p;
}

}  // namespace dtrain
