// The planner's cost model against hand-derived values: Korthikanti et al.
// 2022's activation formulas, ZeRO's 16 bytes per parameter split by stage,
// parameter counts of published models, the replay against the schedule
// simulator, and the search's ranking, refusals and plan files.
#include <gtest/gtest.h>

#include <cmath>

#include "dtrain/error.h"
#include "dtrain/plan/replay.h"
#include "dtrain/plan/search.h"

namespace dtrain::plan {
namespace {

ModelSpec gpt145() {
  return ModelSpec::parse("gpt:layers=80,hidden=12288,heads=96,seq=2048,vocab=51200");
}

TEST(PlannerModel, ParameterCountsOfPublishedModels) {
  EXPECT_NEAR(static_cast<double>(gpt145().params()) / 1e9, 145.6, 0.2);
  EXPECT_NEAR(
      static_cast<double>(ModelSpec::parse("gpt:layers=24,hidden=2304,heads=24,seq=2048,vocab=51200").params()) / 1e9,
      1.7, 0.05);
  const auto llama =
      ModelSpec::parse("llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=8192,vocab=128256");
  EXPECT_NEAR(static_cast<double>(llama.params()) / 1e9, 8.03, 0.01);
  EXPECT_FALSE(llama.tied_embeddings);
  EXPECT_EQ(llama.attention, Attention::kFlash);
}

TEST(PlannerModel, FlopsMatchNarayananFormula) {
  // 96 B s l h^2 (1 + s / 6h + V / 16 l h) per step with full recompute is
  // 4/3 of the model FLOPs in the layers; without recompute, per token:
  // 72 l h^2 (1 + s / 6h + V / 12 l h) (biases aside).
  const auto m = gpt145();
  const double l = 80, h = 12288, s = 2048, v = 51200;
  const double expected = 72 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h));
  EXPECT_NEAR(m.model_flops_per_token() / expected, 1.0, 1e-3);
}

TEST(PlannerModel, ParseRefusesTyposAndMissingFields) {
  EXPECT_THROW(ModelSpec::parse("gpt:layers=2,hidden=64,heads=4,seq=16"), ConfigError);  // no vocab
  EXPECT_THROW(ModelSpec::parse("gpt:layer=2,hidden=64,heads=4,seq=16,vocab=8"), ConfigError);
  EXPECT_THROW(ModelSpec::parse("bert:layers=2"), ConfigError);
  EXPECT_THROW(ModelSpec::parse("gpt:layers=2,hidden=65,heads=4,seq=16,vocab=8"), ConfigError);
  EXPECT_THROW(find_device("a100"), ConfigError);
  EXPECT_EQ(find_device("h200").name, "h200");
}

// Korthikanti et al. 2022, Table 2: activation bytes per layer.
// Messages give a size in the largest unit under which it is at least 1: a
// small model's pre-flight said "0.0 GiB" before.
TEST(PlannerMemory, SizesReadInTheirOwnUnit) {
  EXPECT_EQ(format_bytes(512.0), "0.5 KiB");
  EXPECT_EQ(format_bytes(3.5 * 1024), "3.5 KiB");
  EXPECT_EQ(format_bytes(40.4 * 1024 * 1024), "40.4 MiB");
  EXPECT_EQ(format_bytes(1023.0 * 1024 * 1024), "1023.0 MiB");
  EXPECT_EQ(format_bytes(80.0 * 1024 * 1024 * 1024), "80.0 GiB");
  EXPECT_EQ(format_bytes(4096.0 * 1024 * 1024 * 1024), "4096.0 GiB");
  EXPECT_EQ(format_bytes(-2.0 * 1024 * 1024), "-2.0 MiB");
}

TEST(PlannerMemory, ActivationsMatchKorthikanti) {
  const auto m = gpt145();
  const double s = 2048, b = 1, h = 12288, a = 96, t = 8;
  const double sbh = s * b * h;
  auto bytes = [&](int tp, bool sp, Recompute rc) {
    return layer_activation_bytes(m, {.micro_batch = 1, .tp = tp, .sequence_parallel = sp, .recompute = rc});
  };
  EXPECT_NEAR(bytes(1, false, Recompute::kNone), sbh * (34 + 5 * a * s / h), 1);
  EXPECT_NEAR(bytes(8, false, Recompute::kNone), sbh * (10 + 24 / t + 5 * a * s / (h * t)), 1);
  EXPECT_NEAR(bytes(8, true, Recompute::kNone), sbh / t * (34 + 5 * a * s / h), 1);
  EXPECT_NEAR(bytes(8, false, Recompute::kSelective), sbh * (10 + 24 / t), 1);
  EXPECT_NEAR(bytes(8, true, Recompute::kSelective), sbh * 34 / t, 1);
  EXPECT_NEAR(bytes(1, false, Recompute::kFull), 2 * sbh, 1);
  EXPECT_NEAR(bytes(8, true, Recompute::kFull), 2 * sbh / t, 1);
  // Context parallelism divides the tokens.
  EXPECT_NEAR(layer_activation_bytes(m, {.cp = 2, .recompute = Recompute::kFull}), sbh, 1);
}

// ZeRO (Rajbhandari et al. 2020): mixed-precision Adam holds 2 + 2 + 12
// bytes per parameter; stage 1 shards the 12, stage 2 also the gradients'
// 2, stage 3 also the weights' 2.
TEST(PlannerMemory, ZeroStagesSplitSixteenBytesPerParameter) {
  const auto m = ModelSpec::parse("gpt:layers=4,hidden=1024,heads=16,seq=512,vocab=32000");
  const Cluster c{.device = find_device("a100-80gb"), .gpus = 8, .gpus_per_node = 8};
  const double psi = static_cast<double>(m.params()), n = 8;
  const double expected[] = {psi * 16, psi * (4 + 12 / n), psi * (2 + 14 / n), psi * 16 / n};
  for (int zero = 0; zero <= 3; ++zero) {
    ParallelPlan p{.dp_replicate = zero == 0 ? 8 : 1,
                   .dp_shard = zero == 0 ? 1 : 8,
                   .zero_stage = zero,
                   .precision = "bf16",
                   .global_batch = 8};
    const auto e = estimate(p, m, c);
    EXPECT_NEAR(e.memory.params + e.memory.grads + e.memory.optimizer, expected[zero], 1) << "zero " << zero;
  }
}

TEST(PlannerMemory, PipelineHoldsTheScheduleInFlightMicroBatches) {
  // 1F1B: the first rank holds p micro-batches, the last one; GPipe holds m.
  const auto m = ModelSpec::parse("gpt:layers=8,hidden=512,heads=8,seq=256,vocab=1000");
  const Cluster c{.device = find_device("a100-80gb"), .gpus = 4, .gpus_per_node = 8};
  const double per_layer = layer_activation_bytes(m, {.micro_batch = 1});
  auto plan = [](const char* schedule) {
    return ParallelPlan{
        .pp = 4, .pipeline = {.schedule = schedule, .micro_batches = 8}, .precision = "bf16", .global_batch = 8};
  };
  const auto f1b = estimate(plan("1f1b"), m, c);
  const auto gpipe = estimate(plan("gpipe"), m, c);
  // Two layers per stage; plus one layer's transient (0 without recompute).
  EXPECT_NEAR(f1b.memory.activations, 4 * 2 * per_layer, 1);
  EXPECT_GT(f1b.peak_memory_bytes[0], f1b.peak_memory_bytes[1]);
  EXPECT_NEAR(gpipe.memory.activations, 8 * 2 * per_layer, 1);
}

// Note [Pipeline memory from the action list], by hand for p = 2, m = 4 on
// the GPT example's shape (4 layers, 2 per stage; fp32).
//  1F1B, rank 0: F0 F1 B0 F2 B1 F3 B2 B3 (with sends and receives). At B1 it
//  holds two micro-batches' activations, the outputs of micro-batches 0-2
//  (sent: kept to the end of the step) and the gradient receives of
//  micro-batches 1-3 (posted 8 actions ahead): 6 boundary tensors.
//  ZB-H1, rank 1 (the last stage): F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3. At
//  W0 it holds micro-batches 0 and 1 (activations and I's captured
//  gradients, the logits' too), the sent input gradients of 0 and 1 and the
//  posted receives of 2 and 3: 4 boundary tensors.
TEST(PlannerMemory, PipelineBuffersAndCapturedGradientsFollowTheExecutor) {
  const auto m = ModelSpec::parse(
      "gpt:layers=4,hidden=128,heads=4,seq=64,vocab=84,attention=flash,kernels=eager,dropout=0,bias=0");
  const Cluster c{.device = find_device("a100-80gb"), .gpus = 2, .gpus_per_node = 8};
  const ActivationShape shape{.micro_batch = 6, .bytes_per_element = 4};
  const double per_layer = layer_activation_bytes(m, shape);
  const double captured = layer_captured_gradient_bytes(m, shape);
  const double boundary = 6.0 * 64 * 128 * 4, logits = 6.0 * 64 * 84;
  // Per token: norms' outputs 2h, QKV 3h, the MLP's input 4h, two projections' outputs 2h.
  EXPECT_NEAR(captured, 6.0 * 64 * 4 * 11 * 128, 1e-6);
  auto plan = [](const char* schedule) {
    return ParallelPlan{
        .pp = 2, .pipeline = {.schedule = schedule, .micro_batches = 4}, .precision = "fp32", .global_batch = 24};
  };
  const auto f1b = estimate(plan("1f1b"), m, c);
  EXPECT_GT(f1b.peak_memory_bytes[0], f1b.peak_memory_bytes[1]);
  EXPECT_NEAR(f1b.memory.activations, 2 * 2 * per_layer, 1);
  EXPECT_NEAR(f1b.memory.buffers, 6 * boundary, 1);
  EXPECT_EQ(f1b.memory.captured, 0);
  const auto zb = estimate(plan("zb"), m, c);
  EXPECT_GT(zb.peak_memory_bytes[1], zb.peak_memory_bytes[0]);
  EXPECT_NEAR(zb.memory.activations, 2 * 2 * per_layer, 1);
  EXPECT_NEAR(zb.memory.captured, 2 * 2 * captured + 2 * logits * 4, 1);
  EXPECT_NEAR(zb.memory.logits, 2 * 10 * logits, 1);
  EXPECT_NEAR(zb.memory.buffers, 4 * boundary, 1);
}

TEST(PlannerTime, ReplayMatchesTheUnitTimeSimulator) {
  using pipeline::ScheduleKind;
  for (auto kind :
       {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B, ScheduleKind::kZeroBubble}) {
    for (int p : {1, 2, 4}) {
      for (int m : {1, 3, 8}) {
        const int v = kind == ScheduleKind::kInterleaved1F1B ? 2 : 1;
        const auto s = pipeline::make_schedule({.kind = kind, .ranks = p, .stages_per_rank = v, .micro_batches = m});
        const auto sim = pipeline::validate(s);
        const auto r = replay(s, {.stage = std::vector<StageTimes>(s.stage_count(), {1, 1, 1})});
        EXPECT_DOUBLE_EQ(r.makespan, sim.makespan) << to_string(kind) << " p=" << p << " m=" << m;
        EXPECT_EQ(r.peak_in_flight, sim.peak_in_flight) << to_string(kind) << " p=" << p << " m=" << m;
      }
    }
  }
}

TEST(PlannerTime, OneFOneBBubbleAndTransfers) {
  // 1F1B with F = 1, B = 2: (m + p - 1)(F + B); transfers of d add at least
  // the 2(p - 1) on the way to the last stage and back.
  const int p = 4, m = 8;
  const auto s = pipeline::make_schedule({.kind = pipeline::ScheduleKind::k1F1B, .ranks = p, .micro_batches = m});
  const auto r = replay(s, {.stage = std::vector<StageTimes>(p, {1, 2, 0}), .p2p_seconds = 0});
  EXPECT_DOUBLE_EQ(r.makespan, (m + p - 1) * 3.0);
  const auto d = replay(s, {.stage = std::vector<StageTimes>(p, {1, 2, 0}), .p2p_seconds = 0.25});
  EXPECT_GE(d.makespan, (m + p - 1) * 3.0 + 2 * (p - 1) * 0.25 - 1e-9);
  EXPECT_LE(d.makespan, (m + p - 1) * 3.0 + 2 * (m + p - 1) * 0.25 + 1e-9);
}

TEST(PlannerSearch, RanksFitsAndWritesRunnablePlanFiles) {
  const auto m = ModelSpec::parse("gpt:layers=12,hidden=768,heads=12,seq=1024,vocab=50257");
  const Cluster c{.device = find_device("a100-40gb"), .gpus = 8, .gpus_per_node = 8};
  const auto r = search(m, c, {.global_batch = 64});
  ASSERT_FALSE(r.fitting.empty());
  for (std::size_t k = 1; k < r.fitting.size(); ++k)
    EXPECT_LE(r.fitting[k - 1].step_seconds, r.fitting[k].step_seconds * 1.001);
  for (const auto& e : r.fitting) EXPECT_TRUE(e.fits);
  const auto& best = r.fitting.front().plan;
  const auto again = ParallelPlan::from_json(best.to_json());
  EXPECT_EQ(again, best);
  again.check_well_formed({.world = 8, .model = {.layers = 12, .heads = 12, .width = 768, .seq = 1024}});
  // --fixed pins exactly what it names.
  const auto pinned = search(m, c, {.global_batch = 64, .fixed = FixedFields::parse("tp=2,pp=2,zero=1,micro_batch=2")});
  ASSERT_FALSE(pinned.fitting.empty());
  for (const auto& e : pinned.fitting) {
    EXPECT_EQ(e.plan.tp, 2);
    EXPECT_EQ(e.plan.pp, 2);
    EXPECT_EQ(e.plan.zero_stage, 1);
    EXPECT_EQ(e.micro_batch, 2);
  }
  EXPECT_THROW(FixedFields::parse("tq=2"), ConfigError);
  EXPECT_THROW(FixedFields::parse("schedule=zigzag"), ConfigError);
}

TEST(PlannerSearch, RefusesWhatDoesNotFitWithTheFigureAndANearbyPlan) {
  const auto m = gpt145();
  const Cluster c{.device = find_device("a100-80gb"), .gpus = 64, .gpus_per_node = 8};
  const auto r = search(m, c, {.global_batch = 64, .fixed = FixedFields::parse("tp=8,pp=1,dp=8,zero=0")});
  EXPECT_TRUE(r.fitting.empty());
  ASSERT_TRUE(r.smallest.has_value());
  EXPECT_GT(r.smallest->peak(), static_cast<double>(c.device.memory_bytes));
  const auto change = cheapest_fitting_change(r.smallest->plan, m, c);
  ASSERT_TRUE(change.has_value());
  EXPECT_TRUE(change->fits);
  EXPECT_NE(describe_change(r.smallest->plan, change->plan), "no change");
}

TEST(PlannerSearch, WellFormedIsApartFromRunnable) {
  ParallelPlan p{
      .pp = 2, .dp_replicate = 2, .dp_shard = 2, .zero_stage = 3, .recompute = Recompute::kFull, .global_batch = 8};
  const PlanContext c{.world = 8};
  EXPECT_NO_THROW(p.check_well_formed(c));
  EXPECT_NO_THROW(p.validate(c));  // HSDP inside a pipeline runs
  p.precision = "fp8";
  EXPECT_NO_THROW(p.check_well_formed(c));
  EXPECT_THROW(p.validate(c), ConfigError);  // this build plans fp8 but does not train in it
  p.precision = "fp32";
  p.tp = 3;
  EXPECT_THROW(p.check_well_formed(c), ConfigError);
}

}  // namespace
}  // namespace dtrain::plan
