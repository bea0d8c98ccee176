// `dtrain ckpt` on dtrain's own checkpoints through the CLI binary: a ZeRO-3
// checkpoint of 2 ranks (ShardedCheckpointer) is inspected (step, ranks, CRC
// check, plan, every tensor's layout), consolidated and converted to
// safetensors, to Python's full-state structure and through DCP and back,
// each bit for bit equal to what the ranks held; a corrupted part is refused.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/optim/adamw.h>

#include <cstdlib>
#include <fstream>
#include <set>

#include "../multirank/zero_helpers.h"
#include "checkpoint_files.h"
#include "dtrain/checkpoint/safetensors.h"
#include "dtrain/checkpoint/torch_file.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/parallel/zero/sharded_checkpoint.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "ranks.h"
#include "test_paths.h"

namespace {

namespace fs = std::filesystem;
namespace ck = dtrain::checkpoint;

// `dtrain ckpt ARGS`, output into `log`; the exit status.
int ckpt_folder_cli(const std::string& args, const fs::path& log) {
  const std::string cmd = std::string("DTRAIN_PYTHON=") + DTRAIN_PYTHON + " " + dtrain::testing::binary_dir() +
                          "/tools/dtrain ckpt " + args + " > " + log.string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string ckpt_folder_log(const fs::path& file) {
  std::ifstream in(file);
  return {std::istreambuf_iterator<char>(in), {}};
}

// Every tensor of `actual` equals, bit for bit, the full parameter of its name.
void expect_full_parameters(const ck::NamedTensors& actual, const std::map<std::string, at::Tensor>& full,
                            std::size_t count) {
  EXPECT_EQ(actual.size(), count);
  for (const auto& [name, t] : actual) {
    ASSERT_TRUE(full.count(name)) << name;
    EXPECT_TRUE(at::equal(t, full.at(name))) << name;
  }
}

}  // namespace

TEST(CkptFolderCommand, InspectsConsolidatesAndConvertsZeroCheckpoints) {
  namespace tz = dtrain::testing::zero;
  const auto dir = dtrain::testing::ckfiles::temp_dir("ckpt", "folder");
  std::map<std::string, at::Tensor> full;
  std::size_t unique = 0;  // parameters, each once (make_model shares one)
  dtrain::testing::run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(30)});
    auto model = tz::make_model();
    dtrain::ShardedDataParallel sdp(model, group, {.stage = 3});
    torch::optim::AdamW opt(sdp.parameters(), torch::optim::AdamWOptions(0.01).weight_decay(0.1));
    for (int step = 0; step < 2; ++step) {
      const tz::Batch mine = tz::global_batch(step, 8).slice(rank * 4, 4);
      opt.zero_grad();
      tz::loss_of(sdp(mine.x), mine.y).backward();
      opt.step();
    }
    dtrain::ShardedCheckpointer({.dir = dir / "ckpt"}, sdp, opt).save(2);
    auto gathered = sdp.full_state_dict();
    if (rank == 0) full = gathered;
  });
  {
    std::set<const void*> seen;
    auto m = tz::make_model();
    for (const auto& p : m->parameters()) unique += seen.insert(p.unsafeGetTensorImpl()).second ? 1 : 0;
  }
  const auto log = dir / "log.txt";
  const std::string ckpt = (dir / "ckpt").string();

  ASSERT_EQ(ckpt_folder_cli("inspect " + ckpt, log), 0) << ckpt_folder_log(log);
  const std::string listing = ckpt_folder_log(log);
  for (const char* expected : {"step 2, saved by 2 ranks", "every size and CRC32 checked: ok", "plan: ZeRO", "2 shards",
                               "optimizer adamw", "unit mid [", "frozen", "exp_avg, exp_avg_sq), step 2"}) {
    EXPECT_NE(listing.find(expected), std::string::npos) << expected << " not in\n" << listing;
  }
  for (const auto& [name, t] : full) {
    if (name != "out.s") {
      EXPECT_NE(listing.find(name), std::string::npos) << name;
    }
  }

  ASSERT_EQ(ckpt_folder_cli("consolidate " + ckpt + " " + (dir / "model.safetensors").string(), log), 0)
      << ckpt_folder_log(log);
  expect_full_parameters(ck::load_safetensors(dir / "model.safetensors").tensors, full, unique);

  ASSERT_EQ(ckpt_folder_cli("convert --to torch " + ckpt + " " + (dir / "full.pt").string(), log), 0)
      << ckpt_folder_log(log);
  const auto py = ck::load_torch_file(dir / "full.pt").toGenericDict();
  expect_full_parameters(ck::load_torch_state_dict(dir / "full.pt", "model"), full, unique);
  const auto optim = py.at("optim").toGenericDict();
  EXPECT_EQ(optim.at("param_groups").toList().get(0).toGenericDict().at("lr").toDouble(), 0.01);
  const auto w_state = optim.at("state").toGenericDict().at("mid.w").toGenericDict();
  EXPECT_EQ(w_state.at("step").toTensor().item<double>(), 2.0);
  EXPECT_EQ(w_state.at("exp_avg").toTensor().sizes(), full.at("mid.w").sizes());
  EXPECT_FALSE(optim.at("state").toGenericDict().contains("mid.scale"));  // frozen

  // Through Python's DCP (python/dtrain_dcp.py) and back.
  ASSERT_EQ(ckpt_folder_cli("convert --to dcp " + ckpt + " " + (dir / "dcp").string(), log), 0) << ckpt_folder_log(log);
  EXPECT_TRUE(fs::exists(dir / "dcp" / ".metadata"));
  ASSERT_EQ(ckpt_folder_cli("consolidate " + (dir / "dcp").string() + " " + (dir / "back.safetensors").string(), log),
            0)
      << ckpt_folder_log(log);
  expect_full_parameters(ck::load_safetensors(dir / "back.safetensors").tensors, full, unique);
  ASSERT_EQ(ckpt_folder_cli("inspect " + (dir / "dcp").string(), log), 0) << ckpt_folder_log(log);
  EXPECT_NE(ckpt_folder_log(log).find("mid.w"), std::string::npos) << ckpt_folder_log(log);

  // A flipped byte in rank 1's part: refused, naming the file.
  const fs::path part = dir / "ckpt" / "step_2" / "rank_1" / "zero.pt";
  {
    std::fstream f(part, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(100);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(100);
    f.write(&c, 1);
  }
  EXPECT_EQ(ckpt_folder_cli("inspect " + (dir / "ckpt" / "step_2").string(), log), 2);
  EXPECT_NE(ckpt_folder_log(log).find("rank_1/zero.pt fails its CRC"), std::string::npos) << ckpt_folder_log(log);
  fs::remove_all(dir);
}
