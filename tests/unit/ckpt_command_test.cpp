// `dtrain ckpt inspect|convert` through the CLI binary: conversions between
// torch.save state dicts (also one entry of a training checkpoint),
// safetensors files and sharded folders keep every tensor bit for bit;
// inspect lists names, dtypes and the total; bad input exits 2.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>

#include "dtrain/checkpoint/safetensors.h"
#include "dtrain/checkpoint/torch_file.h"
#include "test_paths.h"

namespace {

namespace fs = std::filesystem;
namespace ck = dtrain::checkpoint;

int dtrain_cli(const std::string& args, const fs::path& output) {
  const std::string cmd =
      dtrain::testing::binary_dir() + "/tools/dtrain ckpt " + args + " > " + output.string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string read_text(const fs::path& file) {
  std::ifstream in(file);
  return {std::istreambuf_iterator<char>(in), {}};
}

void expect_same(const ck::NamedTensors& actual, const ck::NamedTensors& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (const auto& [name, t] : expected) {
    bool found = false;
    for (const auto& [n, a] : actual) {
      if (n != name) continue;
      found = true;
      EXPECT_EQ(a.scalar_type(), t.scalar_type()) << name;
      EXPECT_EQ(a.sizes(), t.sizes()) << name;
      const auto ac = a.contiguous(), tc = t.contiguous();
      EXPECT_EQ(std::memcmp(ac.data_ptr(), tc.data_ptr(), tc.nbytes()), 0) << name;
    }
    EXPECT_TRUE(found) << name;
  }
}

}  // namespace

TEST(CkptCommand, ConvertsBitwiseAndInspects) {
  const auto dir = fs::temp_directory_path() / ("dtrain-ckpt-cli-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const ck::NamedTensors sd = {{"embed.weight", at::randn({10, 4})},
                               {"block.bias", at::randn({4}).to(at::kBFloat16)},
                               {"steps", at::arange(3, at::kLong)},
                               {"mask", at::ones({2, 2}, at::kBool)}};
  c10::impl::GenericDict checkpoint(c10::StringType::get(), c10::AnyType::get());
  checkpoint.insert("model", ck::state_dict_value(sd));
  checkpoint.insert("step", 3);
  ck::save_torch_file(dir / "train.pt", checkpoint);
  const auto log = dir / "out.txt";

  ASSERT_EQ(dtrain_cli("convert --to safetensors --key model " + (dir / "train.pt").string() + " " +
                           (dir / "model.safetensors").string(),
                       log),
            0)
      << read_text(log);
  expect_same(ck::load_safetensors(dir / "model.safetensors").tensors, sd);
  ASSERT_EQ(
      dtrain_cli("convert --to torch " + (dir / "model.safetensors").string() + " " + (dir / "back.pt").string(), log),
      0)
      << read_text(log);
  expect_same(ck::load_torch_state_dict(dir / "back.pt"), sd);
  ASSERT_EQ(dtrain_cli("convert --to safetensors --max-shard-bytes 40 " + (dir / "back.pt").string() + " " +
                           (dir / "sharded").string(),
                       log),
            0)
      << read_text(log);
  EXPECT_TRUE(fs::exists(dir / "sharded" / "model.safetensors.index.json"));
  expect_same(ck::load_safetensors_dir(dir / "sharded").tensors, sd);

  ASSERT_EQ(dtrain_cli("inspect " + (dir / "sharded").string(), log), 0) << read_text(log);
  const std::string listing = read_text(log);
  for (const auto& [name, t] : sd) EXPECT_NE(listing.find(name), std::string::npos) << listing;
  EXPECT_NE(listing.find("BFloat16"), std::string::npos) << listing;
  EXPECT_NE(listing.find("total 196 bytes"), std::string::npos) << listing;  // 160 + 8 + 24 + 4

  EXPECT_EQ(dtrain_cli("inspect " + (dir / "missing.safetensors").string(), log), 2);
  EXPECT_EQ(dtrain_cli("inspect " + (dir / "train.pt").string(), log), 2);  // a checkpoint: needs --key
  EXPECT_NE(read_text(log).find("--key"), std::string::npos) << read_text(log);
  fs::remove_all(dir);
}
