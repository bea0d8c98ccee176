// The Gloo backend (CPU tensors over TCP).
//
// The torch wheel ships c10d's ProcessGroupGloo.hpp but not the Gloo headers
// it includes; we compile against Debian's libgloo-dev headers. Only class
// names and shared/unique pointers to Gloo types appear in the parts we use
// (Options, the constructor, device factories), all defined inside libtorch,
// so the header version does not affect what runs. See docs/build.md.
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdlib>

#include "../core/broken_pipes.h"
#include "../core/torch_compat.h"
#include "backends.h"
#include "dtrain/error.h"

namespace dtrain::dist::detail {

namespace {
// Before any Gloo group exists (libdtrain's load): see
// compat::c10d_flight_recorder_off_by_default().
[[maybe_unused]] const bool c10d_flight_recorder_turned_off = compat::c10d_flight_recorder_off_by_default();
}  // namespace

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const BackendRequest& request) {
  ::dtrain::detail::ignore_broken_pipes();  // Gloo writes without MSG_NOSIGNAL: Note [Broken pipes]
  auto options = c10d::ProcessGroupGloo::Options::create(request.timeout);
  options->group_name = request.group_name;
  const char* interface = std::getenv("GLOO_SOCKET_IFNAME");
  try {
    if (interface != nullptr && *interface != '\0' && request.gloo_host.empty()) {
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(interface));
    } else if (request.gloo_host.empty()) {
      options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    } else {
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(request.gloo_host));
    }
  } catch (const c10::Error& e) {
    throw ConfigError(std::string("cannot create a Gloo transport device: ") + e.what_without_backtrace(),
                      "set GLOO_SOCKET_IFNAME to a network interface that reaches the other ranks");
  }
  try {
    return c10::make_intrusive<c10d::ProcessGroupGloo>(request.store, request.rank, request.size, options);
  } catch (const c10::Error& e) {
    throw CommunicationError("Gloo could not connect group '" + request.group_name + "': " + e.what_without_backtrace(),
                             "check that every rank can reach the others' addresses (GLOO_SOCKET_IFNAME, firewalls)");
  }
}

}  // namespace dtrain::dist::detail
