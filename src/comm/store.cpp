// dtrain::dist::Store over c10d's TCPStore, HashStore and PrefixStore.
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>

#include "../core/broken_pipes.h"
#include "dtrain/comm/store_keys.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "group_state.h"

namespace dtrain::dist {
namespace {
std::vector<uint8_t> bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

bool mentions_address_in_use(const std::string& what) {
  return what.find("in use") != std::string::npos || what.find("EADDRINUSE") != std::string::npos;
}
}  // namespace

Store Store::in_memory() {
  auto impl = std::make_shared<detail::StoreImpl>();
  impl->store = c10::make_intrusive<c10d::HashStore>();
  impl->where = "in-memory store";
  return Store(std::move(impl));
}

Store Store::tcp(const TcpStoreOptions& options) {
  DTRAIN_CHECK(options.port >= 0 && options.port <= 65535, ConfigError,
               "store port " << options.port << " is out of range 0..65535.", "pick a free TCP port");
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(options.port);
  opts.isServer = options.is_server;
  opts.waitWorkers = false;  // membership is checked by init_process_group, with clear errors
  opts.timeout = options.timeout;
  if (options.is_server && options.listen_fd >= 0) opts.masterListenFd = options.listen_fd;
  // The server (libuv) writes without MSG_NOSIGNAL, the client with it: Note [Broken pipes].
  if (options.is_server) ::dtrain::detail::ignore_broken_pipes();
  const std::string where = options.host + ":" + std::to_string(options.port);
  auto impl = std::make_shared<detail::StoreImpl>();
  try {
    auto store = c10::make_intrusive<c10d::TCPStore>(options.host, opts);
    impl->port = store->getPort();
    impl->store = std::move(store);
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    if (options.is_server) {
      DTRAIN_CHECK(!mentions_address_in_use(what), ConfigError,
                   "cannot host the rendezvous store on port " << options.port << ": the port is already in use.",
                   "choose another MASTER_PORT (or --rdzv-endpoint port), or stop the process holding it");
      throw ConfigError("cannot host the rendezvous store on " + where + ": " + what,
                        "check that MASTER_ADDR/MASTER_PORT name this host and a free port");
    }
    throw TimeoutError("could not reach the rendezvous store at " + where + " within " +
                           log::format_seconds(options.timeout) + ": " + what,
                       "check that rank 0 is running and that MASTER_ADDR/MASTER_PORT point at it "
                       "(and that no firewall blocks the port)");
  }
  impl->where = options.host + ":" + std::to_string(impl->port);
  return Store(std::move(impl));
}

Store Store::with_prefix(const std::string& prefix) const {
  auto impl = std::make_shared<detail::StoreImpl>(*impl_);
  impl->store = c10::make_intrusive<c10d::PrefixStore>(prefix, impl_->store);
  return Store(std::move(impl));
}

// Round trips are counted as a TCPStore client makes them: one per call,
// two for get (it waits for the key, then reads it) and for a wait that
// times out (it then cancels the wait).
void Store::set(const std::string& key, const std::string& value) {
  ++*impl_->round_trips;
  impl_->store->set(key, bytes(value));
}

std::string Store::get(const std::string& key) {
  *impl_->round_trips += 2;
  const auto value = impl_->store->get(key);
  return {value.begin(), value.end()};
}

std::int64_t Store::add(const std::string& key, std::int64_t delta) {
  ++*impl_->round_trips;
  return impl_->store->add(key, delta);
}

std::string Store::compare_set(const std::string& key, const std::string& expected, const std::string& desired) {
  ++*impl_->round_trips;
  const auto out = impl_->store->compareSet(key, bytes(expected), bytes(desired));
  return {out.begin(), out.end()};
}

bool Store::check(const std::vector<std::string>& keys) {
  ++*impl_->round_trips;
  return impl_->store->check(keys);
}

bool delete_key(Store& store, const std::string& key) {
  ++*store.impl()->round_trips;
  return store.impl()->store->deleteKey(key);
}

std::int64_t num_keys(Store& store) {
  ++*store.impl()->round_trips;
  return store.impl()->store->getNumKeys();
}

std::optional<std::string> get_if_present(Store& store, const std::string& key) {
  // A compare-and-set that never matches a present value: it answers the
  // value, or, when the key is absent, the (non-empty) expected value.
  static const std::string kAbsent(1, '\0');
  const std::string out = store.compare_set(key, kAbsent, kAbsent);
  if (out == kAbsent) return std::nullopt;
  return out;
}

void multi_set(Store& store, const std::vector<std::string>& keys, const std::vector<std::string>& values) {
  DTRAIN_INTERNAL_ASSERT(keys.size() == values.size(),
                         "multi_set: " << keys.size() << " keys, " << values.size() << " values");
  if (keys.empty()) return;
  std::vector<std::vector<uint8_t>> data;
  data.reserve(values.size());
  for (const auto& v : values) data.push_back(bytes(v));
  ++*store.impl()->round_trips;
  store.impl()->store->multiSet(keys, data);
}

std::int64_t round_trips(const Store& store) {
  return store.impl()->round_trips->load();
}

void Store::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  ++*impl_->round_trips;
  try {
    impl_->store->wait(keys, timeout);
  } catch (const c10::Error& e) {
    ++*impl_->round_trips;
    std::string names;
    for (const auto& k : keys) names += (names.empty() ? "" : ", ") + k;
    throw TimeoutError("keys [" + names + "] did not appear in " + impl_->where + " within " +
                           log::format_seconds(timeout) + ": " + e.what_without_backtrace(),
                       "check that every rank of the job is running");
  }
}

int Store::port() const {
  return impl_->port;
}

}  // namespace dtrain::dist
