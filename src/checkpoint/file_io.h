// Private to checkpoint/: a read-only view of a whole file through mmap, and
// the atomic write (temporary file, rename) every checkpoint format uses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string_view>

namespace dtrain::checkpoint::detail {

// A file mapped private and copy-on-write (PROT_READ|PROT_WRITE, MAP_PRIVATE):
// tensors made over it may be written to in place without touching the file.
// Unmapped when the last shared_ptr to it goes. An empty file has data() ==
// nullptr and size() == 0. Open failures are DataErrors naming the file.
class MappedFile {
 public:
  static std::shared_ptr<MappedFile> open(const std::filesystem::path& file);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  MappedFile(std::filesystem::path path, std::byte* data, std::size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::filesystem::path path_;
  std::byte* data_;
  std::size_t size_;
};

// Writes through `append`, which the body calls with each chunk in order.
using ChunkSink = std::function<void(const void* data, std::size_t size)>;

// Creates `file` by running `body` on a sink into "<file>.tmp.<pid>", then
// renaming it over `file`; with `durable`, the temporary is fsync'd before the
// rename and the folder after. A failure removes the temporary and throws a
// DataError naming the file and errno's message; `file` is left as it was.
void write_file_atomically(const std::filesystem::path& file, bool durable,
                           const std::function<void(const ChunkSink&)>& body);

}  // namespace dtrain::checkpoint::detail
