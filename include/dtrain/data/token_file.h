// A language-model dataset over a flat binary file of token ids (uint16 or
// uint32, little-endian, as written by common tokenizer pipelines), cut into
// windows: example i is tokens [i*stride, i*stride + seq_len) as input and
// the same window shifted by one as target. The file is memory-mapped.
#pragma once

#include <filesystem>
#include <memory>

#include "dtrain/data/dataset.h"

namespace dtrain::data {

struct TokenFileOptions {
  int token_bytes = 2;  // 2 (uint16) or 4 (uint32)
  std::int64_t seq_len = 128;
  std::int64_t stride = 0;  // 0: seq_len (non-overlapping windows)
};

class TokenFileDataset : public Dataset<TensorExample> {
 public:
  // Throws DataError for a missing file, a size that is not a whole number of
  // tokens, or fewer than seq_len + 1 tokens; ConfigError for bad options.
  TokenFileDataset(const std::filesystem::path& path, TokenFileOptions options);
  ~TokenFileDataset() override;
  std::int64_t size() const override { return windows_; }
  // data and target: int64 [seq_len].
  TensorExample get(std::int64_t index) const override;
  std::int64_t num_tokens() const { return tokens_; }

 private:
  std::int64_t token_at(std::int64_t position) const;

  TokenFileOptions options_;
  std::string path_;
  const unsigned char* data_ = nullptr;
  std::size_t mapped_bytes_ = 0;
  std::int64_t tokens_ = 0;
  std::int64_t windows_ = 0;
};

}  // namespace dtrain::data
