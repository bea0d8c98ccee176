// Fashion-MNIST over IDX files.
#include "dtrain/data/fashion_mnist.h"

#include <ATen/Functions.h>

#include "dtrain/data/idx.h"
#include "dtrain/error.h"

namespace dtrain::data {
namespace {

std::filesystem::path find_file(const std::filesystem::path& dir, const std::string& stem) {
  for (const char* suffix : {".gz", ""}) {
    auto p = dir / (stem + suffix);
    std::error_code ec;
    if (std::filesystem::is_regular_file(p, ec)) return p;
  }
  throw DataError("Fashion-MNIST file " + (dir / stem).string() + "[.gz] not found.",
                  "install Debian's dataset-fashion-mnist (files in " + std::string(kFashionMnistDefaultDir) +
                      ") or pass --data-dir with the four IDX files");
}

}  // namespace

FashionMnist::FashionMnist(const std::filesystem::path& dir, Split split) {
  const std::string prefix = split == Split::kTrain ? "train" : "t10k";
  const auto image_file = find_file(dir, prefix + "-images-idx3-ubyte");
  const auto label_file = find_file(dir, prefix + "-labels-idx1-ubyte");
  at::Tensor images = read_idx(image_file);
  at::Tensor labels = read_idx(label_file);

  DTRAIN_CHECK(images.scalar_type() == at::kByte && images.dim() == 3 && images.size(1) == 28 && images.size(2) == 28,
               DataError,
               image_file.string() << ": expected u8 images of N x 28 x 28, got " << images.scalar_type() << " "
                                   << images.sizes() << ".",
               "this is not a Fashion-MNIST image file");
  DTRAIN_CHECK(
      labels.scalar_type() == at::kByte && labels.dim() == 1, DataError,
      label_file.string() << ": expected N u8 labels, got " << labels.scalar_type() << " " << labels.sizes() << ".",
      "this is not a Fashion-MNIST label file");
  DTRAIN_CHECK(images.size(0) == labels.size(0), DataError,
               "Fashion-MNIST " << prefix << " files disagree: " << images.size(0) << " images but " << labels.size(0)
                                << " labels.",
               "the image and label files come from different sets; reinstall them");
  DTRAIN_CHECK(
      labels.numel() == 0 || labels.max().item<int>() < kClasses, DataError,
      label_file.string() << ": has label " << labels.max().item<int>() << ", outside 0.." << kClasses - 1 << ".",
      "the label file is corrupt");

  images_ = images.to(at::kFloat).div_(255.0).sub_(kMean).div_(kStd).unsqueeze(1).contiguous();
  labels_ = labels.to(at::kLong);
}

TensorExample FashionMnist::get(std::int64_t index) const {
  DTRAIN_CHECK(index >= 0 && index < size(), ConfigError,
               "example index " << index << " is outside the dataset of " << size() << ".",
               "use an index in 0.." << size() - 1);
  return {images_[index], labels_[index]};
}

std::vector<TensorExample> FashionMnist::get_many(const std::vector<std::int64_t>& indices) const {
  for (auto i : indices) {
    DTRAIN_CHECK(i >= 0 && i < size(), ConfigError,
                 "example index " << i << " is outside the dataset of " << size() << ".",
                 "use indices in 0.." << size() - 1);
  }
  const at::Tensor idx = at::tensor(indices, at::kLong);
  const auto images = images_.index_select(0, idx).unbind(0);
  const auto labels = labels_.index_select(0, idx).unbind(0);
  std::vector<TensorExample> out;
  out.reserve(indices.size());
  for (std::size_t k = 0; k < indices.size(); ++k) out.push_back({images[k], labels[k]});
  return out;
}

Batch FashionMnist::get_batch(const at::Tensor& indices) const {
  return {images_.index_select(0, indices), labels_.index_select(0, indices)};
}

}  // namespace dtrain::data
