// `dtrain ckpt`: which of libdtrain's two commands a path goes to (dtrain's
// own checkpoint folders, or files of the ecosystem), and Python's
// distributed checkpoints (DCP) through python/dtrain_dcp.py: DCP's metadata
// is a pickle of torch's private dataclasses, which only torch writes and
// reads soundly (docs/checkpoints.md).
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

namespace dtrain::tools {

struct CkptRequest {
  std::string command;  // inspect, convert, consolidate
  std::string input, output, key, to;
  std::int64_t max_shard_bytes = 5'000'000'000;
};

// Runs the request; prints to `out`; throws dtrain::Error.
int ckpt_command(const CkptRequest& request, std::ostream& out);

}  // namespace dtrain::tools
