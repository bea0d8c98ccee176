// Pipeline parallelism against references:
//   - schedules: every generator's lists validate for p 1..4, m 1..8 (v 1..2),
//     their simulated bubble is the textbook formula, and the simulator
//     rejects hand-broken lists (missing receive, self transfer, deadlock);
//   - training: for every schedule, p 1..4 and m 1..8, gradients, loss and
//     two SGD steps of the pipelined GPT equal unpipelined training on the
//     same batches (fp32, rtol 1e-5); evaluation equals the model's forward;
//   - a changed micro-batch shape is a ConfigError on every rank;
//   - GradScaler (found-inf over all stages, an inf on one stage skips the
//     step everywhere) and global-norm clipping across stages equal the
//     single-process scaler and clipping;
//   - DP x PP on a 2 x 2 mesh equals one process on the whole batch, for
//     every schedule and every data-parallel applier (DDP, ZeRO 1-3, one
//     all-reduce), clipping included (the GPT, with its tied weight);
//   - a stage process killed mid-step: the others get a CommunicationError
//     naming their peer and stop, within the timeout (processes).
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <csignal>
#include <iostream>
#include <sstream>

#include "dtrain/amp/grad_scaler.h"
#include "dtrain/comm/mesh.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/dist/clip.h"
#include "dtrain/error.h"
#include "dtrain/parallel/pipeline/pipeline.h"
#include "model.h"
#include "pipeline_stages.h"
#include "ranks.h"

using dtrain::pipeline::Action;
using dtrain::pipeline::ActionKind;
using dtrain::pipeline::make_schedule;
using dtrain::pipeline::Pipeline;
using dtrain::pipeline::ScheduleKind;
using dtrain::pipeline::validate;
using namespace dtrain::testing;

namespace {

constexpr ScheduleKind kKinds[] = {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B,
                                   ScheduleKind::kZeroBubble};

int stages_per_rank(ScheduleKind kind) {
  return kind == ScheduleKind::kInterleaved1F1B ? 2 : 1;
}

gpt::GptConfig tiny_config(int stages) {
  return {
      .vocab_size = 11, .block_size = 8, .n_layer = std::max<std::int64_t>(2, stages - 2), .n_head = 2, .n_embd = 16};
}

struct Batch {
  at::Tensor x, y;
};
Batch batch_for(const gpt::GptConfig& c, int size, int step) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  return {at::randint(c.vocab_size, {size, c.block_size}, gen, at::kLong),
          at::randint(c.vocab_size, {size, c.block_size}, gen, at::kLong)};
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << " undefined";
  EXPECT_TRUE(at::allclose(got, want, /*rtol=*/1e-5, /*atol=*/1e-6))
      << what << ": max difference " << (got - want).abs().max().item<double>();
}

// One pipeline run of `kind` on p rank threads for each m in `ms`: two SGD
// steps compared with the whole model on the whole batch, then evaluation.
void expect_pipeline_equals_reference(ScheduleKind kind, int p, const std::vector<int>& ms) {
  const int v = stages_per_rank(kind);
  run_rank_threads(p, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, p, {.timeout = std::chrono::seconds(30)});
    for (const int m : ms) {
      const std::string where =
          to_string(kind) + " p=" + std::to_string(p) + " m=" + std::to_string(m) + " rank " + std::to_string(rank);
      const gpt::GptConfig config = tiny_config(p * v);
      torch::nn::Sequential layers = gpt::gpt_layers(config);
      gpt::init_weights(*layers, config.n_layer, 7);
      Pipeline pipe(gpt::pipeline_stages(layers, p, v, rank), group, {.schedule = kind, .micro_batches = m},
                    gpt::lm_loss);
      torch::optim::SGD opt(pipe.parameters(), 0.1);
      gpt::Gpt reference(config);
      gpt::init_weights(*reference, config.n_layer, 7);
      torch::optim::SGD ref_opt(reference->parameters(), 0.1);
      const auto ref_params = reference->layers->named_parameters();
      for (int step = 0; step < 2; ++step) {
        const Batch b = batch_for(config, 2 * m, step);
        opt.zero_grad();
        const at::Tensor loss = pipe.step(b.x, b.y);
        ref_opt.zero_grad();
        const at::Tensor ref_loss = gpt::lm_loss(reference->forward(b.x), b.y);
        ref_loss.backward();
        const bool last = pipe.schedule().rank_of_stage(pipe.schedule().stage_count() - 1) == rank;
        if (last) expect_close(loss, ref_loss.detach(), where + " loss");
        for (const auto& stage : pipe.stages()) {
          for (const auto& item : stage.module->named_parameters()) {
            expect_close(item.value().grad(), ref_params[item.key()].grad(), where + " grad of " + item.key());
          }
          for (const auto& tied : stage.tied) {
            expect_close(tied.parameter.grad(), ref_params["embed.wte.weight"].grad(), where + " tied grad");
          }
        }
        opt.step();
        ref_opt.step();
      }
      for (const auto& stage : pipe.stages()) {
        for (const auto& item : stage.module->named_parameters()) {
          expect_close(item.value().detach(), ref_params[item.key()].detach(), where + " " + item.key());
        }
      }
      // Evaluation on a batch of another size agrees its own shapes ...
      const Batch eval = batch_for(config, 4 * m, 99);
      const at::Tensor out = pipe.forward(eval.x);
      const bool last = pipe.schedule().rank_of_stage(pipe.schedule().stage_count() - 1) == rank;
      if (last) {
        at::NoGradGuard no_grad;
        expect_close(out, reference->forward(eval.x), where + " eval output");
      } else {
        EXPECT_FALSE(out.defined()) << where;
      }
      // ... and training goes on with the shapes agreed before.
      const Batch again = batch_for(config, 2 * m, 2);
      const at::Tensor loss = pipe.step(again.x, again.y);
      if (last)
        expect_close(loss, gpt::lm_loss(reference->forward(again.x), again.y).detach(), where + " loss after eval");
    }
  });
}

const std::vector<int> kAllM = {1, 2, 3, 4, 5, 6, 7, 8};

}  // namespace

TEST(PipelineSchedule, EveryGeneratorValidatesAndMatchesItsBubbleFormula) {
  for (const ScheduleKind kind : kKinds) {
    for (int p = 1; p <= 4; ++p) {
      for (int m = 1; m <= 8; ++m) {
        const int v = stages_per_rank(kind);
        const auto sim = validate(make_schedule({.kind = kind, .ranks = p, .stages_per_rank = v, .micro_batches = m}));
        if (m % p != 0) continue;
        const double formula = double(p - 1) / (v * m + p - 1);  // GPipe, 1F1B; interleaved: v chunks per rank
        if (kind == ScheduleKind::kZeroBubble) {
          // ZB-H1 (F = I = W): (p - 1) idle slots per rank against 3m busy.
          EXPECT_NEAR(sim.bubble_fraction, double(p - 1) / (3 * m + p - 1), 1e-9) << "p=" << p << " m=" << m;
        } else {
          EXPECT_NEAR(sim.bubble_fraction, formula, 1e-9) << to_string(kind) << " p=" << p << " m=" << m;
        }
        if (kind == ScheduleKind::kGPipe) {
          EXPECT_EQ(sim.peak_in_flight[0], m);
        }
        if (kind == ScheduleKind::k1F1B) {
          EXPECT_EQ(sim.peak_in_flight[0], std::min(m, p));
        }
      }
    }
  }
}

TEST(PipelineSchedule, SimulatorRejectsAMissingReceive) {
  auto schedule = make_schedule({.kind = ScheduleKind::k1F1B, .ranks = 2, .micro_batches = 2});
  auto& rank1 = schedule.actions[1];
  const Action recv{ActionKind::kRecvActivation, 1, 1};
  rank1.erase(std::find(rank1.begin(), rank1.end(), recv));
  try {
    validate(schedule);
    FAIL() << "a schedule without RECV_F1.1 validated";
  } catch (const dtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("RECV_F1.1"), std::string::npos) << e.what();
  }
}

TEST(PipelineSchedule, SimulatorRejectsADeadlockAndASelfTransfer) {
  // Rank 0 waits for the gradient of micro-batch 0 before sending micro-batch 0 forward.
  auto schedule = make_schedule({.kind = ScheduleKind::kGPipe, .ranks = 2, .micro_batches = 1});
  auto& rank0 = schedule.actions[0];
  ASSERT_EQ(to_string(rank0[1]), "SEND_F0.0");
  std::swap(rank0[1], rank0[2]);  // RECV_B0.0 before SEND_F0.0
  try {
    validate(schedule);
    FAIL() << "a deadlocking schedule validated";
  } catch (const dtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("deadlocks"), std::string::npos) << e.what();
  }
  auto self =
      make_schedule({.kind = ScheduleKind::kInterleaved1F1B, .ranks = 1, .stages_per_rank = 2, .micro_batches = 1});
  self.actions[0].insert(self.actions[0].begin() + 1, Action{ActionKind::kSendActivation, 0, 0});
  EXPECT_THROW(validate(self), dtrain::ConfigError);
}

TEST(PipelineSchedule, TableShowsEveryRank) {
  const auto schedule = make_schedule({.kind = ScheduleKind::kZeroBubble, .ranks = 4, .micro_batches = 8});
  const std::string table = to_table(schedule);
  for (const char* cell : {"rank 0 |", "rank 3 |", "F0.0", "I3.7", "W0.7", "simulated bubble 0.111"}) {
    EXPECT_NE(table.find(cell), std::string::npos) << cell << " not in\n" << table;
  }
}

TEST(PipelineTraining, GPipeEqualsUnpipelined) {
  for (int p = 1; p <= 4; ++p) expect_pipeline_equals_reference(ScheduleKind::kGPipe, p, kAllM);
}
TEST(PipelineTraining, OneFOneBEqualsUnpipelined) {
  for (int p = 1; p <= 4; ++p) expect_pipeline_equals_reference(ScheduleKind::k1F1B, p, kAllM);
}
TEST(PipelineTraining, InterleavedEqualsUnpipelined) {
  for (int p = 1; p <= 4; ++p) expect_pipeline_equals_reference(ScheduleKind::kInterleaved1F1B, p, kAllM);
}
TEST(PipelineTraining, ZeroBubbleEqualsUnpipelined) {
  for (int p = 1; p <= 4; ++p) expect_pipeline_equals_reference(ScheduleKind::kZeroBubble, p, kAllM);
}

TEST(PipelineTraining, ChangedBatchShapeIsAConfigErrorOnEveryRank) {
  constexpr int kRanks = 2;
  run_rank_threads(kRanks, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, kRanks, {.timeout = std::chrono::seconds(30)});
    const gpt::GptConfig config = tiny_config(kRanks);
    torch::nn::Sequential layers = gpt::gpt_layers(config);
    gpt::init_weights(*layers, config.n_layer, 7);
    Pipeline pipe(gpt::pipeline_stages(layers, kRanks, 1, rank), group,
                  {.schedule = ScheduleKind::k1F1B, .micro_batches = 2}, gpt::lm_loss);
    pipe.step(batch_for(config, 4, 0).x, batch_for(config, 4, 0).y);
    const Batch bigger = batch_for(config, 6, 1);
    try {
      pipe.step(bigger.x, bigger.y);
      ADD_FAILURE() << "rank " << rank << ": a changed batch shape went through";
    } catch (const dtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("micro-batch changed"), std::string::npos) << e.what();
    }
  });
}

// p = 2, 1F1B, m = 2: GradScaler with found_inf_group = the pipeline and
// clipping over the stages' gradient set, against one process doing the same
// (an inf planted in the head's gradient at step 1 on both).
TEST(PipelineTraining, GradScalerAndClippingAcrossStagesEqualSingleProcess) {
  constexpr int kRanks = 2, kSteps = 4, kBadStep = 1;
  constexpr double kMaxNorm = 0.05;  // below the gradients' norm: clipping acts
  run_rank_threads(kRanks, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, kRanks, {.timeout = std::chrono::seconds(30)});
    const gpt::GptConfig config = tiny_config(kRanks);
    torch::nn::Sequential layers = gpt::gpt_layers(config);
    gpt::init_weights(*layers, config.n_layer, 7);
    Pipeline pipe(gpt::pipeline_stages(layers, kRanks, 1, rank), group,
                  {.schedule = ScheduleKind::k1F1B, .micro_batches = 2}, gpt::lm_loss);
    torch::optim::SGD opt(pipe.parameters(), 0.1);
    dtrain::amp::GradScaler scaler({.init_scale = 1024.0, .growth_interval = 2, .found_inf_group = group});
    gpt::Gpt reference(config);
    gpt::init_weights(*reference, config.n_layer, 7);
    torch::optim::SGD ref_opt(reference->parameters(), 0.1);
    dtrain::amp::GradScaler ref_scaler({.init_scale = 1024.0, .growth_interval = 2});
    auto ref_params = reference->layers->named_parameters();
    for (int step = 0; step < kSteps; ++step) {
      const Batch b = batch_for(config, 4, step);
      opt.zero_grad();
      pipe.step(b.x, b.y, &scaler);
      ref_opt.zero_grad();
      ref_scaler.scale(gpt::lm_loss(reference->forward(b.x), b.y)).backward();
      if (step == kBadStep) {
        ref_params["head.ln_f.weight"].mutable_grad()[0] = std::numeric_limits<float>::infinity();
        for (const auto& stage : pipe.stages()) {
          for (auto& item : stage.module->named_parameters()) {
            if (item.key() == "head.ln_f.weight")
              item.value().mutable_grad()[0] = std::numeric_limits<float>::infinity();
          }
        }
      }
      scaler.unscale_(opt);
      ref_scaler.unscale_(ref_opt);
      const at::Tensor norm = pipe.clip_grad_norm_(kMaxNorm);
      const at::Tensor ref_norm = dtrain::clip_grad_norm_(reference->parameters(), kMaxNorm);
      const bool stepped = scaler.step(opt);
      EXPECT_EQ(stepped, ref_scaler.step(ref_opt)) << "rank " << rank << " step " << step;
      EXPECT_EQ(stepped, step != kBadStep) << "rank " << rank << " step " << step;
      scaler.update();
      ref_scaler.update();
      EXPECT_EQ(scaler.get_scale(), ref_scaler.get_scale());
      if (stepped) expect_close(norm, ref_norm, "global norm at step " + std::to_string(step));
    }
    for (const auto& stage : pipe.stages()) {
      for (const auto& item : stage.module->named_parameters()) {
        expect_close(item.value().detach(), ref_params[item.key()].detach(),
                     "rank " + std::to_string(rank) + " " + item.key());
      }
    }
  });
}

// 4 ranks as 2 replicas x 2 ranks of stages: replica d trains on half d of
// each batch; stage gradients are averaged over the data groups by each
// applier (DDP, ZeRO 1, 2 and 3 per stage, one all-reduce), for every
// schedule, with global-norm clipping across the mesh. Two steps, then
// evaluation, equal one process on the whole batch.
TEST(PipelineMesh, DataTimesPipelineOnFourRanksEqualsSingleProcess) {
  constexpr int kWorld = 4, kSteps = 2, kBatch = 8;
  constexpr double kMaxNorm = 0.05;  // below the gradients' norm: clipping acts
  struct Reduction {
    dtrain::pipeline::StageSyncFactory sync;
    int zero_stage;
    const char* name;
  };
  const Reduction reductions[] = {{dtrain::pipeline::ddp_stage_sync(), 0, "ddp"},
                                  {dtrain::pipeline::zero_stage_sync({.stage = 1}), 1, "zero1"},
                                  {dtrain::pipeline::zero_stage_sync({.stage = 2}), 2, "zero2"},
                                  {dtrain::pipeline::zero_stage_sync({.stage = 3}), 3, "zero3"},
                                  {dtrain::pipeline::allreduce_stage_sync(), 0, "all-reduce"}};
  run_rank_threads(kWorld, [&](int rank, dtrain::dist::Store store) {
    auto world = dtrain::dist::init_process_group(store, rank, kWorld, {.timeout = std::chrono::seconds(30)});
    dtrain::dist::DeviceMesh mesh(world, {{"pp", 2}, {"dp_replicate", 2}});
    EXPECT_EQ(mesh["pp"].size(), 2);
    EXPECT_EQ(mesh["dp_replicate"].size(), 2);
    for (const ScheduleKind kind : kKinds) {
      for (const Reduction& reduction : reductions) {
        const std::string where = to_string(kind) + " " + reduction.name + " rank " + std::to_string(rank);
        const int v = stages_per_rank(kind);
        const gpt::GptConfig config = tiny_config(2 * v);
        torch::nn::Sequential layers = gpt::gpt_layers(config);
        gpt::init_weights(*layers, config.n_layer, 7);
        dtrain::pipeline::PipelineOptions options{.schedule = kind,
                                                  .micro_batches = 2,
                                                  .data_parallel_group = mesh["dp_replicate"],
                                                  .stage_sync = reduction.sync};
        Pipeline pipe(gpt::pipeline_stages(layers, 2, v, mesh.coordinate("pp")), mesh["pp"], options, gpt::lm_loss);
        EXPECT_EQ(pipe.sharded_stages().size(), reduction.zero_stage ? std::size_t(v) : 0) << where;
        torch::optim::SGD opt(pipe.parameters(), 0.1);
        gpt::Gpt reference(config);
        gpt::init_weights(*reference, config.n_layer, 7);
        torch::optim::SGD ref_opt(reference->parameters(), 0.1);
        for (int step = 0; step < kSteps; ++step) {
          const Batch b = batch_for(config, kBatch, step);
          const auto half = [&](const at::Tensor& t) { return t.chunk(2, 0)[mesh.coordinate("dp_replicate")]; };
          pipe.zero_grad();
          pipe.step(half(b.x), half(b.y));
          const at::Tensor norm = pipe.clip_grad_norm_(kMaxNorm);
          opt.step();
          ref_opt.zero_grad();
          gpt::lm_loss(reference->forward(b.x), b.y).backward();
          const at::Tensor ref_norm = dtrain::clip_grad_norm_(reference->parameters(), kMaxNorm);
          ref_opt.step();
          expect_close(norm, ref_norm, where + " global norm at step " + std::to_string(step));
        }
        // Evaluation (which also brings sharded stages' full parameters and
        // the borrowed tied copies up to date) equals the reference's forward.
        const Batch eval = batch_for(config, 4, 99);
        const at::Tensor out = pipe.forward(eval.x);
        if (mesh.coordinate("pp") == 1) {
          at::NoGradGuard no_grad;
          expect_close(out, reference->forward(eval.x), where + " eval output");
        }
        // ZeRO-3 frees the stages' full parameters between steps: gather them.
        std::vector<std::unique_ptr<dtrain::ShardedDataParallel::FullParameters>> full;
        for (auto* sdp : pipe.sharded_stages())
          full.push_back(std::make_unique<dtrain::ShardedDataParallel::FullParameters>(*sdp));
        auto ref_params = reference->layers->named_parameters();
        for (const auto& stage : pipe.stages()) {
          for (const auto& item : stage.module->named_parameters())
            expect_close(item.value().detach(), ref_params[item.key()].detach(), where + " " + item.key());
          for (const auto& tied : stage.tied)
            expect_close(tied.parameter.detach(), ref_params["embed.wte.weight"].detach(), where + " tied");
        }
      }
    }
  });
}

// Three stage processes; the last is SIGKILLed inside its loss at step 2.
// Stage 1 waits for its gradient, stage 0 for stage 1's: each gets a
// CommunicationError naming the peer it waited on, and stops.
TEST(PipelinePeerDeath, SurvivingStagesGetCommunicationErrorNamingThePeer) {
  constexpr int kRanks = 3, kKillStep = 2;
  const auto outcomes =
      run_rank_processes(kRanks,
                         [&](int rank) {
                           auto group = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(20)});
                           const gpt::GptConfig config = tiny_config(kRanks);
                           torch::nn::Sequential layers = gpt::gpt_layers(config);
                           gpt::init_weights(*layers, config.n_layer, 7);
                           int step = 0;
                           auto loss = [&](const at::Tensor& out, const at::Tensor& target) {
                             if (step == kKillStep) std::raise(SIGKILL);
                             return gpt::lm_loss(out, target);
                           };
                           Pipeline pipe(gpt::pipeline_stages(layers, kRanks, 1, rank), group,
                                         {.schedule = ScheduleKind::k1F1B, .micro_batches = 4}, loss);
                           try {
                             for (; step < 5; ++step)
                               pipe.step(batch_for(config, 8, step).x, batch_for(config, 8, step).y);
                             ADD_FAILURE() << "rank " << rank << " finished without its peers";
                           } catch (const dtrain::CommunicationError& e) {
                             std::cerr << "survivor at step " << step << ": " << e.what() << std::endl;
                           }
                         },
                         {.timeout = std::chrono::seconds(60), .expect_success = false});
  for (int rank = 0; rank < 2; ++rank) {
    const std::string& out = outcomes[rank].output;
    EXPECT_FALSE(outcomes[rank].timed_out) << out;
    EXPECT_NE(out.find("survivor at step 2: [rank " + std::to_string(rank) + "/3]"), std::string::npos) << out;
    EXPECT_NE(out.find("peer rank " + std::to_string(rank + 1)), std::string::npos) << out;
  }
  EXPECT_EQ(outcomes[2].signal, SIGKILL);
}

// The cut comes from the placement planner: profiled compute balanced, memory
// budgets respected (or a ConfigError saying what is missing), no stage empty.
TEST(PipelineStages, PlannedCutBalancesComputeUnderBudgets) {
  torch::nn::Sequential layers = gpt::gpt_layers(tiny_config(2));  // embed, block0, block1, head
  std::vector<dtrain::LayerCost> costs;
  for (const auto& item : layers->named_children()) costs.push_back({.name = item.key(), .bytes = 10, .compute = 1});
  costs[3].compute = 3;  // a heavy head gets a stage of its own
  EXPECT_EQ(dtrain::pipeline::plan_stages(layers, 2, costs), (std::vector<std::size_t>{0, 0, 0, 1}));
  EXPECT_EQ(dtrain::pipeline::plan_stages(layers, 4, costs), (std::vector<std::size_t>{0, 1, 2, 3}));
  EXPECT_THROW(dtrain::pipeline::plan_stages(layers, 2, costs, {15, 15}), dtrain::ConfigError);
  EXPECT_THROW(dtrain::pipeline::plan_stages(layers, 5, costs), dtrain::ConfigError);
  const auto stages = dtrain::pipeline::split_stages(layers, {0, 0, 0, 1});
  ASSERT_EQ(stages.size(), 2u);
  EXPECT_EQ(stages[0]->size(), 3u);
  EXPECT_EQ(stages[1]->named_children()[0].key(), "head");
}
