// The rendezvous stores: c10d's TCPStore (hosted by the node whose address
// the endpoint names, when its port is free) and an in-memory one for tests.
// `dtrain run` links no LibTorch; it loads libdtrain for this file only when
// a multi-node rendezvous is asked for (tools/dtrain/rendezvous_loader.cpp).
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <c10/util/Logging.h>

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <future>
#include <thread>

#include "dtrain/comm/store.h"
#include "dtrain/elastic/rendezvous.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "dtrain/net.h"
#include "rdzv_auth.h"

namespace dtrain::elastic {
namespace {

// Store errors (the node hosting the store went away, a timeout) become
// CommunicationErrors naming the endpoint.
class DistRendezvousStore : public RendezvousStore {
 public:
  // `guard` (the authentication gate or tunnel) outlives the store's connections.
  DistRendezvousStore(dist::Store store, bool hosts, std::string where, std::shared_ptr<void> guard = nullptr)
      : guard_(std::move(guard)), store_(std::move(store)), hosts_(hosts), where_(std::move(where)) {}
  void set(const std::string& key, const std::string& value) override {
    guarded([&] { store_.set(key, value); });
  }
  std::optional<std::string> try_get(const std::string& key) override {
    std::optional<std::string> out;
    guarded([&] {
      if (store_.check({key})) out = store_.get(key);
    });
    return out;
  }
  std::int64_t add(const std::string& key, std::int64_t delta) override {
    std::int64_t out = 0;
    guarded([&] { out = store_.add(key, delta); });
    return out;
  }
  std::string create_if_absent(const std::string& key, const std::string& desired) override {
    std::string out;
    guarded([&] { out = store_.compare_set(key, "", desired); });
    return out;
  }
  bool hosts_store() const override { return hosts_; }

 private:
  template <typename F>
  void guarded(F&& f) {
    try {
      f();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      std::string what = e.what();
      what = what.substr(0, what.find('\n'));
      throw CommunicationError("lost the rendezvous store at " + where_ + ": " + what,
                               "the node hosting it (the one --rdzv-endpoint names) stopped; restart the job");
    }
  }
  std::shared_ptr<void> guard_;
  dist::Store store_;
  bool hosts_;
  std::string where_;
};

// A node without a secret that reaches a gated store: say so, rather than
// letting c10d's client time out on the gate's greeting.
void refuse_if_gated(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return;
  const int fd = ::socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC, res->ai_protocol);
  const bool connected = fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0;
  ::freeaddrinfo(res);
  char greeting[8] = {};
  pollfd p{fd, POLLIN, 0};
  const bool gated = connected && ::poll(&p, 1, 300) == 1 && ::recv(fd, greeting, sizeof greeting, MSG_WAITALL) == 8 &&
                     std::memcmp(greeting, "DTRDZV1\n", 8) == 0;
  if (fd >= 0) ::close(fd);
  DTRAIN_CHECK(!gated, ConfigError,
               "the rendezvous at " << host << ":" << port << " requires a shared secret, and this node has none.",
               "pass the job's --rdzv-secret-file (or set DTRAIN_RDZV_SECRET) on every node");
}

// The store on 127.0.0.1 only, behind a gate on the endpoint's port.
std::shared_ptr<RendezvousStore> host_gated(const std::string& host, int port, std::chrono::milliseconds timeout,
                                            const std::string& secret) {
  int public_port = port;
  const int public_fd = net::listen_tcp(public_port);  // ConfigError when taken: be a client
  int inner_port = 0;
  int inner_fd = -1;
  try {
    inner_fd = net::listen_tcp(inner_port, /*loopback_only=*/true);
  } catch (...) {
    ::close(public_fd);
    throw;
  }
  std::optional<dist::Store> store;
  try {
    store = dist::Store::tcp(
        {.host = "127.0.0.1", .port = inner_port, .is_server = true, .timeout = timeout, .listen_fd = inner_fd});
  } catch (...) {
    ::close(public_fd);
    throw;
  }
  auto gate = std::make_shared<auth::Gate>(public_fd, inner_port, secret);
  DTRAIN_LOG(kInfo) << "hosting the rendezvous store on port " << port << "; joins need the shared secret";
  return std::make_shared<DistRendezvousStore>(std::move(*store), true, host + ":" + std::to_string(port), gate);
}

}  // namespace

std::shared_ptr<RendezvousStore> connect_tcp_rendezvous_store(const std::string& host, int port,
                                                              std::chrono::milliseconds timeout,
                                                              const std::string& secret, StoreRole role) {
  const bool may_host = role == StoreRole::kHost || (role == StoreRole::kAuto && net::names_this_machine(host));
  if (!secret.empty() && may_host) {
    try {
      return host_gated(host, port, timeout, secret);
    } catch (const ConfigError&) {
      // The port is taken, normally by the node that hosts the store: join it as a client.
      if (role == StoreRole::kHost) throw;
    }
  }
  if (secret.empty() && may_host) {
    try {
      auto store = dist::Store::tcp({.host = host, .port = port, .is_server = true, .timeout = timeout});
      DTRAIN_LOG(kInfo) << "hosting the rendezvous store on port " << port;
      return std::make_shared<DistRendezvousStore>(std::move(store), true, host + ":" + std::to_string(port));
    } catch (const ConfigError&) {
      // The port is taken, normally by the node that hosts the store: join it as a client.
      if (role == StoreRole::kHost) throw;
    }
  }
  // c10d's client does not bound its handshake by the timeout: a port held by
  // another program that accepts but never answers would block forever. The
  // connection therefore runs on a thread of its own, under our deadline.
  const std::string where = host + ":" + std::to_string(port);
  const std::string seconds = log::format_seconds(timeout);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (!net::wait_until_reachable(host, port, deadline)) {
    throw TimeoutError("could not reach the rendezvous store at " + where + " within " + seconds + ".",
                       "start the node whose address --rdzv-endpoint names first (it hosts the store), check the "
                       "address and port, or raise --rdzv-timeout");
  }
  // With a secret the store client talks to a local tunnel that makes the
  // handshake for each of its connections; checked once first.
  std::shared_ptr<auth::Tunnel> tunnel;
  if (secret.empty()) {
    refuse_if_gated(host, port);
  } else {
    tunnel = std::make_shared<auth::Tunnel>(host, port, secret, timeout);
    tunnel->check();
  }
  const std::string store_host = tunnel ? "127.0.0.1" : host;
  const int store_port = tunnel ? tunnel->port() : port;
  auto promise = std::make_shared<std::promise<dist::Store>>();
  auto future = promise->get_future();
  std::thread([promise, store_host, store_port, timeout] {
    try {
      promise->set_value(
          dist::Store::tcp({.host = store_host, .port = store_port, .is_server = false, .timeout = timeout}));
    } catch (...) {
      promise->set_exception(std::current_exception());
    }
  }).detach();
  // Something accepts connections there; c10d's handshake gets the whole timeout again, plus slack for its retries.
  if (future.wait_for(2 * timeout + std::chrono::seconds(5)) == std::future_status::timeout) {
    throw TimeoutError("the rendezvous endpoint " + where +
                           " accepted a connection but did not answer as a store within " + seconds + ".",
                       "another program may be using that port: choose another --rdzv-endpoint port");
  }
  try {
    return std::make_shared<DistRendezvousStore>(future.get(), false, where, tunnel);
  } catch (const Error& e) {
    throw TimeoutError(e.message(),
                       "start the node whose address --rdzv-endpoint names first (it hosts the store), check the "
                       "address and port, or raise --rdzv-timeout");
  }
}

std::shared_ptr<RendezvousStore> make_memory_rendezvous_store() {
  return std::make_shared<DistRendezvousStore>(dist::Store::in_memory(), true, "memory");
}

}  // namespace dtrain::elastic

// The entry point `dtrain run` looks up with dlsym (C linkage: an unmangled name).
extern "C" __attribute__((visibility("default"))) void dtrain_connect_tcp_rendezvous_store(
    const std::string* host, int port, long long timeout_ms, const std::string* secret, int role,
    std::shared_ptr<dtrain::elastic::RendezvousStore>* out) {
  // The launcher explains connection problems itself; c10d's warnings with
  // stack traces would bury that (workers keep their own log level).
  FLAGS_caffe2_log_level = 3;  // fatal only
  *out = dtrain::elastic::connect_tcp_rendezvous_store(*host, port, std::chrono::milliseconds(timeout_ms), *secret,
                                                       static_cast<dtrain::elastic::StoreRole>(role));
}
