// Multi-node rendezvous for `dtrain run`: loads libdtrain (for c10d's
// TCPStore) only when it is needed, so single-node launches stay LibTorch-free.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "dtrain/elastic/rendezvous.h"

namespace dtrain::tools {

// Connects to (or hosts) the rendezvous store at host:port through libdtrain,
// found next to this program (build tree or install prefix) or at $DTRAIN_LIBRARY.
std::shared_ptr<elastic::RendezvousStore> load_tcp_rendezvous_store(const std::string& host, int port,
                                                                    std::chrono::milliseconds timeout);

// The address other nodes reach this one by when it talks to `host`: the
// local address of a route to it (127.0.0.1 for loopback endpoints).
std::string local_address_towards(const std::string& host, int port);

}  // namespace dtrain::tools
