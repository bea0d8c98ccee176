// The one place `dtrain run` loads libdtrain (dlopen), and the workers' store
// it hosts through it on a background thread.
#include "libdtrain_loader.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>

#include "dtrain/error.h"
#include "dtrain/module_loader.h"

namespace dtrain::tools {
namespace {

constexpr const char* kHint = "set DTRAIN_LIBRARY to the path of libdtrain.so";

// Where libdtrain is: $DTRAIN_LIBRARY when set (and nowhere else then), else
// the install prefix this program is in, else the build tree it came from.
const std::string& libdtrain_path() {
  static const std::string path = [] {
    if (const char* env = std::getenv("DTRAIN_LIBRARY")) {
      DTRAIN_CHECK(std::filesystem::exists(env), ConfigError,
                   "DTRAIN_LIBRARY=" << env
                                     << " does not exist; dtrain run needs libdtrain (c10d's TCPStore) "
                                        "to host the workers' store.",
                   kHint);
      return std::string(env);
    }
    const auto exe = std::filesystem::read_symlink("/proc/self/exe").parent_path();
    const std::string installed = (exe.parent_path() / "lib" / DTRAIN_LIBRARY_FILE_NAME).string();
    for (const std::string& candidate : {installed, std::string(DTRAIN_LIBRARY_BUILD_PATH)}) {
      if (std::filesystem::exists(candidate)) return candidate;
    }
    throw ConfigError(
        "dtrain run needs libdtrain (c10d's TCPStore) to host the workers' store, and found it "
        "neither at " +
            installed + " nor at " + std::string(DTRAIN_LIBRARY_BUILD_PATH) + ".",
        kHint);
  }();
  return path;
}

// libdtrain, loaded once (thread-safe). RTLD_LAZY: resolving all of
// LibTorch's function symbols up front made loading ~20% slower here, and
// the store is on the workers' path to their first step.
void* libdtrain_handle() {
  static void* const handle = [] {
    return dtrain::detail::load_module("libdtrain", libdtrain_path(), /*lazy=*/true, kHint);
  }();
  return handle;
}

// The function `name` from libdtrain.
template <typename Fn>
Fn libdtrain_function(const char* name) {
  return reinterpret_cast<Fn>(dtrain::detail::module_symbol(libdtrain_handle(), libdtrain_path(), name, kHint));
}

using ConnectFn = void (*)(const std::string*, int, long long, const std::string*, int,
                           std::shared_ptr<elastic::RendezvousStore>*);
using HostFn = void (*)(int, int, std::shared_ptr<void>*);
using LighthouseFn = void (*)(int, int, const std::string*, std::shared_ptr<void>*, std::function<void()>*,
                              std::function<bool()>*);

}  // namespace

std::shared_ptr<elastic::RendezvousStore> load_tcp_rendezvous_store(const std::string& host, int port,
                                                                    std::chrono::milliseconds timeout,
                                                                    const std::string& secret,
                                                                    elastic::StoreRole role) {
  static const auto connect = libdtrain_function<ConnectFn>("dtrain_connect_tcp_rendezvous_store");
  std::shared_ptr<elastic::RendezvousStore> store;
  connect(&host, port, static_cast<long long>(timeout.count()), &secret, static_cast<int>(role), &store);
  return store;
}

int run_ckpt_command(const std::vector<std::string>& args, std::ostream& out) {
  using CkptFn = int (*)(const std::vector<std::string>*, std::ostream*);
  static const auto command = libdtrain_function<CkptFn>("dtrain_ckpt_command");
  return command(&args, &out);
}

int run_ckpt_folder_command(const std::vector<std::string>& args, std::ostream& out) {
  using CkptFn = int (*)(const std::vector<std::string>*, std::ostream*);
  static const auto command = libdtrain_function<CkptFn>("dtrain_ckpt_folder_command");
  return command(&args, &out);
}

bool lighthouse_serves(const std::string& host, int port, std::chrono::milliseconds timeout) {
  using ServesFn = bool (*)(const std::string*, int, long long);
  static const auto serves = libdtrain_function<ServesFn>("dtrain_lighthouse_serves");
  return serves(&host, port, static_cast<long long>(timeout.count()));
}

BackgroundWorkerStore::~BackgroundWorkerStore() {
  stop();
}

void BackgroundWorkerStore::serve(int listen_fd, int port) {
  stop();
  try {
    libdtrain_path();
  } catch (...) {
    ::close(listen_fd);
    throw;
  }
  starter_ = std::thread([this, listen_fd, port] {
    std::shared_ptr<void> store;
    std::exception_ptr error;
    std::function<void()> check_service;
    std::function<bool()> serving;
    std::function<void(int, int, std::shared_ptr<void>*)> host;
    try {
      if (lighthouse_) {
        host = [fn = libdtrain_function<LighthouseFn>("dtrain_host_lighthouse"), config = lighthouse_config_,
                &check_service, &serving](int fd, int p, std::shared_ptr<void>* out) {
          fn(fd, p, &config, out, &check_service, &serving);
        };
      } else {
        host = libdtrain_function<HostFn>("dtrain_host_worker_store");
      }
    } catch (...) {
      ::close(listen_fd);  // workers' connections fail at once instead of waiting for their timeout
      error = std::current_exception();
    }
    if (host) {
      try {
        host(listen_fd, port, &store);  // owns listen_fd from here on, even when it throws
      } catch (...) {
        error = std::current_exception();
      }
    }
    const std::lock_guard lock(mutex_);
    store_ = std::move(store);
    error_ = error;
    check_service_ = std::move(check_service);
    serving_ = std::move(serving);
  });
}

void BackgroundWorkerStore::stop() {
  if (starter_.joinable()) starter_.join();
  const std::lock_guard lock(mutex_);
  check_service_ = nullptr;  // before the service it points into
  serving_ = nullptr;
  store_.reset();
  error_ = nullptr;
}

bool BackgroundWorkerStore::serving() {
  const std::lock_guard lock(mutex_);
  return serving_ ? serving_() : !lighthouse_;  // a lighthouse not started yet serves nothing
}

void BackgroundWorkerStore::check() {
  const std::lock_guard lock(mutex_);
  if (error_) std::rethrow_exception(error_);
  if (check_service_) check_service_();
}

}  // namespace dtrain::tools
