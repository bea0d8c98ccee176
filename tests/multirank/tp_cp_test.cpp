// Tensor and context parallelism together: tp 2 x cp 2 on 4 processes, a
// cp group inside each tp coordinate. An attention block whose fused QKV is
// column-parallel (tp splits the heads) and whose output projection is
// row-parallel, its causal attention run by nn::cp::causal_attention over
// mesh["cp"] on this rank's heads and zig-zag part of the sequence; a
// replicated head. Gradients are averaged over cp by DDP (parameters are
// Replicate on cp; nn::cp::mean_loss), the norm combines over tp from the
// layouts. Three SGD steps with clipping (acting) equal one process on the
// whole sequences (rtol 1e-5): losses, norms, every rank's parameter parts.
// Then the 4-D plan, dp_shard x pp x cp x tp on 16 processes (below).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <iostream>
#include <sstream>

#include "dtrain/comm/mesh.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/dist/clip.h"
#include "dtrain/nn/context_parallel.h"
#include "dtrain/parallel/ddp/ddp.h"
#include "dtrain/parallel/pipeline/pipeline.h"
#include "ranks.h"
#include "tp_compose_model.h"

using namespace dtrain::testing::tp_compose;

namespace {

// `blocks` attention blocks ("0".."blocks-1") and a replicated head.
torch::nn::Sequential tp_cp_reference(int blocks) {
  torch::manual_seed(2512);
  torch::nn::Sequential net;
  for (int i = 0; i < blocks; ++i) net->push_back(std::to_string(i), RefAttention());
  net->push_back(std::to_string(blocks), torch::nn::Linear(kTpCpWidth, kClasses));
  return net;
}

torch::nn::Sequential tp_cp_net(dtrain::dist::DeviceMesh& mesh, int blocks) {
  torch::nn::Sequential ref = tp_cp_reference(blocks);
  torch::nn::Sequential net;
  torch::NoGradGuard no_grad;
  for (int i = 0; i < blocks; ++i) {
    TpCpAttention block(mesh);
    auto src = ref[i]->as<RefAttentionImpl>();
    block->qkv->copy_from_full(src->qkv->weight, src->qkv->bias);
    block->proj->copy_from_full(src->proj->weight, src->proj->bias);
    block->ln->weight.copy_(src->ln->weight);
    block->ln->bias.copy_(src->ln->bias);
    net->push_back(std::to_string(i), block);
  }
  torch::nn::Linear head(kTpCpWidth, kClasses);
  head->weight.copy_(ref[blocks]->as<torch::nn::LinearImpl>()->weight);
  head->bias.copy_(ref[blocks]->as<torch::nn::LinearImpl>()->bias);
  net->push_back(std::to_string(blocks), head);
  return net;
}

// SGD with momentum rather than AdamW: the key projection's bias has an
// exactly zero gradient (softmax ignores a shift shared by all keys), so
// its computed gradient is rounding noise, which Adam's first steps turn
// into lr * sign(noise), different in every summation order.
torch::optim::SGDOptions tp_cp_sgd() {
  return torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01);
}

at::Tensor token_loss(const at::Tensor& out, const at::Tensor& y) {
  return compose_loss(out.reshape({-1, kClasses}), y.reshape({-1}));
}

}  // namespace

TEST(TpCompose, TensorTimesContextParallelEqualsOneProcess) {
  constexpr int kSteps = 3;
  constexpr double kMaxNorm = 0.1;
  dtrain::testing::run_rank_processes(
      4,
      [&](int rank) {
        auto world = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(60)});
        dtrain::dist::DeviceMesh mesh(world, {{"cp", 2}, {"tp", 2}});
        const std::string where = "rank " + std::to_string(rank);
        std::ostringstream failures;
        torch::nn::Sequential net = tp_cp_net(mesh, 1);
        dtrain::DistributedDataParallel<torch::nn::Sequential> ddp(net, mesh["cp"]);
        torch::optim::SGD opt(net->parameters(), tp_cp_sgd());
        std::vector<std::pair<at::Tensor, dtrain::dist::Layout>> laid_out;
        const auto params = net->named_parameters();
        const auto layouts = dtrain::dist::named_layouts(*net, mesh);
        for (std::size_t i = 0; i < params.size(); ++i) laid_out.emplace_back(params[i].value(), layouts[i].second);
        const dtrain::GradientSet gradients = dtrain::GradientSet::from_layouts(laid_out, mesh);
        torch::nn::Sequential reference = tp_cp_reference(1);
        torch::optim::SGD ref_opt(reference->parameters(), tp_cp_sgd());
        const int cp = mesh.coordinate("cp");
        for (int step = 0; step < kSteps; ++step) {
          at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(900 + step);
          const at::Tensor x = at::randn({kTpCpBatch, kTpCpSeq, kTpCpWidth}, gen);
          const at::Tensor y = at::randint(0, kClasses, {kTpCpBatch, kTpCpSeq}, gen);
          ddp.zero_grad();
          const at::Tensor out = ddp.forward(dtrain::nn::cp::zigzag_shard(x, 2, cp, 1));
          const at::Tensor loss =
              dtrain::nn::cp::mean_loss(token_loss(out, dtrain::nn::cp::zigzag_shard(y, 2, cp, 1)), mesh["cp"]);
          loss.backward();
          const at::Tensor norm = dtrain::clip_grad_norm_(gradients, kMaxNorm);
          opt.step();
          ref_opt.zero_grad();
          const at::Tensor ref_loss = token_loss(reference->forward(x), y);
          ref_loss.backward();
          const at::Tensor ref_norm = dtrain::clip_grad_norm_(reference->parameters(), kMaxNorm);
          ref_opt.step();
          if (step == 0 && ref_norm.item<double>() <= kMaxNorm) failures << where << ": clipping did not act\n";
          compose_close(norm, ref_norm, where + " norm at step " + std::to_string(step), failures);
          compose_close(loss.detach(), ref_loss.detach(), where + " loss at step " + std::to_string(step), failures);
        }
        EXPECT_EQ(compare_parts(*net, mesh, reference, where, failures), 8);
        EXPECT_TRUE(failures.str().empty()) << failures.str();
        if (!failures.str().empty()) std::cerr << failures.str();
      },
      {.timeout = std::chrono::seconds(120)});
}

// The 4-D plan: dp_shard 2 x pp 2 x cp 2 x tp 2 on 16 processes. Three
// attention blocks and the head cut into 2 stages (1f1b, 2 micro-batches),
// each stage sharded by ZeRO over dp_shard x cp (its gradients averaged over
// the cp ranks as well, ZeroOptions::shard_dims), heads split over tp, the
// ring over cp, the loss averaged over cp; three SGD steps with clipping
// (norms from the layouts over the whole mesh) equal one process on the
// union batch of whole sequences (rtol 1e-5).
TEST(TpCompose, FourDimensionalPlanEqualsOneProcess) {
  using dtrain::pipeline::ScheduleKind;
  constexpr int kSteps = 3, kBatch = 12, kMicro = 2, kBlocks = 3;
  constexpr double kMaxNorm = 0.1;
  dtrain::testing::run_rank_processes(
      16,
      [&](int rank) {
        auto world = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(120)});
        dtrain::dist::DeviceMesh mesh(world, {{"pp", 2}, {"dp_shard", 2}, {"cp", 2}, {"tp", 2}});
        const std::string where = "rank " + std::to_string(rank);
        std::ostringstream failures;
        const int cp = mesh.coordinate("cp"), dp = mesh.coordinate("dp_shard");
        torch::nn::Sequential net = tp_cp_net(mesh, kBlocks);
        const auto stages = dtrain::pipeline::split_stages(net, {0, 0, 1, 1});
        dtrain::pipeline::PipelineOptions options{
            .schedule = ScheduleKind::k1F1B,
            .micro_batches = kMicro,
            .data_parallel_group = mesh.join({"dp_shard", "cp"}),
            .stage_sync = dtrain::pipeline::zero_stage_sync({.stage = 3, .shard_dims = {"dp_shard", "cp"}}),
            .mesh = mesh};
        dtrain::dist::ProcessGroup cp_group = mesh["cp"];
        auto loss_fn = [cp_group](const at::Tensor& out, const at::Tensor& y) {
          return dtrain::nn::cp::mean_loss(token_loss(out, y), cp_group);
        };
        std::vector<dtrain::pipeline::PipelineStage> mine;
        mine.push_back({.module = stages[mesh.coordinate("pp")]});
        dtrain::pipeline::Pipeline pipe(std::move(mine), mesh["pp"], options, loss_fn);
        torch::optim::SGD opt(pipe.parameters(), tp_cp_sgd());
        torch::nn::Sequential reference = tp_cp_reference(kBlocks);
        torch::optim::SGD ref_opt(reference->parameters(), tp_cp_sgd());
        for (int step = 0; step < kSteps; ++step) {
          at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(950 + step);
          const at::Tensor x = at::randn({kBatch, kTpCpSeq, kTpCpWidth}, gen);
          const at::Tensor y = at::randint(0, kClasses, {kBatch, kTpCpSeq}, gen);
          const auto mine = [&](const at::Tensor& t) {
            return dtrain::nn::cp::zigzag_shard(t.chunk(2, 0)[dp], 2, cp, 1);
          };
          pipe.zero_grad();
          const at::Tensor loss = pipe.step(mine(x), mine(y));
          const at::Tensor norm = pipe.clip_grad_norm_(kMaxNorm);
          opt.step();
          ref_opt.zero_grad();
          const at::Tensor ref_loss = token_loss(reference->forward(x), y);
          ref_loss.backward();
          const at::Tensor ref_norm = dtrain::clip_grad_norm_(reference->parameters(), kMaxNorm);
          ref_opt.step();
          if (step == 0 && ref_norm.item<double>() <= kMaxNorm) failures << where << ": clipping did not act\n";
          compose_close(norm, ref_norm, where + " norm at step " + std::to_string(step), failures);
          if (loss.defined()) {
            at::Tensor both = loss.detach().reshape({1}).clone();
            mesh["dp_shard"].all_reduce(both, dtrain::dist::ReduceOp::kAvg).wait();
            compose_close(both.reshape({}), ref_loss.detach(), where + " loss at step " + std::to_string(step),
                          failures);
          }
        }
        int compared = 0;
        {
          dtrain::ShardedDataParallel::FullParameters full(*pipe.sharded_stages().at(0));
          compared = compare_parts(*pipe.stages().front().module, mesh, reference, where, failures);
        }
        EXPECT_EQ(compared, mesh.coordinate("pp") == 0 ? 12 : 8);  // 2 blocks; 1 block and the head
        EXPECT_TRUE(failures.str().empty()) << failures.str();
        if (!failures.str().empty()) std::cerr << failures.str();
      },
      {.timeout = std::chrono::seconds(300)});
}
