#include "dtrain/host_memory.h"

#include <limits>

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "dtrain/error.h"

namespace dtrain {

bool retain_freed_host_memory(const HostMemoryOptions& options) {
#ifdef __GLIBC__
  constexpr auto kMax = static_cast<std::size_t>(std::numeric_limits<int>::max());
  // Setting either threshold also stops glibc from adjusting both on its own.
  const bool ok = options.mmap_threshold <= kMax && options.trim_threshold <= kMax &&
                  mallopt(M_MMAP_THRESHOLD, static_cast<int>(options.mmap_threshold)) == 1 &&
                  mallopt(M_TRIM_THRESHOLD, static_cast<int>(options.trim_threshold)) == 1;
  DTRAIN_CHECK(ok, ConfigError,
               "glibc refused the host-memory thresholds (mmap " << options.mmap_threshold << ", trim "
                                                                 << options.trim_threshold << " bytes)",
               "use an mmap threshold of at most 32 MiB and a trim threshold below 2 GiB");
  return true;
#else
  (void)options;
  return false;
#endif
}

}  // namespace dtrain
