// Reading the flight recorder's dumps (flight_recorder.h) of all ranks and
// saying which rank kept the others waiting: the one analysis behind
// `dtrain run`'s failure report and `dtrain trace analyze DIR`. No LibTorch.
//
// What it finds (docs/flight_recorder.md), per group, from every rank's ring:
//  - ranks that issued different collectives under one sequence number
//    ("rank 1 issued all_gather #5 of group world where ranks 0, 2-3 issued
//    all_reduce(sum) #5");
//  - ranks that never entered a collective the others wait in ("rank 3 never
//    entered all_reduce(sum) #418 of group dp_replicate; ranks 0-2 waited
//    30.0 s; rank 3's last op: recv #77 from rank 2 of group pp (completed)"),
//    or that left no dump while the others wait (stopped, or dead);
//  - receives whose sender never entered the matching send.
// The dumps must all be in one folder (one file per rank, rank_<R>.json).
#pragma once

#include <string>
#include <vector>

namespace dtrain::dist {

struct FlightReport {
  std::vector<std::string> findings;  // one sentence each, the most telling first
  std::vector<int> ranks_dumped;
  std::vector<int> ranks_missing;  // ranks of the job (from the dumps) with no dump
  // The findings, one per line; says so when there are none.
  std::string text() const;
};

// Reads every rank_*.json under `dir`. ConfigError when `dir` is not a
// folder; DataError naming the file for a dump it cannot read.
FlightReport analyze_flight_dumps(const std::string& dir);

// "0-2, 5": ranks for messages (sorted, runs joined).
std::string format_ranks(std::vector<int> ranks);

}  // namespace dtrain::dist
