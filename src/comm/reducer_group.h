// Private: the door through which c10d's Reducer (DDP's bucketing engine,
// which takes a c10d ProcessGroup) talks to other ranks. Every operation it
// issues goes through dtrain's ProcessGroup (transport choice, error
// translation); the c10d type is only forward-declared here, so src/parallel/
// never names it.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include "dtrain/comm/process_group.h"

namespace c10d {
class ProcessGroup;
}

namespace dtrain::dist::detail {

// A c10d ProcessGroup whose operations are `group`'s (a new one per call).
c10::intrusive_ptr<c10d::ProcessGroup> process_group_for_reducer(const ProcessGroup& group);

}  // namespace dtrain::dist::detail
