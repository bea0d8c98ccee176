// torch.save files both ways against Python (tests/data/checkpoint/torch_peer.py):
// Python's state dicts (OrderedDict), every dtype, views and nested
// containers read here bit for bit; files written here opened by
// torch.load(weights_only=True), a full checkpoint resumed by a Python model
// and AdamW whose next step equals ours; forbidden globals refused.
#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <unistd.h>
#include <zlib.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "checkpoint_files.h"
#include "dtrain/checkpoint/optimizer_state.h"
#include "dtrain/checkpoint/torch_file.h"
#include "dtrain/error.h"

namespace {

namespace fs = std::filesystem;
namespace ck = dtrain::checkpoint;
using dtrain::testing::ckfiles::crc_of;
using dtrain::testing::ckfiles::read_json;
using dtrain::testing::ckfiles::run_peer;
using dtrain::testing::ckfiles::temp_dir;

std::string python_dtype(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return "float64";
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    case at::kComplexFloat: return "complex64";
    case at::kFloat8_e4m3fn: return "float8_e4m3fn";
    case at::kFloat8_e5m2: return "float8_e5m2";
    case at::kUInt16: return "uint16";
    case at::kUInt32: return "uint32";
    case at::kUInt64: return "uint64";
    default: return "?";
  }
}

nlohmann::json describe(const ck::NamedTensors& tensors) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, t] : tensors)
    out[name] = {{"dtype", python_dtype(t.scalar_type())}, {"shape", t.sizes().vec()}, {"crc32", crc_of(t)}};
  return out;
}

torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::LayerNorm(torch::nn::LayerNormOptions({3})),
                               torch::nn::Linear(3, 2));
}

ck::NamedTensors named_state(const torch::nn::Module& m) {
  ck::NamedTensors out;
  for (const auto& item : m.named_parameters()) out.emplace_back(item.key(), item.value());
  for (const auto& item : m.named_buffers()) out.emplace_back(item.key(), item.value());
  return out;
}

}  // namespace

// Python's torch.save of state dicts, every dtype, views, nested containers.
TEST(TorchFile, ReadsWhatPythonSaved) {
  const auto dir = temp_dir("torchfile", "read");
  run_peer("torch_peer.py", "write " + dir.string());

  const auto sd = ck::load_torch_state_dict(dir / "state_dict.pt");  // an OrderedDict with _metadata
  EXPECT_EQ(describe(sd), read_json(dir / "state_dict.json"));
  EXPECT_EQ(sd.front().first, "0.weight");  // the OrderedDict's order

  const auto dtypes = ck::load_torch_state_dict(dir / "dtypes.pt");
  EXPECT_EQ(describe(dtypes), read_json(dir / "dtypes.json"));
  // Views of one storage stay views of one storage, as in Python.
  const at::Tensor* row = nullptr;
  const at::Tensor* transposed = nullptr;
  for (const auto& [name, t] : dtypes) {
    if (name == "view.row") row = &t;
    if (name == "view.transposed") transposed = &t;
  }
  ASSERT_TRUE(row && transposed);
  EXPECT_TRUE(row->storage().is_alias_of(transposed->storage()));
  EXPECT_FALSE(transposed->is_contiguous());

  const auto nested = ck::load_torch_file(dir / "nested.pt").toGenericDict();
  EXPECT_EQ(nested.at("step").toInt(), 7);
  EXPECT_EQ(nested.at("lr").toDouble(), 0.25);
  EXPECT_EQ(nested.at("name").toStringRef(), "gpt");
  EXPECT_EQ(nested.at("big").toInt(), std::int64_t{1} << 40);
  EXPECT_EQ(nested.at("neg").toInt(), -3);
  const auto flags = nested.at("flags").toList();
  ASSERT_EQ(flags.size(), 3u);
  EXPECT_TRUE(flags.get(0).toBool());
  EXPECT_FALSE(flags.get(1).toBool());
  EXPECT_TRUE(flags.get(2).isNone());
  EXPECT_EQ(nested.at("betas").toTupleRef().elements().at(1).toDouble(), 0.95);
  const auto state = nested.at("state").toGenericDict();
  EXPECT_TRUE(at::equal(state.at(0).toGenericDict().at("t").toTensor(), at::ones(2)));

  try {
    ck::load_torch_file(dir / "forbidden.pt");
    ADD_FAILURE() << "loaded a pickle that calls os.system";
  } catch (const dtrain::DataError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("forbidden.pt"), std::string::npos) << what;
    EXPECT_NE(what.find("'posix.system'"), std::string::npos) << what;
    EXPECT_NE(what.find("weights-only"), std::string::npos) << what;
  }
  EXPECT_THROW(ck::load_torch_state_dict(dir / "nested.pt"), dtrain::DataError);  // values that are not tensors
}

// C++ writes; Python opens with weights_only=True, resumes model and AdamW
// from our checkpoint and takes one step; ours and Python's next step agree.
TEST(TorchFile, PythonLoadsWhatCppSaved) {
  const auto dir = temp_dir("torchfile", "write");
  // Every dtype torch.save names, non-contiguous and 0-d tensors.
  ck::NamedTensors tensors;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  for (const auto type : {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong, at::kInt, at::kShort, at::kChar,
                          at::kByte, at::kBool, at::kComplexFloat}) {
    auto raw = at::randint(0, 256, {12 * static_cast<std::int64_t>(c10::elementSize(type))}, gen, at::kByte);
    if (type == at::kBool) raw = raw.bitwise_and(1);
    tensors.emplace_back(python_dtype(type), raw.view(type).reshape({3, 4}));
  }
  tensors.emplace_back("transposed", at::arange(6, at::kFloat).reshape({2, 3}).t());
  tensors.emplace_back("scalar", at::scalar_tensor(1.5));
  ck::save_torch_state_dict(dir / "cpp_dtypes.pt", tensors);
  std::ofstream(dir / "cpp_dtypes.json") << describe(tensors).dump();

  // A model and AdamW after two steps on a fixed batch (the same initial
  // weights as the Python model: the peer's file).
  run_peer("torch_peer.py", "write " + dir.string());
  auto model = make_model();
  {
    at::NoGradGuard no_grad;
    const auto init = ck::load_torch_state_dict(dir / "state_dict.pt");
    for (auto& [name, t] : named_state(*model)) {
      bool found = false;
      for (const auto& [n, v] : init)
        if (n == name) found = (t.copy_(v), true);
      ASSERT_TRUE(found) << name;
    }
  }
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(0.01).weight_decay(0.1));
  const auto batch = at::linspace(-1, 1, 20).reshape({5, 4});
  auto train_step = [&] {
    optimizer.zero_grad();
    model->forward(batch).square().sum().backward();
    optimizer.step();
  };
  train_step();
  train_step();
  c10::impl::GenericDict checkpoint(c10::StringType::get(), c10::AnyType::get());
  checkpoint.insert("model", ck::state_dict_value(named_state(*model)));
  checkpoint.insert("optimizer", ck::python_optimizer_state_dict(optimizer));
  checkpoint.insert("step", 2);
  ck::save_torch_file(dir / "cpp_checkpoint.pt", checkpoint);

  run_peer("torch_peer.py", "check " + dir.string());
  train_step();  // the step Python took from our checkpoint
  const auto python = ck::load_torch_state_dict(dir / "py_after_step.pt");
  const auto ours = named_state(*model);
  ASSERT_EQ(python.size(), ours.size());
  for (std::size_t i = 0; i < ours.size(); ++i) {
    EXPECT_EQ(python[i].first, ours[i].first);
    EXPECT_TRUE(at::allclose(python[i].second, ours[i].second, 1e-5, 1e-7))
        << ours[i].first << ": max difference " << (python[i].second - ours[i].second).abs().max().item<double>();
    EXPECT_FALSE(at::equal(python[i].second, ck::load_torch_state_dict(dir / "cpp_checkpoint.pt", "model")[i].second))
        << "the step changed nothing";
  }
}

TEST(TorchFile, RefusesWhatItCannotReadOrWrite) {
  const auto dir = temp_dir("torchfile", "refuse");
  // LibTorch's pickler would name torch.Float8_e4m3fnStorage, which Python lacks.
  EXPECT_THROW(ck::save_torch_state_dict(dir / "f8.pt", {{"w", at::zeros(2, at::kFloat8_e4m3fn)}}),
               dtrain::ConfigError);
  EXPECT_FALSE(fs::exists(dir / "f8.pt"));
  std::ofstream(dir / "not_zip.pt") << "hello";
  EXPECT_THROW(ck::load_torch_file(dir / "not_zip.pt"), dtrain::DataError);
  EXPECT_THROW(ck::load_torch_file(dir / "missing.pt"), dtrain::DataError);
  // A valid file cut short anywhere: a DataError, never a crash.
  ck::save_torch_state_dict(dir / "ok.pt", {{"w", at::randn({64})}, {"b", at::ones(3, at::kLong)}});
  std::ifstream in(dir / "ok.pt", std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), {});
  for (std::size_t n = 0; n < bytes.size(); n += 37) {
    std::ofstream(dir / "cut.pt", std::ios::binary | std::ios::trunc)
        .write(bytes.data(), static_cast<std::streamsize>(n));
    EXPECT_THROW(ck::load_torch_file(dir / "cut.pt"), dtrain::DataError) << n << " bytes";
  }
}

// Python's pickles, mutated (bytes replaced, inserted, deleted, cut short) and
// put back into a valid zip: loading gives the value or a DataError, never
// anything else; what loads has every tensor's bytes readable.
TEST(TorchFile, FuzzedPicklesGiveOnlyDataErrors) {
  const auto dir = temp_dir("torchfile", "fuzz");
  run_peer("torch_peer.py", "write " + dir.string());
  struct Archive {
    std::vector<std::pair<std::string, std::string>> records;  // without data.pkl
    std::string pickle;
  };
  std::vector<Archive> seeds;
  for (const char* name : {"state_dict.pt", "dtypes.pt", "nested.pt"}) {
    caffe2::serialize::PyTorchStreamReader reader((dir / name).string());
    Archive a;
    for (const auto& record : reader.getAllRecords()) {
      auto [data, size] = reader.getRecord(record);
      std::string bytes(static_cast<const char*>(data.get()), size);
      if (record == "data.pkl") {
        a.pickle = bytes;
      } else if (record != "version" && record != ".data/version" && record != ".data/serialization_id") {
        a.records.emplace_back(record, bytes);  // the writer adds its own version and id
      }
    }
    ASSERT_FALSE(a.pickle.empty()) << name;
    seeds.push_back(std::move(a));
  }
  std::mt19937_64 rng(26);
  auto pick = [&](std::size_t n) { return n == 0 ? std::size_t{0} : static_cast<std::size_t>(rng() % n); };
  const auto file = dir / "case.pt";
  int loaded = 0, refused = 0;
  constexpr int kCases = 2000;
  for (int i = 0; i < kCases; ++i) {
    const Archive& seed = seeds[pick(seeds.size())];
    std::string pickle = seed.pickle;
    switch (i % 4) {
      case 0:
        for (std::size_t k = 0, n = 1 + pick(3); k < n; ++k) pickle[pick(pickle.size())] = static_cast<char>(rng());
        break;
      case 1: pickle.insert(pick(pickle.size()), 1, static_cast<char>(rng())); break;
      case 2: pickle.erase(pick(pickle.size()), 1 + pick(4)); break;
      default: pickle.resize(pick(pickle.size())); break;
    }
    {
      caffe2::serialize::PyTorchStreamWriter writer(file.string());
      for (const auto& [name, bytes] : seed.records) writer.writeRecord(name, bytes.data(), bytes.size());
      writer.writeRecord("data.pkl", pickle.data(), pickle.size());
      writer.writeEndOfFile();
    }
    try {
      const c10::IValue value = ck::load_torch_file(file);
      std::vector<c10::IValue> todo{value};
      for (std::size_t seen = 0; !todo.empty() && seen < 10000; ++seen) {  // reachable tensors, read in full
        const c10::IValue v = todo.back();
        todo.pop_back();
        if (v.isTensor()) {
          EXPECT_TRUE(v.toTensor().contiguous().view(-1).numel() >= 0);
          crc_of(v.toTensor());
        } else if (v.isGenericDict()) {
          for (const auto& kv : v.toGenericDict()) todo.push_back(kv.value());
        } else if (v.isList()) {
          for (const auto& item : v.toListRef()) todo.push_back(item);
        } else if (v.isTuple()) {
          for (const auto& item : v.toTupleRef().elements()) todo.push_back(item);
        }
      }
      ++loaded;
    } catch (const dtrain::DataError& e) {
      EXPECT_NE(std::string(e.what()).find(file.string()), std::string::npos) << e.what();
      ++refused;
    }
  }
  std::printf("%d cases: %d loaded, %d refused with a DataError\n", kCases, loaded, refused);
  EXPECT_EQ(loaded + refused, kCases);
  EXPECT_GT(refused, kCases / 2);
}

// Python's AdamW and SGD checkpoints (two steps) resume in LibTorch's
// optimizers; the third step equals Python's third.
TEST(TorchFile, CppResumesPythonOptimizers) {
  const auto dir = temp_dir("torchfile", "resume");
  run_peer("torch_peer.py", "write " + dir.string());
  const auto batch = at::linspace(-1, 1, 20).reshape({5, 4});
  for (const std::string name : {"adamw", "sgd"}) {
    auto model = make_model();
    const auto checkpoint = dir / ("py_" + name + "_checkpoint.pt");
    {
      at::NoGradGuard no_grad;
      const auto sd = ck::load_torch_state_dict(checkpoint, "model");
      for (auto& [n, t] : named_state(*model))
        for (const auto& [m, v] : sd)
          if (n == m) t.copy_(v);
    }
    // Options deliberately wrong: the state dict's must replace them.
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    if (name == "adamw") {
      optimizer = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(9.0));
    } else {
      optimizer = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(9.0));
    }
    ck::load_python_optimizer_state_dict(*optimizer, ck::load_torch_file(checkpoint).toGenericDict().at("optimizer"));
    EXPECT_EQ(optimizer->param_groups()[0].options().get_lr(), name == "adamw" ? 0.01 : 0.05);
    optimizer->zero_grad();
    model->forward(batch).square().sum().backward();
    optimizer->step();
    const auto python = ck::load_torch_state_dict(dir / ("py_" + name + "_after_third.pt"));
    const auto ours = named_state(*model);
    ASSERT_EQ(python.size(), ours.size());
    for (std::size_t i = 0; i < ours.size(); ++i) {
      EXPECT_EQ(python[i].first, ours[i].first);
      EXPECT_TRUE(at::allclose(python[i].second, ours[i].second, 1e-5, 1e-7))
          << name << " " << ours[i].first << ": max difference "
          << (python[i].second - ours[i].second).abs().max().item<double>();
    }
    // And back: our state in Python's structure loads into a fresh optimizer unchanged.
    const auto again = ck::python_optimizer_state_dict(*optimizer);
    auto fresh = make_model();
    torch::optim::AdamW other(fresh->parameters(), torch::optim::AdamWOptions(1.0));
    if (name == "adamw") {
      ck::load_python_optimizer_state_dict(other, again);
      EXPECT_EQ(other.param_groups()[0].options().get_lr(), 0.01);
    } else {
      EXPECT_THROW(ck::load_python_optimizer_state_dict(other, again), dtrain::DataError);  // SGD's state, no betas
    }
  }
}
