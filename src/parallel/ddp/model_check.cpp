// Cross-rank model consistency check: one small all-gather of (count, hash)
// in the common case; the full descriptions only when something differs.
#include "model_check.h"

#include <ATen/Functions.h>

#include <cstring>
#include <sstream>

#include "dtrain/error.h"

namespace dtrain::detail {
namespace {

std::string describe(const NamedTensor& t) {
  std::ostringstream out;
  out << t.kind << " '" << t.name << "' " << t.tensor.scalar_type() << " " << t.tensor.sizes();
  return out.str();
}

std::int64_t fnv1a(const std::string& text) {
  std::uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  std::int64_t out = 0;
  std::memcpy(&out, &h, sizeof out);
  return out;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::stringstream in(text);
  std::string line;
  while (std::getline(in, line)) lines.push_back(line);
  return lines;
}

// Everyone's description lists, gathered through the group.
std::vector<std::vector<std::string>> gather_descriptions(dist::ProcessGroup& group, const std::string& mine) {
  const auto options = at::TensorOptions().device(group.device());
  const auto lengths = group.all_gather(at::tensor({static_cast<std::int64_t>(mine.size())}, options.dtype(at::kLong)));
  std::int64_t longest = 0;
  for (const auto& l : lengths) longest = std::max(longest, l.item<std::int64_t>());
  at::Tensor bytes = at::zeros({std::max<std::int64_t>(longest, 1)}, at::kByte);
  std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  const auto all = group.all_gather(bytes.to(group.device()));
  std::vector<std::vector<std::string>> out;
  for (std::size_t r = 0; r < all.size(); ++r) {
    const at::Tensor cpu = all[r].cpu();
    const auto n = static_cast<std::size_t>(lengths[r].item<std::int64_t>());
    out.push_back(split_lines(std::string(static_cast<const char*>(cpu.data_ptr()), n)));
  }
  return out;
}

}  // namespace

void check_same_model_across_ranks(dist::ProcessGroup& group, const std::vector<NamedTensor>& tensors) {
  std::string mine;
  for (const auto& t : tensors) mine += describe(t) + "\n";
  const auto options = at::TensorOptions().dtype(at::kLong).device(group.device());
  const auto summaries =
      group.all_gather(at::tensor({static_cast<std::int64_t>(tensors.size()), fnv1a(mine)}, options));
  bool same = true;
  for (const auto& s : summaries) same = same && at::equal(s.cpu(), summaries[0].cpu());
  if (same) return;

  const auto lists = gather_descriptions(group, mine);
  const auto& reference = lists[0];
  for (std::size_t r = 1; r < lists.size(); ++r) {
    const auto& other = lists[r];
    const std::size_t common = std::min(reference.size(), other.size());
    for (std::size_t i = 0; i < common; ++i) {
      if (reference[i] != other[i]) {
        throw ConfigError("the model differs across ranks: " + reference[i] + " on rank 0 but " + other[i] +
                              " on rank " + std::to_string(r) + " (entry " + std::to_string(i) + ").",
                          "build the same model (layers, shapes, dtypes) on every rank before wrapping it in "
                          "DistributedDataParallel");
      }
    }
    if (reference.size() != other.size()) {
      const bool zero_longer = reference.size() > other.size();
      const auto& extra = zero_longer ? reference[common] : other[common];
      throw ConfigError("the model differs across ranks: rank 0 has " + std::to_string(reference.size()) +
                            " parameters and buffers, rank " + std::to_string(r) + " has " +
                            std::to_string(other.size()) + "; the first without a counterpart is " + extra +
                            " on rank " + (zero_longer ? std::string("0") : std::to_string(r)) + ".",
                        "build the same model (layers, shapes, dtypes) on every rank before wrapping it in "
                        "DistributedDataParallel");
    }
  }
  DTRAIN_INTERNAL_ASSERT(false, "model summaries differ but descriptions agree");
}

}  // namespace dtrain::detail
