// Memory-mapped token-id files for language-model training.
#include "dtrain/data/token_file.h"

#include <ATen/Functions.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "dtrain/error.h"

namespace dtrain::data {

TokenFileDataset::TokenFileDataset(const std::filesystem::path& path, TokenFileOptions options)
    : options_(options), path_(path.string()) {
  DTRAIN_CHECK(options_.token_bytes == 2 || options_.token_bytes == 4, ConfigError,
               "token_bytes=" << options_.token_bytes << " is not 2 or 4.", "use 2 for uint16 ids, 4 for uint32");
  DTRAIN_CHECK(options_.seq_len >= 1, ConfigError, "seq_len=" << options_.seq_len << " must be at least 1.",
               "pass the context length");
  if (options_.stride == 0) options_.stride = options_.seq_len;
  DTRAIN_CHECK(options_.stride >= 1, ConfigError, "stride=" << options_.stride << " must be at least 1.",
               "use 0 for non-overlapping windows");
  const int fd = ::open(path_.c_str(), O_RDONLY);
  DTRAIN_CHECK(fd >= 0, DataError, path_ << ": cannot open: " << std::strerror(errno) << ".",
               "check the token file's path");
  struct stat st {};
  ::fstat(fd, &st);
  const auto bytes = static_cast<std::int64_t>(st.st_size);
  if (bytes % options_.token_bytes != 0) {
    ::close(fd);
    throw DataError(path_ + ": " + std::to_string(bytes) + " bytes is not a whole number of " +
                        std::to_string(options_.token_bytes) + "-byte tokens.",
                    "check token_bytes (2 for uint16, 4 for uint32) or whether the file is truncated");
  }
  tokens_ = bytes / options_.token_bytes;
  if (tokens_ < options_.seq_len + 1) {
    ::close(fd);
    throw DataError(path_ + ": " + std::to_string(tokens_) +
                        " tokens are fewer than seq_len + 1 = " + std::to_string(options_.seq_len + 1) + ".",
                    "use a shorter seq_len or a larger token file");
  }
  void* map = ::mmap(nullptr, static_cast<std::size_t>(bytes), PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  DTRAIN_CHECK(map != MAP_FAILED, DataError, path_ << ": cannot map: " << std::strerror(errno) << ".",
               "check memory limits");
  data_ = static_cast<const unsigned char*>(map);
  mapped_bytes_ = static_cast<std::size_t>(bytes);
  windows_ = (tokens_ - options_.seq_len - 1) / options_.stride + 1;
}

TokenFileDataset::~TokenFileDataset() {
  if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), mapped_bytes_);
}

std::int64_t TokenFileDataset::token_at(std::int64_t position) const {
  const unsigned char* p = data_ + position * options_.token_bytes;
  if (options_.token_bytes == 2) return static_cast<std::int64_t>(p[0] | (p[1] << 8));
  return static_cast<std::int64_t>(static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
                                   (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24));
}

TensorExample TokenFileDataset::get(std::int64_t index) const {
  DTRAIN_CHECK(index >= 0 && index < windows_, ConfigError,
               "window " << index << " is outside the " << windows_ << " windows of " << path_ << ".",
               "use an index in 0.." << windows_ - 1);
  at::Tensor window = at::empty({options_.seq_len + 1}, at::kLong);
  auto* out = window.data_ptr<std::int64_t>();
  const std::int64_t start = index * options_.stride;
  for (std::int64_t i = 0; i <= options_.seq_len; ++i) out[i] = token_at(start + i);
  return {window.slice(0, 0, options_.seq_len), window.slice(0, 1, options_.seq_len + 1)};
}

}  // namespace dtrain::data
