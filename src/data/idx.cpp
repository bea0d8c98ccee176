// IDX reading through zlib's gz* API, which also reads uncompressed files.
#include "dtrain/data/idx.h"

#include <ATen/Functions.h>
#include <zlib.h>

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "dtrain/error.h"

namespace dtrain::data {
namespace {

constexpr std::int64_t kMaxBytes = std::int64_t{1} << 36;  // 64 GiB: larger means a corrupt header

struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};
using GzFile = std::unique_ptr<std::remove_pointer_t<gzFile>, GzCloser>;

struct TypeInfo {
  at::ScalarType type;
  int bytes;
};

TypeInfo type_of(std::uint8_t code, const std::string& file) {
  switch (code) {
    case 0x08: return {at::kByte, 1};
    case 0x09: return {at::kChar, 1};
    case 0x0B: return {at::kShort, 2};
    case 0x0C: return {at::kInt, 4};
    case 0x0D: return {at::kFloat, 4};
    case 0x0E: return {at::kDouble, 8};
    default: break;
  }
  throw DataError(
      file + ": unknown IDX type code 0x" +
          [&] {
            char buf[8];
            std::snprintf(buf, sizeof buf, "%02x", code);
            return std::string(buf);
          }() +
          ".",
      "the file is not an IDX file or is corrupt; re-download or reinstall it");
}

// Reads exactly `n` bytes, or reports how many were there.
std::int64_t read_fully(gzFile f, void* out, std::int64_t n, const std::string& file) {
  auto* p = static_cast<char*>(out);
  std::int64_t done = 0;
  while (done < n) {
    const auto chunk = static_cast<unsigned>(std::min<std::int64_t>(n - done, 1 << 30));
    const int got = gzread(f, p + done, chunk);
    if (got < 0) {
      int code = 0;
      const char* msg = gzerror(f, &code);
      throw DataError(file + ": the gzip stream is damaged (" + msg + ").",
                      "the file is corrupt; re-download or reinstall it");
    }
    if (got == 0) break;
    done += got;
  }
  if (done < n) {
    int code = 0;
    const char* msg = gzerror(f, &code);
    if (code != Z_OK && code != Z_STREAM_END) {
      throw DataError(file + ": the gzip stream is damaged (" + msg + ").",
                      "the file is corrupt or truncated; re-download or reinstall it");
    }
  }
  return done;
}

void to_native_endian(at::Tensor& t, int bytes) {
  if (bytes == 1 || std::endian::native == std::endian::big) return;
  auto* p = static_cast<std::uint8_t*>(t.data_ptr());
  const std::int64_t n = t.numel();
  for (std::int64_t i = 0; i < n; ++i) std::reverse(p + i * bytes, p + (i + 1) * bytes);
}

}  // namespace

at::Tensor read_idx(const std::filesystem::path& path) {
  const std::string file = path.string();
  std::error_code ec;
  DTRAIN_CHECK(std::filesystem::is_regular_file(path, ec), DataError, file << ": no such file.",
               "check the path (for Fashion-MNIST: apt install dataset-fashion-mnist, or pass --data-dir)");
  GzFile f(gzopen(file.c_str(), "rb"));
  DTRAIN_CHECK(f != nullptr, DataError, file << ": cannot open: " << std::strerror(errno) << ".",
               "check the file's permissions");

  std::array<std::uint8_t, 4> magic{};
  const auto got = read_fully(f.get(), magic.data(), 4, file);
  DTRAIN_CHECK(got == 4, DataError, file << ": truncated: the 4-byte IDX header is missing (" << got << " bytes).",
               "the file is empty or cut short; re-download or reinstall it");
  DTRAIN_CHECK(magic[0] == 0 && magic[1] == 0, DataError, file << ": not an IDX file (bad magic number).",
               "pass an IDX file such as train-images-idx3-ubyte[.gz]");
  const TypeInfo info = type_of(magic[2], file);
  const int ndims = magic[3];
  DTRAIN_CHECK(ndims >= 1, DataError, file << ": IDX header declares 0 dimensions.", "the file is corrupt");

  std::vector<std::uint8_t> raw_dims(static_cast<size_t>(ndims) * 4);
  const auto dims_bytes = static_cast<std::int64_t>(raw_dims.size());
  DTRAIN_CHECK(read_fully(f.get(), raw_dims.data(), dims_bytes, file) == dims_bytes, DataError,
               file << ": truncated inside the IDX header (" << ndims << " dimensions declared).",
               "the file is cut short; re-download or reinstall it");
  std::vector<std::int64_t> dims;
  std::int64_t bytes = info.bytes;
  for (int d = 0; d < ndims; ++d) {
    const std::uint8_t* b = &raw_dims[static_cast<size_t>(d) * 4];
    const std::int64_t size = (std::int64_t{b[0]} << 24) | (b[1] << 16) | (b[2] << 8) | b[3];
    dims.push_back(size);
    DTRAIN_CHECK(size == 0 || bytes <= kMaxBytes / size, DataError,
                 file << ": IDX header declares more than " << (kMaxBytes >> 30) << " GiB of data.",
                 "the header is corrupt");
    bytes *= size;
  }

  at::Tensor out = at::empty(dims, at::TensorOptions().dtype(info.type));
  const auto read = read_fully(f.get(), out.data_ptr(), bytes, file);
  DTRAIN_CHECK(read == bytes, DataError,
               file << ": truncated: the header announces " << bytes << " bytes of data, the file has " << read << ".",
               "the file is cut short; re-download or reinstall it");
  char extra = 0;
  DTRAIN_CHECK(read_fully(f.get(), &extra, 1, file) == 0, DataError,
               file << ": has bytes after the " << bytes << " bytes of data its header announces.",
               "the file is corrupt or not the IDX file expected");
  to_native_endian(out, info.bytes);
  return out;
}

}  // namespace dtrain::data
