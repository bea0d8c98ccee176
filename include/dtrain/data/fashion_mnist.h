// The Fashion-MNIST dataset (Zalando; 60,000 training and 10,000 test
// 28x28 grey images in 10 classes), read from IDX files such as those of
// Debian's dataset-fashion-mnist package.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "dtrain/data/dataset.h"

namespace dtrain::data {

inline constexpr const char* kFashionMnistDefaultDir = "/usr/share/datasets/fashion-mnist";

enum class Split { kTrain, kTest };

struct Batch {
  at::Tensor images;  // float32 [B, 1, 28, 28]
  at::Tensor labels;  // int64 [B]
};

// Also a Dataset<TensorExample>: data float32 [1, 28, 28], target int64 [].
class FashionMnist : public Dataset<TensorExample> {
 public:
  static constexpr int kClasses = 10;
  // Mean and standard deviation of the training pixels (in [0, 1]); images
  // are returned as (x - kMean) / kStd.
  static constexpr double kMean = 0.2860;
  static constexpr double kStd = 0.3530;

  // Loads `split` from `dir`, which holds {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz].
  // Throws DataError for missing, corrupt, truncated or mismatched files
  // (images not N x 28 x 28 u8, labels not N u8 in 0..9, counts differing).
  FashionMnist(const std::filesystem::path& dir, Split split);

  std::int64_t size() const override { return labels_.size(0); }
  TensorExample get(std::int64_t index) const override;
  // One gather for the whole batch, returned as per-example views.
  std::vector<TensorExample> get_many(const std::vector<std::int64_t>& indices) const override;
  // Gathers the examples at `indices` (int64, any order) into one batch.
  Batch get_batch(const at::Tensor& indices) const;
  // The whole split as one batch.
  Batch all() const { return {images_, labels_}; }

 private:
  at::Tensor images_;  // float32 [N, 1, 28, 28], normalised
  at::Tensor labels_;  // int64 [N]
};

}  // namespace dtrain::data
