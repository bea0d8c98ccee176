// FaultTolerantReplicas (include/dtrain/ft/replicas.h): one step's quorum,
// group, recovery, gradient average and commit vote.
//
// Note [Live recovery]
// Every member computes from the quorum alike who is behind (step below the
// quorum's highest) and which up-to-date member serves it (quorum.h:
// recovery_source). The transfer is a header (total bytes, chunk bytes) and
// then the state in chunks of at most FaultTolerantOptions::
// recovery_chunk_bytes, point to point over the quorum's group:
//  - The source serialises its ReplicaState and step counter once, in
//    start_step(), straight into chunk-sized byte tensors: the snapshot
//    (no contiguous archive is built). ReplicaState::save is
//    arbitrary code (an optimizer's state, a GradScaler, a data position)
//    that cannot be split by tensor, and what it writes changes: buffers in
//    the forward (running statistics), parameters, optimizer and scaler state
//    at the optimizer step. A snapshot taken before the step's forward is
//    the committed state whatever the caller does next. Each send holds its
//    chunk alive until the transport is done with it.
//  - The source issues every chunk's send and returns: its forward and
//    backward run while the chunks go (Gloo's threads, or the shared-memory
//    ring's writer thread). It waits for the sends (each wait bounded by the
//    group timeout) in finish_serving(), before its gradient all-reduce,
//    its vote, or its next step, so a failed transfer fails its step.
//  - The receiver cannot step before it has the state: it receives the
//    header and then each chunk in order into one buffer (each receive
//    bounded by the group timeout), and loads the state only once every
//    byte arrived. A source that dies or stalls mid-transfer fails the
//    receive (the peer's closed connection, its process gone, or the
//    timeout); the receiver is left as it was: behind, voting to abort,
//    with failure() naming the bytes received; at the next quorum it
//    recovers again, from a live member.
// The other members go on with their forward and backward meanwhile and
// meet both at the all-reduce. The snapshot costs the source one copy of
// its state in memory (as the single message did); the receiver holds the
// received bytes and then its loaded state.
//
// Note [Ranks at different steps]
// A replica group of several ranks recovers rank to rank; when that
// completes on some ranks only (a rank's load failed, its source died
// mid-transfer), the step aborts and the group's ranks hold the states of
// different steps. Before asking for a quorum they agree on the lowest
// (a MIN over the group), so the group is behind and every rank recovers
// from the same source step. That needs a member ahead of it: if none is
// (the up-to-date groups died and the lighthouse, restarted, no longer knows
// the newest step; ours otherwise refuses such a quorum), a rank that went
// ahead cannot be brought back, and the group stops with a RendezvousError
// on every rank instead of training on with diverged ranks. Every rank
// decides alike: the same MIN/MAX, the same quorum.
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>
#include <system_error>
#include <utility>

#include "dtrain/error.h"
#include "dtrain/ft/replicas.h"
#include "dtrain/log.h"

namespace dtrain::ft {

namespace {
constexpr const char* kStepKey = "dtrain_ft/step";
constexpr int kRecoveryTag = 27;

// A tensor of `sizes` (contiguous) over `flat`'s storage from element
// `offset` on: an alias, not an autograd view, so that optimizers' zero_grad
// (detach_, then reset) may drop it as any gradient.
at::Tensor alias_of(const at::Tensor& flat, std::int64_t offset, at::IntArrayRef sizes) {
  std::vector<std::int64_t> strides(sizes.size(), 1);
  for (std::size_t i = sizes.size(); i-- > 1;) strides[i - 1] = strides[i] * std::max<std::int64_t>(sizes[i], 1);
  at::Tensor alias = at::empty({0}, flat.options());
  alias.set_(flat.storage(), flat.storage_offset() + offset, sizes, strides);
  return alias;
}

// Adds the wall time of its scope to a FaultTolerantTimes field.
class Timed {
 public:
  explicit Timed(double& into) : into_(into), start_(std::chrono::steady_clock::now()) {}
  ~Timed() { into_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count(); }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  double& into_;
  std::chrono::steady_clock::time_point start_;
};
}  // namespace

FaultTolerantReplicas::FaultTolerantReplicas(LighthouseClient& client, ReplicaState state, FaultTolerantOptions options)
    : client_(client), state_(std::move(state)), options_(options) {
  DTRAIN_CHECK(state_.save && state_.load, ConfigError,
               "FaultTolerantReplicas needs a ReplicaState with both save and load.",
               "use ft::module_and_optimizer_state(model, optimizer)");
  DTRAIN_CHECK(options_.recovery_chunk_bytes > 0, ConfigError,
               "FaultTolerantOptions::recovery_chunk_bytes is " << options_.recovery_chunk_bytes << ".",
               "give a positive chunk size (the default is 1 MiB)");
  DTRAIN_CHECK(!options_.max_retries || *options_.max_retries >= 0, ConfigError,
               "FaultTolerantOptions::max_retries is " << options_.max_retries.value_or(0) << ".",
               "give 0 or more steps in a row that may fail (unset: no limit)");
}

FaultTolerantReplicas::~FaultTolerantReplicas() {
  drop_asked_ahead();
  if (times_.steps == 0) return;
  const auto per_step = [this](double ms) {
    std::ostringstream out;
    out.precision(3);
    out << std::fixed << ms / static_cast<double>(times_.steps);
    return out.str();
  };
  DTRAIN_LOG(kInfo) << "replica " << replica_id() << ": " << times_.steps << " steps; per step (ms): quorum "
                    << per_step(times_.quorum_ms) << ", group " << per_step(times_.group_ms) << ", recovery "
                    << per_step(times_.recovery_ms) << ", flatten " << per_step(times_.flatten_ms) << ", all-reduce "
                    << per_step(times_.all_reduce_ms) << ", unflatten " << per_step(times_.unflatten_ms) << ", vote "
                    << per_step(times_.vote_ms) << ", ask ahead " << per_step(times_.ask_ahead_ms);
}

void FaultTolerantReplicas::drop_asked_ahead() {
  if (!ahead_.valid()) return;
  // A caller that stops before reading its asked-ahead quorum (an error
  // elsewhere, or finish() before max_steps): the thread stops waiting
  // within a wait slice (or, inside a withdrawal or a failover search, at
  // that call's own bound), and the client is this thread's again.
  client_.abandon_waits(true);
  try {
    ahead_.get();
  } catch (const std::exception&) {
  }
  client_.abandon_waits(false);
}

void FaultTolerantReplicas::resume_at(std::int64_t step) {
  DTRAIN_CHECK(
      quorum_.members.empty() && step >= 0, ConfigError,
      "FaultTolerantReplicas::resume_at(" << step << ") after a quorum was joined (replica " << replica_id() << ").",
      "call it once, before the first start_step()");
  step_ = step;
}

void FaultTolerantReplicas::fail(const std::string& what, const std::exception& e) {
  DTRAIN_LOG(kWarning) << "replica " << replica_id() << ": " << what << " failed in " << quorum_.describe()
                       << "; the step will not commit: " << e.what();
  failed_ = true;
  want_fresh_ = true;
  failure_ = what + " failed: " + e.what();
}

namespace {
// `text` from rank 0 of `group` to all of its ranks.
std::string broadcast_text(dist::ProcessGroup& group, const std::string& text) {
  at::Tensor length = at::empty({1}, at::kLong);
  length.fill_(static_cast<std::int64_t>(text.size()));
  group.broadcast(length, 0).wait();
  at::Tensor bytes = at::empty({length.item<std::int64_t>()}, at::kByte);
  if (group.rank() == 0) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  group.broadcast(bytes, 0).wait();
  return {static_cast<const char*>(bytes.const_data_ptr()), static_cast<std::size_t>(bytes.numel())};
}
}  // namespace

void FaultTolerantReplicas::start_step() {
  finish_serving();  // a caller that skipped the last step's all-reduce and vote
  ++times_.steps;
  failed_ = false;
  recovered_ = false;
  redo_ = false;
  failure_.clear();
  if (held_) {
    // The answer read at the all-reduce changed the group or named a replica
    // behind (Note [Quorum read at the all-reduce]): the same step again, in it.
    quorum_ = *std::exchange(held_, std::nullopt);
    enter_quorum();
    return;
  }
  if (options_.overlap_quorum && asked_ahead_ && !answer_pending_) {
    asked_ahead_ = false;
    answer_pending_ = true;  // read by settle_quorum(), at the all-reduce
    return;
  }
  asked_ahead_ = false;
  answer_pending_ = false;  // a caller that skipped the all-reduce and vote: read it now
  {
    Timed time(times_.quorum_ms);
    std::int64_t agreed = step_, newest = step_;
    if (shared_by_ranks()) {
      // The group asks with the step every one of its ranks has: after a
      // recovery that one rank completed and another did not (the step
      // aborted), the group is behind, and all of its ranks recover again from
      // the same source step. Rank 0 asks; the others take its answer.
      // See Note [Ranks at different steps].
      at::Tensor group_steps = at::empty({2}, at::kLong);
      group_steps[0].fill_(step_);
      group_steps[1].fill_(-step_);
      options_.replica_group->all_reduce(group_steps, dist::ReduceOp::kMin).wait();
      agreed = group_steps[0].item<std::int64_t>();
      newest = -group_steps[1].item<std::int64_t>();
      if (agreed != newest) {
        DTRAIN_LOG(kWarning) << "replica " << replica_id() << ": this rank is at step " << step_
                             << ", its group's ranks at steps " << agreed << " to " << newest
                             << " (a recovery that did not complete everywhere); the group recovers again";
        step_ = agreed;
      }
    }
    quorum_ = join_quorum(agreed, newest);
    want_fresh_ = false;
  }
  enter_quorum();
}

Quorum FaultTolerantReplicas::join_quorum(std::int64_t agreed, std::int64_t newest) {
  if (!shared_by_ranks()) return ask_quorum();
  // With the quorum, which lighthouse candidate gave it: the other ranks
  // make its group in that one's store (Note [Lighthouse failover]).
  // An answer that ends the group (Note [End of training]) reaches every
  // rank too, instead of leaving the others in the broadcast.
  std::string text;
  std::exception_ptr ended;
  if (local_rank() == 0) {
    try {
      const Quorum q = ask_quorum();
      text = std::to_string(client_.connection()) + " " + std::to_string(client_.connections()) + " " + q.to_text();
    } catch (const TrainingFinishedError& e) {
      text = "finished\n" + e.message() + "\n" + e.hint();
      ended = std::current_exception();
    } catch (const ReplicaStateLostError& e) {
      text = "lost\n" + e.message() + "\n" + e.hint();
      ended = std::current_exception();
    } catch (const std::exception& e) {
      // The lighthouse did not answer (TimeoutError), no candidate is left
      // (CommunicationError), ...: the other ranks must not wait in the
      // broadcast below for a rank that is leaving.
      text = std::string("error\nrank 0 of replica group ") + std::to_string(replica_id()) +
             " could not get the step's quorum from the lighthouse: " + e.what() +
             "\nsee rank 0's log; the launcher restarts the replica group";
      ended = std::current_exception();
    }
  }
  text = broadcast_text(*options_.replica_group, text);
  if (ended) std::rethrow_exception(ended);
  if (const auto nl = text.find('\n'); nl != std::string::npos) {
    const auto nl2 = text.find('\n', nl + 1);
    const std::string message = text.substr(nl + 1, nl2 - nl - 1), hint = text.substr(nl2 + 1);
    if (text.rfind("finished", 0) == 0) throw TrainingFinishedError(message, hint);
    if (text.rfind("lost", 0) == 0) throw ReplicaStateLostError(message, hint);
    throw CommunicationError(message, hint);
  }
  std::istringstream where(text);
  std::size_t index = 0;
  std::int64_t connections = 0;
  where >> index >> connections;
  if (local_rank() != 0) client_.follow(index, connections);
  std::string rest;
  std::getline(where >> std::ws, rest);
  Quorum q = Quorum::from_text(rest);
  DTRAIN_CHECK(agreed == newest || q.max_step() > agreed, RendezvousError,
               "replica " << replica_id() << ": the ranks of this replica group hold the states of steps " << agreed
                          << " to " << newest << " (a live recovery completed on some of them only), and no member of "
                          << q.describe() << " is ahead of step " << agreed
                          << " to recover all of them from; training on would leave the ranks diverged.",
               "the up-to-date replica groups are gone (or the lighthouse lost track of the newest step): restart "
               "the job from a checkpoint");
  return q;
}

Quorum FaultTolerantReplicas::ask_quorum() {
  if (ahead_.valid()) return ahead_.get();
  return client_.quorum(step_, want_fresh_);
}

void FaultTolerantReplicas::enter_quorum() {
  DTRAIN_INTERNAL_ASSERT(quorum_.index_of(replica_id()) >= 0,
                         "replica " << replica_id() << " is not in its own " << quorum_.describe());
  if (quorum_.quorum_id != group_quorum_id_) {
    Timed time(times_.group_ms);
    make_group();
  }
  if (!failed_) {
    Timed time(times_.recovery_ms);
    recover_or_serve();
  }
}

// Note [Quorum read at the all-reduce]
// After a committed step the next step's request is already out (asked
// ahead, Note [Commit vote]), and in the steady state its answer is the
// last quorum again: same members, same group, nobody behind. With
// FaultTolerantOptions::overlap_quorum, start_step() then does not wait for
// it: the caller's forward and backward run while the lighthouse forms it
// (on a busy host, waking the lighthouse and its store costs more than the
// round trips themselves), and settle_quorum() reads it where the
// all-reduce needs the group. When it is that quorum (the same quorum id,
// every member at this step) the step goes on in the group made for it,
// exactly as if start_step() had read it. Otherwise (a member dropped,
// restarted or joined; a fresh group asked for) nothing was sent: the
// step's gradients are dropped, should_commit() returns false without a
// vote, and the next start_step() goes on with the answer held: makes the
// new group, serves or receives a live recovery, and the caller runs the
// step again, same step and data. Every member of the quorum read the same
// answer, so every one that read it ahead decides alike; a member that
// asked in start_step() (a restarted replica) simply waits for the others
// at the group's making, one forward and backward longer. For the
// lighthouse and the peers nothing changed but that delay: the round is
// voted on once, after the step that ran in its group. The forward and
// backward run for nothing are those of an aborted step (what they change
// besides the gradients, a module's running statistics or a random
// generator, stays changed, as after any aborted step); a replica that
// asked ahead is never behind (it just committed), so it never has to
// recover before its forward.
void FaultTolerantReplicas::settle_quorum() {
  if (!answer_pending_) return;
  answer_pending_ = false;
  Timed time(times_.quorum_ms);
  Quorum q = join_quorum(step_, step_);
  if (group_ && q.quorum_id == group_quorum_id_ && q.behind().empty()) {
    quorum_ = std::move(q);
    return;
  }
  held_ = std::move(q);
  redo_ = true;
}
void FaultTolerantReplicas::make_group() {
  group_.reset();
  std::erase_if(retired_, [](const auto& retired) { return retired.second->completed(); });
  group_quorum_id_ = -1;
  const int rank = quorum_.index_of(replica_id());
  const int size = static_cast<int>(quorum_.members.size());
  DTRAIN_LOG(kInfo) << "replica " << replica_id() << ": " << quorum_.describe();
  // The group takes over the calling thread's log identity; this rank's is
  // its own job's, not its index in the quorum.
  log::ScopedIdentity keep(log::identity());
  try {
    const std::string prefix = "pg/" + std::to_string(quorum_.quorum_id) + "/" + std::to_string(local_rank());
    // A member that died after asking is noticed by its heartbeat, not the
    // group's rendezvous timeout (Note [Members that never come]).
    if (size > 1) client_.await_members(quorum_, prefix + "/arrive", options_.group_timeout);
    group_ = dist::init_process_group(client_.store().with_prefix(prefix), rank, size,
                                      {.backend = dist::BackendKind::kGloo,
                                       .timeout = options_.group_timeout,
                                       .name = "dp_replicate (quorum " + std::to_string(quorum_.quorum_id) + ")",
                                       .intra_host_shared_memory = options_.intra_host_shared_memory});
    group_quorum_id_ = quorum_.quorum_id;
  } catch (const std::exception& e) {
    fail("making the group", e);
  }
}

namespace {
// The source's ReplicaState and step counter, serialised once: the snapshot,
// written straight into the chunks it is sent as (byte tensors of `chunk`
// bytes, the last one shorter), so no contiguous archive is built and
// regrown; a send still in a transport holds its chunk alive.
struct Snapshot {
  std::vector<at::Tensor> chunks;
  std::int64_t bytes = 0;
};
Snapshot serialise(const ReplicaState& state, std::int64_t step, std::int64_t chunk) {
  torch::serialize::OutputArchive archive;
  state.save(archive);
  archive.write(kStepKey, at::scalar_tensor(step, at::kLong));
  Snapshot out;
  std::int64_t used = chunk;  // of the last chunk
  archive.save_to([&](const void* data, std::size_t n) {
    const char* from = static_cast<const char*>(data);
    for (std::size_t left = n; left > 0;) {
      if (used == chunk) {
        out.chunks.push_back(at::empty({chunk}, at::kByte));
        used = 0;
      }
      const auto take = static_cast<std::size_t>(std::min<std::int64_t>(chunk - used, static_cast<std::int64_t>(left)));
      std::memcpy(static_cast<char*>(out.chunks.back().data_ptr()) + used, from, take);
      used += static_cast<std::int64_t>(take);
      from += take;
      left -= take;
    }
    out.bytes += static_cast<std::int64_t>(n);
    return n;
  });
  if (!out.chunks.empty()) out.chunks.back() = out.chunks.back().narrow(0, 0, used);
  return out;
}

std::int64_t chunk_count(std::int64_t total, std::int64_t chunk) {
  return total == 0 ? 0 : (total + chunk - 1) / chunk;
}
}  // namespace

void FaultTolerantReplicas::recover_or_serve() {
  const auto late = quorum_.behind();
  if (late.empty()) return;
  const int me = quorum_.index_of(replica_id());
  if (std::find(late.begin(), late.end(), me) != late.end()) {
    recover_from(quorum_.recovery_source(me));
    return;
  }
  try {
    std::optional<Snapshot> snapshot;
    const std::int64_t chunk = options_.recovery_chunk_bytes;
    for (const int peer : late) {
      if (quorum_.recovery_source(peer) != me) continue;
      if (!snapshot) {
        serving_.began = std::chrono::steady_clock::now();
        snapshot = serialise(state_, step_, chunk);
        serving_.serialise_ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - serving_.began).count();
      }
      at::Tensor header = at::empty({2}, at::kLong);
      header[0].fill_(snapshot->bytes);
      header[1].fill_(chunk);
      serving_.sends.push_back(group_->isend(header, peer, kRecoveryTag));
      for (const at::Tensor& part : snapshot->chunks) serving_.sends.push_back(group_->isend(part, peer, kRecoveryTag));
      serving_.bytes += snapshot->bytes;
      serving_.peers.push_back(quorum_.members[peer].replica_id);
    }
    if (snapshot) {
      serving_.issued_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - serving_.began).count();
    }
  } catch (const std::exception& e) {
    fail("live recovery (sending)", e);
  }
}

void FaultTolerantReplicas::recover_from(int source) {
  const int source_id = quorum_.members[source].replica_id;
  std::int64_t total = -1;
  std::int64_t received = 0;
  try {
    at::Tensor header = at::empty({2}, at::kLong);
    group_->recv(header, source, kRecoveryTag);
    total = header[0].item<std::int64_t>();
    const std::int64_t chunk = header[1].item<std::int64_t>();
    DTRAIN_CHECK(total >= 0 && chunk > 0, CommunicationError,
                 "replica " << replica_id() << ": replica " << source_id << " announced a state of " << total
                            << " bytes in chunks of " << chunk << " bytes",
                 "both replicas must run the same dtrain");
    // All or nothing: every chunk lands in this buffer; the state is loaded
    // only once the last one arrived.
    at::Tensor bytes = at::empty({total}, at::kByte);
    for (std::int64_t offset = 0; offset < total; offset += chunk) {
      at::Tensor part = bytes.narrow(0, offset, std::min(chunk, total - offset));
      group_->recv(part, source, kRecoveryTag);
      received += part.numel();
    }
    torch::serialize::InputArchive archive;
    archive.load_from(static_cast<const char*>(bytes.const_data_ptr()), static_cast<std::size_t>(bytes.numel()));
    state_.load(archive);
    at::Tensor step;
    archive.read(kStepKey, step);
    DTRAIN_LOG(kInfo) << "replica " << replica_id() << ": recovered step " << step.item<std::int64_t>() << " (" << total
                      << " bytes in " << chunk_count(total, chunk) << " chunks) from replica " << source_id
                      << " (was at step " << step_ << ")";
    step_ = step.item<std::int64_t>();
    recovered_ = true;
  } catch (const std::exception& e) {
    const std::string progress = total < 0
                                     ? std::string("before its size arrived")
                                     : std::to_string(received) + " of " + std::to_string(total) + " bytes received" +
                                           (received == total ? " (loading them failed)" : "");
    fail("live recovery from replica " + std::to_string(source_id) + " (" + progress +
             "; this replica's state is unchanged unless the load itself failed)",
         e);
  }
}

void FaultTolerantReplicas::finish_serving() {
  if (serving_.sends.empty()) return;
  Timed time(times_.recovery_ms);
  std::vector<dist::Work> sends = std::move(serving_.sends);
  serving_.sends.clear();
  // Every send is waited for (each wait bounded by the group timeout), also
  // after one failed: a Gloo send's Work owns its chunk, which the transport
  // may still be writing to another, live receiver.
  std::exception_ptr first_failure;
  for (auto& work : sends) {
    try {
      work.wait();
    } catch (...) {
      if (!first_failure) first_failure = std::current_exception();
    }
  }
  try {
    if (first_failure) std::rethrow_exception(first_failure);
    const auto now = std::chrono::steady_clock::now();
    std::string peers;
    for (const int id : serving_.peers) peers += (peers.empty() ? "" : ", ") + std::to_string(id);
    DTRAIN_LOG(kInfo) << "replica " << replica_id() << ": sent step " << step_ << " (" << serving_.bytes
                      << " bytes, chunks of " << options_.recovery_chunk_bytes << ") to recovering replica"
                      << (serving_.peers.size() == 1 ? " " : "s ") << peers << "; start_step held this replica "
                      << std::llround(serving_.issued_ms) << " ms (serialising " << std::llround(serving_.serialise_ms)
                      << " ms), the transfer ended "
                      << std::llround(std::chrono::duration<double, std::milli>(now - serving_.began).count())
                      << " ms after it began (the step's forward and backward ran meanwhile)";
  } catch (const std::exception& e) {
    fail("live recovery (sending)", e);
  }
  serving_ = {};
}

// Note [Gradients as views of the flat buffer]
// The cross-replica mean runs on one flat buffer (kept across steps), so a
// step copies the gradients in and, without gradients_as_buffer_views, the
// mean back out: two passes over every gradient. With it, the second pass
// goes: the gradients become views of the buffer (as DDP's
// gradient_as_bucket_view; aliases of its storage, not autograd views,
// which LibTorch's zero_grad could not detach_), which the optimizer reads. They cannot stay
// views across steps for free: accumulating into a kept gradient is a pass
// too (an add, and the zeroing before it), which is why the caller drops
// them instead and backward hands fresh tensors that the next step copies
// in. A view the caller did not drop is not written under it: the step
// then takes a fresh buffer (the view keeps the old one alive), as after a
// failed all-reduce, whose abandoned collective may still write the buffer
// (flat_ is dropped there; the gradients are only replaced after success).
void FaultTolerantReplicas::all_reduce_gradients(std::vector<at::Tensor>& tensors) {
  finish_serving();
  settle_quorum();
  if (failed_ || redo_ || tensors.empty()) return;
  try {
    std::optional<Timed> flatten_time(times_.flatten_ms);
    std::vector<at::Tensor> flat;
    flat.reserve(tensors.size());
    std::int64_t total = 0;
    bool alike = true;  // one dtype and device: the buffer kept from the last step fits
    for (const auto& t : tensors) {
      flat.push_back(t.reshape({-1}));
      total += t.numel();
      alike = alike && t.scalar_type() == tensors.front().scalar_type() && t.device() == tensors.front().device();
    }
    // The flat buffer is kept across steps: a fresh one of several MB is
    // fresh pages from the kernel every step (their faults cost more than
    // the copy: ~1 ms for bench/ft's 4 MB). No collective holds it between
    // steps (one abandoned on a silent member may: flat_ is dropped then).
    // A gradient that is still a view of it (gradients_as_buffer_views, its
    // caller not having dropped it) keeps the old one, and the step gets a
    // fresh one: cat_out may not read what it writes.
    const bool aliased = flat_.defined() && std::any_of(tensors.begin(), tensors.end(),
                                                        [this](const at::Tensor& t) { return t.is_alias_of(flat_); });
    if (!alike) {
      flat_ = at::cat(flat);
    } else {
      if (aliased || !flat_.defined() || flat_.numel() != total ||
          flat_.scalar_type() != tensors.front().scalar_type() || flat_.device() != tensors.front().device()) {
        flat_ = at::empty({total}, tensors.front().options());
      }
      at::cat_out(flat_, flat);
    }
    at::Tensor buffer = flat_;
    flatten_time.reset();
    {
      Timed time(times_.all_reduce_ms);
      dist::Work work = group_->all_reduce(buffer, dist::ReduceOp::kAvg);
      wait_watching_members(work, "the gradient all-reduce");
    }
    Timed unflatten_time(times_.unflatten_ms);
    std::int64_t offset = 0;
    for (auto& t : tensors) {
      if (options_.gradients_as_buffer_views) {
        t = alias_of(buffer, offset, t.sizes());
      } else {
        t.copy_(buffer.narrow(0, offset, t.numel()).view_as(t));
      }
      offset += t.numel();
    }
  } catch (const std::exception& e) {
    flat_ = at::Tensor();
    fail("the gradient all-reduce", e);
  }
}

void FaultTolerantReplicas::wait_watching_members(dist::Work& work, const std::string& what) {
  struct Done {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
  };
  auto done = std::make_shared<Done>();
  dist::Future future = work.future();
  future->addCallback([done](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lock(done->mutex);
    done->done = true;
    done->cv.notify_all();
  });
  try {
    client_.await_collective(
        quorum_,
        [&done](std::chrono::milliseconds slice) {
          std::unique_lock<std::mutex> lock(done->mutex);
          return done->cv.wait_for(lock, slice, [&done] { return done->done; });
        },
        what);
  } catch (...) {
    retired_.emplace_back(*group_, future);
    throw;
  }
  // The future completed (by the collective's end or its own deadline):
  // this only rethrows the outcome. (A wait() begun while the continuation
  // above is pending ends with the operation too: Note [Waits and
  // continuations] in src/comm/work.cpp.)
  work.wait();
}

void FaultTolerantReplicas::finish() {
  // The client serves one thread at a time: a request asked ahead for a step
  // that will not run is dropped first.
  drop_asked_ahead();
  asked_ahead_ = answer_pending_ = false;
  if (local_rank() == 0) client_.finish(step_);
}

bool FaultTolerantReplicas::should_commit() {
  finish_serving();
  settle_quorum();
  // Nothing to vote on yet (Note [Quorum read at the all-reduce]): a new
  // quorum, not a failure, so max_retries does not count it.
  if (redo_) return false;
  std::optional<Timed> vote_time(times_.vote_ms);
  bool commit = false;
  // Whether every rank of the group is at this step (always, after a
  // commit: see Note [Ranks at different steps]); the next quorum is asked
  // ahead only then, since start_step() would otherwise ask with the lowest.
  bool same_step = true;
  if (shared_by_ranks()) {
    // The replica group votes ok only if each of its ranks is; rank 0 votes
    // for it and shares the decision.
    at::Tensor flags = at::empty({4}, at::kLong);
    flags[0].fill_(failed_ ? 0 : 1);
    flags[1].fill_(want_fresh_ ? 0 : 1);
    flags[2].fill_(step_);
    flags[3].fill_(-step_);
    options_.replica_group->all_reduce(flags, dist::ReduceOp::kMin).wait();
    const bool ok = flags[0].item<std::int64_t>() == 1;
    want_fresh_ = flags[1].item<std::int64_t>() == 0;
    same_step = flags[2].item<std::int64_t>() == -flags[3].item<std::int64_t>();
    at::Tensor decision = at::zeros({1}, at::kInt);
    if (local_rank() == 0) decision.fill_(client_.agree_commit(quorum_, ok) ? 1 : 0);
    options_.replica_group->broadcast(decision, 0).wait();
    commit = decision.item<int>() == 1;
  } else {
    commit = client_.agree_commit(quorum_, !failed_);
  }
  vote_time.reset();
  if (commit) {
    ++step_;
    if (step_ == options_.max_steps) finish();
    // The lighthouse forms the next step's quorum while the caller applies
    // this one's update (Note [Commit vote]: every member commits, so each
    // asks at the same step as it would in start_step()).
    if (step_ < options_.max_steps && same_step && !want_fresh_) {
      asked_ahead_ = true;  // on every rank of the group alike
      if (local_rank() == 0) {
        Timed time(times_.ask_ahead_ms);
        if (options_.overlap_quorum) {
          try {
            ahead_ = std::async(std::launch::async, [this, step = step_, identity = log::identity()] {
              log::ScopedIdentity as(identity);
              client_.ask_ahead(step);
              return client_.quorum(step, false);
            });
          } catch (const std::system_error& e) {
            // No thread to be had: the step is committed, so ask on this one
            // (the answer is then read on it too, where it would have been).
            DTRAIN_LOG(kWarning) << "replica " << replica_id()
                                 << ": no thread for the quorum asked ahead, asking on the caller's: " << e.what();
            client_.ask_ahead(step_);
          }
        } else {
          client_.ask_ahead(step_);
        }
      }
    }
  } else if (!failed_) {
    DTRAIN_LOG(kWarning) << "replica " << replica_id() << ": step " << step_ << " aborted (another member of "
                         << quorum_.describe() << " failed)";
  }
  if (commit) {
    uncommitted_ = 0;
  } else {
    count_uncommitted(failed_ ? failure_ : "another member of " + quorum_.describe() + " failed");
  }
  return commit;
}

void FaultTolerantReplicas::count_uncommitted(const std::string& why) {
  ++uncommitted_;
  DTRAIN_CHECK(!options_.max_retries || uncommitted_ <= *options_.max_retries, CommunicationError,
               "replica " << replica_id() << ": " << uncommitted_ << " steps in a row aborted (step " << step_
                          << ", the last: " << why << "), more than FaultTolerantOptions::max_retries ("
                          << options_.max_retries.value_or(0) << "); giving up, nothing of them applied.",
               "find the member that fails them (each rank's log, the flight recorder's report: `dtrain trace "
               "analyze`), or raise max_retries");
}

}  // namespace dtrain::ft
