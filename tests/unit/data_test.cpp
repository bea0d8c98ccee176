// IDX reading and the Fashion-MNIST dataset, against files written here
// (good, corrupt, truncated, mismatched) and Debian's real files.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>

#include "dtrain/data/fashion_mnist.h"
#include "dtrain/data/idx.h"
#include "dtrain/error.h"

namespace fs = std::filesystem;
using dtrain::DataError;
using dtrain::data::read_idx;

namespace {

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() /
            ("dtrain-data-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter_++));
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

std::vector<std::uint8_t> header(std::uint8_t type, const std::vector<std::uint32_t>& dims) {
  std::vector<std::uint8_t> out{0, 0, type, static_cast<std::uint8_t>(dims.size())};
  for (auto d : dims) {
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<std::uint8_t>(d >> s));
  }
  return out;
}

void write_bytes(const fs::path& path, const std::vector<std::uint8_t>& bytes, bool gzip) {
  if (gzip) {
    gzFile f = gzopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    if (!bytes.empty()) {
      ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
    }
    gzclose(f);
  } else {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
}

std::vector<std::uint8_t> concat(std::vector<std::uint8_t> a, const std::vector<std::uint8_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::string error_of(const fs::path& path) {
  try {
    read_idx(path);
  } catch (const DataError& e) {
    return e.what();
  }
  return "<no error>";
}

// Writes an N-example Fashion-MNIST-shaped split into `dir`.
void write_split(const fs::path& dir, const std::string& prefix, std::uint32_t images, std::uint32_t labels,
                 std::uint8_t max_label = 9, std::uint32_t side = 28) {
  std::vector<std::uint8_t> pixels(static_cast<size_t>(images) * side * side);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<std::uint8_t>(i * 7);
  std::vector<std::uint8_t> label_bytes(labels);
  for (size_t i = 0; i < label_bytes.size(); ++i) label_bytes[i] = static_cast<std::uint8_t>(i % (max_label + 1u));
  if (!label_bytes.empty()) label_bytes.back() = max_label;
  write_bytes(dir / (prefix + "-images-idx3-ubyte.gz"), concat(header(0x08, {images, side, side}), pixels), true);
  write_bytes(dir / (prefix + "-labels-idx1-ubyte"), concat(header(0x08, {labels}), label_bytes), false);
}

}  // namespace

TEST(Idx, ReadsEveryTypeBigEndianPlainAndGzip) {
  TempDir dir;
  for (bool gz : {false, true}) {
    write_bytes(dir.path() / "u8", concat(header(0x08, {2, 3}), {1, 2, 3, 4, 5, 255}), gz);
    auto t = read_idx(dir.path() / "u8");
    EXPECT_EQ(t.scalar_type(), at::kByte);
    EXPECT_EQ(t.sizes(), at::IntArrayRef({2, 3}));
    EXPECT_EQ(t[1][2].item<int>(), 255);

    write_bytes(dir.path() / "i16", concat(header(0x0B, {2}), {0x01, 0x02, 0xFF, 0xFE}), gz);
    t = read_idx(dir.path() / "i16");
    EXPECT_EQ(t.scalar_type(), at::kShort);
    EXPECT_EQ(t[0].item<int>(), 0x0102);
    EXPECT_EQ(t[1].item<int>(), -2);

    write_bytes(dir.path() / "i32", concat(header(0x0C, {1}), {0x00, 0x01, 0x00, 0x02}), gz);
    EXPECT_EQ(read_idx(dir.path() / "i32")[0].item<int>(), 65538);

    write_bytes(dir.path() / "f32", concat(header(0x0D, {1}), {0x3F, 0xC0, 0x00, 0x00}), gz);  // 1.5f
    EXPECT_FLOAT_EQ(read_idx(dir.path() / "f32")[0].item<float>(), 1.5f);

    write_bytes(dir.path() / "f64", concat(header(0x0E, {1}), {0xC0, 0x04, 0, 0, 0, 0, 0, 0}), gz);  // -2.5
    EXPECT_DOUBLE_EQ(read_idx(dir.path() / "f64")[0].item<double>(), -2.5);

    write_bytes(dir.path() / "i8", concat(header(0x09, {1}), {0xFF}), gz);
    EXPECT_EQ(read_idx(dir.path() / "i8")[0].item<int>(), -1);
  }
}

TEST(Idx, ZeroSizedDimension) {
  TempDir dir;
  write_bytes(dir.path() / "empty", header(0x08, {0, 28, 28}), false);
  EXPECT_EQ(read_idx(dir.path() / "empty").numel(), 0);
}

TEST(Idx, ClearErrorsForBadFiles) {
  TempDir dir;
  const auto p = dir.path();
  EXPECT_NE(error_of(p / "nope").find("no such file"), std::string::npos);

  write_bytes(p / "empty", {}, false);
  EXPECT_NE(error_of(p / "empty").find("IDX header is missing"), std::string::npos);

  write_bytes(p / "magic", concat({1, 2, 8, 1}, {0, 0, 0, 1, 7}), false);
  EXPECT_NE(error_of(p / "magic").find("bad magic"), std::string::npos);

  write_bytes(p / "type", concat(header(0x07, {1}), {1}), false);
  EXPECT_NE(error_of(p / "type").find("unknown IDX type code 0x07"), std::string::npos);

  write_bytes(p / "short_header", {0, 0, 8, 3, 0, 0, 0, 2}, false);
  EXPECT_NE(error_of(p / "short_header").find("truncated inside the IDX header"), std::string::npos);

  for (bool gz : {false, true}) {
    write_bytes(p / "short_data", concat(header(0x08, {2, 2}), {1, 2, 3}), gz);
    const auto what = error_of(p / "short_data");
    EXPECT_NE(what.find("announces 4 bytes of data, the file has 3"), std::string::npos) << what;
    EXPECT_NE(what.find(p.string()), std::string::npos) << what;

    write_bytes(p / "long", concat(header(0x08, {2}), {1, 2, 3}), gz);
    EXPECT_NE(error_of(p / "long").find("has bytes after"), std::string::npos);
  }

  write_bytes(p / "huge", header(0x0E, {0xFFFFFF, 0xFFFFFF, 0xFFFFFF}), false);
  EXPECT_NE(error_of(p / "huge").find("GiB"), std::string::npos);
}

TEST(Idx, DamagedOrCutGzipStream) {
  TempDir dir;
  std::vector<std::uint8_t> data(4096);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::uint8_t>((i * 131) ^ (i >> 3));
  write_bytes(dir.path() / "ok.gz", concat(header(0x08, {4096}), data), true);
  std::ifstream in(dir.path() / "ok.gz", std::ios::binary);
  std::vector<std::uint8_t> gz((std::istreambuf_iterator<char>(in)), {});
  ASSERT_GT(gz.size(), 100u);

  auto cut = gz;
  cut.resize(gz.size() / 2);
  write_bytes(dir.path() / "cut.gz", cut, false);
  const auto cut_error = error_of(dir.path() / "cut.gz");
  EXPECT_TRUE(cut_error.find("truncated") != std::string::npos || cut_error.find("gzip") != std::string::npos)
      << cut_error;

  auto flipped = gz;
  for (size_t i = 20; i < flipped.size() - 10; i += 7) flipped[i] ^= 0x5A;
  write_bytes(dir.path() / "flipped.gz", flipped, false);
  EXPECT_NE(error_of(dir.path() / "flipped.gz"), "<no error>");
}

TEST(FashionMnistFiles, LoadsAndNormalises) {
  TempDir dir;
  write_split(dir.path(), "train", 5, 5);
  dtrain::data::FashionMnist ds(dir.path(), dtrain::data::Split::kTrain);
  EXPECT_EQ(ds.size(), 5);
  const auto ex = ds.get(1);
  EXPECT_EQ(ex.data.sizes(), at::IntArrayRef({1, 28, 28}));
  EXPECT_EQ(ex.target.item<int64_t>(), 1);
  const double raw = static_cast<std::uint8_t>((28 * 28 + 3) * 7);  // pixel (1, 0, 3)
  const double expected = (raw / 255.0 - dtrain::data::FashionMnist::kMean) / dtrain::data::FashionMnist::kStd;
  EXPECT_NEAR(ex.data[0][0][3].item<double>(), expected, 1e-5);
  const auto batch = ds.get_batch(at::tensor({4, 0}, at::kLong));
  EXPECT_EQ(batch.images.sizes(), at::IntArrayRef({2, 1, 28, 28}));
  EXPECT_EQ(batch.labels[0].item<int64_t>(), 9);
  EXPECT_THROW(ds.get(5), dtrain::ConfigError);
}

TEST(FashionMnistFiles, MismatchedOrWrongFilesAreRejected) {
  auto error_for = [](auto write) {
    TempDir dir;
    write(dir.path());
    try {
      dtrain::data::FashionMnist(dir.path(), dtrain::data::Split::kTest);
    } catch (const DataError& e) {
      return std::string(e.what());
    }
    return std::string("<no error>");
  };
  EXPECT_NE(error_for([](const fs::path& d) { write_split(d, "t10k", 4, 3); }).find("4 images but 3 labels"),
            std::string::npos);
  EXPECT_NE(error_for([](const fs::path& d) { write_split(d, "t10k", 3, 3, 12); }).find("has label 12"),
            std::string::npos);
  EXPECT_NE(error_for([](const fs::path& d) { write_split(d, "t10k", 3, 3, 9, 27); }).find("N x 28 x 28"),
            std::string::npos);
  const auto missing = error_for([](const fs::path& d) { write_split(d, "train", 3, 3); });
  EXPECT_NE(missing.find("t10k-images-idx3-ubyte[.gz] not found"), std::string::npos) << missing;
  EXPECT_NE(missing.find("dataset-fashion-mnist"), std::string::npos) << missing;
}

TEST(FashionMnistFiles, RealDebianDataset) {
  if (!fs::exists(dtrain::data::kFashionMnistDefaultDir)) GTEST_SKIP() << "dataset-fashion-mnist not installed";
  dtrain::data::FashionMnist train(dtrain::data::kFashionMnistDefaultDir, dtrain::data::Split::kTrain);
  dtrain::data::FashionMnist test(dtrain::data::kFashionMnistDefaultDir, dtrain::data::Split::kTest);
  ASSERT_EQ(train.size(), 60000);
  ASSERT_EQ(test.size(), 10000);
  // Fashion-MNIST is balanced: 6000 training and 1000 test images per class.
  EXPECT_TRUE(at::bincount(train.all().labels).eq(6000).all().item<bool>());
  EXPECT_TRUE(at::bincount(test.all().labels).eq(1000).all().item<bool>());
  // Normalisation uses the training set's statistics.
  EXPECT_NEAR(train.all().images.mean().item<double>(), 0.0, 0.01);
  EXPECT_NEAR(train.all().images.std().item<double>(), 1.0, 0.01);
}
