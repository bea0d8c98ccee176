// DataLoader: order independent of workers, errors with the example index,
// timeouts, prefetch bound, resumption, token files, the worker tuner.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

#include "dtrain/data/fashion_mnist.h"
#include "dtrain/data/loader.h"
#include "dtrain/data/token_file.h"
#include "dtrain/error.h"

using namespace dtrain::data;

namespace {
// Example i is (i, i*i); get() can sleep a little, fail or hang on request.
class Numbers : public Dataset<TensorExample> {
 public:
  explicit Numbers(std::int64_t n, std::int64_t fail_at = -1, std::int64_t hang_at = -1)
      : n_(n), fail_at_(fail_at), hang_at_(hang_at) {}
  std::int64_t size() const override { return n_; }
  TensorExample get(std::int64_t i) const override {
    if (i == fail_at_) throw std::runtime_error("corrupt record");
    if (i == hang_at_) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    if (jitter) std::this_thread::sleep_for(std::chrono::microseconds((i * 7919) % 300));
    return {at::full({2}, static_cast<double>(i)), at::scalar_tensor(i * i, at::kLong)};
  }
  std::vector<TensorExample> get_many(const std::vector<std::int64_t>& indices) const override {
    ++batches_started;
    return Dataset::get_many(indices);
  }
  bool jitter = false;
  mutable std::atomic<int> batches_started{0};

 private:
  std::int64_t n_, fail_at_, hang_at_;
};

std::vector<std::vector<std::int64_t>> epoch_targets(TensorLoader& loader, std::int64_t epoch) {
  std::vector<std::vector<std::int64_t>> out;
  loader.start_epoch(epoch);
  while (auto b = loader.next()) {
    const at::Tensor t = b->target.contiguous();
    out.emplace_back(t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel());
    EXPECT_TRUE(at::equal(b->data.select(1, 0).to(at::kLong) * b->data.select(1, 0).to(at::kLong), b->target));
  }
  return out;
}

std::shared_ptr<Sampler> random(std::int64_t n) {
  return std::make_shared<DistributedSampler>(random_sampler(n, 9));
}
}  // namespace

TEST(DataLoader, OrderIsTheSameForAnyWorkerCount) {
  auto ds = std::make_shared<Numbers>(203);
  ds->jitter = true;
  std::vector<std::vector<std::int64_t>> reference;
  for (int workers : {0, 1, 2, 4}) {
    for (bool persistent : {false, true}) {
      auto loader = make_tensor_loader(ds, random(203),
                                       {.batch_size = 8, .num_workers = workers, .persistent_workers = persistent});
      for (std::int64_t epoch : {0, 1}) {
        const auto got = epoch_targets(*loader, epoch);
        ASSERT_EQ(got.size(), 26u);  // 25 full batches and one of 3
        EXPECT_EQ(got.back().size(), 3u);
        if (epoch == 0 && reference.empty()) reference = got;
        if (epoch == 0) {
          EXPECT_EQ(got, reference) << workers << " workers";
        } else {
          EXPECT_NE(got, reference) << "epochs must reshuffle";
        }
      }
    }
  }
}

TEST(DataLoader, ShuffleAndSeedWithoutASampler) {
  auto ds = std::make_shared<Numbers>(30);
  auto a = make_tensor_loader(ds, {.batch_size = 4, .shuffle = true, .seed = 5, .num_workers = 2});
  auto b = make_tensor_loader(ds, {.batch_size = 4, .shuffle = true, .seed = 5, .pin_memory = true});
  auto c = make_tensor_loader(ds, {.batch_size = 4, .shuffle = true, .seed = 6});
  auto plain = make_tensor_loader(ds, {.batch_size = 4});
  const auto ordered = epoch_targets(*plain, 0);
  EXPECT_EQ(ordered.front(), (std::vector<std::int64_t>{0, 1, 4, 9}));
  const auto shuffled = epoch_targets(*a, 0);
  EXPECT_NE(shuffled, ordered);
  EXPECT_EQ(shuffled, epoch_targets(*b, 0)) << "pin_memory is a no-op without CUDA and must not change data";
  EXPECT_NE(shuffled, epoch_targets(*c, 0));
}

TEST(DataLoader, DropLastAndSequentialOrder) {
  auto ds = std::make_shared<Numbers>(10);
  auto loader = make_tensor_loader(ds, std::make_shared<DistributedSampler>(sequential_sampler(10)),
                                   {.batch_size = 4, .drop_last = true, .num_workers = 2});
  const auto got = epoch_targets(*loader, 0);
  EXPECT_EQ(got, (std::vector<std::vector<std::int64_t>>{{0, 1, 4, 9}, {16, 25, 36, 49}}));
}

TEST(DataLoader, WorkerErrorNamesTheExample) {
  for (int workers : {0, 2}) {
    auto loader = make_tensor_loader(std::make_shared<Numbers>(100, 37),
                                     std::make_shared<DistributedSampler>(sequential_sampler(100)),
                                     {.batch_size = 10, .num_workers = workers});
    loader->start_epoch(0);
    for (int b = 0; b < 3; ++b) ASSERT_TRUE(loader->next().has_value());
    try {
      loader->next();
      ADD_FAILURE() << "no error";
    } catch (const dtrain::DataError& e) {
      EXPECT_NE(std::string(e.what()).find("loading example 37 failed: corrupt record"), std::string::npos) << e.what();
    }
  }
}

TEST(DataLoader, StuckWorkerTimesOut) {
  auto loader = make_tensor_loader(std::make_shared<Numbers>(40, -1, 12),
                                   std::make_shared<DistributedSampler>(sequential_sampler(40)),
                                   {.batch_size = 10, .num_workers = 1, .timeout = std::chrono::milliseconds(300)});
  loader->start_epoch(0);
  ASSERT_TRUE(loader->next().has_value());
  try {
    loader->next();
    ADD_FAILURE() << "no timeout";
  } catch (const dtrain::TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("did not deliver batch 1 (examples 10, 11, 12"), std::string::npos)
        << e.what();
  }
}

TEST(DataLoader, PrefetchIsBounded) {
  auto ds = std::make_shared<Numbers>(1000);
  auto loader = make_tensor_loader(ds, random(1000), {.batch_size = 4, .num_workers = 2, .prefetch_factor = 3});
  loader->start_epoch(0);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(ds->batches_started.load(), 6);
  ASSERT_TRUE(loader->next().has_value());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(ds->batches_started.load(), 7);
}

TEST(DataLoader, ResumesMidEpochWhereItStopped) {
  auto ds = std::make_shared<Numbers>(77);
  auto whole = make_tensor_loader(ds, random(77), {.batch_size = 5, .num_workers = 2});
  const auto expected = epoch_targets(*whole, 3);

  auto first = make_tensor_loader(ds, random(77), {.batch_size = 5, .num_workers = 2});
  first->start_epoch(3);
  for (int b = 0; b < 6; ++b) ASSERT_TRUE(first->next().has_value());
  const SamplerState saved = first->state();
  EXPECT_EQ(saved, (SamplerState{.epoch = 3, .consumed = 30}));

  auto resumed = make_tensor_loader(ds, random(77), {.batch_size = 5, .num_workers = 1});
  resumed->load_state(saved);
  const auto rest = epoch_targets(*resumed, 3);
  EXPECT_EQ(rest, std::vector<std::vector<std::int64_t>>(expected.begin() + 6, expected.end()));
}

TEST(DataLoader, BadOptions) {
  auto ds = std::make_shared<Numbers>(5);
  EXPECT_THROW(make_tensor_loader(ds, random(5), {.batch_size = 0}), dtrain::ConfigError);
  EXPECT_THROW(make_tensor_loader(ds, random(5), {.num_workers = -1}), dtrain::ConfigError);
  EXPECT_THROW(make_tensor_loader(ds, random(5), {.prefetch_factor = 0}), dtrain::ConfigError);
}

TEST(DataLoader, FashionMnistBatchesMatchDirectGather) {
  if (!std::filesystem::exists(kFashionMnistDefaultDir)) GTEST_SKIP() << "no Fashion-MNIST";
  auto ds = std::make_shared<FashionMnist>(kFashionMnistDefaultDir, Split::kTest);
  auto sampler = std::make_shared<DistributedSampler>(
      DistributedSamplerOptions{.dataset_size = ds->size(), .num_replicas = 3, .rank = 1, .seed = 4});
  auto loader = make_tensor_loader(ds, sampler, {.batch_size = 64, .num_workers = 2});
  loader->start_epoch(0);
  const auto indices = sampler->remaining_indices();
  std::int64_t offset = 0;
  while (auto b = loader->next()) {
    const auto n = b->data.size(0);
    const auto direct =
        ds->get_batch(at::tensor(std::vector<std::int64_t>(indices.begin() + offset, indices.begin() + offset + n)));
    EXPECT_TRUE(at::equal(b->data, direct.images));
    EXPECT_TRUE(at::equal(b->target, direct.labels));
    offset += n;
  }
  EXPECT_EQ(offset, 3334);  // ceil(10000 / 3)
}

TEST(TokenFile, WindowsAndErrors) {
  const auto dir = std::filesystem::temp_directory_path() / ("dtrain-tokens-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir / "t16.bin", std::ios::binary);
    for (std::uint16_t v = 0; v < 11; ++v) {
      const std::uint16_t t = static_cast<std::uint16_t>(v * 1000);
      out.write(reinterpret_cast<const char*>(&t), 2);
    }
    std::ofstream out32(dir / "t32.bin", std::ios::binary);
    for (std::uint32_t v = 0; v < 6; ++v) {
      const std::uint32_t t = 70000 + v;
      out32.write(reinterpret_cast<const char*>(&t), 4);
    }
    std::ofstream odd(dir / "odd.bin", std::ios::binary);
    odd << "abc";
  }
  TokenFileDataset ds(dir / "t16.bin", {.token_bytes = 2, .seq_len = 4});
  EXPECT_EQ(ds.num_tokens(), 11);
  EXPECT_EQ(ds.size(), 2);  // windows start at 0 and 4; each needs 5 tokens
  const auto ex = ds.get(1);
  EXPECT_TRUE(at::equal(ex.data, at::tensor({4000, 5000, 6000, 7000}, at::kLong)));
  EXPECT_TRUE(at::equal(ex.target, at::tensor({5000, 6000, 7000, 8000}, at::kLong)));
  TokenFileDataset overlapping(dir / "t16.bin", {.seq_len = 4, .stride = 1});
  EXPECT_EQ(overlapping.size(), 7);
  TokenFileDataset wide(dir / "t32.bin", {.token_bytes = 4, .seq_len = 5});
  EXPECT_EQ(wide.get(0).target[4].item<std::int64_t>(), 70005);

  EXPECT_THROW(TokenFileDataset(dir / "odd.bin", {.token_bytes = 2, .seq_len = 1}), dtrain::DataError);
  EXPECT_THROW(TokenFileDataset(dir / "t16.bin", {.seq_len = 11}), dtrain::DataError);
  EXPECT_THROW(TokenFileDataset(dir / "missing.bin", {}), dtrain::DataError);
  EXPECT_THROW(TokenFileDataset(dir / "t16.bin", {.token_bytes = 3}), dtrain::ConfigError);
  EXPECT_THROW(ds.get(2), dtrain::ConfigError);
  std::filesystem::remove_all(dir);
}

TEST(WorkerTuner, MeasuresEveryCountAndPicksTheFastest) {
  auto ds = std::make_shared<Numbers>(400);
  ds->jitter = true;
  const auto tuning = tune_num_workers(
      [&](int workers) { return make_tensor_loader(ds, random(400), {.batch_size = 8, .num_workers = workers}); }, 3,
      20);
  ASSERT_EQ(tuning.samples_per_second.size(), 4u);
  double best = 0;
  for (const auto& [workers, rate] : tuning.samples_per_second) {
    EXPECT_GT(rate, 0);
    best = std::max(best, rate);
  }
  EXPECT_EQ(tuning.samples_per_second[static_cast<size_t>(tuning.best)].second, best);
  // Sleeping get()s overlap across threads, so some worker count beats loading inline.
  EXPECT_GT(tuning.best, 0);
}
