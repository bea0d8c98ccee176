// Work handles and the one place where communication failures become
// dtrain::CommunicationError (Note [Communication errors]).
//
// Note [Communication errors]
// Whatever fails under an operation — Gloo's "Connection closed by peer", a
// timeout, NCCL's errors, our shared-memory transport, a size mismatch — is
// rethrown once, here, as a CommunicationError whose message names the
// operation, the group, this rank (the group's rank identity, also on Gloo's
// and executor threads), the peer of a point-to-point operation and the
// sizes. Wait paths and future paths translate alike, so a failure reaches
// user code the same way whether it waited on a Work, on a DDP bucket, or
// inside backward.
//
// Note [Abort instead of hang]
// Every wait a rank makes on another rank ends by a deadline of its own:
//  - Gloo: collectives and barriers carry the group's timeout in their
//    options (Gloo's algorithms time out every transfer), send/recv waits
//    pass it to Gloo's buffer waits, and Work::wait passes it to c10d's wait;
//  - shared memory: every barrier and ring wait checks the deadline (and
//    whether the peer's process still exists) every few milliseconds
//    (shm_transport.cpp, shm_p2p.cpp);
//  - operations completed through a future of ours (shared-memory
//    collectives, coalesced operations) are waited on with the timeout plus a
//    grace (the transport's own error, which names the peer, normally comes
//    first), never with an unbounded wait;
//  - NCCL: c10d's watchdog enforces the timeout on the GPU side; when a
//    wait on an NCCL operation fails (a timeout included), its group's
//    communicators are aborted at once (Backend::abort, ncclCommAbort), so
//    that no later stream synchronisation waits on a collective that cannot
//    finish. Compiled; not yet run on a GPU.
// A failure becomes a CommunicationError naming the operation, group, rank
// and peer (above), and the flight recorder dumps (flight_recorder.h).
//
// Note [Waits and continuations]
// A Work's outcome (its error, its result, the finish step that copies a
// coalesced buffer back) is settled once, under the Outcome's lock, by
// whichever comes first: Work::wait() or the continuation of a future()
// taken from it. Contract: any number of threads may wait() and take
// future()s, in any order, and no wait ends later than the operation (or
// its deadline). So wait() never holds that lock while it waits: a future
// completes by running its callbacks on the completing thread before it
// tells c10d's Work::wait (Gloo's AsyncWork completes its future, then
// finishes), and future()'s continuation takes the lock; a wait() begun
// before the end and holding it blocked the continuation, and so itself,
// until the group timeout, and then reported a timeout for an operation
// that had succeeded (multirank.CollectivesMore.WaitWithAPending...).
// wait() waits without that lock and settles under it only if nothing
// settled first; a continuation that settled first decides the outcome both
// report. Waiters take turns (Outcome::wait_mutex, which no continuation
// takes): Gloo's send/recv wait consumes one completion, so a second waiter
// inside it would wait out the timeout and Gloo would close the group's
// connections; the second finds the outcome settled when its turn comes.
// A failed NCCL operation's abort runs on a waiting thread, once, whoever
// settled the failure.
#include <ATen/core/ivalue.h>

#include <condition_variable>

#include "dtrain/error.h"
#include "flight_recorder.h"
#include "group_state.h"

namespace dtrain::dist {
namespace detail {

std::string describe_tensor(const at::Tensor& tensor) {
  if (!tensor.defined()) return "undefined";
  std::string out = c10::toString(tensor.scalar_type());
  out += "[";
  for (std::int64_t d = 0; d < tensor.dim(); ++d) out += (d ? "," : "") + std::to_string(tensor.size(d));
  out += "]";
  if (!tensor.device().is_cpu()) out += " on " + tensor.device().str();
  return out;
}

std::exception_ptr communication_error(const OpInfo& info, const std::string& cause, const std::string& hint_text) {
  log::ScopedIdentity scoped(info.identity);
  std::string message = info.op + " on " + info.group;
  if (info.peer >= 0) message += " with peer rank " + std::to_string(info.peer);
  if (!info.sizes.empty()) message += " (" + info.sizes + ")";
  message += " failed: " + cause;
  const bool timeout = cause.find("imed out") != std::string::npos || cause.find("imeout") != std::string::npos;
  std::string hint = !hint_text.empty() ? hint_text
                     : info.peer >= 0   ? "rank " + std::to_string(info.peer) +
                                            " may have died, stalled or posted a different size; its log says why"
                                      : "a peer rank may have died or stalled; its log says why";
  if (timeout) hint += " (the group timeout is " + log::format_seconds(info.timeout) + ", DTRAIN_TIMEOUT_SECONDS)";
  return std::make_exception_ptr(CommunicationError(message, hint));
}

namespace {
OpInfo with_group(const GroupState& group, OpInfo info) {
  info.group = describe(group);
  info.identity = group.identity;
  info.timeout = group.timeout;
  if (group.kind == BackendKind::kNccl) info.abort_backend.emplace(group.backend);
  return info;
}
}  // namespace

std::exception_ptr communication_error(const GroupState& group, OpInfo info, const std::string& cause,
                                       const std::string& hint) {
  return communication_error(with_group(group, std::move(info)), cause, hint);
}

std::exception_ptr translate(const OpInfo& info, std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const CommunicationError&) {
    return error;  // already names its operation
  } catch (const c10::Error& e) {
    return communication_error(info, e.what_without_backtrace());
  } catch (const dtrain::Error& e) {
    return communication_error(info, e.message());
  } catch (const std::exception& e) {
    return communication_error(info, e.what());
  } catch (...) {
    return communication_error(info, "unknown error");
  }
}

void Outcome::settle(std::exception_ptr failure) {
  if (done) return;
  if (!failure && finish) {
    try {
      finish();
    } catch (...) {
      failure = std::current_exception();
    }
  }
  finish = nullptr;  // drops what it holds
  done = true;
  error = failure ? translate(info, failure) : nullptr;
  if (info.flight != 0) {
    FlightRecorder::get()->mark(info.flight, error ? FlightState::kFailed : FlightState::kCompleted);
  }
  if (!error) return;
  if (FlightRecorder* recorder = FlightRecorder::get()) {
    log::ScopedIdentity scoped(info.identity);
    recorder->dump(info.op + " failed on " + info.group, /*after_failure=*/true);
  }
}

namespace {
// Marks a recorded operation's entry when `future` completes.
void mark_when_done(const Future& future, std::uint64_t ticket) {
  if (ticket == 0) return;
  future->addCallback([ticket](c10::ivalue::Future& f) {
    FlightRecorder::get()->mark(ticket, f.hasError() ? FlightState::kFailed : FlightState::kCompleted);
  });
}

// Waits for `future` until `deadline`; false if it did not complete by then.
bool wait_until(const Future& future, std::chrono::steady_clock::time_point deadline) {
  if (future->completed()) return true;
  struct Flag {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
  };
  auto flag = std::make_shared<Flag>();
  future->addCallback([flag](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lock(flag->mutex);
    flag->done = true;
    flag->cv.notify_all();
  });
  // Also polled: a future completes (completed() is true) before it runs its
  // callbacks, in the order they were added, on the completing thread. One
  // added earlier (Work::future()'s continuation, which takes the Outcome's
  // lock, or a caller's slow callback) runs before ours and delays it, so the
  // flag is only the fast path.
  std::unique_lock<std::mutex> lock(flag->mutex);
  constexpr auto kPoll = std::chrono::milliseconds(5);
  while (!flag->done && !future->completed()) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    flag->cv.wait_until(lock, std::min(deadline, now + kPoll));
  }
  return true;
}
}  // namespace

namespace {
std::shared_ptr<Work::Impl> new_impl(const GroupState& group, OpInfo info, c10::IValue result,
                                     std::function<void()> finish) {
  auto impl = std::make_shared<Work::Impl>();
  impl->outcome = std::make_shared<Outcome>();
  impl->outcome->info = with_group(group, std::move(info));
  impl->outcome->result = std::move(result);
  impl->outcome->finish = std::move(finish);
  return impl;
}
}  // namespace

Work make_work(const std::shared_ptr<GroupState>& group, OpInfo info, c10::IValue result,
               const std::function<c10::intrusive_ptr<c10d::Work>()>& issue, std::function<void()> finish) {
  auto impl = new_impl(*group, std::move(info), std::move(result), std::move(finish));
  try {
    impl->work = issue();
  } catch (...) {
    if (impl->outcome->info.flight != 0) FlightRecorder::get()->mark(impl->outcome->info.flight, FlightState::kFailed);
    std::rethrow_exception(translate(impl->outcome->info, std::current_exception()));
  }
  if (const std::uint64_t ticket = impl->outcome->info.flight; ticket != 0) {
    FlightRecorder::get()->mark(ticket, FlightState::kStarted);
    // Collectives complete through their future; a point-to-point Work of
    // Gloo's or ours has none, and is marked when waited on (Outcome::settle).
    if (impl->outcome->info.peer < 0) {
      try {
        mark_when_done(impl->work->getFuture(), ticket);
      } catch (const c10::Error&) {
        // No future on this Work type: marked at the wait.
      }
    }
  }
  return Work(std::move(impl));
}

Work make_future_work(const std::shared_ptr<GroupState>& group, OpInfo info, Future future,
                      std::function<void()> finish) {
  auto impl = new_impl(*group, std::move(info), c10::IValue(), std::move(finish));
  impl->future = std::move(future);
  mark_when_done(impl->future, impl->outcome->info.flight);
  return Work(std::move(impl));
}

}  // namespace detail

void Work::wait() {
  if (!impl_) return;
  detail::Outcome& outcome = *impl_->outcome;
  // Note [Abort instead of hang]: on a waiting thread only, never in a
  // future's callback, which may run on the backend's own watchdog thread;
  // once per failed operation, whichever settled it (a wait or a future()'s
  // continuation).
  auto end = [&outcome] {
    bool abort_now = false;
    {
      std::lock_guard<std::mutex> lock(outcome.mutex);
      if (outcome.error && outcome.info.abort_backend && !outcome.aborted) {
        outcome.aborted = true;
        abort_now = true;
      }
    }
    if (abort_now) {
      if (auto backend = outcome.info.abort_backend->lock()) {
        try {
          backend->abort();
        } catch (...) {
          // Already torn down: nothing left to release.
        }
      }
    }
    if (outcome.error) std::rethrow_exception(outcome.error);
  };
  auto settled = [&outcome] {
    std::lock_guard<std::mutex> lock(outcome.mutex);
    return outcome.done;
  };
  if (settled()) return end();
  // Note [Waits and continuations]: the wait holds no Outcome lock, only the
  // waiters' own (a second waiter finds the outcome settled once it gets it).
  std::lock_guard<std::mutex> waiting(outcome.wait_mutex);
  if (settled()) return end();
  std::exception_ptr error;
  c10::IValue value;
  try {
    if (impl_->work) {
      impl_->work->wait(outcome.info.timeout);
    } else {
      // Note [Abort instead of hang]: the transport's own deadline normally ends it first.
      const auto grace = std::max<std::chrono::milliseconds>(std::chrono::seconds(1), outcome.info.timeout / 10);
      if (!detail::wait_until(impl_->future, std::chrono::steady_clock::now() + outcome.info.timeout + grace)) {
        throw std::runtime_error("did not complete within " + log::format_seconds(outcome.info.timeout + grace) +
                                 " (timed out)");
      }
      if (impl_->future->hasError()) {
        error = impl_->future->exception_ptr();
      } else {
        value = impl_->future->value();
      }
    }
  } catch (...) {
    error = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(outcome.mutex);
    if (!outcome.done) {
      if (!error && outcome.result.isNone() && !value.isNone()) outcome.result = std::move(value);
      outcome.settle(error);
    }
  }
  end();
}

Future Work::future() {
  if (!impl_) {
    auto ready = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
    ready->markCompleted(c10::IValue());
    return ready;
  }
  std::shared_ptr<detail::Outcome> outcome = impl_->outcome;
  Future source = impl_->work ? impl_->work->getFuture() : impl_->future;
  const c10::TypePtr type = outcome->result.isNone() ? c10::AnyType::get() : outcome->result.type();
  return source->then(
      [outcome](c10::ivalue::Future& parent) -> c10::IValue {
        std::lock_guard<std::mutex> lock(outcome->mutex);
        if (!outcome->done) {
          if (parent.hasError()) {
            outcome->settle(parent.exception_ptr());
          } else {
            if (outcome->result.isNone()) outcome->result = parent.value();
            outcome->settle(nullptr);
          }
        }
        if (outcome->error) std::rethrow_exception(outcome->error);
        return outcome->result;
      },
      type);
}

}  // namespace dtrain::dist
