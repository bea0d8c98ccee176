// Non-template parts of the DataLoader: collation, pinning, messages, tuning.
#include "dtrain/data/loader.h"

#include <ATen/Functions.h>
#include <torch/cuda.h>

#include <sstream>

#include "dtrain/error.h"
#include "dtrain/log.h"

namespace dtrain::data {

TensorBatch collate_tensors(std::vector<TensorExample>&& examples) {
  std::vector<at::Tensor> data, target;
  data.reserve(examples.size());
  target.reserve(examples.size());
  for (auto& e : examples) {
    data.push_back(std::move(e.data));
    target.push_back(std::move(e.target));
  }
  return {at::stack(data), at::stack(target)};
}

void pin_tensors(TensorBatch& batch) {
  batch.data = batch.data.pin_memory();
  batch.target = batch.target.pin_memory();
}

namespace detail {

void check_loader_options(const DataLoaderOptions& o) {
  DTRAIN_CHECK(o.batch_size >= 1, ConfigError, "DataLoader batch_size=" << o.batch_size << " must be at least 1.",
               "pass a positive batch size");
  DTRAIN_CHECK(o.num_workers >= 0 && o.num_workers <= 256, ConfigError,
               "DataLoader num_workers=" << o.num_workers << " is outside 0..256.",
               "use 0 to load in the training thread, or a few worker threads");
  DTRAIN_CHECK(o.prefetch_factor >= 1, ConfigError,
               "DataLoader prefetch_factor=" << o.prefetch_factor << " must be at least 1.", "use e.g. 2");
  DTRAIN_CHECK(o.timeout.count() > 0, ConfigError, "DataLoader timeout must be positive.",
               "give the longest time a batch may take to load");
}

std::string describe_indices(const std::vector<std::int64_t>& indices) {
  std::ostringstream out;
  out << "examples ";
  for (std::size_t i = 0; i < indices.size() && i < 8; ++i) out << (i ? ", " : "") << indices[i];
  if (indices.size() > 8) out << ", ...";
  out << " (" << indices.size() << " in all)";
  return out.str();
}

void rethrow_for_example(std::int64_t index) {
  try {
    throw;
  } catch (const std::exception& e) {
    throw DataError("loading example " + std::to_string(index) + " failed: " + e.what(),
                    "fix the dataset's get() for this index, or the data it reads");
  } catch (...) {
    throw DataError("loading example " + std::to_string(index) + " failed with a non-standard exception.",
                    "fix the dataset's get() for this index");
  }
}

bool can_pin_memory() {
  static const bool available = torch::cuda::is_available();
  return available;
}

void throw_loader_timeout(std::int64_t batch, const std::vector<std::int64_t>& indices,
                          std::chrono::milliseconds timeout) {
  throw TimeoutError("DataLoader workers did not deliver batch " + std::to_string(batch) + " (" +
                         describe_indices(indices) + ") within " + log::format_seconds(timeout) + ".",
                     "a dataset get() is stuck or very slow; raise DataLoaderOptions::timeout if it is only slow");
}

}  // namespace detail

WorkerTuning tune_num_workers(const std::function<std::unique_ptr<TensorLoader>(int)>& make, int max_workers,
                              int batches) {
  DTRAIN_CHECK(max_workers >= 0 && batches >= 1, ConfigError,
               "tune_num_workers needs max_workers >= 0 and batches >= 1.", "e.g. max_workers 4, batches 50");
  WorkerTuning result;
  double best_rate = -1;
  for (int workers = 0; workers <= max_workers; ++workers) {
    auto loader = make(workers);
    loader->start_epoch(0);
    std::int64_t samples = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int b = 0; b < batches; ++b) {
      auto batch = loader->next();
      if (!batch) break;
      samples += batch->data.size(0);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double rate = seconds > 0 ? static_cast<double>(samples) / seconds : 0.0;
    result.samples_per_second.emplace_back(workers, rate);
    DTRAIN_LOG(kDebug) << "tune_num_workers: " << workers << " workers: " << rate << " samples/s";
    if (rate > best_rate) {
      best_rate = rate;
      result.best = workers;
    }
  }
  return result;
}

}  // namespace dtrain::data
