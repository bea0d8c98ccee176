#include "rendezvous_loader.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <vector>

#include "dtrain/error.h"

namespace dtrain::tools {
namespace {

using ConnectFn = void (*)(const std::string*, int, long long, std::shared_ptr<elastic::RendezvousStore>*);

ConnectFn load_connect() {
  std::vector<std::string> candidates;
  if (const char* path = std::getenv("DTRAIN_LIBRARY")) candidates.emplace_back(path);
  candidates.emplace_back(DTRAIN_LIBRARY_BUILD_PATH);
  const auto exe = std::filesystem::read_symlink("/proc/self/exe").parent_path();
  candidates.push_back((exe.parent_path() / "lib" / DTRAIN_LIBRARY_FILE_NAME).string());
  std::string errors;
  for (const auto& path : candidates) {
    if (!std::filesystem::exists(path)) continue;
    void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      errors += std::string(" ") + ::dlerror() + ";";
      continue;
    }
    if (auto fn = reinterpret_cast<ConnectFn>(::dlsym(lib, "dtrain_connect_tcp_rendezvous_store"))) return fn;
    errors += " " + path + " lacks dtrain_connect_tcp_rendezvous_store;";
  }
  throw ConfigError("multi-node rendezvous needs libdtrain, which could not be loaded (tried " +
                        std::string(DTRAIN_LIBRARY_BUILD_PATH) + " and the install prefix)." + errors,
                    "set DTRAIN_LIBRARY to the path of libdtrain.so");
}

}  // namespace

std::shared_ptr<elastic::RendezvousStore> load_tcp_rendezvous_store(const std::string& host, int port,
                                                                    std::chrono::milliseconds timeout) {
  static const ConnectFn connect = load_connect();
  std::shared_ptr<elastic::RendezvousStore> store;
  connect(&host, port, static_cast<long long>(timeout.count()), &store);
  return store;
}

std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* resolved = nullptr;
  const std::string service = std::to_string(port);
  if (::getaddrinfo(host.c_str(), service.c_str(), &hints, &resolved) != 0 || resolved == nullptr) {
    char name[256] = {};
    ::gethostname(name, sizeof name - 1);
    return name;  // resolution fails later, with a clear error from the store
  }
  std::string out = "127.0.0.1";
  // connect() on a UDP socket sends nothing; it only picks the route and source address.
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_in local{};
  socklen_t len = sizeof local;
  if (fd >= 0 && ::connect(fd, resolved->ai_addr, resolved->ai_addrlen) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
    char text[INET_ADDRSTRLEN] = {};
    if (::inet_ntop(AF_INET, &local.sin_addr, text, sizeof text) != nullptr) out = text;
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(resolved);
  return out;
}

}  // namespace dtrain::tools
