// The memory pre-flight (memory_check.h).
#include "dtrain/trainer/memory_check.h"

#include <ATen/ATen.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <algorithm>
#include <exception>
#include <vector>

#include "dtrain/comm/env.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "dtrain/plan/device_table.h"

namespace dtrain {

namespace {

// The ranks sharing this host: stated, else the launcher's contract (the one
// reader of it: torchrun's LOCAL_WORLD_SIZE, Slurm's, MPI's), else 1.
int local_ranks_of(const MemoryCheck& check) {
  if (check.local_ranks > 0) return check.local_ranks;
  return dist::launched_by_launcher() ? dist::read_env_contract().local_world_size : 1;
}

// An accelerator's free memory plus what this process's allocator holds
// (reserved: in use by tensors or cached for reuse, both this process's to
// spend); nullopt when its allocator cannot tell.
std::optional<plan::MemoryLimit> accelerator_limit(c10::Device device) {
  try {
    c10::DeviceAllocator* allocator = c10::getDeviceAllocator(device.type());
    const auto [free, total] = allocator->getMemoryInfo(device.index());
    const std::int64_t held = allocator->getDeviceStats(device.index())
                                  .reserved_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
                                  .current;
    const auto bytes = static_cast<std::int64_t>(free) + held;
    return plan::MemoryLimit{.bytes = bytes,
                             .source = device.str() + "'s free memory (" +
                                       plan::format_bytes(static_cast<double>(free)) + " of " +
                                       plan::format_bytes(static_cast<double>(total)) + ") and this process's " +
                                       plan::format_bytes(static_cast<double>(held)) + " already on it"};
  } catch (const c10::Error& e) {
    DTRAIN_LOG(kWarning) << "memory pre-flight: " << device.str()
                         << "'s allocator cannot tell its free memory; falling back to MemoryCheck::device ("
                         << e.what_without_backtrace() << ")";
    return std::nullopt;
  }
}

// This rank's own limit: the stated one, else an accelerator's own figure,
// else a CPU host's available memory over its ranks
// (plan::rank_memory_limit), else the device table's memory.
plan::MemoryLimit own_limit(const MemoryCheck& check, const plan::DeviceSpec& device) {
  if (auto stated = plan::stated_memory_limit(check.limit)) return *stated;
  if (check.runs_on && !check.runs_on->is_cpu()) {
    if (auto limit = accelerator_limit(*check.runs_on)) return *limit;
  }
  if (device.compute_units > 0) return plan::rank_memory_limit(local_ranks_of(check));
  return {device.memory_bytes, "the device table's " + device.name};
}

plan::Cluster cluster_of(const MemoryCheck& check, const plan::DeviceSpec& device) {
  plan::Cluster cluster{.device = device, .gpus = check.plan.world()};
  cluster.gpus_per_node = std::min(cluster.gpus, device.gpus_per_node);
  return cluster;
}

}  // namespace

// Note [One pre-flight decision]
// Each rank reads its own limit: a stated limit is the same on every rank,
// but DTRAIN_MEMORY_LIMIT and MemAvailable belong to a host and a moment.
// Deciding alone, one rank could refuse while the others went on to their
// first collective and waited there for it. So the ranks exchange their
// limits (one all_gather of an int64 each) and all decide against the
// smallest; the estimate is a function of the plan alone, so every rank then
// decides alike, and a refusal names the rank whose limit it was. A rank
// that cannot read its limit sends -1: it stops with its own error, every
// other rank with one naming it.
plan::MemoryLimit agreed_memory_limit(const MemoryCheck& check, const std::optional<dist::ProcessGroup>& group) {
  plan::MemoryLimit mine{.bytes = -1, .source = ""};
  std::exception_ptr failure;
  try {
    mine = own_limit(check, plan::find_device(check.device));
  } catch (const ConfigError&) {
    failure = std::current_exception();
  }
  if (!group || group->size() < 2) {
    if (failure) std::rethrow_exception(failure);
    return mine;
  }
  dist::ProcessGroup exchange = *group;  // a handle: collectives are non-const
  const std::vector<at::Tensor> all = exchange.all_gather(at::tensor({mine.bytes}, at::kLong).to(group->device()));
  int least = -1;
  std::int64_t bytes = 0;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    const std::int64_t b = all[r].to(at::kCPU).item<std::int64_t>();
    if (b < 0) {
      if (failure) std::rethrow_exception(failure);
      DTRAIN_CHECK(false, ConfigError,
                   "rank " << r << " cannot tell how much memory it may use, so no rank starts (memory pre-flight).",
                   "read rank " << r << "'s error; state the limit (MemoryCheck::limit, --memory-limit or "
                                << "DTRAIN_MEMORY_LIMIT), or turn the check off (--no-memory-check)");
    }
    if (least < 0 || b < bytes) {
      least = r;
      bytes = b;
    }
  }
  if (least == group->rank()) return mine;
  return {.bytes = bytes,
          .source = "rank " + std::to_string(least) + "'s limit, the least of the " + std::to_string(all.size()) +
                    " ranks'; this rank's: " + plan::format_bytes(static_cast<double>(mine.bytes)) + ", " +
                    mine.source};
}

std::optional<plan::PlanEstimate> check_memory(const MemoryCheck& check,
                                               const std::optional<dist::ProcessGroup>& group) {
  if (!check.enabled) return std::nullopt;
  const int ranks = group ? group->size() : 1;
  DTRAIN_CHECK(check.plan.world() == ranks, ConfigError,
               "the memory pre-flight's plan has " << check.plan.world() << " ranks, the run " << ranks << ".",
               "give MemoryCheck the plan being trained");
  const plan::DeviceSpec device = plan::find_device(check.device);
  const plan::Cluster cluster = cluster_of(check, device);
  // The planner costs fewer shapes than dtrain runs (e.g. a stage of the
  // embedding alone, explicit stage maps): those run unchecked. Every rank
  // decides this alike (a function of the plan).
  try {
    auto memory_only = check.cost;
    memory_only.memory_only = true;
    plan::estimate(check.plan, check.model, cluster, memory_only);
  } catch (const ConfigError& e) {
    DTRAIN_LOG(kWarning) << "memory pre-flight skipped: the planner cannot cost this plan (" << e.what() << ")";
    return std::nullopt;
  }
  const plan::MemoryLimit limit = agreed_memory_limit(check, group);
  plan::PlanEstimate e = plan::check_plan_memory(check.plan, check.model, cluster, check.cost, limit);
  DTRAIN_LOG(kInfo) << "memory pre-flight: the plan needs " << plan::format_bytes(e.peak()) << " per rank of "
                    << plan::format_bytes(static_cast<double>(limit.bytes)) << " (" << limit.source << ")";
  return e;
}

}  // namespace dtrain
