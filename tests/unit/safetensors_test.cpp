// safetensors files against Python's safetensors.torch (the peer script
// tests/data/checkpoint/safetensors_peer.py): every dtype both ways, bit for
// bit; sharded folders both ways; each kind of malformed file a DataError
// naming the problem; mmap'd views outliving everything else.
#include "dtrain/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint_files.h"
#include "dtrain/error.h"

namespace {

namespace fs = std::filesystem;
namespace ck = dtrain::checkpoint;
using dtrain::testing::ckfiles::crc_of;
using dtrain::testing::ckfiles::read_json;
using dtrain::testing::ckfiles::run_peer;
using dtrain::testing::ckfiles::temp_dir;

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto ca = a.contiguous(), cb = b.contiguous();
  return ca.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

const char* format_name(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return "F64";
    case at::kFloat: return "F32";
    case at::kHalf: return "F16";
    case at::kBFloat16: return "BF16";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kShort: return "I16";
    case at::kChar: return "I8";
    case at::kByte: return "U8";
    case at::kBool: return "BOOL";
    case at::kFloat8_e4m3fn: return "F8_E4M3";
    case at::kFloat8_e4m3fnuz: return "F8_E4M3FNUZ";
    case at::kFloat8_e5m2: return "F8_E5M2";
    case at::kFloat8_e5m2fnuz: return "F8_E5M2FNUZ";
    case at::kComplexFloat: return "C64";
    case at::kUInt16: return "U16";
    case at::kUInt32: return "U32";
    case at::kUInt64: return "U64";
    default: return "?";
  }
}

// Tensors of every dtype with any bit pattern (NaN payloads, -0, subnormals),
// bools 0/1, in a spread of shapes including 0-d and empty.
ck::NamedTensors every_dtype(std::uint64_t seed) {
  const std::vector<at::ScalarType> types = {at::kDouble,        at::kFloat,
                                             at::kHalf,          at::kBFloat16,
                                             at::kLong,          at::kInt,
                                             at::kShort,         at::kChar,
                                             at::kByte,          at::kBool,
                                             at::kFloat8_e4m3fn, at::kFloat8_e4m3fnuz,
                                             at::kFloat8_e5m2,   at::kFloat8_e5m2fnuz,
                                             at::kComplexFloat,  at::kUInt16,
                                             at::kUInt32,        at::kUInt64};
  const std::vector<std::vector<std::int64_t>> shapes = {{4, 3}, {5}, {}, {2, 0}, {2, 2, 3}, {1, 1}};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  ck::NamedTensors out;
  for (std::size_t i = 0; i < types.size(); ++i) {
    const auto& shape = shapes[i % shapes.size()];
    std::int64_t numel = 1;
    for (auto s : shape) numel *= s;
    const auto size = static_cast<std::int64_t>(c10::elementSize(types[i]));
    auto raw = at::randint(0, 256, {numel * size}, gen, at::TensorOptions().dtype(at::kByte));
    if (types[i] == at::kBool) raw = raw.bitwise_and(1);
    out.emplace_back(std::string("w.") + format_name(types[i]), raw.view(types[i]).reshape(shape));
  }
  return out;
}

// Every tensor in `tensors` as the peer's description says: dtype, shape, bytes.
void expect_described(const ck::NamedTensors& tensors, const nlohmann::json& report) {
  ASSERT_EQ(tensors.size(), report["tensors"].size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(report["tensors"].contains(name)) << name;
    const auto& d = report["tensors"][name];
    EXPECT_EQ(d["dtype"].get<std::string>(), format_name(t.scalar_type())) << name;
    EXPECT_EQ(d["shape"].get<std::vector<std::int64_t>>(), t.sizes().vec()) << name;
    EXPECT_EQ(d["crc32"].get<std::uint32_t>(), crc_of(t)) << name;
  }
}

const at::Tensor& find(const ck::NamedTensors& tensors, const std::string& name) {
  for (const auto& [n, t] : tensors)
    if (n == name) return t;
  throw std::runtime_error("no tensor " + name);
}

}  // namespace

TEST(Safetensors, RoundTripInCppEveryDtype) {
  const auto dir = temp_dir("safetensors", "cpp");
  const auto tensors = every_dtype(1);
  for (const bool copy : {false, true}) {
    ck::save_safetensors(dir / "a.safetensors", tensors, {.metadata = {{"step", "12"}}});
    const auto back = ck::load_safetensors(dir / "a.safetensors", {.copy = copy});
    ASSERT_EQ(back.tensors.size(), tensors.size());
    EXPECT_EQ(back.metadata, (std::map<std::string, std::string>{{"step", "12"}}));
    for (const auto& [name, t] : tensors) EXPECT_TRUE(bitwise_equal(find(back.tensors, name), t)) << name;
  }
}

// C++ writes, Python reads (and describes) and writes again, C++ reads that.
TEST(Safetensors, CppToPythonToCppBitwise) {
  const auto dir = temp_dir("safetensors", "py-roundtrip");
  const auto tensors = every_dtype(2);
  ck::save_safetensors(dir / "cpp.safetensors", tensors, {.metadata = {{"written_by", "dtrain"}}});
  run_peer("safetensors_peer.py", "roundtrip " + (dir / "cpp.safetensors").string() + " " +
                                      (dir / "py.safetensors").string() + " " + (dir / "report.json").string());
  const auto report = read_json(dir / "report.json");
  expect_described(tensors, report);
  EXPECT_EQ(report["metadata"]["written_by"], "dtrain");
  const auto back = ck::load_safetensors(dir / "py.safetensors");
  EXPECT_EQ(back.metadata.at("written_by"), "dtrain");
  ASSERT_EQ(back.tensors.size(), tensors.size());
  for (const auto& [name, t] : tensors) EXPECT_TRUE(bitwise_equal(find(back.tensors, name), t)) << name;
}

// Python writes a file and a sharded folder (its own seeded tensors); C++
// reads both and finds what Python described.
TEST(Safetensors, ReadsPythonFileAndShardedFolder) {
  const auto dir = temp_dir("safetensors", "py-make");
  run_peer("safetensors_peer.py", "make " + (dir / "py.safetensors").string() + " " + (dir / "sharded").string() + " " +
                                      (dir / "report.json").string());
  const auto report = read_json(dir / "report.json");
  const auto file = ck::load_safetensors(dir / "py.safetensors");
  expect_described(file.tensors, report);
  EXPECT_EQ(file.metadata.at("written_by"), "python");
  const auto folder = ck::load_safetensors_dir(dir / "sharded");
  expect_described(folder.tensors, report);
  EXPECT_EQ(folder.metadata.at("written_by"), "python");
}

// C++ writes shards by size; Python reads them through the index.
TEST(Safetensors, ShardedFolderReadByPython) {
  const auto dir = temp_dir("safetensors", "sharded");
  ck::NamedTensors tensors;
  for (int i = 0; i < 7; ++i) tensors.emplace_back("layer." + std::to_string(i), at::randn({10 + i, 8}));
  const auto files = ck::save_safetensors_sharded(dir, tensors, {.max_shard_bytes = 1000, .metadata = {{"k", "v"}}});
  ASSERT_GT(files.size(), 2u);
  EXPECT_EQ(files.back().filename(), "model.safetensors.index.json");
  for (std::size_t i = 0; i + 1 < files.size(); ++i) {
    EXPECT_LE(fs::file_size(files[i]), 1000u + 400u) << files[i];  // data within the limit, plus a header
    EXPECT_NE(files[i].filename().string().find("-of-" + std::string(5 - std::to_string(files.size() - 1).size(), '0') +
                                                std::to_string(files.size() - 1)),
              std::string::npos);
  }
  run_peer("safetensors_peer.py", "readdir " + dir.string() + " " + (dir / "report.json").string());
  expect_described(tensors, read_json(dir / "report.json"));
  const auto back = ck::load_safetensors_dir(dir);
  ASSERT_EQ(back.tensors.size(), tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(back.tensors[i].first, tensors[i].first);  // the index's shard order keeps the given order
    EXPECT_TRUE(bitwise_equal(back.tensors[i].second, tensors[i].second));
  }
  // Everything in one shard: a single model.safetensors, and no stale index.
  ck::save_safetensors_sharded(dir, tensors);
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_EQ(ck::load_safetensors_dir(dir).tensors.size(), tensors.size());
}

// Views into the mapping stay valid after the file is gone; writing into one
// changes neither the file nor another load of it.
TEST(Safetensors, ViewsOutliveFileAndAreCopyOnWrite) {
  const auto dir = temp_dir("safetensors", "views");
  const auto w = at::arange(1000, at::kFloat);
  ck::save_safetensors(dir / "a.safetensors", {{"w", w}});
  at::Tensor view = ck::load_safetensors(dir / "a.safetensors").tensors.at(0).second;
  view.mul_(2);
  EXPECT_TRUE(at::equal(ck::load_safetensors(dir / "a.safetensors").tensors.at(0).second, w));
  fs::remove_all(dir);
  EXPECT_TRUE(at::equal(view, w * 2));
}

TEST(Safetensors, RefusesWhatItCannotWrite) {
  const auto dir = temp_dir("safetensors", "refuse");
  EXPECT_THROW(ck::save_safetensors(dir / "a", {{"a", at::ones(2)}, {"a", at::ones(2)}}), dtrain::ConfigError);
  EXPECT_THROW(ck::save_safetensors(dir / "a", {{"__metadata__", at::ones(2)}}), dtrain::ConfigError);
  EXPECT_THROW(ck::save_safetensors(dir / "a", {{"c", at::ones(2, at::kComplexDouble)}}), dtrain::ConfigError);
  EXPECT_THROW(ck::save_safetensors(dir / "no" / "such" / "a", {{"a", at::ones(2)}}), dtrain::DataError);
  EXPECT_FALSE(fs::exists(dir / "a"));
}
