// ParallelPlan as data: JSON round trips field for field, typos in a plan
// file are refused, the mesh follows the degrees, and every plan that cannot
// run fails validate() with a message that says what to change.
#include "dtrain/plan/plan.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "dtrain/error.h"

using dtrain::ParallelPlan;
using dtrain::PlanContext;

namespace {

template <typename E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "(no error)";
}

std::string invalid(const ParallelPlan& p, PlanContext c) {
  return error_of<dtrain::ConfigError>([&] { p.validate(c); });
}

const PlanContext::Model kGpt{.layers = 6, .heads = 4, .width = 128, .seq = 64};

}  // namespace

TEST(ParallelPlan, JsonRoundTripKeepsEveryField) {
  ParallelPlan p{.pp = 2,
                 .dp_shard = 2,
                 .zero_stage = 2,
                 .pipeline = {.schedule = "interleaved",
                              .stages_per_rank = 2,
                              .micro_batches = 4,
                              .stage_of_layer = {0, 0, 1, 2, 3, 3}},
                 .recompute = dtrain::Recompute::kSelective,
                 .recompute_every = 2,
                 .precision = "bf16",
                 .global_batch = 32};
  const ParallelPlan back = ParallelPlan::from_json(p.to_json());
  EXPECT_EQ(back, p) << p.to_json() << "\n" << back.to_json();
  EXPECT_EQ(ParallelPlan::from_json("{}"), ParallelPlan{});
}

TEST(ParallelPlan, PlanFilesWithTyposOrWrongTypesAreRefused) {
  EXPECT_NE(error_of<dtrain::DataError>([] {
              ParallelPlan::from_json(R"({"pp": 2, "dp_shards": 2})");
            }).find("unknown field 'dp_shards' in the plan"),
            std::string::npos);
  EXPECT_NE(error_of<dtrain::DataError>([] {
              ParallelPlan::from_json(R"({"pipeline": {"microbatches": 4}})");
            }).find("unknown field 'microbatches' in the plan's pipeline"),
            std::string::npos);
  EXPECT_NE(error_of<dtrain::DataError>([] { ParallelPlan::from_json(R"({"pp": "two"})"); }).find("wrong type"),
            std::string::npos);
  EXPECT_NE(error_of<dtrain::DataError>([] { ParallelPlan::from_json("pp: 2"); }).find("not JSON"), std::string::npos);
  EXPECT_NE(error_of<dtrain::ConfigError>([] { ParallelPlan::from_json(R"({"tp": 0})"); }).find("tp degree is 0"),
            std::string::npos);
}

TEST(ParallelPlan, MeshHoldsTheSplitDimensionsInOrder) {
  const ParallelPlan p{.pp = 2, .dp_shard = 2, .zero_stage = 1};
  const auto dims = p.mesh_dims();
  ASSERT_EQ(dims.size(), 2u);
  EXPECT_EQ(dims[0].name, "pp");
  EXPECT_EQ(dims[1].name, "dp_shard");
  EXPECT_EQ(p.world(), 4);
  EXPECT_TRUE(ParallelPlan{}.mesh_dims().empty());
  EXPECT_NE(p.table().find("2 (pp) x 2 (dp_shard)"), std::string::npos) << p.table();
}

TEST(ParallelPlan, PlansThatRunValidate) {
  EXPECT_NO_THROW((ParallelPlan{.dp_replicate = 4, .global_batch = 48}.validate({.world = 4, .model = kGpt})));
  EXPECT_NO_THROW((ParallelPlan{.dp_shard = 3, .zero_stage = 3}.validate({.world = 3, .model = kGpt})));
  EXPECT_NO_THROW(
      (ParallelPlan{.dp_replicate = 2, .dp_shard = 2, .zero_stage = 3}.validate({.world = 4, .model = kGpt})));
  EXPECT_NO_THROW(
      (ParallelPlan{.pp = 2, .dp_shard = 2, .zero_stage = 2, .pipeline = {.micro_batches = 4}, .global_batch = 16}
           .validate({.world = 4, .model = kGpt})));
  EXPECT_NO_THROW((
      ParallelPlan{.pp = 3, .pipeline = {.schedule = "interleaved", .stages_per_rank = 2, .micro_batches = 3}}.validate(
          {.world = 3, .model = kGpt})));
}

TEST(ParallelPlan, PlansThatCannotWorkSayWhatToChange) {
  EXPECT_NE(invalid({.pp = 4}, {.world = 6}).find("make 4 ranks, but the world has 6"), std::string::npos);
  EXPECT_NE(invalid({.pp = 4}, {.world = 6}).find("product is 6"), std::string::npos);
  EXPECT_NE(invalid({.dp_replicate = 2, .zero_stage = 3}, {.world = 2})
                .find("ZeRO stage 3 shards over dp_shard, which is 1 here"),
            std::string::npos);
  EXPECT_NE(invalid({.dp_shard = 2}, {.world = 2}).find("shards nothing"), std::string::npos);
  EXPECT_NO_THROW((ParallelPlan{.tp = 2}.validate({.world = 2})));
  EXPECT_NO_THROW((ParallelPlan{.dp_replicate = 2, .tp = 2, .sequence_parallel = true}.validate({.world = 4})));
  // Tensor parallelism composes with ZeRO, pipelines and cp (tests/multirank/tp_*_test.cpp) ...
  for (int stage : {1, 2, 3})
    EXPECT_NO_THROW((ParallelPlan{.dp_shard = 2, .tp = 2, .zero_stage = stage}.validate({.world = 4})));
  for (const char* schedule : {"gpipe", "1f1b", "zb"})
    EXPECT_NO_THROW((ParallelPlan{.pp = 2, .tp = 2, .pipeline = {.schedule = schedule}}.validate({.world = 4})));
  EXPECT_NO_THROW(
      (ParallelPlan{.pp = 2, .tp = 2, .pipeline = {.schedule = "interleaved", .stages_per_rank = 2}}.validate(
          {.world = 4, .model = kGpt})));
  EXPECT_NO_THROW((ParallelPlan{.cp = 2, .tp = 2}.validate({.world = 4})));
  EXPECT_NO_THROW((ParallelPlan{.dp_replicate = 2, .cp = 2, .tp = 2}.validate({.world = 8})));
  EXPECT_NO_THROW(
      (ParallelPlan{.pp = 2, .dp_shard = 2, .tp = 2, .zero_stage = 3}.validate({.world = 8, .model = kGpt})));
  EXPECT_NO_THROW((ParallelPlan{.pp = 2, .dp_replicate = 2, .tp = 2}.validate({.world = 8, .model = kGpt})));
  // ... and HSDP (tests/system/gpt_compose_test.cpp), with sequence
  // parallelism too; under cp it splits the positions a cp rank holds.
  EXPECT_NO_THROW((ParallelPlan{.dp_replicate = 2, .dp_shard = 2, .tp = 2, .zero_stage = 2}.validate({.world = 8})));
  for (const ParallelPlan& sp : {ParallelPlan{.dp_shard = 2, .tp = 2, .zero_stage = 1, .sequence_parallel = true},
                                 ParallelPlan{.pp = 2, .tp = 2, .sequence_parallel = true},
                                 ParallelPlan{.cp = 2, .tp = 2, .sequence_parallel = true}}) {
    EXPECT_NO_THROW(sp.validate({.world = 4, .model = kGpt}));
  }
  const PlanContext::Model short_seq{.layers = 6, .heads = 4, .width = 128, .seq = 12};
  const std::string split = invalid({.cp = 2, .tp = 4, .sequence_parallel = true}, {.world = 8, .model = short_seq});
  EXPECT_NE(split.find("cannot split the 6 positions a cp rank holds"), std::string::npos) << split;
  EXPECT_NE(split.find("cp x tp dividing 12"), std::string::npos) << split;
  // cp composes with tp, ZeRO and pipelines through dtrain::parallelize
  // (tests/system/gpt_compose_test.cpp), the 4-D plan and HSDP included.
  EXPECT_NO_THROW((ParallelPlan{.pp = 2, .cp = 2, .tp = 2}.validate({.world = 8, .model = kGpt})));
  EXPECT_NO_THROW((ParallelPlan{.dp_shard = 2, .cp = 2, .tp = 2, .zero_stage = 1}.validate({.world = 8})));
  EXPECT_NO_THROW(
      (ParallelPlan{.pp = 2, .dp_shard = 2, .cp = 2, .tp = 2, .zero_stage = 3}.validate({.world = 16, .model = kGpt})));
  EXPECT_NO_THROW((ParallelPlan{.cp = 2}.validate({.world = 2})));
  EXPECT_NO_THROW((ParallelPlan{.dp_replicate = 2, .cp = 2}.validate({.world = 4})));
  EXPECT_NO_THROW((ParallelPlan{.dp_shard = 2, .cp = 2, .zero_stage = 3}.validate({.world = 4})));
  EXPECT_NO_THROW((ParallelPlan{.pp = 2, .cp = 2}.validate({.world = 4, .model = kGpt})));
  EXPECT_NO_THROW((ParallelPlan{.dp_replicate = 2, .dp_shard = 2, .cp = 2, .zero_stage = 3}.validate({.world = 8})));
  EXPECT_NE(invalid({.tp = 3}, {.world = 3, .model = kGpt}).find("does not divide the model's 4 attention heads"),
            std::string::npos);
  EXPECT_NO_THROW((ParallelPlan{.pp = 2, .dp_replicate = 2, .dp_shard = 2, .zero_stage = 2}.validate({.world = 8})));
  EXPECT_NO_THROW((ParallelPlan{.pp = 2, .dp_shard = 2, .zero_stage = 3}.validate({.world = 4})));
  EXPECT_NE(invalid({.pp = 2, .pipeline = {.micro_batches = 4}, .global_batch = 6}, {.world = 2})
                .find("4 micro-batches do not divide a replica's batch of 6"),
            std::string::npos);
  EXPECT_NE(invalid({.dp_replicate = 4, .global_batch = 6}, {.world = 4}).find("multiple of 4"), std::string::npos);
  EXPECT_NE(invalid({.pp = 2, .pipeline = {.schedule = "interleaved"}}, {.world = 2})
                .find("the interleaved schedule runs 2 or more stages per rank"),
            std::string::npos);
  EXPECT_NE(
      invalid({.pp = 4, .pipeline = {.schedule = "interleaved", .stages_per_rank = 2}}, {.world = 4, .model = kGpt})
          .find("makes 8 stages, but the model has 6 layers"),
      std::string::npos);
  EXPECT_NE(invalid({.pp = 2, .pipeline = {.stage_of_layer = {0, 0, 2, 2, 2, 2}}}, {.world = 2, .model = kGpt})
                .find("not 2 contiguous stages"),
            std::string::npos);
  EXPECT_NE(invalid({.pp = 2, .pipeline = {.schedule = "zigzag"}}, {.world = 2}).find("unknown pipeline schedule"),
            std::string::npos);
  // Recompute is the model's to apply (nn::checkpoint): every plan may ask for it.
  EXPECT_NO_THROW((dtrain::ParallelPlan{.recompute = dtrain::Recompute::kFull}.validate({.world = 1})));
  EXPECT_NE(invalid({.pp = 2, .accumulate = 2}, {.world = 2}).find("raise micro_batches instead"), std::string::npos);
}
