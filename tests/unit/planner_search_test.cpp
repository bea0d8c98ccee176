// The search's shortcuts against the long way round: the compiled replay
// (Note [Compiled replay]) against the sweep it replaces, bit for bit, and
// the schedules cached by (kind, p, v, m) never handing one plan another's
// figures: plans that share a cached schedule but differ in per-stage costs
// get their own, a search's figures are those of each plan estimated alone,
// and estimates do not depend on what was estimated before.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <set>

#include "dtrain/error.h"
#include "dtrain/plan/replay.h"
#include "dtrain/plan/search.h"

namespace dtrain::plan {
namespace {

// The replay as it was before it was compiled: sweep the ranks' lists until
// every one is done, each rank running its actions until one waits for a
// fact no rank has produced yet. The reference the compiled replay must equal.
ReplayResult sweep_replay(const pipeline::Schedule& s, const ReplayOptions& o) {
  using pipeline::ActionKind;
  const int p = s.options.ranks, n = s.stage_count(), m = s.options.micro_batches;
  constexpr double kUnknown = std::numeric_limits<double>::infinity();
  const std::size_t cells = static_cast<std::size_t>(n) * m;
  std::vector<double> f_done(cells, kUnknown), i_done(cells, kUnknown), sent_f(cells, kUnknown),
      sent_b(cells, kUnknown);
  auto at = [m](int stage, int micro) { return static_cast<std::size_t>(stage) * m + micro; };
  ReplayResult r;
  r.busy.assign(p, 0);
  r.peak_in_flight.assign(p, 0);
  std::vector<std::size_t> pc(p, 0);
  std::vector<double> clock(p, 0);
  std::vector<int> in_flight(p, 0);
  bool progress = true, done = false;
  while (progress && !done) {
    progress = false;
    done = true;
    for (int rank = 0; rank < p; ++rank) {
      const auto& list = s.actions[rank];
      for (; pc[rank] < list.size(); ++pc[rank]) {
        const pipeline::Action& a = list[pc[rank]];
        const int st = a.stage, i = a.micro;
        const StageTimes& t = o.stage[st];
        double ready = 0, duration = 0;
        switch (a.kind) {
          case ActionKind::kForward:
            ready = (st > 0 && s.rank_of_stage(st - 1) == rank) ? f_done[at(st - 1, i)] : 0;
            duration = t.forward;
            break;
          case ActionKind::kBackward:
          case ActionKind::kBackwardInput:
            ready = std::max(f_done[at(st, i)],
                             (st + 1 < n && s.rank_of_stage(st + 1) == rank) ? i_done[at(st + 1, i)] : 0.0);
            duration = t.backward_input + (a.kind == ActionKind::kBackward ? t.backward_weight : 0);
            break;
          case ActionKind::kBackwardWeight:
            ready = i_done[at(st, i)];
            duration = t.backward_weight;
            break;
          case ActionKind::kSendActivation:
          case ActionKind::kSendGradient:
            (a.kind == ActionKind::kSendActivation ? sent_f : sent_b)[at(st, i)] = clock[rank];
            if (o.blocking_sends) clock[rank] += o.p2p_seconds;
            progress = true;
            continue;
          case ActionKind::kRecvActivation: ready = sent_f[at(st - 1, i)] + o.p2p_seconds; break;
          case ActionKind::kRecvGradient: ready = sent_b[at(st + 1, i)] + o.p2p_seconds; break;
        }
        if (ready == kUnknown) break;
        clock[rank] = std::max(clock[rank], ready) + duration;
        r.busy[rank] += duration;
        progress = true;
        if (a.kind == ActionKind::kForward) {
          f_done[at(st, i)] = clock[rank];
          r.peak_in_flight[rank] = std::max(r.peak_in_flight[rank], ++in_flight[rank]);
        } else if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) {
          i_done[at(st, i)] = clock[rank];
          if (a.kind == ActionKind::kBackward) --in_flight[rank];
        } else if (a.kind == ActionKind::kBackwardWeight) {
          --in_flight[rank];
        }
      }
      done = done && pc[rank] == list.size();
    }
  }
  r.end = clock;
  r.makespan = *std::max_element(clock.begin(), clock.end());
  return r;
}

// Every schedule kind over ranks, stages per rank and micro-batches (m not a
// multiple of p included), stage times drawn apart per stage (the first and
// last stages' ends differ in a plan too), with and without blocking sends:
// the same figures to the last bit.
TEST(PlannerReplay, CompiledEqualsTheSweepBitForBit) {
  using pipeline::ScheduleKind;
  std::mt19937 rng(28);
  std::uniform_real_distribution<double> draw(0.1, 3.0);
  for (auto kind :
       {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B, ScheduleKind::kZeroBubble}) {
    for (int p : {1, 2, 3, 4, 8}) {
      for (int v : {1, 2, 3}) {
        if (v > 1 && kind != ScheduleKind::kInterleaved1F1B) continue;
        if (v == 1 && kind == ScheduleKind::kInterleaved1F1B) continue;
        for (int m : {1, 3, 8, 17}) {
          const auto s = pipeline::make_schedule({.kind = kind, .ranks = p, .stages_per_rank = v, .micro_batches = m});
          const auto program = compile_replay(s);
          for (bool blocking : {false, true}) {
            ReplayOptions o{.p2p_seconds = draw(rng) / 4, .blocking_sends = blocking};
            for (int st = 0; st < s.stage_count(); ++st) o.stage.push_back({draw(rng), draw(rng), draw(rng)});
            const auto want = sweep_replay(s, o);
            const auto got = replay(program, o);
            const std::string where = to_string(kind) + " p=" + std::to_string(p) + " v=" + std::to_string(v) +
                                      " m=" + std::to_string(m) + (blocking ? " blocking" : "");
            EXPECT_EQ(got.makespan, want.makespan) << where;  // exact: no tolerance
            EXPECT_EQ(got.busy, want.busy) << where;
            EXPECT_EQ(got.end, want.end) << where;
            EXPECT_EQ(got.peak_in_flight, want.peak_in_flight) << where;
          }
        }
      }
    }
  }
}

// An 8-layer GPT on 16 GPUs: pipelines of 2 and 4 ranks with every
// schedule, ZeRO 0-3 and HSDP, recompute, tp 1-2.
ModelSpec small_gpt() {
  return ModelSpec::parse("gpt:layers=8,hidden=1024,heads=16,seq=1024,vocab=32000");
}
const Cluster kSixteen{.device = find_device("a100-40gb"), .gpus = 16, .gpus_per_node = 8};

// The replay's busy time of the critical rank is the sum of its parts
// (compute, recompute, tp, cp, ZeRO-3), each computed from this plan's own
// layer costs; pipeline_idle is the replay's makespan less that busy time,
// and the step the makespan plus the gradient sync, the meeting and the
// optimizer. A replay of another plan's stage times (a cache keyed too
// coarsely) breaks the sum.
double replay_mismatch(const PlanEstimate& e) {
  const TimeBreakdown& t = e.time;
  const double parts = t.compute + t.recompute + t.tp_comm + t.cp_comm + t.zero3_comm + t.pipeline_idle;
  const double makespan = t.step - t.grad_sync - t.meeting - t.optimizer;
  return std::abs(parts - makespan) / makespan;
}

TEST(PlannerSearch, PlansSharingAScheduleGetTheirOwnFigures) {
  const auto m = small_gpt();
  // One schedule (1F1B, p = 2, m = 8), four plans that differ only in what
  // the schedule's cache key leaves out: recompute and ZeRO-3 change every
  // stage's times, tp the times and the memory.
  auto plan = [](int tp, int zero, Recompute rc) {
    const int dp = 8 / tp;
    return ParallelPlan{.pp = 2,
                        .dp_replicate = zero == 0 ? dp : 1,
                        .dp_shard = zero == 0 ? 1 : dp,
                        .tp = tp,
                        .zero_stage = zero,
                        .pipeline = {.schedule = "1f1b", .micro_batches = 8},
                        .recompute = rc,
                        .precision = "bf16",
                        .global_batch = 8 * dp};
  };
  const std::vector<ParallelPlan> plans{plan(1, 0, Recompute::kNone), plan(1, 0, Recompute::kFull),
                                        plan(1, 3, Recompute::kNone), plan(2, 3, Recompute::kNone)};
  std::vector<PlanEstimate> first;
  for (const auto& p : plans) first.push_back(estimate(p, m, kSixteen));
  std::set<double> steps, makespans, peaks;
  for (const auto& e : first) {
    EXPECT_LT(replay_mismatch(e), 1e-9) << e.plan.table();
    steps.insert(e.step_seconds);
    makespans.insert(e.step_seconds - e.time.grad_sync - e.time.meeting - e.time.optimizer);
    peaks.insert(e.peak());
  }
  EXPECT_EQ(steps.size(), plans.size());
  EXPECT_EQ(makespans.size(), plans.size());
  EXPECT_EQ(peaks.size(), plans.size());
  // Interleaved with 2 and 4 stages per rank: same kind, p and m, other
  // schedules, other in-flight counts and bubbles.
  auto interleaved = plans[0];
  interleaved.pipeline.schedule = "interleaved";
  interleaved.pipeline.stages_per_rank = 2;
  const auto v2 = estimate(interleaved, m, kSixteen);
  interleaved.pipeline.stages_per_rank = 4;
  const auto v4 = estimate(interleaved, m, kSixteen);
  EXPECT_NE(v2.step_seconds, v4.step_seconds);
  EXPECT_NE(v2.memory.activations, v4.memory.activations);
  // Estimated again, in the other order: the same figures to the last digit.
  for (std::size_t k = plans.size(); k-- > 0;)
    EXPECT_EQ(estimate(plans[k], m, kSixteen).to_json(), first[k].to_json()) << plans[k].table();
}

TEST(PlannerSearch, FiguresAreThoseOfEachPlanEstimatedAlone) {
  const auto m = small_gpt();
  const auto r = search(m, kSixteen, {.global_batch = 64});
  ASSERT_GT(r.fitting.size(), 100u);
  std::size_t pipelined = 0;
  for (const auto& e : r.fitting) {
    EXPECT_EQ(estimate(e.plan, m, kSixteen).to_json(), e.to_json()) << e.plan.table();
    if (e.plan.pp > 1) {
      ++pipelined;
      EXPECT_LT(replay_mismatch(e), 1e-9) << e.plan.table();
    }
  }
  EXPECT_GT(pipelined, 50u);
}

}  // namespace
}  // namespace dtrain::plan
