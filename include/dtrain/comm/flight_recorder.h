// The flight recorder: each rank's last N collectives and point-to-point
// operations, for finding the rank behind a hang (docs/flight_recorder.md).
//
// Off unless DTRAIN_FLIGHT_RECORDER=N (N > 0) is set when the process makes
// its first group; then every operation issued through a dist::ProcessGroup
// is kept in a ring of N entries: group, per-group sequence number, op, peer,
// sizes, dtype, bytes, enqueue / start / end times and state. Off, the
// operations pay one branch.
//
// A rank writes its ring as JSON to DTRAIN_FLIGHT_RECORDER_DIR/rank_<R>.json
// (replacing the previous dump, atomically) when
//  - an operation it waits on fails (a timeout included; at most once a second),
//  - it receives SIGUSR1 (the launcher's request; a helper thread writes the
//    dump, the handler only wakes it), and
//  - the program calls dump_flight_recorder().
// With the recorder on, dtrain takes SIGUSR1 unless the program installed a
// handler of its own before the first group was made.
// flight_analysis.h reads the dumps of all ranks and says who is missing.
#pragma once

#include <string>

#include "dtrain/comm/env.h"

namespace dtrain::dist {

// The recorder's knobs, read by the env-contract reader (env.cpp):
// DTRAIN_FLIGHT_RECORDER (entries kept per rank; unset or 0: off) and
// DTRAIN_FLIGHT_RECORDER_DIR (default "dtrain_flight_recorder" in the
// working directory). ConfigError when malformed.
struct FlightRecorderOptions {
  int entries = 0;
  std::string dump_dir = "dtrain_flight_recorder";
};
FlightRecorderOptions flight_recorder_options(const EnvLookup& env = process_env());

// Whether this process records (DTRAIN_FLIGHT_RECORDER > 0, read once).
bool flight_recorder_enabled();

// Writes this rank's ring now; returns the file written, or "" when the
// recorder is off. `reason` is stored in the file. Thread-safe.
std::string dump_flight_recorder(const std::string& reason);

}  // namespace dtrain::dist
