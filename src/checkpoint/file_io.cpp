// mmap'd reads and atomic writes for the checkpoint formats.
#include "file_io.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "dtrain/error.h"

namespace fs = std::filesystem;

namespace dtrain::checkpoint::detail {
namespace {

// Closes a descriptor when the scope ends, whatever ends it.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::shared_ptr<MappedFile> MappedFile::open(const fs::path& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  DTRAIN_CHECK(fd >= 0, DataError, "cannot open " << file.string() << ": " << std::strerror(errno) << ".",
               "check the path and its permissions");
  FdCloser closer{fd};
  struct stat st {};
  DTRAIN_CHECK(::fstat(fd, &st) == 0, DataError, "cannot stat " << file.string() << ": " << std::strerror(errno) << ".",
               "");
  DTRAIN_CHECK(S_ISREG(st.st_mode), DataError, file.string() << " is not a regular file.", "give a file's path");
  const auto size = static_cast<std::size_t>(st.st_size);
  if (size == 0) return std::shared_ptr<MappedFile>(new MappedFile(file, nullptr, 0));
  void* data = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  DTRAIN_CHECK(data != MAP_FAILED, DataError,
               "cannot map " << file.string() << " (" << size << " bytes): " << std::strerror(errno) << ".", "");
  return std::shared_ptr<MappedFile>(new MappedFile(file, static_cast<std::byte*>(data), size));
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

void write_file_atomically(const fs::path& file, bool durable, const std::function<void(const ChunkSink&)>& body) {
  const fs::path tmp = file.string() + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  DTRAIN_CHECK(fd >= 0, DataError, "cannot create " << tmp.string() << ": " << std::strerror(errno) << ".",
               "check that the folder exists and is writable");
  FdCloser closer{fd};
  auto fail = [&](const std::string& what) {
    const std::string reason = std::strerror(errno);
    ::unlink(tmp.c_str());
    DTRAIN_CHECK(false, DataError, "cannot " << what << " " << file.string() << ": " << reason << ".",
                 "check free space and permissions");
  };
  try {
    body([&](const void* data, std::size_t size) {
      const auto* p = static_cast<const char*>(data);
      while (size > 0) {
        const ssize_t n = ::write(fd, p, size);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) fail("write");
        p += n;
        size -= static_cast<std::size_t>(n);
      }
    });
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (durable && ::fsync(fd) != 0) fail("fsync");
  closer.fd = -1;
  if (::close(fd) != 0) fail("close");
  if (::rename(tmp.c_str(), file.c_str()) != 0) fail("rename into place");
  if (durable) {
    const fs::path parent = file.has_parent_path() ? file.parent_path() : fs::path(".");
    const int dir = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir >= 0) {
      ::fsync(dir);
      ::close(dir);
    }
  }
}

}  // namespace dtrain::checkpoint::detail
