// A ProcessGroup inside an IValue, for autograd Functions that communicate
// in backward: AutogradContext::saved_data holds only IValues. Private to
// src/nn/.
#pragma once

#include <ATen/core/ivalue.h>

#include "dtrain/comm/process_group.h"

namespace dtrain::nn::detail {

struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(dist::ProcessGroup g) : group(std::move(g)) {}
  dist::ProcessGroup group;
};

inline c10::IValue capsule_of(dist::ProcessGroup group) {
  return c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(std::move(group)));
}

// The group a capsule_of() IValue holds (shared with the IValue).
inline dist::ProcessGroup group_in(const c10::IValue& capsule) {
  return static_cast<GroupCapsule*>(capsule.toCapsule().get())->group;
}

}  // namespace dtrain::nn::detail
