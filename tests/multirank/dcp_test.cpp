// dtrain's ZeRO checkpoints against Python's distributed checkpoints (DCP)
// and PyTorch FSDP2 (issue 26), both ways, through python/dtrain_dcp.py; the
// Python side is tests/data/checkpoint/dcp_peer.py (2 CPU ranks over Gloo).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <filesystem>
#include <map>

#include "../unit/checkpoint_files.h"
#include "dtrain/checkpoint/checkpoint_reader.h"
#include "dtrain/checkpoint/torch_file.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/parallel/zero/full_state.h"
#include "dtrain/parallel/zero/sharded_checkpoint.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "ranks.h"
#include "zero_helpers.h"

namespace {

using dtrain::testing::run_rank_threads;
using dtrain::testing::ckfiles::run_peer;
using dtrain::testing::ckfiles::temp_dir;
using namespace dtrain::testing::zero;
using Dict = c10::impl::GenericDict;

constexpr std::int64_t kDcpGlobalBatch = 12;
const std::vector<std::int64_t> kDcpWidths = {5, 8, 7, 3};  // dcp_peer.py's model

Dict dcp_test_dict() {
  return Dict(c10::AnyType::get(), c10::AnyType::get());
}

// This rank's pieces as held in memory: name -> {offset, param, exp_avg,
// exp_avg_sq, step}, for the peer to compare with what FSDP2 loaded.
c10::IValue live_pieces(dtrain::ShardedDataParallel& sdp, torch::optim::Optimizer& opt) {
  Dict pieces = dcp_test_dict();
  for (const auto& piece : sdp.parameter_shards()) {
    const auto& s = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(piece.shard.unsafeGetTensorImpl()));
    Dict d = dcp_test_dict();
    d.insert("offset", piece.offset);
    d.insert("param", piece.shard.detach().clone());
    d.insert("exp_avg", s.exp_avg().clone());
    d.insert("exp_avg_sq", s.exp_avg_sq().clone());
    d.insert("step", s.step());
    pieces.insert(piece.name, d);
  }
  Dict out = dcp_test_dict();
  out.insert("pieces", pieces);
  return out;
}

// A ZeRO-3 checkpoint of 4 ranks (ShardedCheckpointer) consolidated, written
// for Python, turned into DCP and loaded by FSDP2 on 2 ranks (dcp.load and
// set_state_dict): every parameter and AdamW state element equals, bit for
// bit, what the 4 dtrain ranks held when they saved, and the optimizer's
// options come with it.
TEST(Dcp, ZeroCheckpointOf4RanksLoadsIntoFsdp2On2) {
  const auto dir = temp_dir("dcp", "to-fsdp2");
  run_rank_threads(4, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 4, {.timeout = std::chrono::seconds(30)});
    auto model = seeded_sequential(kDcpWidths);
    dtrain::ShardedDataParallel sdp(model, group, {.stage = 3});
    torch::optim::AdamW opt(sdp.parameters(), torch::optim::AdamWOptions(0.01).betas({0.8, 0.99}).weight_decay(0.1));
    for (int step = 0; step < 3; ++step) {
      const Batch mine = global_batch(step, kDcpGlobalBatch).slice(rank * 3, 3);
      opt.zero_grad();
      loss_of(sdp(mine.x), mine.y).backward();
      opt.step();
    }
    dtrain::ShardedCheckpointer ckpt({.dir = dir / "ckpt"}, sdp, opt);
    ckpt.save(3);
    dtrain::checkpoint::save_torch_file(dir / ("live_rank_" + std::to_string(rank) + ".pt"), live_pieces(sdp, opt));
  });
  const auto folder = dtrain::open_checkpoint(dir / "ckpt");
  EXPECT_EQ(folder.step, 3);
  EXPECT_EQ(folder.world_size, 4);
  dtrain::checkpoint::save_torch_file(dir / "full.pt",
                                      dtrain::to_fsdp_state_dict(dtrain::read_zero_checkpoint(folder)));
  run_peer("dcp_peer.py", "load-fsdp2 " + (dir / "full.pt").string() + " " + dir.string());
  std::filesystem::remove_all(dir);
}

// FSDP2 on 2 ranks trains 3 steps and saves with dcp.save; converted, the
// checkpoint resumes in dtrain on 4 ranks under ZeRO-2 and ZeRO-3: the
// parameters and AdamW state equal FSDP2's full state bit for bit, the
// options are FSDP2's, and dtrain's 4th step equals FSDP2's 4th.
TEST(Dcp, Fsdp2CheckpointResumesInZeroOn4) {
  const auto dir = temp_dir("dcp", "from-fsdp2");
  run_peer("dcp_peer.py", "save-fsdp2 " + dir.string());
  const auto full = dtrain::from_fsdp_state_dict(dtrain::checkpoint::load_torch_file(dir / "full.pt"));
  const Dict ref3 = dtrain::checkpoint::load_torch_file(dir / "ref3.pt").toGenericDict();
  const Dict ref_model = ref3.at("model").toGenericDict();
  const Dict ref_state = ref3.at("optim").toGenericDict().at("state").toGenericDict();
  const Dict batch3 = dtrain::checkpoint::load_torch_file(dir / "batch3.pt").toGenericDict();
  const auto ref4 = dtrain::checkpoint::load_torch_state_dict(dir / "ref4.pt");
  for (const int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    run_rank_threads(4, [&](int rank, dtrain::dist::Store store) {
      auto group = dtrain::dist::init_process_group(store, rank, 4, {.timeout = std::chrono::seconds(30)});
      auto model = seeded_sequential(kDcpWidths);
      dtrain::ShardedDataParallel sdp(model, group, {.stage = stage});
      torch::optim::AdamW opt(sdp.parameters(), torch::optim::AdamWOptions(0.5));
      dtrain::load_zero_full_state(sdp, opt, full);
      const auto& options = static_cast<torch::optim::AdamWOptions&>(opt.param_groups()[0].options());
      EXPECT_EQ(options.lr(), 0.01);
      EXPECT_EQ(options.weight_decay(), 0.1);
      EXPECT_EQ(std::get<0>(options.betas()), 0.8);
      for (const auto& [name, value] : sdp.full_state_dict()) {
        EXPECT_TRUE(at::equal(value, ref_model.at(name).toTensor())) << name;
      }
      for (const auto& piece : sdp.parameter_shards()) {
        const auto& s = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(piece.shard.unsafeGetTensorImpl()));
        const Dict ref = ref_state.at(piece.name).toGenericDict();
        EXPECT_EQ(s.step(), 3) << piece.name;
        for (const auto& [key, t] : {std::pair{"exp_avg", s.exp_avg()}, std::pair{"exp_avg_sq", s.exp_avg_sq()}}) {
          const at::Tensor want = ref.at(key).toTensor().reshape(-1).narrow(0, piece.offset, t.numel());
          EXPECT_TRUE(at::equal(t, want)) << piece.name << "." << key;
        }
      }
      const Batch mine =
          Batch{batch3.at("x").toTensor(), batch3.at("y").toTensor()}.slice(rank * 3, kDcpGlobalBatch / 4);
      opt.zero_grad();
      loss_of(sdp(mine.x), mine.y).backward();
      opt.step();
      const auto after = sdp.full_state_dict();
      for (const auto& [name, want] : ref4) {
        EXPECT_TRUE(at::allclose(after.at(name), want, 1e-5, 1e-6))
            << name << ": max difference " << (after.at(name) - want).abs().max().item<double>();
      }
    });
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
