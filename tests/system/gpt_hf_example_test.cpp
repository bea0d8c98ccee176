// examples/gpt's --export-hf and --init-from-hf through the binary: a ZeRO-3
// run on 2 ranks exports exactly the parameters it trained (--save-params),
// under GPT-2's names and layouts; a ZeRO-3 run started from that folder
// begins where the first ended (its step-0 validation loss is the first
// run's last) and trains. The same under a pipeline and tp (below).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/checkpoint/safetensors.h"
#include "example_run.h"
#include "test_paths.h"

namespace {

namespace fs = std::filesystem;
namespace ck = dtrain::checkpoint;

const std::string kHfExample = dtrain::testing::binary_dir() + "/examples/gpt";
const std::string kHfLaunch = dtrain::testing::binary_dir() + "/tools/dtrain run --nproc-per-node 2";
const std::string kHfCommon =
    "--strategy zero3 --max-iters 3 --eval-interval 3 --eval-iters 2 --sample-tokens 0 --seed 5 --devices cpu "
    "--batch-size 2 ";

// The HF tensors in the GPT's parameter order (Conv1D weights transposed
// back), flattened: what --save-params writes (with `bias`: for a model with
// biases, each right after its weight).
std::vector<float> in_dtrain_order(const ck::NamedTensors& hf, int n_layer, bool bias = false) {
  std::vector<std::string> order = {"transformer.wte.weight", "transformer.wpe.weight"};
  for (int i = 0; i < n_layer; ++i) {
    const std::string p = "transformer.h." + std::to_string(i) + ".";
    for (const char* n : {"ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"}) {
      order.push_back(p + n + ".weight");
      if (bias) order.push_back(p + n + ".bias");
    }
  }
  order.push_back("transformer.ln_f.weight");
  if (bias) order.push_back("transformer.ln_f.bias");
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
  const auto first = dtrain::testing::run_example(
      kHfExample,
      kHfCommon + "--n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --export-hf " + (dir / "hf").string() +
          " --save-params " + (dir / "trained.f32").string() + " --checkpoint-dir " + (dir / "ckpt").string(),
      kHfLaunch);
  ASSERT_EQ(first.exit_code, 0) << first.stderr_text;
  const auto trained = dtrain::testing::read_floats(dir / "trained.f32");
  const auto hf = ck::load_safetensors_dir(dir / "hf").tensors;
  EXPECT_EQ(hf.size(), 2u + 2 * 12 + 2);  // embeddings, 12 per block (biases zero), ln_f weight and bias
  const auto exported = in_dtrain_order(hf, 2);
  ASSERT_EQ(exported.size(), trained.size());
  EXPECT_EQ(std::memcmp(exported.data(), trained.data(), trained.size() * sizeof(float)), 0);

  // The run's checkpoint (step 3, its last) records the GPT's mapping:
  // `dtrain ckpt convert --to hf` writes the same folder, tensor for tensor.
  const std::string convert = dtrain::testing::binary_dir() + "/tools/dtrain ckpt convert --to hf " +
                              (dir / "ckpt").string() + " " + (dir / "converted").string() + " > /dev/null";
  ASSERT_EQ(std::system(convert.c_str()), 0) << convert;
  const auto converted = ck::load_safetensors_dir(dir / "converted").tensors;
  ASSERT_EQ(converted.size(), hf.size());
  for (const auto& [name, t] : converted) {
    bool same = false;
    for (const auto& [n, v] : hf)
      if (n == name) same = at::equal(t, v);
    EXPECT_TRUE(same) << name;
  }

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

// --init-from-hf and --export-hf under the plans that cut the model: a
// pipeline of 2 stages and tp 2, each started from the same Hugging Face
// folder, end where `single` started from it does (3 steps; tolerances of
// gpt_zero_test.cpp and gpt_tp_test.cpp), and each exports exactly the
// parameters it trained (--save-params), bit for bit, gathered through the
// stages and the tp layouts.
TEST(GptHfExample, PipelineAndTpStartFromHfAsSingleAndExportWhatTheyTrained) {
  if (!dtrain::testing::have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  const auto dir = fs::temp_directory_path() / ("dtrain-gpt-hf-plans-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string common =
      "--max-iters 3 --eval-interval 3 --eval-iters 2 --sample-tokens 0 --seed 5 --devices cpu --batch-size 4 ";
  const auto origin = dtrain::testing::run_example(
      kHfExample, common + "--n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --export-hf " + (dir / "hf0").string(),
      "");
  ASSERT_EQ(origin.exit_code, 0) << origin.stderr_text;
  const std::string from = common + "--init-from-hf " + (dir / "hf0").string() + " ";
  auto run = [&](const std::string& name, const std::string& args, int ranks) {
    const auto r = dtrain::testing::run_example(
        kHfExample,
        from + args + " --save-params " + (dir / (name + ".f32")).string() + " --export-hf " + (dir / name).string(),
        ranks > 1 ? dtrain::testing::binary_dir() + "/tools/dtrain run --nproc-per-node " + std::to_string(ranks) : "");
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.stderr_text;
    EXPECT_EQ(dtrain::testing::last_json_line(r.stdout_text).value("steps", 0), 3) << name << r.stdout_text;
  };
  run("single", "", 1);
  run("pipeline", "--strategy pipeline --pp-schedule 1f1b --micro-batches 2", 2);
  run("tp", "--tp 2", 2);
  const auto reference = dtrain::testing::read_floats(dir / "single.f32");
  ASSERT_FALSE(reference.empty());
  for (const std::string name : {"single", "pipeline", "tp"}) {
    std::vector<float> trained;
    if (name == "pipeline") {
      for (int s = 0; s < 2; ++s) {
        const auto part = dtrain::testing::read_floats(dir / ("pipeline.f32.stage" + std::to_string(s)));
        trained.insert(trained.end(), part.begin(), part.end());
      }
    } else {
      trained = dtrain::testing::read_floats(dir / (name + ".f32"));
    }
    ASSERT_EQ(trained.size(), reference.size()) << name;
    // The start (--init-from-hf turns biases on) and the steps: as single's.
    const auto diff = dtrain::testing::compare_params(trained, reference);
    EXPECT_LE(diff.outside, name == "tp" ? 1u : 0u) << name;  // tp: see gpt_tp_test.cpp's one element
    EXPECT_LT(diff.relative_l2, 1e-5) << name;
    // The export: exactly what it trained.
    const auto exported = in_dtrain_order(ck::load_safetensors_dir(dir / name).tensors, 2, true);
    ASSERT_EQ(exported.size(), trained.size()) << name;
    EXPECT_EQ(std::memcmp(exported.data(), trained.data(), trained.size() * sizeof(float)), 0) << name;
  }
  fs::remove_all(dir);
}
