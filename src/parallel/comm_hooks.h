// Private: communication hooks for DDP gradient buckets that c10d does not
// ship in C++ (bf16 compression, PowerSGD). See comm_hooks.cpp.
#pragma once

#include <torch/csrc/distributed/c10d/comm.hpp>

#include <memory>

#include "dtrain/parallel/ddp.h"

namespace dtrain::detail {

std::unique_ptr<c10d::CommHookInterface> make_bf16_hook(c10::intrusive_ptr<c10d::ProcessGroup> group);
std::unique_ptr<c10d::CommHookInterface> make_powersgd_hook(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                            const PowerSgdOptions& options);

}  // namespace dtrain::detail
