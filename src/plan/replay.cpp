// Event replay of a schedule's action lists with real durations (replay.h).
#include "dtrain/plan/replay.h"

#include <algorithm>

#include "dtrain/error.h"

namespace dtrain::plan {

using pipeline::Action;
using pipeline::ActionKind;
using Op = ReplayProgram::Op;

// Note [Compiled replay]
// Replaying a schedule is a sweep over the ranks' lists, each rank running
// its actions until one waits for a fact (a forward done, a gradient sent)
// that another rank has not produced yet, over and over until every list is
// done. Which facts are produced, and so the order in which the sweep settles
// the actions, depends on the lists only, never on the durations: a fact is
// there or not, whatever its time. compile_replay() runs that sweep once,
// without times, and writes the settled order down as steps, each naming the
// earlier steps it waits for; replay() then walks the steps once, computing
// each time with the same operations in the same order per rank as the sweep
// does (start = max(the rank's clock, when its inputs are there); end = start
// + duration; busy += duration), so its figures are the sweep's to the last
// bit, without the sweeps, the per-stage lookups and the per-cell tables of
// every replay. The search replays each schedule for many plans (docs/
// planner.md, "Search time"): the compiled programs are cached beside the
// schedules (cost_model.cpp).
ReplayProgram compile_replay(const pipeline::Schedule& s) {
  const int p = s.options.ranks, n = s.stage_count(), m = s.options.micro_batches;
  // Indexed [stage * m + micro]: 1 + the step that produced each fact, 0 not yet.
  const std::size_t cells = static_cast<std::size_t>(n) * m;
  std::vector<std::uint32_t> f_done(cells, 0), i_done(cells, 0), sent_f(cells, 0), sent_b(cells, 0);
  auto at = [m](int stage, int micro) { return static_cast<std::size_t>(stage) * m + micro; };
  ReplayProgram program{.ranks = p, .stages = n, .steps = {}, .peak_in_flight = std::vector<int>(p, 0)};
  std::size_t total = 0;
  for (const auto& list : s.actions) total += list.size();
  program.steps.reserve(total);
  std::vector<std::size_t> pc(p, 0);
  std::vector<int> in_flight(p, 0);
  bool progress = true, done = false;
  while (progress && !done) {
    progress = false;
    done = true;
    for (int rank = 0; rank < p; ++rank) {
      const auto& list = s.actions[rank];
      for (; pc[rank] < list.size(); ++pc[rank]) {
        const Action& a = list[pc[rank]];
        const int st = a.stage, i = a.micro;
        ReplayProgram::Step step{.rank = static_cast<std::uint32_t>(rank)};
        bool ready = true;
        switch (a.kind) {
          case ActionKind::kForward:
            step.op = Op::kForward;
            step.duration = static_cast<std::uint32_t>(st) * 4;
            if (st > 0 && s.rank_of_stage(st - 1) == rank) {
              step.after = f_done[at(st - 1, i)];
              ready = step.after != 0;
            }
            break;
          case ActionKind::kBackward:
          case ActionKind::kBackwardInput:
            step.op = Op::kBackward;
            step.duration = static_cast<std::uint32_t>(st) * 4 + (a.kind == ActionKind::kBackward ? 1 : 2);
            step.after = f_done[at(st, i)];
            ready = step.after != 0;
            if (st + 1 < n && s.rank_of_stage(st + 1) == rank) {
              step.also_after = i_done[at(st + 1, i)];
              ready = ready && step.also_after != 0;
            }
            break;
          case ActionKind::kBackwardWeight:
            step.op = Op::kWeight;
            step.duration = static_cast<std::uint32_t>(st) * 4 + 3;
            step.after = i_done[at(st, i)];
            ready = step.after != 0;
            break;
          case ActionKind::kSendActivation:
          case ActionKind::kSendGradient: step.op = Op::kSend; break;
          case ActionKind::kRecvActivation:
            step.op = Op::kRecv;
            step.after = sent_f[at(st - 1, i)];
            ready = step.after != 0;
            break;
          case ActionKind::kRecvGradient:
            step.op = Op::kRecv;
            step.after = sent_b[at(st + 1, i)];
            ready = step.after != 0;
            break;
        }
        if (!ready) break;  // waits for another rank: come back next sweep
        program.steps.push_back(step);
        progress = true;
        const auto id = static_cast<std::uint32_t>(program.steps.size());  // 1 + the step's index
        switch (a.kind) {
          case ActionKind::kForward:
            f_done[at(st, i)] = id;
            program.peak_in_flight[rank] = std::max(program.peak_in_flight[rank], ++in_flight[rank]);
            break;
          case ActionKind::kBackward:
            i_done[at(st, i)] = id;
            --in_flight[rank];
            break;
          case ActionKind::kBackwardInput: i_done[at(st, i)] = id; break;
          case ActionKind::kBackwardWeight: --in_flight[rank]; break;
          case ActionKind::kSendActivation: sent_f[at(st, i)] = id; break;
          case ActionKind::kSendGradient: sent_b[at(st, i)] = id; break;
          default: break;
        }
      }
      done = done && pc[rank] == list.size();
    }
  }
  DTRAIN_INTERNAL_ASSERT(done, "the replay of a validated pipeline schedule stalled");
  return program;
}

ReplayResult replay(const ReplayProgram& program, const ReplayOptions& o) {
  const int p = program.ranks, n = program.stages;
  DTRAIN_INTERNAL_ASSERT(static_cast<int>(o.stage.size()) == n, "replay needs one StageTimes per stage");
  // Durations by stage and kind: F, B = I + W, I, W.
  std::vector<double> duration(static_cast<std::size_t>(n) * 4);
  for (int st = 0; st < n; ++st) {
    const StageTimes& t = o.stage[st];
    double* d = &duration[static_cast<std::size_t>(st) * 4];
    d[0] = t.forward;
    d[1] = t.backward_input + t.backward_weight;
    d[2] = t.backward_input;
    d[3] = t.backward_weight;
  }
  // finished[k + 1]: when step k finished (a send: when it was issued);
  // finished[0] = 0 for steps that wait for nothing.
  std::vector<double> finished(program.steps.size() + 1, 0.0);
  ReplayResult r;
  r.busy.assign(p, 0);
  std::vector<double> clock(p, 0);
  for (std::size_t k = 0; k < program.steps.size(); ++k) {
    const ReplayProgram::Step& s = program.steps[k];
    double& now = clock[s.rank];
    switch (s.op) {
      case Op::kForward:
      case Op::kWeight:
      case Op::kBackward: {
        const double ready =
            s.op == Op::kBackward ? std::max(finished[s.after], finished[s.also_after]) : finished[s.after];
        const double d = duration[s.duration];
        now = std::max(now, ready) + d;
        r.busy[s.rank] += d;
        finished[k + 1] = now;
        break;
      }
      case Op::kSend:
        finished[k + 1] = now;
        if (o.blocking_sends) now += o.p2p_seconds;
        break;
      case Op::kRecv: now = std::max(now, finished[s.after] + o.p2p_seconds); break;
    }
  }
  r.end = clock;
  r.makespan = *std::max_element(clock.begin(), clock.end());
  r.peak_in_flight = program.peak_in_flight;
  return r;
}

ReplayResult replay(const pipeline::Schedule& schedule, const ReplayOptions& options) {
  return replay(compile_replay(schedule), options);
}

}  // namespace dtrain::plan
