// A key-value store shared by the ranks of a job: the rendezvous medium.
//
// A thin handle over c10d's stores (TCPStore across processes and machines,
// HashStore for ranks that are threads of one process). Copies share the same
// underlying store. Keys are byte strings; values here are text.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dtrain::dist {

struct TcpStoreOptions {
  std::string host = "127.0.0.1";  // server address; the server listens on all interfaces
  int port = 29500;                // 0 lets the server pick a free port (see Store::port())
  bool is_server = false;
  // How long a client keeps trying to connect, and the default wait of get/wait.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  // A server takes over this already listening socket instead of binding
  // `port` (the launcher pre-binds it, so clients never race the server).
  int listen_fd = -1;
};

namespace detail {
struct StoreImpl;
}

class Store {
 public:
  // An in-process store (c10d HashStore), for ranks that run as threads.
  static Store in_memory();
  // Connects to (or, with is_server, hosts) a TCPStore. Throws TimeoutError
  // naming host:port when the server cannot be reached in time, and
  // ConfigError when a server's port is already in use.
  static Store tcp(const TcpStoreOptions& options);

  // A view whose keys are all prefixed with `prefix` + "/".
  Store with_prefix(const std::string& prefix) const;

  void set(const std::string& key, const std::string& value);
  // Blocks until `key` exists (up to the store's timeout).
  std::string get(const std::string& key);
  std::int64_t add(const std::string& key, std::int64_t delta);
  // Sets `key` to `desired` if its value is `expected` ("" = the key is
  // absent); returns the value afterwards (`desired` when it was set).
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired);
  bool check(const std::vector<std::string>& keys);
  // Blocks until all keys exist; TimeoutError naming the keys otherwise.
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  // The port a TCP store listens on or connects to; 0 for in-memory stores.
  int port() const;

  // For dtrain's own comm internals (src/comm/group_state.h).
  const std::shared_ptr<detail::StoreImpl>& impl() const { return impl_; }
  explicit Store(std::shared_ptr<detail::StoreImpl> impl) : impl_(std::move(impl)) {}

 private:
  std::shared_ptr<detail::StoreImpl> impl_;
};

}  // namespace dtrain::dist
