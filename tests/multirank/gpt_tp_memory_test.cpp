// Activation memory of the GPT under tensor parallelism, per rank and per
// layer, against Korthikanti et al. 2022's formulas (section 4.2), written
// for this model as tests/unit/recompute_test.cpp writes the unsplit one:
// fp32 activations (4 bytes), no dropout (so no masks).
//
// Their per-layer count in 16-bit with dropout masks, t = tp degree:
//   TP       sbh (10 + 24/t + 5as/(ht))
//   TP + SP  sbh (34 + 5as/h) / t
// Term by term, in elements: LayerNorm inputs 2 sbh, the QKV and fc inputs
// (the LayerNorms' outputs) 2 sbh, Q K V 3 sbh/t, the output projection's
// input sbh/t, the fc output (GELU's input) 4 sbh/t and GELU's output (the
// second product's input) 4 sbh/t, plus the attention matrix a s^2 b / t
// (math kernel) or flash attention's log-sum-exp a s b / t (fp32). Their
// 16-bit masks (2 sbh + a s^2 b / t bytes) do not exist here. So per layer:
//   TP       4 (4 sbh + 12 sbh/t) + attention
//   TP + SP  4 (16 sbh) / t + attention
// Under SP the column layers keep only their 1/t of the sequence and gather
// it again in backward (nn::tp::gathered_linear); without that the gathered
// inputs would add 2 sbh (1 - 1/t) elements, 12% of the SP figure at t 2.
//
// Measured in real processes (CpuMemoryStats counts the whole process), as
// the live CPU tensor bytes after forward and loss minus before, for 4 and 2
// blocks: half the difference is one layer (embedding, head, logits and loss
// cancel).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <iostream>
#include <string>

#include "dtrain/comm/mesh.h"
#include "dtrain/memory_stats.h"
#include "model.h"
#include "ranks.h"
#include "tensor_parallel.h"

namespace {

// Bytes held by the tp GPT of `layers` blocks between forward and backward,
// on this rank.
std::int64_t tp_activation_bytes(dtrain::dist::DeviceMesh& mesh, std::int64_t layers, bool sp, std::int64_t batch,
                                 std::int64_t seq) {
  const gpt::GptConfig config{.vocab_size = 65, .block_size = seq, .n_layer = layers, .n_head = 8, .n_embd = 64};
  torch::nn::Sequential full = gpt::gpt_layers(config);
  gpt::init_weights(*full, config.n_layer, 11);
  torch::nn::Sequential model = gpt::apply_tp(full, mesh, {.sequence_parallel = sp});
  const at::Tensor idx = at::arange(batch * seq).remainder(65).view({batch, seq});
  const at::Tensor targets = idx.roll(1, 1);
  mesh.group().barrier();
  const std::int64_t before = dtrain::CpuMemoryStats::live_bytes();
  at::Tensor loss = gpt::tp_lm_loss(model->forward(idx), targets, mesh["tp"], config.vocab_size);
  const std::int64_t held = dtrain::CpuMemoryStats::live_bytes() - before;
  loss.backward();
  return held;
}

double korthikanti_tp_bytes(double s, double b, double h, double a, double t, bool sp, bool flash) {
  const double sbh = s * b * h;
  const double attention = 4 * (flash ? a * s * b : a * s * s * b) / t;
  return (sp ? 4 * 16 * sbh / t : 4 * (4 * sbh + 12 * sbh / t)) + attention;
}

class GptTpActivationMemory : public ::testing::TestWithParam<int> {};

}  // namespace

TEST_P(GptTpActivationMemory, PerRankPerLayerFollowsKorthikanti) {
  const int world = GetParam();
  const auto outcomes = dtrain::testing::run_rank_processes(
      world,
      [&](int rank) {
        at::set_num_threads(1);
        dtrain::CpuMemoryStats::enable();
        ASSERT_TRUE(dtrain::CpuMemoryStats::enabled());
        auto group = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(60)});
        dtrain::dist::DeviceMesh mesh(group, {{"tp", world}});
        // 8 heads, so every rank has at least 2 at tp 4: with 1 head per rank
        // the math kernel copies q and k (scaled) but uses v as the view it
        // is, which keeps the whole QKV output alive beside the copies
        // (+2 sbh/t, 10% here); from 2 heads on it copies v too and the QKV
        // output is freed.
        const std::int64_t batch = 4, seq = 64, h = 64, a = 8;
        const bool flash_was = at::globalContext().userEnabledFlashSDP();
        (void)tp_activation_bytes(mesh, 2, true, batch, seq);  // warm-up: first-use buffers of the collectives
        for (bool flash : {true, false}) {
          at::globalContext().setSDPUseFlash(flash);
          for (bool sp : {false, true}) {
            const std::int64_t deep = tp_activation_bytes(mesh, 4, sp, batch, seq);
            const std::int64_t shallow = tp_activation_bytes(mesh, 2, sp, batch, seq);
            const double measured = static_cast<double>(deep - shallow) / 2;
            const double formula = korthikanti_tp_bytes(seq, batch, h, a, world, sp, flash);
            const std::string what = std::string(sp ? "tp+sp " : "tp ") + std::to_string(world) + ", " +
                                     (flash ? "flash" : "math") + " attention, rank " + std::to_string(rank);
            std::cout << what << ": " << measured << " bytes per layer, formula " << formula << " ("
                      << (measured / formula - 1) * 100 << "%)" << std::endl;
            EXPECT_NEAR(measured / formula, 1.0, 0.10) << what << ": measured " << measured << ", formula " << formula;
          }
        }
        at::globalContext().setSDPUseFlash(flash_was);
      },
      {.timeout = std::chrono::seconds(240)});
  for (const auto& outcome : outcomes) std::cout << outcome.output;  // the figures
}

INSTANTIATE_TEST_SUITE_P(Degrees, GptTpActivationMemory, ::testing::Values(2, 4),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });
