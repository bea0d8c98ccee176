// examples/gpt's --export-hf and --init-from-hf through the binary: a ZeRO-3
// run on 2 ranks exports exactly the parameters it trained (--save-params),
// under GPT-2's names and layouts; a ZeRO-3 run started from that folder
// begins where the first ended (its step-0 validation loss is the first
// run's last) and trains.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/checkpoint/safetensors.h"
#include "example_run.h"

namespace {

namespace fs = std::filesystem;
namespace ck = dtrain::checkpoint;

const std::string kHfExample = std::string(DTRAIN_BINARY_DIR) + "/examples/gpt";
const std::string kHfLaunch = std::string(DTRAIN_BINARY_DIR) + "/tools/dtrain run --nproc-per-node 2";
const std::string kHfCommon =
    "--strategy zero3 --max-iters 3 --eval-interval 3 --eval-iters 2 --sample-tokens 0 --seed 5 --devices cpu "
    "--batch-size 2 ";

// The HF tensors in the GPT's parameter order (Conv1D weights transposed
// back), flattened: what --save-params writes for a bias-free model.
std::vector<float> in_dtrain_order(const ck::NamedTensors& hf, int n_layer) {
  std::vector<std::string> order = {"transformer.wte.weight", "transformer.wpe.weight"};
  for (int i = 0; i < n_layer; ++i) {
    const std::string p = "transformer.h." + std::to_string(i) + ".";
    for (const char* n : {"ln_1.weight", "attn.c_attn.weight", "attn.c_proj.weight", "ln_2.weight", "mlp.c_fc.weight",
                          "mlp.c_proj.weight"})
      order.push_back(p + n);
  }
  order.push_back("transformer.ln_f.weight");
  std::vector<float> out;
  for (const auto& name : order) {
    at::Tensor t;
    for (const auto& [n, v] : hf)
      if (n == name) t = v;
    EXPECT_TRUE(t.defined()) << name;
    if (!t.defined()) return {};
    if (name.find(".c_") != std::string::npos) t = t.t();
    t = t.contiguous();
    out.insert(out.end(), t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
  }
  return out;
}

}  // namespace

TEST(GptHfExample, Zero3ExportsWhatItTrainedAndResumesFromIt) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  const auto dir = fs::temp_directory_path() / ("dtrain-gpt-hf-example-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto first =
      dtrain::testing::run_example(kHfExample,
                                   kHfCommon + "--n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --export-hf " +
                                       (dir / "hf").string() + " --save-params " + (dir / "trained.f32").string(),
                                   kHfLaunch);
  ASSERT_EQ(first.exit_code, 0) << first.stderr_text;
  const auto trained = dtrain::testing::read_floats(dir / "trained.f32");
  const auto hf = ck::load_safetensors_dir(dir / "hf").tensors;
  EXPECT_EQ(hf.size(), 2u + 2 * 12 + 2);  // embeddings, 12 per block (biases zero), ln_f weight and bias
  const auto exported = in_dtrain_order(hf, 2);
  ASSERT_EQ(exported.size(), trained.size());
  EXPECT_EQ(std::memcmp(exported.data(), trained.data(), trained.size() * sizeof(float)), 0);

  // Sizes come from the folder: the flags that would contradict it are absent.
  const auto second =
      dtrain::testing::run_example(kHfExample, kHfCommon + "--init-from-hf " + (dir / "hf").string(), kHfLaunch);
  ASSERT_EQ(second.exit_code, 0) << second.stderr_text;
  const double last = dtrain::testing::last_json_line(first.stdout_text).value("val_loss", 0.0);
  double resumed_at_0 = -1;
  std::istringstream lines(second.stdout_text);
  for (std::string line; std::getline(lines, line);)
    if (line.find("\"event\":\"eval\"") != std::string::npos && line.find("\"step\":0") != std::string::npos)
      resumed_at_0 = nlohmann::json::parse(line).value("val_loss", -2.0);
  EXPECT_NEAR(resumed_at_0, last, 1e-5 * std::abs(last)) << second.stdout_text;
  EXPECT_EQ(dtrain::testing::last_json_line(second.stdout_text).value("steps", 0), 3);
  fs::remove_all(dir);
}
