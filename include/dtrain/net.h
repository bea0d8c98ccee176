// The few TCP/IP helpers the launcher (tools/dtrain) and the rendezvous
// need, in one place (dtrain_base: no LibTorch). Internal to dtrain: public
// only so that the CLI includes no private header; not a stable API.
#pragma once

#include <chrono>
#include <string>

namespace dtrain::net {

// A close-on-exec socket listening on all interfaces (or on 127.0.0.1 only)
// at `port` (0: any free port); returns the fd and sets `port` to the bound
// one. ConfigError if the port cannot be bound.
int listen_tcp(int& port, bool loopback_only = false);

// Whether `host` resolves to an address of this machine (loopback included).
bool names_this_machine(const std::string& host);

// Retries a plain TCP connection to host:port until one succeeds (true) or
// `deadline` passes (false): a server may start after its clients.
bool wait_until_reachable(const std::string& host, int port, std::chrono::steady_clock::time_point deadline);

// The IPv4 address this machine would use to reach host:port (no packet is
// sent); this host's name when `host` does not resolve.
std::string local_address_towards(const std::string& host, int port);

}  // namespace dtrain::net
