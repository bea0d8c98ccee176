// Checkpoints that reshard across plans (issue 23 item 6, issue 25 item 5,
// trainer/resharding.h):
// examples/gpt saved under one plan resumes under another and ends where one
// uninterrupted process does on the same global batches (12 sequences per
// step under every plan: batch x data-parallel ranks). The plans differ in
// how they sum gradients (over ranks, micro-batches, shards), so the resumed
// parameters equal the uninterrupted ones to float rounding (the bound of
// gpt_zero_test.cpp and pipeline_example_test.cpp), not bit for bit.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "example_run.h"
#include "test_paths.h"

namespace {

namespace fs = std::filesystem;
using dtrain::testing::read_floats;

const std::string kReshardExample = dtrain::testing::binary_dir() + "/examples/gpt";
std::string reshard_launch(int ranks) {
  return dtrain::testing::binary_dir() + "/tools/dtrain run --nproc-per-node " + std::to_string(ranks);
}

// Three AdamW steps per run of a small GPT with clipping and a cosine
// schedule, evaluation included.
const std::string kReshardCommon =
    "--n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --eval-interval 3 --eval-iters 1 --sample-tokens 0 "
    "--warmup-iters 2 --lr-decay-iters 9 --seed 5 --grad-clip 0.5 --devices cpu ";

// A plan: its flags (global batch 12) and its processes.
struct ReshardPlan {
  std::string name;
  std::string flags;
  int ranks = 1;
  bool pipeline = false;  // --save-params writes FILE.stage0 and FILE.stage1
};

const ReshardPlan kSingle{"single", "--strategy single --batch-size 12", 1};
const ReshardPlan kPipeline2x2{
    "dp2xpp2", "--strategy pipeline --pp-size 2 --dp-reduce ddp --micro-batches 2 --pp-schedule 1f1b --batch-size 6", 4,
    true};
const ReshardPlan kZero3On3{"zero3x3", "--strategy zero3 --batch-size 4", 3};
const ReshardPlan kZero2On3{"zero2x3", "--strategy zero2 --batch-size 4", 3};
const ReshardPlan kHsdp2x2{"hsdp2x2", "--strategy zero3 --dp-replicate 2 --dp-shard 2 --batch-size 3", 4};
const ReshardPlan kDdp4{"ddp4", "--strategy ddp --batch-size 3", 4};
const ReshardPlan kPipelineZero3{
    "pp2xzero3", "--pp 2 --dp-shard 2 --zero-stage 3 --micro-batches 2 --pp-schedule 1f1b --batch-size 6", 4, true};
const ReshardPlan kPipelineZero2{
    "pp2xzero2", "--pp 2 --dp-shard 2 --zero-stage 2 --micro-batches 2 --pp-schedule gpipe --batch-size 6", 4, true};
const ReshardPlan kTp2xDp2{"tp2xdp2", "--tp 2 --dp-replicate 2 --batch-size 6", 4};
const ReshardPlan kTp2{"tp2", "--tp 2 --batch-size 12", 2};
// tp stages write the assembled model (one file).
const ReshardPlan kTp2Pp2{"tp2xpp2", "--tp 2 --pp 2 --micro-batches 2 --pp-schedule 1f1b --batch-size 12", 4};

struct ReshardDir {
  fs::path path;
  explicit ReshardDir(const std::string& name)
      : path(fs::temp_directory_path() / ("dtrain-gpt-reshard-" + name + "-" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~ReshardDir() { fs::remove_all(path); }
};

// Runs `plan` up to step `until` with checkpoints in `ckpt` (and, when
// `params` is not empty, its final parameters there); returns stderr.
std::string run_plan(const ReshardPlan& plan, int until, const fs::path& ckpt, const fs::path& params = {}) {
  std::string args = kReshardCommon + plan.flags + " --max-iters " + std::to_string(until);
  if (!ckpt.empty()) args += " --checkpoint-dir " + ckpt.string();
  if (!params.empty()) args += " --save-params " + params.string();
  const auto r = dtrain::testing::run_example(kReshardExample, args, reshard_launch(plan.ranks));
  EXPECT_EQ(r.exit_code, 0) << plan.name << ": " << r.stderr_text;
  return r.stderr_text;
}

std::vector<float> read_plan_params(const ReshardPlan& plan, const fs::path& file) {
  if (!plan.pipeline) return read_floats(file);
  std::vector<float> all;
  for (int s = 0; s < 2; ++s) {
    const auto part = read_floats(file.string() + ".stage" + std::to_string(s));
    all.insert(all.end(), part.begin(), part.end());
  }
  return all;
}

// The uninterrupted single-process run of `steps` steps.
std::vector<float> reshard_reference(const fs::path& dir, int steps) {
  const fs::path file = dir / ("reference" + std::to_string(steps) + ".f32");
  run_plan(kSingle, steps, {}, file);
  return read_floats(file);
}

// Resumes the checkpoint in `saved` (a copy of it: the resumed run saves
// too) under `plan` up to `until`, and compares with `reference`.
void expect_resumes_as_reference(const fs::path& saved, int saved_ranks, int from, const ReshardPlan& plan, int until,
                                 const std::vector<float>& reference, const fs::path& dir, const std::string& what) {
  const fs::path ckpt = dir / ("ckpt-" + plan.name + "-" + std::to_string(until));
  fs::copy(saved, ckpt, fs::copy_options::recursive);
  const fs::path file = dir / (plan.name + "-" + std::to_string(until) + ".f32");
  const std::string log = run_plan(plan, until, ckpt, file);
  EXPECT_NE(log.find("resumed at step " + std::to_string(from)), std::string::npos) << what << ": " << log;
  EXPECT_NE(log.find("saved by " + std::to_string(saved_ranks) + " ranks"), std::string::npos) << what << ": " << log;
  const auto params = read_plan_params(plan, file);
  ASSERT_EQ(params.size(), reference.size()) << what;
  ASSERT_GT(params.size(), 20000u) << what;  // 27936
  const auto diff = dtrain::testing::compare_params(params, reference);
  EXPECT_EQ(diff.outside, 0u) << what;
  EXPECT_LT(diff.relative_l2, 1e-5) << what;
}

// DP x PP 2 x 2 (DDP per stage) saved at step 3, resumed under ZeRO-3 on 3
// ranks, under HSDP 2 x 2, and in one process.
TEST(GptReshard, PipelineCheckpointResumesUnderZeroHsdpAndOneProcess) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  ReshardDir dir("from-pipeline");
  const auto reference = reshard_reference(dir.path, 6);
  ASSERT_FALSE(reference.empty());
  const fs::path saved = dir.path / "pipeline";
  run_plan(kPipeline2x2, 3, saved);
  ASSERT_TRUE(fs::exists(saved / "step_3" / "rank_3" / "laid_out.pt"));
  for (const ReshardPlan* plan : {&kZero3On3, &kHsdp2x2, &kSingle})
    expect_resumes_as_reference(saved, 4, 3, *plan, 6, reference, dir.path, "dp2xpp2 -> " + plan->name);
}

// One process saved at step 3, resumed as DP x PP 2 x 2.
TEST(GptReshard, OneProcessCheckpointResumesPipelined) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  ReshardDir dir("to-pipeline");
  const auto reference = reshard_reference(dir.path, 6);
  ASSERT_FALSE(reference.empty());
  const fs::path saved = dir.path / "single";
  run_plan(kSingle, 3, saved);
  expect_resumes_as_reference(saved, 1, 3, kPipeline2x2, 6, reference, dir.path, "single -> dp2xpp2");
}

// World 4 -> 3 -> 1: DDP on 4 ranks (laid out) to step 3, ZeRO-2 on 3 ranks
// (ZeRO chunks) to step 6, one process to step 9.
TEST(GptReshard, WorldFourThenThreeThenOne) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  ReshardDir dir("4-3-1");
  const auto reference6 = reshard_reference(dir.path, 6);
  const auto reference9 = reshard_reference(dir.path, 9);
  ASSERT_FALSE(reference9.empty());
  const fs::path saved = dir.path / "ddp4";
  run_plan(kDdp4, 3, saved);
  expect_resumes_as_reference(saved, 4, 3, kZero2On3, 6, reference6, dir.path, "ddp4 -> zero2x3");
  expect_resumes_as_reference(dir.path / "ckpt-zero2x3-6", 3, 6, kSingle, 9, reference9, dir.path, "zero2x3 -> single");
}

// `plan` (its ranks' checkpoint, with `rank_file` among its parts) saved at
// step 3 resumes under each of `into` to step 6, and one process saved at step
// 3 resumes under `back`: each ends where 6 uninterrupted steps do.
void expect_round_trip(const std::string& name, const ReshardPlan& plan, const std::string& rank_file,
                       const std::vector<const ReshardPlan*>& into, const ReshardPlan& back) {
  ReshardDir dir(name);
  const auto reference = reshard_reference(dir.path, 6);
  ASSERT_FALSE(reference.empty());
  const fs::path saved = dir.path / plan.name;
  run_plan(plan, 3, saved);
  ASSERT_TRUE(fs::exists(saved / "step_3" / rank_file / "laid_out.pt"));
  for (const ReshardPlan* other : into)
    expect_resumes_as_reference(saved, plan.ranks, 3, *other, 6, reference, dir.path, plan.name + " -> " + other->name);
  const fs::path single = dir.path / "single";
  run_plan(kSingle, 3, single);
  expect_resumes_as_reference(single, 1, 3, back, 6, reference, dir.path, "single -> " + back.name);
}

// Pipelines with sharded stages save each rank's ZeRO pieces laid out
// (flattened, the box of its chunk) under the whole model's names: ZeRO-3
// stages (which could not be checkpointed before) saved at step 3 resume in
// one process, as ZeRO-2 stages under another schedule and under tp 2 (flat
// pieces read as boxes of tp parts); one process saved at step 3 resumes as
// ZeRO-3 stages.
TEST(GptReshard, ShardedPipelineStagesResumeInOneProcessAndBack) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  expect_round_trip("sharded-stages", kPipelineZero3, "rank_3", {&kSingle, &kPipelineZero2, &kTp2}, kPipelineZero3);
}

// Tensor parallelism saves laid out under the whole model's names, its fused
// QKV as [3, C, C] (docs/checkpoints.md): tp 2 x dp_replicate 2 saved at step
// 3 resumes under ZeRO-3 on 3 ranks (through the whole state) and in one
// process; one process saved at step 3 resumes under tp 2.
TEST(GptReshard, TensorParallelCheckpointResumesUnderZeroAndOneProcessAndBack) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  expect_round_trip("tp", kTp2xDp2, "rank_1", {&kZero3On3, &kSingle}, kTp2);
}

// Pipeline stages of tp parts save each tp rank's part with its tp placement
// under the whole model's names: tp 2 x pp 2 saved at step 3 resumes in one
// process and under tp 2 without a pipeline; one process saved at step 3
// resumes as tp 2 x pp 2.
TEST(GptReshard, TensorParallelPipelineStagesResumeInOneProcessAndBack) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  expect_round_trip("tp-stages", kTp2Pp2, "rank_3", {&kSingle, &kTp2}, kTp2Pp2);
}

// `plan` saved at step 3 resumed under itself ends bit for bit where 6
// uninterrupted steps of it do (the same arithmetic: every parameter piece,
// AdamW moment and step restored exactly, the data by the global step).
void expect_resumes_bitwise(const std::string& name, const ReshardPlan& plan) {
  ReshardDir dir(name);
  const fs::path uninterrupted = dir.path / "uninterrupted.f32";
  run_plan(plan, 6, {}, uninterrupted);
  const auto expected = read_plan_params(plan, uninterrupted);
  ASSERT_GT(expected.size(), 20000u);
  const fs::path saved = dir.path / "saved";
  run_plan(plan, 3, saved);
  const fs::path file = dir.path / "resumed.f32";
  const std::string log = run_plan(plan, 6, saved, file);
  EXPECT_NE(log.find("resumed at step 3"), std::string::npos) << log;
  const auto resumed = read_plan_params(plan, file);
  ASSERT_EQ(resumed.size(), expected.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < resumed.size(); ++i) differ += resumed[i] != expected[i] ? 1 : 0;
  EXPECT_EQ(differ, 0u) << name << ": " << differ << " of " << resumed.size() << " parameters differ";
}

const ReshardPlan kZero3On2{"zero3x2", "--strategy zero3 --batch-size 6", 2};
const ReshardPlan kTp2Zero3{"tp2xzero3", "--tp 2 --dp-shard 2 --zero-stage 3 --batch-size 6", 4};
const ReshardPlan kTp2Zero2{"tp2xzero2", "--tp 2 --dp-shard 2 --zero-stage 2 --batch-size 6", 4};
const ReshardPlan kTp2Zero1{"tp2xzero1", "--tp 2 --dp-shard 2 --zero-stage 1 --batch-size 6", 4};
const ReshardPlan kTp2Hsdp{"tp2xhsdp2x2", "--tp 2 --dp-replicate 2 --dp-shard 2 --zero-stage 3 --batch-size 3", 8};
const ReshardPlan kTp2Pp2Zero2{
    "dp2xtp2xpp2zero2", "--dp-shard 2 --zero-stage 2 --tp 2 --pp 2 --micro-batches 2 --pp-schedule 1f1b --batch-size 6",
    8};
const ReshardPlan kTp2Pp2Zero3{
    "dp2xtp2xpp2zero3",
    "--dp-shard 2 --zero-stage 3 --tp 2 --pp 2 --micro-batches 2 --pp-schedule gpipe --batch-size 6", 8};

// ZeRO over tp parts saves each rank's pieces of its tp parts as flat ranges
// of them (Note [ZeRO pieces of tp parts]) under the whole model's names:
// dp_shard 2 x tp 2 under ZeRO-3 saved at step 3 resumes in one process,
// under tp 2 without ZeRO, under ZeRO-3 on 2 ranks without tp, under ZeRO-1
// over tp and under tp 2 x HSDP 2 x 2 (8 processes); one process saved at
// step 3 resumes as dp_shard 2 x tp 2 under ZeRO-3. Each ends where 6 uninterrupted steps of one process do
// (rtol 1e-5: the plans sum gradients in other orders); resumed under
// itself, bit for bit where 6 uninterrupted steps of it end.
TEST(GptReshard, TensorParallelZeroCheckpointResumesInOneProcessUnderTpAndZeroAndBack) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  expect_round_trip("tp-zero3", kTp2Zero3, "rank_3", {&kSingle, &kTp2, &kZero3On2, &kTp2Zero1, &kTp2Hsdp}, kTp2Zero3);
  expect_resumes_bitwise("tp-zero3-bitwise", kTp2Zero3);
}

// ZeRO-2 and ZeRO-1 over tp parts (AdamW's moments sharded with the
// parameters' pieces): ZeRO-2 saved at step 3 resumes in one process and as
// ZeRO-3 on 2 ranks; ZeRO-1 saved at step 3 resumes under tp 2 and as ZeRO-3
// over tp; each resumes under itself bit for bit.
TEST(GptReshard, TensorParallelZero2AndZero1CheckpointsReshard) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  expect_round_trip("tp-zero2", kTp2Zero2, "rank_2", {&kSingle, &kZero3On2}, kTp2Zero2);
  expect_round_trip("tp-zero1", kTp2Zero1, "rank_1", {&kTp2, &kTp2Zero3}, kTp2Zero1);
  expect_resumes_bitwise("tp-zero2-bitwise", kTp2Zero2);
  expect_resumes_bitwise("tp-zero1-bitwise", kTp2Zero1);
}

// HSDP inside a pipeline: pp 2 x dp_replicate 2 x dp_shard 2 with ZeRO-3
// stages (8 processes), its shards averaged over dp_replicate, saved at step
// 3, resumes in one process and as pp 2 x ZeRO-2 stages on 4; one process
// saved at step 3 resumes as HSDP stages. Each ends where 6 uninterrupted
// steps of one process do (so the HSDP stages' 3 steps of training equal one
// process's too); resumed under itself, bit for bit.
const ReshardPlan kPipelineHsdp{
    "pp2xhsdp2x2",
    "--pp 2 --dp-replicate 2 --dp-shard 2 --zero-stage 3 --micro-batches 3 --pp-schedule 1f1b --batch-size 3", 8, true};
TEST(GptReshard, HsdpPipelineStagesTrainAsOneProcessAndReshard) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  expect_round_trip("hsdp-stages", kPipelineHsdp, "rank_7", {&kSingle, &kPipelineZero2}, kPipelineHsdp);
  expect_resumes_bitwise("hsdp-stages-bitwise", kPipelineHsdp);
}

// dp_shard 2 x tp 2 x pp 2 (8 processes) with ZeRO-2 stages saved at step 3
// resumes in one process, under tp 2, under tp 2 x pp 2 (no ZeRO) and under
// ZeRO-3 over tp; one process saved at step 3 resumes as dp_shard 2 x tp 2 x
// pp 2 with ZeRO-3 stages; ZeRO-2 stages resume under themselves bit for bit.
TEST(GptReshard, TensorParallelZeroPipelineStagesReshard) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  expect_round_trip("tp-zero-stages", kTp2Pp2Zero2, "rank_7", {&kSingle, &kTp2, &kTp2Pp2, &kTp2Zero3}, kTp2Pp2Zero3);
  expect_resumes_bitwise("tp-zero-stages-bitwise", kTp2Pp2Zero2);
}

}  // namespace
