// The two ends of a fault-tolerant job that no live recovery can serve
// (docs/fault_tolerance.md, Note [End of training] in src/ft/lighthouse_end.cpp):
// thrown by a replica's lighthouse client, and ReplicaStateLostError also by
// the lighthouse's check(), on which `dtrain run` restarts the whole job.
// Core layer, so the launcher's agent (elastic) catches them without the ft
// layer.
#pragma once

#include "dtrain/error.h"

namespace dtrain {

// The training finished (every up-to-date replica group reached its last
// step and left) before this replica group, behind, could join: it has no
// peer to recover from, and nothing is left to train.
class TrainingFinishedError : public RendezvousError {
  using RendezvousError::RendezvousError;
};

// Every replica group that held the newest step is gone: the groups left
// are behind it and cannot go on live; the job restarts as a whole, from
// its checkpoint.
class ReplicaStateLostError : public RendezvousError {
  using RendezvousError::RendezvousError;
};

}  // namespace dtrain
