// DataLoader throughput and first-batch latency: dtrain's threaded loader over
// Fashion-MNIST with a per-example augmentation (flip + padded crop, chosen
// from the example index so both sides do identical work). bench/dataloader/peer.py
// runs torch.utils.data.DataLoader on the same data and transform. One JSON
// line per configuration:
//   {"impl":"dtrain","case":"w2_persistent","samples_per_second":..,
//    "first_batch_ms":..,"second_epoch_first_batch_ms":..}
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "../common/timing.h"

#include <chrono>
#include <cstdio>
#include <string>

#include "dtrain/dtrain.h"

namespace {
using Clock = std::chrono::steady_clock;
using namespace dtrain::data;

class Augmented : public Dataset<TensorExample> {
 public:
  explicit Augmented(std::shared_ptr<FashionMnist> base) : base_(std::move(base)) {}
  std::int64_t size() const override { return base_->size(); }
  TensorExample get(std::int64_t i) const override {
    TensorExample ex = base_->get(i);
    at::Tensor img = ex.data;
    if (((i * 2654435761LL) >> 7) & 1) img = img.flip({2});
    const std::int64_t dy = i % 5, dx = (i / 5) % 5;
    img = at::constant_pad_nd(img, {2, 2, 2, 2}).slice(1, dy, dy + 28).slice(2, dx, dx + 28).contiguous();
    return {img, ex.target};
  }

 private:
  std::shared_ptr<FashionMnist> base_;
};

using dtrain::bench::ms_since;
}  // namespace

int main(int argc, char** argv) {
  try {
    at::set_num_threads(1);
    const int batches = argc > 1 ? std::atoi(argv[1]) : 450;
    auto data = std::make_shared<Augmented>(std::make_shared<FashionMnist>(kFashionMnistDefaultDir, Split::kTrain));
    for (int workers : {0, 1, 2}) {
      for (bool persistent : {false, true}) {
        if (workers == 0 && persistent) continue;
        auto sampler = std::make_shared<DistributedSampler>(random_sampler(data->size(), 0));
        auto loader = make_tensor_loader(
            data, sampler,
            {.batch_size = 64, .drop_last = true, .num_workers = workers, .persistent_workers = persistent});
        std::int64_t samples = 0;
        double first_ms = 0, second_first_ms = 0;
        const auto start = Clock::now();
        for (int epoch = 0; epoch < 2; ++epoch) {
          const auto epoch_start = Clock::now();
          loader->start_epoch(epoch);
          for (int b = 0; b < batches; ++b) {
            auto batch = loader->next();
            if (!batch) break;
            if (b == 0) (epoch == 0 ? first_ms : second_first_ms) = ms_since(epoch_start);
            samples += batch->data.size(0);
          }
          // Finish the epoch early: start_epoch discards what is still loading.
        }
        const double seconds = ms_since(start) / 1000.0;
        std::printf(
            "{\"impl\":\"dtrain\",\"case\":\"w%d%s\",\"samples_per_second\":%.1f,\"first_batch_ms\":%.3f,"
            "\"second_epoch_first_batch_ms\":%.3f}\n",
            workers, workers == 0 ? "" : (persistent ? "_persistent" : "_fresh"),
            static_cast<double>(samples) / seconds, first_ms, second_first_ms);
        std::fflush(stdout);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dataloader_bench: error: %s\n", e.what());
    return 1;
  }
}
