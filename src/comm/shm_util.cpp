#include "shm_util.h"

#include <dirent.h>
#include <linux/futex.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>
#include <fstream>
#include <functional>
#include <string>

namespace dtrain::dist::detail {

void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, std::chrono::microseconds timeout) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000) * 1000;
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<std::uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

std::uint64_t host_identity() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  struct stat ns {};
  ::stat("/proc/self/ns/pid", &ns);  // pids are compared only within one pid namespace
  struct stat shm {};
  ::stat("/dev/shm", &shm);  // containers of one host name may each mount their own
  return std::hash<std::string>{}(std::string(host) + "/" + boot_id + "/" + std::to_string(ns.st_ino) + "/" +
                                  std::to_string(shm.st_dev) + ":" + std::to_string(shm.st_ino));
}

bool process_gone(std::int64_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  const auto close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() || line[close + 2] == 'Z' || line[close + 2] == 'X';
}

std::string shm_file_prefix(std::int64_t pid) {
  return "/dev/shm/dtrain-" + std::to_string(pid) + "-";
}

int remove_shared_memory_of(std::int64_t pid) {
  const std::string prefix = shm_file_prefix(pid);
  const std::string dir = "/dev/shm/", name_prefix = prefix.substr(dir.size());
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return 0;
  int removed = 0;
  while (const dirent* entry = ::readdir(d)) {
    const std::string name = entry->d_name;
    if (name.rfind(name_prefix, 0) == 0 && ::unlink((dir + name).c_str()) == 0) ++removed;
  }
  ::closedir(d);
  return removed;
}

}  // namespace dtrain::dist::detail
