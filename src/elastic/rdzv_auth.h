// Private: the rendezvous' shared-secret authentication (Note [Rendezvous
// authentication] in rdzv_auth.cpp). A gate in front of the hosted TCPStore
// lets through only connections that prove they know the secret; a tunnel on
// each other node carries its store client's connections through that proof.
// In dtrain_base (no LibTorch): plain sockets and threads.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/elastic/rendezvous.h"

namespace dtrain::elastic::auth {

// read_secret() is declared with the rendezvous (include/dtrain/elastic/rendezvous.h).

// Accepts connections on `listen_fd` (taken over) until destroyed, serving
// each on a thread of its own with `serve(*this, fd, peer address)` (the
// acceptor is passed in: it may run before its owner has stored it). Destruction
// shuts down the listening socket, every accepted socket and every socket a
// handler registered with track() (so relays blocked on them return), joins
// the threads and closes all of them. One door for the gate and the tunnel.
class Acceptor {
 public:
  using Serve = std::function<void(Acceptor& self, int fd, const std::string& peer)>;
  Acceptor(int listen_fd, Serve serve);
  ~Acceptor();
  Acceptor(const Acceptor&) = delete;
  Acceptor& operator=(const Acceptor&) = delete;
  // Another socket to shut down and close with this acceptor's.
  void track(int fd);
  // Set once destruction began: handlers' relays watch it.
  const std::atomic<bool>& stopping() const { return stop_; }

 private:
  void accept_loop();
  int listen_fd_;
  Serve serve_;
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::vector<std::thread> threads_;
  std::vector<int> open_fds_;
  std::thread acceptor_;
};

// Host side: accepts on `public_fd` (taken over), checks each connection's
// proof, and relays the good ones to 127.0.0.1:`inner_port`; refused ones are
// logged with their address and closed before a byte reaches the store.
class Gate {
 public:
  Gate(int public_fd, int inner_port, std::string secret);
  ~Gate();
  Gate(const Gate&) = delete;
  Gate& operator=(const Gate&) = delete;
  // Connections refused so far.
  int refused() const { return refused_.load(); }

 private:
  void serve(Acceptor& acceptor, int fd, const std::string& peer);
  int inner_port_;
  std::string secret_;
  std::atomic<int> refused_{0};
  std::unique_ptr<Acceptor> acceptor_;  // last: its threads use the members above
};

// Client side: listens on 127.0.0.1:port(); each connection made there is
// relayed to host:port after the handshake. `check()` makes one handshake
// first so that a wrong secret, a missing one, or a host without one is
// reported as such (ConfigError) rather than as a store that does not answer.
class Tunnel {
 public:
  Tunnel(std::string host, int port, std::string secret, std::chrono::milliseconds timeout);
  ~Tunnel();
  Tunnel(const Tunnel&) = delete;
  Tunnel& operator=(const Tunnel&) = delete;
  int port() const { return local_port_; }
  void check();

 private:
  void serve(Acceptor& acceptor, int local);
  std::string host_;
  int port_;
  std::string secret_;
  std::chrono::milliseconds timeout_;
  int local_port_ = 0;
  std::unique_ptr<Acceptor> acceptor_;  // last: its threads use the members above
};

namespace detail {
// The handshake on a connected socket; throw ConfigError naming `where` on refusal.
void client_handshake(int fd, const std::string& secret, const std::string& where);
// True when the peer proved it knows the secret (then it is told so).
bool server_handshake(int fd, const std::string& secret);
}  // namespace detail

}  // namespace dtrain::elastic::auth
