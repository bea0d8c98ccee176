// The rendezvous' shared-secret authentication (src/elastic/rdzv_auth.h).
//
// Note [Rendezvous authentication]
// c10d's TCPStore lets any program that reaches its port read and write any
// key: a stray program (or a node of another job, or one started without the
// secret) could join a round, close it, or end it. With a secret
// (--rdzv-secret-file, or DTRAIN_RDZV_SECRET), the node that hosts the store
// binds the store to 127.0.0.1 only and puts a gate on the endpoint's port;
// every connection must first pass a challenge-response keyed by the secret:
//   gate -> peer   "DTRDZV1\n" and a fresh 32-byte nonce Ns
//   peer -> gate   its own nonce Nc and HMAC-SHA-256(secret, "client" Ns Nc)
//   gate -> peer   'Y' and HMAC-SHA-256(secret, "server" Nc Ns)   (or 'N', close)
// Only then are bytes relayed to the store, so nothing an unauthenticated
// peer sends ever reaches it: it cannot join, close or end a round, nor read
// the membership. The secret never crosses the wire; the nonces make every
// proof single-use (a recorded handshake cannot be replayed: the gate's
// nonce differs), and the gate's own proof tells a node that the host is not
// an impostor. A peer that does not finish within 5 s is dropped.
// The other nodes reach the store through a local tunnel that makes the
// handshake for each connection their store client opens. The gate logs
// each refusal with the peer's address; a dtrain node without the secret, or
// with another one, fails with a message saying so.
// Not covered: the bytes after the handshake are not encrypted or
// authenticated (use a private network against an active man in the
// middle), processes on the host machine itself can reach the loopback
// store, and the workers' store (MASTER_PORT) is separate.
#include "rdzv_auth.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>

#include "../core/hmac.h"
#include "dtrain/error.h"
#include "dtrain/log.h"

namespace dtrain::elastic::auth {
namespace {
constexpr char kMagic[] = "DTRDZV1\n";  // 8 bytes
constexpr std::size_t kMagicSize = 8;
constexpr std::size_t kNonce = 32;
constexpr std::size_t kMac = 32;
constexpr auto kHandshakeTimeout = std::chrono::seconds(5);

std::string nonce() {
  std::random_device rd;  // getrandom(2) on Linux
  std::string n(kNonce, '\0');
  for (auto& c : n) c = static_cast<char>(rd() & 0xff);
  return n;
}

std::string mac(const std::string& secret, const std::string& role, const std::string& a, const std::string& b) {
  const auto d = crypto::hmac_sha256(secret, role + a + b);
  return std::string(d.begin(), d.end());
}

bool same(const std::string& a, const std::string& b) {
  if (a.size() != kMac || b.size() != kMac) return false;
  crypto::Digest x{}, y{};
  std::memcpy(x.data(), a.data(), kMac);
  std::memcpy(y.data(), b.data(), kMac);
  return crypto::equal_digests(x, y);
}

void set_timeout(int fd, std::chrono::milliseconds t) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(t.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((t.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

// Exactly n bytes, or "" on EOF, error or timeout.
std::string read_exactly(int fd, std::size_t n) {
  std::string out(n, '\0');
  std::size_t got = 0;
  while (got < n) {
    const ssize_t r = ::recv(fd, out.data() + got, n - got, 0);
    if (r <= 0) {
      if (r < 0 && errno == EINTR) continue;
      return "";
    }
    got += static_cast<std::size_t>(r);
  }
  return out;
}

bool write_all(int fd, const std::string& data) {
  std::size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t w = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (w <= 0) {
      if (w < 0 && errno == EINTR) continue;
      return false;
    }
    sent += static_cast<std::size_t>(w);
  }
  return true;
}

// The store on this host answers at once; only a wedged one takes longer.
constexpr std::chrono::milliseconds kInnerConnectTimeout{5000};

// A connection to host:port, or -1 when none is made within `timeout` (a
// non-blocking connect: a host that drops packets must not hold the caller
// for the kernel's SYN retries, minutes).
int connect_to(const std::string& host, int port, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return -1;
  int fd = -1;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    bool connected = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    if (!connected && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int error = 0;
      socklen_t len = sizeof error;
      connected = ::poll(&p, 1, static_cast<int>(timeout.count())) == 1 &&
                  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) == 0 && error == 0;
    }
    if (connected) break;
    ::close(fd);
    fd = -1;
  }
  ::freeaddrinfo(res);
  if (fd >= 0) {
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  return fd;
}

// Copies bytes both ways until either side closes or `stop` is set.
void relay(int a, int b, const std::atomic<bool>& stop) {
  char buf[1 << 16];
  pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
  while (!stop.load()) {
    const int n = ::poll(fds, 2, 200);
    if (n < 0 && errno != EINTR) return;
    for (int i = 0; i < 2; ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const ssize_t r = ::recv(fds[i].fd, buf, sizeof buf, 0);
      if (r <= 0) return;
      if (!write_all(fds[1 - i].fd, std::string(buf, static_cast<std::size_t>(r)))) return;
    }
  }
}

std::string peer_name(const sockaddr_storage& addr) {
  char host[NI_MAXHOST] = {};
  char port[NI_MAXSERV] = {};
  ::getnameinfo(reinterpret_cast<const sockaddr*>(&addr), sizeof addr, host, sizeof host, port, sizeof port,
                NI_NUMERICHOST | NI_NUMERICSERV);
  return std::string(host) + ":" + port;
}

// Wakes every relay (shutdown), waits for them, then closes the sockets.
void finish(std::mutex& mutex, std::vector<int>& fds, std::vector<std::thread>& threads) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (int fd : fds) ::shutdown(fd, SHUT_RDWR);
  }
  for (auto& t : threads) t.join();
  for (int fd : fds) ::close(fd);
}
}  // namespace

std::string read_secret(const std::string& file) {
  std::string secret;
  std::string origin;
  if (!file.empty()) {
    std::ifstream in(file, std::ios::binary);
    DTRAIN_CHECK(in.good(), ConfigError, "cannot read --rdzv-secret-file " << file << ".",
                 "give a readable file holding the job's shared secret (e.g. head -c 32 /dev/urandom | base64 > F)");
    secret.assign(std::istreambuf_iterator<char>(in), {});
    while (!secret.empty() && std::isspace(static_cast<unsigned char>(secret.back()))) secret.pop_back();
    origin = "--rdzv-secret-file " + file;
  } else if (const char* v = std::getenv("DTRAIN_RDZV_SECRET")) {
    secret = v;
    origin = "DTRAIN_RDZV_SECRET";
  }
  DTRAIN_CHECK(origin.empty() || !secret.empty(), ConfigError, origin << " is empty.",
               "put the job's shared secret there");
  DTRAIN_CHECK(secret.empty() || secret.size() >= 16, ConfigError,
               "the rendezvous secret from " << origin << " has " << secret.size() << " bytes; at least 16 are needed.",
               "use a longer random secret, e.g. head -c 32 /dev/urandom | base64");
  return secret;
}

namespace detail {

bool server_handshake(int fd, const std::string& secret) {
  set_timeout(fd, kHandshakeTimeout);
  const std::string ns = nonce();
  if (!write_all(fd, std::string(kMagic, kMagicSize) + ns)) return false;
  const std::string reply = read_exactly(fd, kNonce + kMac);
  if (reply.empty()) return false;
  const std::string nc = reply.substr(0, kNonce);
  if (!same(reply.substr(kNonce), mac(secret, "client", ns, nc))) {
    write_all(fd, "N");
    return false;
  }
  const bool ok = write_all(fd, "Y" + mac(secret, "server", nc, ns));
  set_timeout(fd, std::chrono::milliseconds(0));
  return ok;
}

void client_handshake(int fd, const std::string& secret, const std::string& where) {
  set_timeout(fd, kHandshakeTimeout);
  const std::string greeting = read_exactly(fd, kMagicSize + kNonce);
  DTRAIN_CHECK(!greeting.empty() && greeting.compare(0, kMagicSize, kMagic, kMagicSize) == 0, ConfigError,
               "the rendezvous at " << where << " does not ask for a secret, but this node has one.",
               "start the node hosting the store with the same --rdzv-secret-file (or DTRAIN_RDZV_SECRET)");
  const std::string ns = greeting.substr(kMagicSize);
  const std::string nc = nonce();
  DTRAIN_CHECK(write_all(fd, nc + mac(secret, "client", ns, nc)), ConfigError,
               "the rendezvous at " << where << " closed the connection during the handshake.", "check the endpoint");
  const std::string verdict = read_exactly(fd, 1);
  DTRAIN_CHECK(verdict == "Y", ConfigError,
               "the rendezvous at " << where << " refused this node: its secret does not match the job's.",
               "give every node the same --rdzv-secret-file (or DTRAIN_RDZV_SECRET)");
  DTRAIN_CHECK(same(read_exactly(fd, kMac), mac(secret, "server", nc, ns)), ConfigError,
               "the host at " << where << " accepted this node but could not prove it knows the secret.",
               "something else answers on that port: check --rdzv-endpoint");
  set_timeout(fd, std::chrono::milliseconds(0));
}

}  // namespace detail

Acceptor::Acceptor(int listen_fd, Serve serve) : listen_fd_(listen_fd), serve_(std::move(serve)) {
  acceptor_ = std::thread([this, id = log::identity()] {
    const log::ScopedIdentity scoped(id);
    accept_loop();
  });
}

Acceptor::~Acceptor() {
  stop_ = true;
  ::shutdown(listen_fd_, SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  finish(mutex_, open_fds_, threads_);
  ::close(listen_fd_);
}

void Acceptor::track(int fd) {
  std::lock_guard<std::mutex> lock(mutex_);
  open_fds_.push_back(fd);
}

void Acceptor::accept_loop() {
  pollfd p{listen_fd_, POLLIN, 0};
  while (!stop_.load()) {
    if (::poll(&p, 1, 200) <= 0) continue;
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC);
    if (fd < 0) continue;
    std::lock_guard<std::mutex> lock(mutex_);
    open_fds_.push_back(fd);
    threads_.emplace_back([this, fd, peer = peer_name(addr), id = log::identity()] {
      const log::ScopedIdentity scoped(id);
      serve_(*this, fd, peer);
    });
  }
}

Gate::Gate(int public_fd, int inner_port, std::string secret)
    : inner_port_(inner_port),
      secret_(std::move(secret)),
      acceptor_(std::make_unique<Acceptor>(
          public_fd, [this](Acceptor& self, int fd, const std::string& peer) { serve(self, fd, peer); })) {}

Gate::~Gate() = default;

void Gate::serve(Acceptor& acceptor, int fd, const std::string& peer) {
  if (!detail::server_handshake(fd, secret_)) {
    ++refused_;
    if (!acceptor.stopping().load()) {
      DTRAIN_LOG(kWarning) << "refused a rendezvous connection from " << peer
                           << ": it did not prove the job's shared secret";
    }
    ::shutdown(fd, SHUT_RDWR);
    return;
  }
  const int inner = connect_to("127.0.0.1", inner_port_, kInnerConnectTimeout);
  if (inner >= 0) {
    acceptor.track(inner);
    relay(fd, inner, acceptor.stopping());
    ::shutdown(inner, SHUT_RDWR);
  }
  ::shutdown(fd, SHUT_RDWR);
}

Tunnel::Tunnel(std::string host, int port, std::string secret, std::chrono::milliseconds timeout)
    : host_(std::move(host)), port_(port), secret_(std::move(secret)), timeout_(timeout) {
  const int listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = listen_fd >= 0 && ::bind(listen_fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::listen(listen_fd, 64) == 0;
  if (!ok && listen_fd >= 0) ::close(listen_fd);
  DTRAIN_CHECK(ok, ConfigError, "cannot open a loopback port for the rendezvous tunnel: " << std::strerror(errno),
               "check the machine's loopback interface");
  socklen_t len = sizeof a;
  ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&a), &len);
  local_port_ = ntohs(a.sin_port);
  acceptor_ = std::make_unique<Acceptor>(
      listen_fd, [this](Acceptor& self, int fd, const std::string& /*peer*/) { serve(self, fd); });
}

Tunnel::~Tunnel() = default;

void Tunnel::check() {
  const std::string where = host_ + ":" + std::to_string(port_);
  const int fd = connect_to(host_, port_, timeout_);
  DTRAIN_CHECK(
      fd >= 0, TimeoutError,
      "could not reach the rendezvous store at " << where << " within " << log::format_seconds(timeout_) << ".",
      "start the node whose address --rdzv-endpoint names first");
  try {
    detail::client_handshake(fd, secret_, where);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

void Tunnel::serve(Acceptor& acceptor, int local) {
  const int remote = connect_to(host_, port_, timeout_);
  if (remote >= 0) {
    acceptor.track(remote);
    try {
      detail::client_handshake(remote, secret_, host_ + ":" + std::to_string(port_));
      relay(local, remote, acceptor.stopping());
    } catch (const Error& e) {
      DTRAIN_LOG(kError) << e.message();
    }
    ::shutdown(remote, SHUT_RDWR);
  }
  ::shutdown(local, SHUT_RDWR);
}

}  // namespace dtrain::elastic::auth
