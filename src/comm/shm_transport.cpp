// Note [Shared-memory transport]
// Ranks on one host share a region (a /dev/shm file, unlinked as soon as all
// have mapped it, so nothing is left behind by a crash after that; one before
// it is swept by the launcher, see shm_util.h): a control block with
// one phase counter and one pid per rank, then one slot per rank of
// kSlotBytes, used as two halves. Operations go stripe by stripe (a stripe
// fills one half), in steps separated by barriers:
//   all_reduce:     every rank copies its stripe into its half-slot (ranks 0
//                   and 1 all of it but their own partition, which their sum
//                   reads from their input) | rank r sums partition r over
//                   all ranks, in rank order, into its output and its own
//                   half-slot | every rank copies partition j from rank j's
//                   half-slot
//   reduce_scatter: every rank copies, for each destination d, its stripe of
//                   slice d into part d of its half-slot | rank r sums part r
//                   over all half-slots, in rank order, into its output
//   all_gather:     every rank copies its stripe into its half-slot | every
//                   rank copies rank j's half-slot into block j of its output
// Consecutive stripes (of one operation or the next) alternate halves, so no
// barrier is needed at a stripe's end: a half is written again two stripes
// later, after a barrier that every rank reaches only once it has finished
// reading that half. (Each barrier costs a wake-up of a sleeping peer on a
// busy host; a third barrier per all-reduce was ~1/3 of their count.)
// Each sum is done once, in a fixed order, so all ranks get bitwise the same
// values; the arithmetic is ATen's (add_out, copy_) on tensors over the
// shared memory, written straight into the output (no temporary). Ranks 0
// and 1 are the sum's first two operands, read before the output (their own
// input) is written, so they need not publish their own partition: on 2
// ranks a quarter less copying per all-reduce (issue 29).
// reduce_scatter and all_gather move each byte once each way, where
// Gloo's reduce_scatter is an all-reduce plus a chunk (twice the traffic) and
// both go through loopback TCP. Barriers spin briefly, then sleep on a futex
// (Note [Barrier waits]); a peer whose process is gone (checked through /proc
// by pid) fails the operation within milliseconds, a peer that does not
// arrive fails it after the timeout: an error naming the rank, never a hang.
#include "shm_transport.h"

#include <ATen/ops/add.h>
#include <ATen/ops/from_blob.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <thread>

#include "dtrain/comm/env.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "shm_util.h"

namespace dtrain::dist::detail {
namespace {

constexpr std::size_t kSlotBytes = 8u << 20;
constexpr std::size_t kHalfBytes = kSlotBytes / 2;  // one stripe (see the Note)
constexpr std::size_t kCacheLine = 64;

struct alignas(kCacheLine) Control {
  std::atomic<std::uint64_t> phase;
  std::atomic<std::int64_t> pid;
  // The futex word: the low 32 bits of `phase`, stored after it. Waiters
  // count themselves in `waiters` so that an arriving rank makes the wake
  // system call only when someone sleeps (Note [Barrier waits]).
  std::atomic<std::uint32_t> word;
  std::atomic<std::uint32_t> waiters;
  // Set once an operation failed on this rank (Note [A failed operation]): its
  // phase stops there, and peers waiting for it fail instead of waiting out
  // the timeout or, worse, pairing its next operation with this one.
  std::atomic<std::uint32_t> failed;
};
}  // namespace

struct SharedMemoryTransport::Region {
  void* base = nullptr;
  std::size_t bytes = 0;
  Control* control = nullptr;
  char* slots = nullptr;
  ~Region() {
    if (base != nullptr) ::munmap(base, bytes);
  }
  // Half `half` (0 or 1) of rank r's slot.
  char* slot(int r, int half) const {
    return slots + static_cast<std::size_t>(r) * kSlotBytes + static_cast<std::size_t>(half) * kHalfBytes;
  }
};

std::unique_ptr<SharedMemoryTransport> SharedMemoryTransport::create(const ShmBootstrap& b) {
  if (b.size < 2) return nullptr;
  const std::uint64_t me = host_identity();
  for (std::uint64_t other : b.all_gather_u64(me)) {
    if (other != me) return nullptr;
  }
  const std::size_t control = ((static_cast<std::size_t>(b.size) * sizeof(Control) + 4095) / 4096) * 4096;
  const std::size_t bytes = control + static_cast<std::size_t>(b.size) * kSlotBytes;
  // Rank 0 creates the file under a random name and broadcasts the name.
  std::int64_t id = -1;
  std::string path;
  int fd = -1;
  // The id carries rank 0's pid (high 32 bits; Linux pids fit in 22) and a
  // random number: the name starts with shm_file_prefix(pid), so the
  // launcher can remove the file if a rank dies before every rank mapped it.
  auto path_of = [](std::int64_t id) { return shm_file_prefix(id >> 32) + "comm-" + std::to_string(id & 0xffffffff); };
  if (b.rank == 0) {
    std::random_device rd;
    const std::int64_t candidate = (static_cast<std::int64_t>(::getpid()) << 32) | rd();
    path = path_of(candidate);
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    // fallocate, not only ftruncate: a full /dev/shm (64 MB in a default
    // container) must fail here, not raise SIGBUS at the first write.
    const bool ok = fd >= 0 && ::ftruncate(fd, static_cast<off_t>(bytes)) == 0 &&
                    ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)) == 0;
    if (ok) {
      id = candidate;
    } else if (fd >= 0) {
      ::close(fd);
      fd = -1;
      ::unlink(path.c_str());
    }
  }
  id = b.broadcast_i64(id);
  if (id < 0) {
    DTRAIN_LOG(kInfo) << "no room for a " << bytes / (1 << 20)
                      << " MiB shared-memory region in /dev/shm; CPU collectives go through Gloo";
    return nullptr;
  }
  if (b.rank != 0) {
    path = path_of(id);
    fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  }
  void* base = fd >= 0 ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  if (fd >= 0) ::close(fd);
  if (base != MAP_FAILED) static_cast<Control*>(base)[b.rank].pid.store(::getpid());
  // Everyone mapped (or failed): agree, then the name is no longer needed.
  const bool all_mapped = b.all_min(base != MAP_FAILED ? 1 : 0) == 1;
  if (b.rank == 0) ::unlink(path.c_str());
  if (!all_mapped) {
    if (base != MAP_FAILED) ::munmap(base, bytes);
    return nullptr;
  }
  std::unique_ptr<SharedMemoryTransport> out(new SharedMemoryTransport());
  out->region_ = std::make_unique<Region>();
  out->region_->base = base;
  out->region_->bytes = bytes;
  out->region_->control = static_cast<Control*>(base);  // zero-filled by ftruncate
  out->region_->slots = static_cast<char*>(base) + control;
  out->rank_ = b.rank;
  out->size_ = b.size;
  out->timeout_ = b.timeout;
  // See Note [Barrier waits]; the ranks share this host, so its CPUs, and
  // so may the launcher's other processes on it (a group of 2 among 4
  // processes of a pipeline-and-data job on 2 cores).
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const int usable = ::sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  int processes = b.size;
  try {
    processes = std::max(processes, read_env_contract().local_world_size);
  } catch (const ConfigError&) {
    // No launcher's variables (ranks as threads of one process): the group's.
  }
  out->spin_ = processes <= usable ? std::chrono::microseconds(50) : std::chrono::microseconds(1);
  return out;
}

SharedMemoryTransport::~SharedMemoryTransport() = default;

// Note [Barrier waits]
// A rank arriving at a barrier publishes its phase, then waits for every
// peer's. Most peers arrive within microseconds (the ranks run the same
// collective), so a waiter first spins (spin_); after that it sleeps on the
// peer's futex word, which the peer wakes when it arrives. That costs one
// scheduler wake-up (tens of microseconds) instead of polling with sleeps,
// whose granularity (timer slack, ~50 us) was the floor of every small
// collective, and burns no CPU that a rank's compute threads could use. The
// sleep is bounded (kNap) so that a dead peer (checked through /proc by pid)
// or the group timeout is noticed: an error naming the rank, never a hang.
// The waiter increments `waiters` before reading the word, the arriver
// stores the word before reading `waiters` (both sequentially consistent),
// so either the waiter sees the new word or the arriver sees the waiter.
// The spin (spin_, set by create) is 50 us where every rank can have a CPU
// of its own, not the ~1 us it was: a wake-up of a sleeping waiter (a futex
// wake of a vCPU that went idle) costs more than that on the 2-core VM of
// issue 29, where 2-rank GPT DDP with the 50 us spin and the half copy-in
// above ran 1.0-8.2 % faster in 8 of 8 interleaved rounds
// (docs/performance.md). It is bounded, so a late peer costs at most 50 us
// of CPU per barrier before the sleep, and it yields every 256 polls: a
// waiter that kept the CPU while the peer's (or its own rank's) thread waited
// for it made 4-64 KiB all-reduces 2x slower (bench collectives p50 0.07 ->
// 0.16 ms; with the yield 0.085). With more ranks than CPUs a spinning
// waiter would hold the CPU its peer needs to arrive, so there it stays ~1 us;
// "ranks" counts the launcher's processes on this host (LOCAL_WORLD_SIZE)
// when there are more of them than the group has. One spin per barrier, not
// one per peer.
void SharedMemoryTransport::barrier() {
  constexpr std::chrono::microseconds kNap{2000};
  ++phase_;
  Control& mine = region_->control[rank_];
  mine.phase.store(phase_, std::memory_order_release);
  mine.word.store(static_cast<std::uint32_t>(phase_));
  if (mine.waiters.load() > 0) futex_wake_all(&mine.word);
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  const auto spin_until = std::chrono::steady_clock::now() + spin_;
  for (int r = 0; r < size_; ++r) {
    Control& peer = region_->control[r];
    auto arrived = [&] { return peer.phase.load(std::memory_order_acquire) >= phase_; };
    // Note [A failed operation]: a peer that failed stops short of this barrier.
    auto failed_earlier = [&] {
      return peer.failed.load() != 0 ? "shared-memory transport: peer rank " + std::to_string(r) +
                                           " failed an earlier shared-memory operation and will not arrive"
                                     : std::string();
    };
    if (arrived()) continue;
    for (unsigned spins = 1; !arrived(); ++spins) {
      if ((spins & 255) != 0) continue;
      if (std::chrono::steady_clock::now() > spin_until) break;
      std::this_thread::yield();  // a peer waiting for this CPU runs first
    }
    if (arrived()) continue;
    if (std::string failure = failed_earlier(); !failure.empty()) throw std::runtime_error(failure);
    peer.waiters.fetch_add(1);
    for (int naps = 1; !arrived(); ++naps) {
      const std::uint32_t seen = peer.word.load();
      if (arrived()) break;
      futex_wait(&peer.word, seen, kNap);
      if (arrived()) continue;
      // A failed peer is checked after every nap (its failure wakes this
      // one); its process and the deadline every 8th.
      std::string failure = failed_earlier();
      if (failure.empty()) {
        if ((naps & 7) != 0) continue;
        if (process_gone(peer.pid.load())) {
          failure = "shared-memory transport: peer rank " + std::to_string(r) + " (pid " +
                    std::to_string(peer.pid.load()) + ") exited";
        } else if (std::chrono::steady_clock::now() > deadline) {
          failure = "shared-memory transport: peer rank " + std::to_string(r) + " did not arrive within " +
                    log::format_seconds(timeout_) + " (timed out; it hung or issued different collectives)";
        }
      }
      if (!failure.empty()) {
        peer.waiters.fetch_sub(1);
        // Plain exceptions: the group wraps them into a CommunicationError naming the operation.
        throw std::runtime_error(failure);
      }
    }
    peer.waiters.fetch_sub(1);
  }
}

namespace {
// [lo, lo + len) of `count` elements split over `size` parts: part r.
std::pair<std::int64_t, std::int64_t> part(std::int64_t count, int r, int size) {
  const std::int64_t lo = count * r / size, hi = count * (r + 1) / size;
  return {lo, hi - lo};
}
}  // namespace

int SharedMemoryTransport::next_half() {
  half_ ^= 1;
  return half_;
}

// Note [A failed operation]
// An operation that throws on one rank (a peer's timeout, its death, an
// allocation) leaves this rank's phase and half out of step with its peers:
// one that passed a barrier this rank had published would otherwise pair
// this rank's next operation with the failed one and read unsummed data.
// So a failure marks this rank's control block (peers waiting for it fail
// within a nap, naming it) and the transport refuses every later operation
// here: the group's shared-memory collectives end with the first failure.
template <typename F>
void SharedMemoryTransport::guarded(const F& operation) {
  if (!broken_.empty()) {
    throw std::runtime_error("shared-memory transport: unusable since an earlier operation failed on this rank (" +
                             broken_ + ")");
  }
  try {
    operation();
  } catch (const std::exception& e) {
    broken_ = e.what();
    Control& mine = region_->control[rank_];
    mine.failed.store(1);
    mine.word.fetch_add(1);
    futex_wake_all(&mine.word);
    throw;
  }
}

void SharedMemoryTransport::all_reduce_sum(at::Tensor& tensor) {
  guarded([&] { all_reduce_sum_unguarded(tensor); });
}
void SharedMemoryTransport::reduce_scatter_sum(at::Tensor& output, const at::Tensor& input) {
  guarded([&] { reduce_scatter_sum_unguarded(output, input); });
}
void SharedMemoryTransport::all_gather(at::Tensor& output, const at::Tensor& input) {
  guarded([&] { all_gather_unguarded(output, input); });
}

void SharedMemoryTransport::all_reduce_sum_unguarded(at::Tensor& tensor) {
  const auto element = static_cast<std::int64_t>(tensor.element_size());
  const std::int64_t per_stripe = static_cast<std::int64_t>(kHalfBytes) / element;
  const std::int64_t n = tensor.numel();
  at::Tensor flat = tensor.view(-1);
  for (std::int64_t start = 0; start < n; start += per_stripe) {
    const std::int64_t count = std::min(per_stripe, n - start);
    const int half = next_half();
    auto slot = [&](int r) { return at::from_blob(region_->slot(r, half), {count}, tensor.options()); };
    at::Tensor mine = flat.narrow(0, start, count);
    const auto [lo, len] = part(count, rank_, size_);
    // Ranks 0 and 1 read their own partition from `mine` (see the Note).
    const bool own_from_input = rank_ < 2;
    if (own_from_input) {
      if (lo > 0) slot(rank_).narrow(0, 0, lo).copy_(mine.narrow(0, 0, lo));
      const std::int64_t rest = count - lo - len;
      if (rest > 0) slot(rank_).narrow(0, lo + len, rest).copy_(mine.narrow(0, lo + len, rest));
    } else {
      slot(rank_).copy_(mine);
    }
    barrier();
    if (len > 0) {
      // Straight into the output: the slots still hold every other rank's
      // input. The output may be an operand (ranks 0 and 1): elementwise, an
      // exact alias of an input is read before it is written.
      at::Tensor result = mine.narrow(0, lo, len);
      auto operand = [&](int r) { return r == rank_ ? result : slot(r).narrow(0, lo, len); };
      at::add_out(result, operand(0), operand(1));  // size_ >= 2 (see create)
      for (int r = 2; r < size_; ++r) result.add_(slot(r).narrow(0, lo, len));
      slot(rank_).narrow(0, lo, len).copy_(result);
    }
    barrier();
    for (int r = 0; r < size_; ++r) {
      const auto [rlo, rlen] = part(count, r, size_);
      if (r != rank_ && rlen > 0) mine.narrow(0, rlo, rlen).copy_(slot(r).narrow(0, rlo, rlen));
    }
  }
}

void SharedMemoryTransport::reduce_scatter_sum_unguarded(at::Tensor& output, const at::Tensor& input) {
  const auto element = static_cast<std::int64_t>(input.element_size());
  // A stripe holds `per` elements of each of the size_ slices.
  const std::int64_t per = static_cast<std::int64_t>(kHalfBytes) / element / size_;
  const std::int64_t n = output.numel();
  at::Tensor in = input.view({size_, n});
  at::Tensor out = output.view(-1);
  for (std::int64_t start = 0; start < n; start += per) {
    const std::int64_t len = std::min(per, n - start);
    const int half = next_half();
    auto slot = [&](int r) { return at::from_blob(region_->slot(r, half), {size_, len}, input.options()); };
    slot(rank_).copy_(in.narrow(1, start, len));
    barrier();
    at::Tensor result = out.narrow(0, start, len);
    at::add_out(result, slot(0)[rank_], slot(1)[rank_]);  // size_ >= 2 (see create)
    for (int r = 2; r < size_; ++r) result.add_(slot(r)[rank_]);
  }
}

void SharedMemoryTransport::all_gather_unguarded(at::Tensor& output, const at::Tensor& input) {
  const auto element = static_cast<std::int64_t>(input.element_size());
  const std::int64_t per = static_cast<std::int64_t>(kHalfBytes) / element;
  const std::int64_t n = input.numel();
  at::Tensor in = input.view(-1);
  at::Tensor out = output.view({size_, n});
  for (std::int64_t start = 0; start < n; start += per) {
    const std::int64_t len = std::min(per, n - start);
    const int half = next_half();
    at::from_blob(region_->slot(rank_, half), {len}, input.options()).copy_(in.narrow(0, start, len));
    barrier();
    for (int r = 0; r < size_; ++r) {
      out[r].narrow(0, start, len).copy_(at::from_blob(region_->slot(r, half), {len}, input.options()));
    }
  }
}

}  // namespace dtrain::dist::detail
