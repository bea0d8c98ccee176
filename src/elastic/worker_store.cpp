// The workers' store as `dtrain run` hosts it (include/dtrain/elastic/worker_store.h):
// c10d's TCPStore server on the round's pre-bound MASTER_PORT socket. In
// libdtrain only; the launcher loads it on demand (tools/dtrain/libdtrain_loader.cpp).
#include <c10/util/Logging.h>

#include <memory>

#include "dtrain/comm/store.h"

// The entry point `dtrain run` looks up with dlsym (C linkage: an unmangled
// name). Takes over `listen_fd`; the server runs until *out is released.
extern "C" __attribute__((visibility("default"))) void dtrain_host_worker_store(int listen_fd, int port,
                                                                                std::shared_ptr<void>* out) {
  // Workers come and go (restarts, kills); c10d's warnings about dropped
  // connections would bury the launcher's own messages.
  FLAGS_caffe2_log_level = 3;  // fatal only
  // The server also connects to itself as a client (over loopback: the
  // socket listens on all interfaces); its timeout bounds that connection only.
  auto store = dtrain::dist::Store::tcp({.host = "127.0.0.1",
                                         .port = port,
                                         .is_server = true,
                                         .timeout = std::chrono::seconds(60),
                                         .listen_fd = listen_fd});
  *out = std::make_shared<dtrain::dist::Store>(std::move(store));
}
