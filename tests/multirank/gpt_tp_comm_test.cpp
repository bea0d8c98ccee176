// Communication volume of the GPT under tensor parallelism, per layer and per
// step (forward + backward), counted by the tp group's own counters
// (dist::traffic) against the formula of issue 25 / Megatron (Shoeybi et al.
// 2019; Korthikanti et al. 2022), with N = b s h fp32 elements and t the
// degree. Counted bytes are the argument's payload (traffic.h): an
// all-reduce's tensor, an all-gather's part, a reduce-scatter's whole input.
//
//   TP       4 all-reduces of N per layer: g after the attention and the MLP
//            row-parallel layers in forward, f before the QKV and fc
//            column-parallel layers in backward.
//   TP + SP  the all-reduces become all-gathers (the sequence's 1/t in,
//            N/t counted) and reduce-scatters (N counted): forward 2 + 2,
//            backward 2 + 2; on the wire ((t-1)/t N each, an all-reduce
//            being a reduce-scatter plus an all-gather) the same volume as
//            TP's 4 all-reduces. Two more all-gathers per layer in backward:
//            the column layers keep only their 1/t of the sequence and
//            gather it again (Note in nn::tp::gathered_linear, as Megatron),
//            which buys the 1/t activations gpt_tp_memory_test measures. And
//            the two LayerNorm gains, replicated over tp with partial
//            gradients under SP, are all-reduced in backward (h each).
//
// Measured as the counters' difference between a 4-block and a 2-block GPT
// over one forward and backward, halved: the embedding, the head and the
// loss cancel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <iostream>
#include <string>

#include "dtrain/comm/mesh.h"
#include "dtrain/comm/traffic.h"
#include "model.h"
#include "ranks.h"
#include "tensor_parallel.h"

namespace {

using dtrain::dist::OpKind;

struct TpLayerTraffic {
  dtrain::dist::Traffic::Count all_reduce, all_gather, reduce_scatter, other;
};

// The tp group's counters over one forward and backward of a `layers`-block GPT.
dtrain::dist::Traffic tp_step_traffic(dtrain::dist::DeviceMesh& mesh, std::int64_t layers, bool sp, std::int64_t batch,
                                      std::int64_t seq) {
  const gpt::GptConfig config{.vocab_size = 65, .block_size = seq, .n_layer = layers, .n_head = 4, .n_embd = 64};
  torch::nn::Sequential full = gpt::gpt_layers(config);
  gpt::init_weights(*full, config.n_layer, 11);
  torch::nn::Sequential model = gpt::apply_tp(full, mesh, {.sequence_parallel = sp});
  const at::Tensor idx = at::arange(batch * seq).remainder(65).view({batch, seq});
  const at::Tensor targets = idx.roll(1, 1);
  dtrain::dist::ProcessGroup tp = mesh["tp"];
  const dtrain::dist::Traffic before = dtrain::dist::traffic(tp);
  gpt::tp_lm_loss(model->forward(idx), targets, tp, config.vocab_size).backward();
  const dtrain::dist::Traffic after = dtrain::dist::traffic(tp);
  dtrain::dist::Traffic step;
  for (int k = 0; k < dtrain::dist::kOpKinds; ++k) {
    step.by_kind[k] = {after.by_kind[k].ops - before.by_kind[k].ops, after.by_kind[k].bytes - before.by_kind[k].bytes};
  }
  return step;
}

// Per layer: half the difference of 4 and 2 blocks; a count that does not
// halve exactly fails the test (it would not be per layer).
TpLayerTraffic per_layer(const dtrain::dist::Traffic& deep, const dtrain::dist::Traffic& shallow) {
  auto half = [&](OpKind kind) {
    const auto d = deep[kind], s = shallow[kind];
    EXPECT_EQ((d.ops - s.ops) % 2, 0) << to_string(kind);
    EXPECT_EQ((d.bytes - s.bytes) % 2, 0) << to_string(kind);
    return dtrain::dist::Traffic::Count{(d.ops - s.ops) / 2, (d.bytes - s.bytes) / 2};
  };
  TpLayerTraffic t{half(OpKind::kAllReduce), half(OpKind::kAllGather), half(OpKind::kReduceScatter), {}};
  for (OpKind kind : {OpKind::kBroadcast, OpKind::kBarrier, OpKind::kSend, OpKind::kRecv}) {
    const auto c = half(kind);
    t.other.ops += c.ops;
    t.other.bytes += c.bytes;
  }
  return t;
}

class GptTpCommunication : public ::testing::TestWithParam<int> {};

}  // namespace

TEST_P(GptTpCommunication, PerLayerVolumeFollowsTheFormula) {
  const int world = GetParam();
  const auto outcomes = dtrain::testing::run_rank_processes(
      world,
      [&](int rank) {
        at::set_num_threads(1);
        auto group = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(60)});
        dtrain::dist::DeviceMesh mesh(group, {{"tp", world}});
        const std::int64_t batch = 3, seq = 16, h = 64, t = world;
        const std::int64_t n_bytes = batch * seq * h * 4;  // N fp32 elements
        double wire_tp = 0, wire_sp = 0, wire_sp_regather = 0;
        for (bool sp : {false, true}) {
          const TpLayerTraffic layer =
              per_layer(tp_step_traffic(mesh, 4, sp, batch, seq), tp_step_traffic(mesh, 2, sp, batch, seq));
          const std::string what =
              std::string(sp ? "tp+sp " : "tp ") + std::to_string(world) + ", rank " + std::to_string(rank);
          EXPECT_EQ(layer.other.ops, 0) << what << ": broadcasts, barriers or p2p inside a layer";
          if (!sp) {
            EXPECT_EQ(layer.all_reduce.ops, 4) << what;
            EXPECT_EQ(layer.all_reduce.bytes, 4 * n_bytes) << what;
            EXPECT_EQ(layer.all_gather.ops, 0) << what;
            EXPECT_EQ(layer.reduce_scatter.ops, 0) << what;
            wire_tp = 2.0 * (t - 1) / t * static_cast<double>(layer.all_reduce.bytes);
          } else {
            EXPECT_EQ(layer.all_gather.ops, 6) << what;  // 2 forward, 2 backward of the reduce-scatters, 2 re-gathers
            EXPECT_EQ(layer.all_gather.bytes, 6 * n_bytes / t) << what;
            EXPECT_EQ(layer.reduce_scatter.ops, 4) << what;  // 2 forward, 2 backward of the all-gathers
            EXPECT_EQ(layer.reduce_scatter.bytes, 4 * n_bytes) << what;
            EXPECT_EQ(layer.all_reduce.ops, 2) << what;  // the LayerNorm gains' partial gradients
            EXPECT_EQ(layer.all_reduce.bytes, 2 * h * 4) << what;
            // On the wire: an all-gather moves (t-1) parts, a reduce-scatter (t-1)/t of its input.
            const double ag = static_cast<double>(layer.all_gather.bytes) / layer.all_gather.ops * (t - 1);
            const double rs = static_cast<double>(layer.reduce_scatter.bytes) / layer.reduce_scatter.ops * (t - 1) / t;
            wire_sp = 4 * ag + 4 * rs;
            wire_sp_regather = 2 * ag;
          }
        }
        // Sequence parallelism's activations-sized traffic is TP's, bit for bit,
        // besides the backward re-gathers.
        EXPECT_DOUBLE_EQ(wire_sp, wire_tp);
        std::cout << "tp " << world << ", rank " << rank << ": per layer and step on the wire, TP " << wire_tp
                  << " bytes, SP " << wire_sp << " + " << wire_sp_regather << " (backward re-gathers) bytes"
                  << std::endl;
      },
      {.timeout = std::chrono::seconds(120)});
  for (const auto& outcome : outcomes) std::cout << outcome.output;  // the figures
}

INSTANTIATE_TEST_SUITE_P(Degrees, GptTpCommunication, ::testing::Values(2, 4),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });
