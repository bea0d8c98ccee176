// DataLoader: batches from a Dataset in the order a Sampler gives, loaded
// ahead by worker threads.
//
//   DistributedSampler sampler({.dataset_size = ds->size(), .num_replicas = world, .rank = rank, .seed = 1});
//   DataLoader<TensorExample, TensorBatch> loader(ds, sampler_ptr, {.batch_size = 64, .num_workers = 2},
//                                                 collate_tensors);
//   for (std::int64_t epoch = 0; epoch < epochs; ++epoch) {
//     loader.start_epoch(epoch);
//     while (auto batch = loader.next()) { ... }
//   }
//
// Contracts:
// - Batch k of an epoch is always built from the sampler's step k, and next()
//   returns batches in step order, so the order depends only on the sampler
//   (its seed and epoch), never on num_workers or thread timing.
// - At most num_workers x prefetch_factor batches are loaded ahead.
// - An exception while loading reaches the consumer from next() as a
//   DataError naming the example index that failed (found by retrying the
//   batch's examples one by one) and the original message.
// - next() waits at most `timeout` for a batch, then throws TimeoutError
//   naming the batch and its example indices.
// - state() is the sampler position after the last batch next() returned:
//   save it with a checkpoint and load_state() it to resume mid-epoch.
// - Datasets' get()/get_many() and the collate function run with autograd's
//   dispatch layer switched off (at::AutoDispatchBelowAutograd), which cuts the
//   per-op overhead on small per-example tensors: batches carry no autograd
//   history, as with torch's worker processes, and a dataset must not modify
//   tensors that take part in an autograd graph in place.
// - pin_memory pins batches in page-locked memory when CUDA is available
//   (faster, asynchronous host-to-device copies); without CUDA it does nothing.
#pragma once

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/data/dataset.h"
#include "dtrain/data/sampler.h"
#include "dtrain/log.h"

namespace dtrain::data {

struct DataLoaderOptions {
  std::int64_t batch_size = 1;
  // Used only when no sampler is given: the loader then makes a single-rank
  // DistributedSampler (seeded random order when shuffling, else sequential).
  bool shuffle = false;
  std::uint64_t seed = 0;
  bool drop_last = false;
  int num_workers = 0;      // 0: load in the consumer's thread
  int prefetch_factor = 2;  // batches loaded ahead per worker
  bool pin_memory = false;
  bool persistent_workers = false;  // keep worker threads across epochs
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
};

struct TensorBatch {
  at::Tensor data;
  at::Tensor target;
};

// Stacks examples' data and targets along a new first dimension.
TensorBatch collate_tensors(std::vector<TensorExample>&& examples);
void pin_tensors(TensorBatch& batch);

namespace detail {
// Validates options (ConfigError naming the field).
void check_loader_options(const DataLoaderOptions& options);
// "examples 4, 9, 17, ... (64 in all)" for messages.
std::string describe_indices(const std::vector<std::int64_t>& indices);
// Rethrows the current exception as a DataError naming `index`.
[[noreturn]] void rethrow_for_example(std::int64_t index);
// Whether pinning can do anything here (CUDA available).
bool can_pin_memory();
[[noreturn]] void throw_loader_timeout(std::int64_t batch, const std::vector<std::int64_t>& indices,
                                       std::chrono::milliseconds timeout);
}  // namespace detail

template <typename Example, typename BatchT>
class DataLoader {
 public:
  using Collate = std::function<BatchT(std::vector<Example>&&)>;
  using Pin = std::function<void(BatchT&)>;

  DataLoader(std::shared_ptr<const Dataset<Example>> dataset, std::shared_ptr<Sampler> sampler,
             DataLoaderOptions options, Collate collate, Pin pin = {})
      : dataset_(std::move(dataset)),
        sampler_(std::move(sampler)),
        options_(options),
        collate_(std::move(collate)),
        pin_(std::move(pin)) {
    detail::check_loader_options(options_);
  }
  // Without a sampler: one rank, order from options.shuffle and options.seed.
  DataLoader(std::shared_ptr<const Dataset<Example>> dataset, DataLoaderOptions options, Collate collate, Pin pin = {})
      : DataLoader(dataset,
                   std::make_shared<DistributedSampler>(DistributedSamplerOptions{
                       .dataset_size = dataset->size(), .shuffle = options.shuffle, .seed = options.seed}),
                   options, std::move(collate), std::move(pin)) {}
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;
  ~DataLoader() { stop_workers(); }

  // Plans `epoch` from the sampler's position (0 for a new epoch, the loaded
  // position when resuming) and starts loading.
  void start_epoch(std::int64_t epoch) {
    sampler_->set_epoch(epoch);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++generation_;
      plan_ = sampler_->steps(options_.batch_size, options_.drop_last);
      ready_.clear();
      next_to_load_ = 0;
      next_to_return_ = 0;
    }
    cv_.notify_all();
    if (options_.num_workers > 0 && workers_.empty()) start_workers();
  }

  // The next batch of the epoch, or nullopt at its end.
  std::optional<BatchT> next() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (next_to_return_ >= plan_.size()) {
      lock.unlock();
      if (!options_.persistent_workers) stop_workers();
      return std::nullopt;
    }
    const std::size_t k = next_to_return_;
    Slot slot;
    if (options_.num_workers == 0) {
      const auto indices = plan_[k].indices;
      lock.unlock();
      slot = load(indices);
      lock.lock();
    } else {
      if (!cv_.wait_for(lock, options_.timeout, [&] { return ready_.count(k) > 0; })) {
        detail::throw_loader_timeout(static_cast<std::int64_t>(k), plan_[k].indices, options_.timeout);
      }
      slot = std::move(ready_.at(k));
      ready_.erase(k);
    }
    ++next_to_return_;
    last_indices_ = plan_[k].indices;
    sampler_->advance_to(plan_[k].global_end);
    lock.unlock();
    cv_.notify_all();  // a prefetch slot opened
    if (slot.error) std::rethrow_exception(slot.error);
    return std::move(slot.batch);
  }

  // Batches left in the current epoch.
  std::int64_t remaining() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<std::int64_t>(plan_.size() - next_to_return_);
  }
  SamplerState state() const { return sampler_->state(); }
  // The example indices of the batch next() returned last (empty before the first).
  std::vector<std::int64_t> last_indices() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return last_indices_;
  }
  void load_state(const SamplerState& state) { sampler_->load_state(state); }
  const DataLoaderOptions& options() const { return options_; }

 private:
  struct Slot {
    std::optional<BatchT> batch;
    std::exception_ptr error;
  };
  std::vector<std::int64_t> last_indices_;  // guarded by mutex_

  Slot load(const std::vector<std::int64_t>& indices) const {
    // Loading never needs autograd: skipping its dispatch layer saves a
    // good part of the per-op overhead on small per-example tensors, and the
    // results are ordinary tensors (unlike InferenceMode's).
    at::AutoDispatchBelowAutograd below_autograd;
    Slot slot;
    try {
      std::vector<Example> examples;
      try {
        examples = dataset_->get_many(indices);
      } catch (...) {
        // Find the example that fails, to name it.
        for (auto i : indices) {
          try {
            (void)dataset_->get(i);
          } catch (...) {
            detail::rethrow_for_example(i);
          }
        }
        throw;
      }
      BatchT batch = collate_(std::move(examples));
      if (options_.pin_memory && pin_ && detail::can_pin_memory()) pin_(batch);
      slot.batch = std::move(batch);
    } catch (...) {
      slot.error = std::current_exception();
    }
    return slot;
  }

  void start_workers() {
    stopping_ = false;
    for (int w = 0; w < options_.num_workers; ++w)
      workers_.emplace_back([this, identity = log::identity()] {
        log::ScopedIdentity scoped(identity);  // workers' errors carry the rank that started them
        work();
      });
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  void work() {
    const std::size_t window =
        static_cast<std::size_t>(options_.num_workers) * static_cast<std::size_t>(options_.prefetch_factor);
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      cv_.wait(lock,
               [&] { return stopping_ || (next_to_load_ < plan_.size() && next_to_load_ < next_to_return_ + window); });
      if (stopping_) return;
      const std::size_t k = next_to_load_++;
      const std::uint64_t generation = generation_;
      const auto indices = plan_[k].indices;
      lock.unlock();
      Slot slot = load(indices);
      lock.lock();
      if (generation == generation_) ready_[k] = std::move(slot);  // else: a new epoch began meanwhile
      cv_.notify_all();
    }
  }

  std::shared_ptr<const Dataset<Example>> dataset_;
  std::shared_ptr<Sampler> sampler_;
  DataLoaderOptions options_;
  Collate collate_;
  Pin pin_;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<SamplerStep> plan_;
  std::map<std::size_t, Slot> ready_;
  std::size_t next_to_load_ = 0;
  std::size_t next_to_return_ = 0;
  std::uint64_t generation_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

// A DataLoader of TensorExamples collated into TensorBatches.
using TensorLoader = DataLoader<TensorExample, TensorBatch>;
inline std::unique_ptr<TensorLoader> make_tensor_loader(std::shared_ptr<const Dataset<TensorExample>> dataset,
                                                        std::shared_ptr<Sampler> sampler,
                                                        const DataLoaderOptions& options) {
  return std::make_unique<TensorLoader>(std::move(dataset), std::move(sampler), options, collate_tensors, pin_tensors);
}

inline std::unique_ptr<TensorLoader> make_tensor_loader(std::shared_ptr<const Dataset<TensorExample>> dataset,
                                                        const DataLoaderOptions& options) {
  return std::make_unique<TensorLoader>(std::move(dataset), options, collate_tensors, pin_tensors);
}

struct WorkerTuning {
  int best = 0;
  std::vector<std::pair<int, double>> samples_per_second;  // (num_workers, rate), for 0..max
};

// Times loading `batches` batches with 0..max_workers workers through loaders
// made by `make` and returns the fastest count: the best count depends on
// the machine, the data and the transforms, so measure rather than guess.
WorkerTuning tune_num_workers(const std::function<std::unique_ptr<TensorLoader>(int num_workers)>& make,
                              int max_workers, int batches);

}  // namespace dtrain::data
