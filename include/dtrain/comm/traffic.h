// Per-group communication counters: how many operations of each kind a
// process group issued and how many payload bytes this rank handed over, for
// checking a strategy's communication volume against its formula.
#pragma once

#include <cstdint>
#include <string>

namespace dtrain::dist {

class ProcessGroup;

// The kinds of operation a group counts.
enum class OpKind { kAllReduce, kBroadcast, kAllGather, kReduceScatter, kBarrier, kSend, kRecv };
constexpr int kOpKinds = 7;
std::string to_string(OpKind kind);  // "all_reduce", ..., "recv"

// `bytes` is the payload of this rank's argument(s): all_reduce and
// broadcast: the tensor; all_gather: the input (this rank's part);
// reduce_scatter: the input (all size() slices); send and recv: the tensor;
// barrier: 0. Coalesced operations count as the all_reduce / broadcast of
// each flattened buffer (one per dtype and device). Counted when issued
// (after the argument checks), whether it then succeeds or not.
struct Traffic {
  struct Count {
    std::int64_t ops = 0;
    std::int64_t bytes = 0;
  };
  Count by_kind[kOpKinds];
  const Count& operator[](OpKind kind) const { return by_kind[static_cast<int>(kind)]; }
};

// A snapshot of `group`'s counters since it was made. Any thread; always on
// (two relaxed atomic additions per operation).
Traffic traffic(const ProcessGroup& group);

}  // namespace dtrain::dist
