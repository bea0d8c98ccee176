// The Trainer's memory pre-flight (TrainerOptions::memory_check): before the
// first step, the planner's peak memory per rank for the plan being trained
// (dtrain::plan, docs/planner.md) against what a rank may use, decided by
// every rank together, so that a plan that does not fit stops on every rank
// with one clear error (what does not fit, by how much, the nearest plan
// that fits) instead of running out of memory mid-run.
//
//   dtrain::TrainerOptions o{.max_steps = 100, .batch_size = 12};
//   o.memory_check = dtrain::MemoryCheck{
//       .plan = plan,  // what runs, with its global batch and precision
//       .model = dtrain::plan::ModelSpec::parse("gpt:layers=4,hidden=128,heads=4,seq=64,vocab=65")};
//   dtrain::Trainer trainer(strategy, optimizer, source, o);
//   trainer.fit();  // ConfigError on every rank when the plan does not fit
//
// check_memory() is the same decision for loops without the Trainer.
#pragma once

#include <c10/core/Device.h>

#include <optional>
#include <string>

#include "dtrain/comm/process_group.h"
#include "dtrain/plan/cost_model.h"
#include "dtrain/plan/model_spec.h"
#include "dtrain/plan/plan.h"
#include "dtrain/plan/preflight.h"

namespace dtrain {

struct MemoryCheck {
  // The plan being trained: degrees, ZeRO stage, schedule, micro-batches,
  // recompute, accumulation, and its global batch (sequences per optimizer
  // step) and precision ("fp32", "bf16") as trained.
  ParallelPlan plan;
  plan::ModelSpec model;  // the model as the planner sees it
  // The device the ranks run on (plan::find_device): its memory per rank is
  // the limit unless one is stated or `runs_on` is an accelerator; a CPU
  // host's ("cpu-here") is its available memory divided by the host's ranks.
  std::string device = "cpu-here";
  // The device this rank trains on (the Trainer sets it from its strategy
  // when unset). An accelerator's own figure is then the limit: its free
  // memory plus what this process's caching allocator already holds (the
  // model is on it by the pre-flight), read through c10's device-generic
  // allocator (c10::getDeviceAllocator(...)->getMemoryInfo: CUDA, XPU, ...);
  // where the allocator cannot tell, the device table's `device`.
  std::optional<c10::Device> runs_on;
  // Bytes per rank ("300M", "2G"); empty: $DTRAIN_MEMORY_LIMIT, else the
  // device's.
  std::string limit;
  int local_ranks = 0;  // ranks sharing this host; 0: the launcher's contract (local world size), else 1
  // dtrain's engines: fp32 master weights, DDP buckets copying gradients,
  // gradients set to none by zero_grad (Note [Gradient lifetimes]).
  plan::CostOptions cost{.weights = plan::WeightLayout::kFp32Master, .ddp_buckets_copy_gradients = true};
  bool enabled = true;  // false: no check (--no-memory-check)
};

// The pre-flight. Collective over `group` (every rank of the run calls it,
// with the same plan and model; nullopt: one process). Each rank reads its
// own limit; the ranks all-gather them and every rank compares the plan's
// peak with the least (Note [One pre-flight decision]), so either all
// refuse, with a ConfigError naming the rank whose limit it was, the peak
// and its parts, the excess and the nearest plan that fits, or all go on.
// A rank that cannot read its limit stops every rank. Returns the estimate,
// or nullopt when disabled or when the planner cannot cost the plan (a
// warning says why; such plans run unchecked).
std::optional<plan::PlanEstimate> check_memory(const MemoryCheck& check,
                                               const std::optional<dist::ProcessGroup>& group);

// The limit the ranks of `group` agree on: the least of their own (above).
plan::MemoryLimit agreed_memory_limit(const MemoryCheck& check, const std::optional<dist::ProcessGroup>& group);

}  // namespace dtrain
