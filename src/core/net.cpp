// TCP/IP helpers; see net.h.
#include "dtrain/net.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "dtrain/error.h"

namespace dtrain::net {

int listen_tcp(int& port, bool loopback_only) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int yes = 1;
  if (fd >= 0) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(loopback_only ? INADDR_LOOPBACK : INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof addr;
  const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::listen(fd, 1024) == 0 && ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  if (!ok) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    throw ConfigError("cannot listen on TCP port " + std::to_string(port) + ": " + std::strerror(err) + ".",
                      "choose another port, or stop the process holding it");
  }
  port = ntohs(addr.sin_port);
  return fd;
}

namespace {
bool same_address(const sockaddr* a, const sockaddr* b) {
  if (a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
  }
  if (a->sa_family == AF_INET6) {
    return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                       &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr, sizeof(in6_addr)) == 0;
  }
  return false;
}

}  // namespace

bool names_this_machine(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* resolved = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &resolved) != 0) return false;
  ifaddrs* interfaces = nullptr;
  ::getifaddrs(&interfaces);
  bool local = false;
  for (addrinfo* a = resolved; a != nullptr && !local; a = a->ai_next) {
    if (a->ai_family == AF_INET && (ntohl(reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr.s_addr) >> 24) == 127) {
      local = true;
    }
    for (ifaddrs* i = interfaces; i != nullptr && !local; i = i->ifa_next) {
      if (i->ifa_addr != nullptr && same_address(i->ifa_addr, a->ai_addr)) local = true;
    }
  }
  if (interfaces != nullptr) ::freeifaddrs(interfaces);
  ::freeaddrinfo(resolved);
  return local;
}

bool wait_until_reachable(const std::string& host, int port, std::chrono::steady_clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  const std::string service = std::to_string(port);
  while (std::chrono::steady_clock::now() < deadline) {
    addrinfo* resolved = nullptr;
    if (::getaddrinfo(host.c_str(), service.c_str(), &hints, &resolved) == 0) {
      for (addrinfo* a = resolved; a != nullptr; a = a->ai_next) {
        const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        bool ok = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0;
        if (!ok && errno == EINPROGRESS) {
          const auto left =
              std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
          pollfd p{fd, POLLOUT, 0};
          int err = 0;
          socklen_t len = sizeof err;
          ok = ::poll(&p, 1, static_cast<int>(std::clamp<long long>(left.count(), 0, 1000))) == 1 &&
               ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
        }
        ::close(fd);
        if (ok) {
          ::freeaddrinfo(resolved);
          return true;
        }
      }
      ::freeaddrinfo(resolved);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
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

}  // namespace dtrain::net
