// The dataset interface the DataLoader reads from.
//
// A dataset has a size and returns one example per index; get_many() gathers
// several at once and may be overridden where a dataset can do better than
// one get() per index (for example one index_select over an in-memory
// tensor). Implementations must be safe to call from several threads at once.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace dtrain::data {

template <typename Example>
class Dataset {
 public:
  using ExampleType = Example;
  virtual ~Dataset() = default;
  virtual std::int64_t size() const = 0;
  virtual Example get(std::int64_t index) const = 0;
  virtual std::vector<Example> get_many(const std::vector<std::int64_t>& indices) const {
    std::vector<Example> out;
    out.reserve(indices.size());
    for (auto i : indices) out.push_back(get(i));
    return out;
  }
};

// The common example shape: an input and a target tensor.
struct TensorExample {
  at::Tensor data;
  at::Tensor target;
};

}  // namespace dtrain::data
