// Private: the c10d objects behind dtrain's comm handles. Included only by
// src/ code (comm internals and the parallel strategies); public headers stay
// free of c10d so users' translation units stay light.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"
#include "dtrain/comm/store.h"

namespace dtrain::dist {
namespace detail {

struct StoreImpl {
  c10::intrusive_ptr<c10d::Store> store;
  int port = 0;
  std::string where;  // "host:port" or "in-memory store", for messages
};

struct GroupState {
  c10::intrusive_ptr<c10d::Backend> backend;
  // The same backend behind c10d's user-facing ProcessGroup, for c10d
  // components that take one (the DDP Reducer, broadcast_coalesced).
  c10::intrusive_ptr<c10d::ProcessGroup> process_group;
  int rank = 0;
  int size = 1;
  BackendKind kind = BackendKind::kGloo;
  c10::Device device = c10::Device(c10::kCPU);
  std::chrono::milliseconds timeout{0};
  std::string name;
  std::vector<int> world_ranks;
  // This group's slice of the store; subgroups take keys below it.
  Store store{nullptr};
  GroupOptions options;
  int subgroups_created = 0;
};

// "gloo group 'world' (rank 1 of 4)", for messages.
std::string describe(const GroupState& state);

}  // namespace detail

struct Work::Impl {
  c10::intrusive_ptr<c10d::Work> work;
  std::shared_ptr<detail::GroupState> group;
  const char* op = "";
};

inline const c10::intrusive_ptr<c10d::Store>& c10d_store(const Store& store) {
  return store.impl()->store;
}
inline const c10::intrusive_ptr<c10d::Backend>& c10d_backend(const ProcessGroup& group) {
  return group.state()->backend;
}
// The c10d Work behind a handle (null for an empty Work).
inline c10::intrusive_ptr<c10d::Work> c10d_work(const Work& work) {
  return work.impl() ? work.impl()->work : c10::intrusive_ptr<c10d::Work>();
}
inline const c10::intrusive_ptr<c10d::ProcessGroup>& c10d_process_group(const ProcessGroup& group) {
  return group.state()->process_group;
}

}  // namespace dtrain::dist
