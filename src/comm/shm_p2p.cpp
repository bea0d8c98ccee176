// Note [Shared-memory point-to-point]
// Gloo moves a point-to-point message through loopback TCP with its device
// thread on both sides: the receiver's "ready" notice, the sender's write,
// the receiver's read, each under a lock that the rank's own thread takes
// to post the next send or receive. On a host whose cores are all busy
// computing (a pipeline's stages), that thread waits for a core while
// holding the lock, and the rank's next send or receive waits for it:
// measured on 2 cores, 2 pipeline stages of the GPT, 3.6 ms of every 37 ms
// step blocked in isend/irecv, and Gloo's threads used 9% of the cores.
//
// Here, for ranks on one host, each direction of a pair that talks gets a
// ring in /dev/shm (made by its sender at the first send, under a name the
// receiver derives from the sender's pid and group token, read from the
// store when the group is made; unlinked once the receiver mapped it, or by
// the sender at the end if the receiver never came and nothing is unread). Records are a 64-byte header (tag, byte
// size), then the payload, padded to 64 bytes. The sending thread copies the record in and publishes it; the receiving
// thread copies it out when its receive is waited on. No other thread takes part, except when a record does not fit the
// free part of the ring: then it and the sends after it (in order) go to the channel's writer thread, which streams
// them in as the receiver frees room, so a send never blocks. A receive reads records in order; one that belongs to a
// later receive (another tag) is kept aside until that receive asks for it.
//
// Waits spin briefly, then sleep on a futex word the other side bumps when
// it publishes or frees room; they wake every kNap to check that the peer's
// process still exists and the deadline has not passed: an error naming the
// peer, never a hang. A pair whose ring cannot be made (no room in
// /dev/shm) uses the backend, and says so with an empty file under the
// ring's name; pairs on two hosts use the backend without asking.
#include "shm_p2p.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

#include "dtrain/log.h"
#include "group_state.h"
#include "shm_util.h"

namespace dtrain::dist::detail {
namespace {

constexpr std::size_t kRecord = 64;  // headers and records are 64-byte aligned
constexpr std::size_t kControlBytes = 4096;
constexpr int kSpins = 2000;
constexpr std::chrono::microseconds kNap{2000};

std::size_t round_up(std::size_t n) {
  return (n + kRecord - 1) / kRecord * kRecord;
}

struct alignas(64) RingControl {
  std::atomic<std::uint64_t> head;  // bytes the sender published (only it writes)
  char pad0[56];
  std::atomic<std::uint64_t> tail;  // bytes the receiver is done with (only it writes)
  char pad1[56];
  std::atomic<std::uint32_t> data_word;  // bumped after each publish
  std::atomic<std::uint32_t> data_waiters;
  std::atomic<std::uint32_t> space_word;  // bumped after each release of room
  std::atomic<std::uint32_t> space_waiters;
};
static_assert(sizeof(RingControl) <= kControlBytes);

struct Header {
  std::uint64_t tag;
  std::uint64_t bytes;
};

// One direction of a pair, mapped: the control block, then `capacity` bytes.
struct Ring {
  void* base = MAP_FAILED;
  std::size_t mapped = 0;
  RingControl* control = nullptr;
  char* data = nullptr;
  std::size_t capacity = 0;

  ~Ring() {
    if (base != MAP_FAILED) ::munmap(base, mapped);
  }
  void put(std::uint64_t at, const void* src, std::size_t n) {
    const std::size_t offset = at % capacity, first = std::min(n, capacity - offset);
    std::memcpy(data + offset, src, first);
    if (first < n) std::memcpy(data, static_cast<const char*>(src) + first, n - first);
  }
  void get(std::uint64_t at, void* dst, std::size_t n) const {
    const std::size_t offset = at % capacity, first = std::min(n, capacity - offset);
    std::memcpy(dst, data + offset, first);
    if (first < n) std::memcpy(static_cast<char*>(dst) + first, data, n - first);
  }
};

std::unique_ptr<Ring> map_ring(int fd, std::size_t capacity) {
  auto ring = std::make_unique<Ring>();
  ring->mapped = kControlBytes + capacity;
  ring->base = ::mmap(nullptr, ring->mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (ring->base == MAP_FAILED) return nullptr;
  ring->control = static_cast<RingControl*>(ring->base);  // zero-filled by ftruncate
  ring->data = static_cast<char*>(ring->base) + kControlBytes;
  ring->capacity = capacity;
  return ring;
}

void bump(std::atomic<std::uint32_t>& word, std::atomic<std::uint32_t>& waiters) {
  word.fetch_add(1);
  if (waiters.load() > 0) futex_wake_all(&word);
}

struct PeerInfo {
  std::uint64_t host = 0;
  std::int64_t pid = 0;
  std::uint64_t token = 0;  // tells this group's rings from other groups' of the same process
};

using Clock = std::chrono::steady_clock;

// Waits until ready(): spins `spins` times, then sleeps on `word` in naps;
// every 8 naps fails if the peer's process is gone or the deadline passed.
// `stop` (may be null) ends the wait early, returning false.
template <class Ready>
bool wait_until(Ready ready, std::atomic<std::uint32_t>& word, std::atomic<std::uint32_t>& waiters, int peer,
                const PeerInfo& info, Clock::time_point deadline, const char* what,
                const std::atomic<bool>* stop = nullptr, int spins = kSpins) {
  for (int spin = 0; spin < spins; ++spin) {
    if (ready()) return true;
  }
  waiters.fetch_add(1);
  struct Leave {
    std::atomic<std::uint32_t>& w;
    ~Leave() { w.fetch_sub(1); }
  } leave{waiters};
  for (int naps = 1;; ++naps) {
    const std::uint32_t seen = word.load();
    if (ready()) return true;
    if (stop != nullptr && stop->load()) return false;
    futex_wait(&word, seen, kNap);
    if (ready()) return true;
    if ((naps & 7) != 0) continue;
    if (process_gone(info.pid)) {
      throw std::runtime_error("shared-memory point-to-point: peer rank " + std::to_string(peer) + " (pid " +
                               std::to_string(info.pid) + ") exited while this rank " + what);
    }
    if (Clock::now() > deadline) {
      throw std::runtime_error("shared-memory point-to-point: timed out while this rank " + std::string(what) +
                               " (peer rank " + std::to_string(peer) + ")");
    }
  }
}

// A send's or receive's completion, for Work::wait (c10d's base class
// waits on finish()).
class DoneWork : public c10d::Work {
 public:
  explicit DoneWork(c10d::OpType type) : c10d::Work(-1, type) {}
  void done(std::exception_ptr error = nullptr) { finish(std::move(error)); }
};

// The ring from a sender (its pid and group token) to a receiver: both sides
// know the name without asking anyone, so a receiver finds a ring whose
// sender (and the store) is gone.
std::string ring_path(const PeerInfo& sender, int receiver) {
  return shm_file_prefix(sender.pid) + "p2p-" + std::to_string(sender.token) + "-to-" + std::to_string(receiver);
}

}  // namespace

struct PendingSend {
  at::Tensor tensor;
  std::uint64_t tag = 0;
  c10::intrusive_ptr<DoneWork> work;
};

struct SharedMemoryP2P::Channel {
  enum class Mode { kUnknown, kShared, kBackend };
  int peer = 0;
  PeerInfo info;
  Clock::duration timeout{};

  // ---- sending to the peer ----
  std::mutex send_mutex;
  Mode send_mode = Mode::kUnknown;
  std::unique_ptr<Ring> out;
  std::string out_path;  // unlinked by the receiver once mapped; by us at the end when all was read
  std::uint64_t out_head = 0;
  std::deque<PendingSend> pending;  // in send order; the front one is being written
  std::condition_variable pending_cv;
  std::thread writer;
  std::atomic<bool> stop{false};
  std::exception_ptr send_error;

  // ---- receiving from the peer ----
  std::mutex ticket_mutex;
  std::map<std::uint64_t, std::uint64_t> posted;  // tag -> receives posted
  std::mutex recv_mutex;                          // held while reading the ring
  std::atomic<Mode> recv_mode{Mode::kUnknown};    // set under recv_mutex, read without it
  std::unique_ptr<Ring> in;
  std::uint64_t in_tail = 0;
  std::map<std::uint64_t, std::uint64_t> arrived;                       // tag -> records read
  std::map<std::pair<std::uint64_t, std::uint64_t>, at::Tensor> early;  // read before asked for
  std::exception_ptr recv_error;

  ~Channel() {
    {
      std::lock_guard<std::mutex> lock(send_mutex);
      stop = true;
    }
    pending_cv.notify_all();
    if (writer.joinable()) writer.join();
    // Records not yet read stay readable, as a closed socket's buffered data
    // does: the receiver maps the ring (and unlinks it) when it gets to them.
    // Otherwise the name goes now (ENOENT when the receiver unlinked it).
    if (!out_path.empty() && out && out->control->tail.load() == out_head) ::unlink(out_path.c_str());
  }

  // Writes one record at out_head, waiting for room as needed (only from
  // the writer thread, or inline when it all fits). Publishes at the end and
  // whenever it must wait.
  void write_record(std::uint64_t tag, const char* src, std::size_t bytes) {
    Ring& ring = *out;
    RingControl& c = *ring.control;
    const auto deadline = Clock::now() + timeout;
    auto publish = [&] {
      c.head.store(out_head, std::memory_order_release);
      bump(c.data_word, c.data_waiters);
    };
    auto room = [&] { return ring.capacity - (out_head - c.tail.load(std::memory_order_acquire)); };
    auto wait_room = [&] {
      publish();
      const bool ok = wait_until([&] { return room() > 0; }, c.space_word, c.space_waiters, peer, info, deadline,
                                 "waited for room to send", &stop);
      if (!ok) throw std::runtime_error("shared-memory point-to-point: the group was destroyed during a send");
    };
    while (room() < kRecord) wait_room();
    const Header header{tag, bytes};
    ring.put(out_head, &header, sizeof header);
    out_head += kRecord;
    for (std::size_t done = 0; done < bytes;) {
      std::size_t free = room();
      if (free == 0) {
        wait_room();
        free = room();
      }
      const std::size_t chunk = std::min(bytes - done, free);  // free is a multiple of kRecord
      ring.put(out_head, src + done, chunk);
      done += chunk;
      out_head += round_up(chunk);
    }
    publish();
  }

  void writer_loop() {
    std::unique_lock<std::mutex> lock(send_mutex);
    for (;;) {
      pending_cv.wait(lock, [&] { return stop || !pending.empty(); });
      if (stop) break;
      PendingSend& front = pending.front();
      lock.unlock();
      std::exception_ptr error;
      try {
        write_record(front.tag, static_cast<const char*>(front.tensor.data_ptr()), front.tensor.nbytes());
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      if (error) {
        send_error = error;
        for (PendingSend& p : pending) p.work->done(error);
        pending.clear();
        continue;
      }
      front.work->done();
      pending.pop_front();
    }
    for (PendingSend& p : pending) {
      p.work->done(std::make_exception_ptr(
          std::runtime_error("shared-memory point-to-point: the group was destroyed before the send went out")));
    }
    pending.clear();
  }

  // Reads records until the one for (tag, ticket) is in `tensor`.
  void receive(at::Tensor& tensor, std::uint64_t tag, std::uint64_t ticket, Clock::time_point deadline) {
    if (recv_error) std::rethrow_exception(recv_error);
    if (auto it = early.find({tag, ticket}); it != early.end()) {
      const at::Tensor kept = std::move(it->second);
      early.erase(it);
      check_size(tensor, tag, kept.nbytes());
      std::memcpy(tensor.data_ptr(), kept.data_ptr(), kept.nbytes());
      return;
    }
    Ring& ring = *in;
    RingControl& c = *ring.control;
    auto available = [&] { return c.head.load(std::memory_order_acquire) - in_tail; };
    auto release = [&] {
      c.tail.store(in_tail, std::memory_order_release);
      bump(c.space_word, c.space_waiters);
    };
    auto wait_data = [&](const char* what) {
      release();
      wait_until([&] { return available() > 0; }, c.data_word, c.data_waiters, peer, info, deadline, what);
    };
    std::size_t received = 0;
    try {
      for (;;) {
        while (available() < kRecord) wait_data("waited for a message");
        Header header{};
        ring.get(in_tail, &header, sizeof header);
        in_tail += kRecord;
        const std::uint64_t index = arrived[header.tag]++;
        const bool mine = header.tag == tag && index == ticket;
        at::Tensor keep;
        char* dst = nullptr;
        if (mine && header.bytes == tensor.nbytes()) {
          dst = static_cast<char*>(tensor.data_ptr());
        } else {
          keep = at::empty({static_cast<std::int64_t>(header.bytes)}, at::kByte);
          dst = static_cast<char*>(keep.data_ptr());
        }
        for (std::size_t done = 0; done < header.bytes;) {
          std::size_t have = available();
          if (have == 0) {
            wait_data("waited for the rest of a message");
            have = available();
          }
          const std::size_t chunk = std::min<std::size_t>(header.bytes - done, have);
          ring.get(in_tail, dst + done, chunk);
          done += chunk;
          in_tail += round_up(chunk);
        }
        release();
        if (mine) {
          received = header.bytes;
          break;
        }
        early.emplace(std::make_pair(header.tag, index), std::move(keep));
      }
    } catch (...) {
      // Sticky, even for a timeout between records: the failed receive's
      // ticket would otherwise take the next message of its tag, and a
      // later receive would silently get the one after.
      recv_error = std::current_exception();
      throw;
    }
    check_size(tensor, tag, received);  // the record was consumed whole: the channel stays usable
  }

  void check_size(const at::Tensor& tensor, std::uint64_t tag, std::size_t bytes) const {
    if (bytes == tensor.nbytes()) return;
    std::ostringstream out;
    out << "peer rank " << peer << " sent " << bytes << " bytes with tag " << tag << ", but this receive takes "
        << tensor.nbytes() << " bytes; post a receive of the size the peer sends";
    throw std::runtime_error(out.str());
  }
};

namespace {

// A receive, done when waited on (the data is copied out of the ring then).
class RecvWork : public c10d::Work {
 public:
  RecvWork(std::function<void(Clock::time_point)> run, std::chrono::milliseconds timeout)
      : c10d::Work(-1, c10d::OpType::RECV), run_(std::move(run)), timeout_(timeout) {}
  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(run_mutex_);
    if (!ran_) {
      ran_ = true;
      const auto limit = timeout == kNoTimeout ? timeout_ : timeout;
      try {
        run_(Clock::now() + limit);
        finish();
      } catch (...) {
        finish(std::current_exception());
      }
      run_ = nullptr;  // drops the tensor and the channel
    }
    lock.unlock();
    return c10d::Work::wait(timeout);
  }

 private:
  std::mutex run_mutex_;
  bool ran_ = false;
  std::function<void(Clock::time_point)> run_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

namespace {
std::string describe(const PeerInfo& info) {
  return std::to_string(info.host) + " " + std::to_string(info.pid) + " " + std::to_string(info.token);
}
}  // namespace

void SharedMemoryP2P::announce(Store store, int rank) {
  std::random_device rd;
  const PeerInfo me{.host = host_identity(), .pid = ::getpid(), .token = (std::uint64_t{rd()} << 32) ^ rd()};
  store.set("peer/" + std::to_string(rank), describe(me));
}

struct SharedMemoryP2P::Peers {
  std::vector<PeerInfo> info;
};

SharedMemoryP2P::SharedMemoryP2P(Options options, BackendSend send, BackendRecv recv)
    : options_(std::move(options)),
      backend_send_(std::move(send)),
      backend_recv_(std::move(recv)),
      host_(host_identity()),
      peers_(std::make_unique<Peers>()),
      channels_(static_cast<std::size_t>(options_.size)) {
  // Every rank's entry, read now (one round trip): later a peer's ring is
  // found by its name alone, even once the store's host is gone.
  std::vector<std::string> keys;
  for (int r = 0; r < options_.size; ++r) keys.push_back("peer/" + std::to_string(r));
  for (const std::vector<std::uint8_t>& value : c10d_store(options_.store)->multiGet(keys)) {
    PeerInfo info;
    std::istringstream(std::string(value.begin(), value.end())) >> info.host >> info.pid >> info.token;
    peers_->info.push_back(info);
  }
}

SharedMemoryP2P::~SharedMemoryP2P() = default;

std::shared_ptr<SharedMemoryP2P::Channel> SharedMemoryP2P::channel(int peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& slot = channels_[static_cast<std::size_t>(peer)];
  if (!slot) {
    auto made = std::make_shared<Channel>();
    made->peer = peer;
    made->timeout = options_.timeout;
    made->info = peers_->info[static_cast<std::size_t>(peer)];
    slot = std::move(made);
  }
  return slot;
}

c10::intrusive_ptr<c10d::Work> SharedMemoryP2P::send(const at::Tensor& tensor, int peer, int tag) {
  const std::shared_ptr<Channel> held = channel(peer);
  Channel& ch = *held;
  std::unique_lock<std::mutex> lock(ch.send_mutex);
  if (ch.send_error) std::rethrow_exception(ch.send_error);
  if (ch.send_mode == Channel::Mode::kUnknown) {
    ch.send_mode = Channel::Mode::kBackend;
    if (ch.info.host == host_) {
      // Made under a temporary name, then renamed: the receiver sees it
      // whole or not at all. An empty file under the name says "use the
      // backend" (no room in /dev/shm).
      const std::string path = ring_path(peers_->info[static_cast<std::size_t>(options_.rank)], peer);
      const std::string temporary = path + ".new";
      const std::size_t capacity = round_up(std::max(options_.ring_bytes, 4 * kRecord));
      const int fd = ::open(temporary.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      const bool sized = fd >= 0 && ::ftruncate(fd, static_cast<off_t>(kControlBytes + capacity)) == 0 &&
                         ::posix_fallocate(fd, 0, static_cast<off_t>(kControlBytes + capacity)) == 0;
      if (sized) ch.out = map_ring(fd, capacity);
      if (!ch.out && fd >= 0) static_cast<void>(::ftruncate(fd, 0));
      if (fd >= 0) ::close(fd);
      if (fd < 0 || ::rename(temporary.c_str(), path.c_str()) != 0) {
        const std::string cause = std::strerror(errno);
        ::unlink(temporary.c_str());
        ch.out.reset();
        // Sticky: the receiver finds neither a ring nor the "use the
        // backend" mark, so no later send may quietly take another way.
        ch.send_error = std::make_exception_ptr(std::runtime_error(
            "shared-memory point-to-point: cannot create " + path + ": " + cause +
            " (make /dev/shm writable, or set GroupOptions::intra_host_shared_memory = false to use Gloo)"));
        std::rethrow_exception(ch.send_error);
      }
      if (ch.out) {
        ch.out_path = path;
        ch.send_mode = Channel::Mode::kShared;
      } else {
        DTRAIN_LOG(kInfo) << "no room for a " << (kControlBytes + capacity) / 1024
                          << " KiB point-to-point ring in /dev/shm; sends to rank " << peer << " go through Gloo";
      }
    }
  }
  if (ch.send_mode == Channel::Mode::kBackend) {
    lock.unlock();
    return backend_send_(tensor, peer, tag);
  }
  if (ch.send_error) std::rethrow_exception(ch.send_error);
  auto work = c10::make_intrusive<DoneWork>(c10d::OpType::SEND);
  const std::size_t bytes = tensor.nbytes();
  // While sends are pending, only the writer thread touches out_head.
  if (ch.pending.empty() &&
      kRecord + round_up(bytes) <= ch.out->capacity - (ch.out_head - ch.out->control->tail.load())) {
    ch.write_record(static_cast<std::uint64_t>(tag), static_cast<const char*>(tensor.data_ptr()), bytes);
    work->done();
    return work;
  }
  // The record does not fit now: the writer thread streams it in order.
  ch.pending.push_back({.tensor = tensor, .tag = static_cast<std::uint64_t>(tag), .work = work});
  if (!ch.writer.joinable()) ch.writer = std::thread([&ch] { ch.writer_loop(); });
  ch.pending_cv.notify_all();
  return work;
}

c10::intrusive_ptr<c10d::Work> SharedMemoryP2P::recv(at::Tensor& tensor, int peer, int tag) {
  std::shared_ptr<Channel> held = channel(peer);
  Channel& ch = *held;
  // Posting never waits for a receive in progress (that holds recv_mutex).
  if (ch.info.host != host_ || ch.recv_mode == Channel::Mode::kBackend) return backend_recv_(tensor, peer, tag);
  std::uint64_t ticket = 0;
  {
    std::lock_guard<std::mutex> lock(ch.ticket_mutex);
    ticket = ch.posted[static_cast<std::uint64_t>(tag)]++;
  }
  const std::string path = ring_path(ch.info, options_.rank);
  BackendRecv backend = backend_recv_;
  auto run = [held = std::move(held), tensor, tag, ticket, path, backend, peer](Clock::time_point deadline) mutable {
    Channel& ch = *held;
    std::unique_lock<std::mutex> lock(ch.recv_mutex);
    if (ch.recv_mode == Channel::Mode::kUnknown) {
      // The sender makes its ring at its first send: wait for it.
      int fd = -1;
      std::atomic<std::uint32_t> word{0}, waiters{0};
      wait_until([&] { return (fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC)) >= 0; }, word, waiters, peer, ch.info,
                 deadline, "waited for the peer's first send", nullptr, /*spins=*/1);
      struct stat st {};
      ::fstat(fd, &st);
      const auto bytes = static_cast<std::size_t>(st.st_size);
      if (bytes > kControlBytes) ch.in = map_ring(fd, bytes - kControlBytes);
      ::close(fd);
      ::unlink(path.c_str());  // both sides have it: nothing is left behind from here on
      if (bytes == 0) {
        ch.recv_mode = Channel::Mode::kBackend;
      } else if (!ch.in) {
        throw std::runtime_error("shared-memory point-to-point: cannot map " + path + ": " + std::strerror(errno));
      } else {
        ch.recv_mode = Channel::Mode::kShared;
      }
    }
    if (ch.recv_mode == Channel::Mode::kBackend) {
      lock.unlock();
      auto work = backend(tensor, peer, tag);
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      work->wait(std::max(left, std::chrono::milliseconds(1)));
      return;
    }
    ch.receive(tensor, static_cast<std::uint64_t>(tag), ticket, deadline);
  };
  return c10::make_intrusive<RecvWork>(std::move(run), options_.timeout);
}

}  // namespace dtrain::dist::detail
