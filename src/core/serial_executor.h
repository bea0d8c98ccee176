// Private: one thread that runs jobs in the order they were posted and
// completes a future per job. Used where a sequence of blocking operations
// must match across ranks while the posting thread carries on: the
// shared-memory collectives of a group (src/comm/collectives.cpp) and
// PowerSGD's dependent all-reduces per bucket (Note [PowerSGD worker]).
// The thread takes the rank identity of the thread that made the executor,
// so its logs and errors say which rank.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "dtrain/log.h"

namespace dtrain {

class SerialExecutor {
 public:
  using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

  SerialExecutor()
      : core_(std::make_shared<Core>()), thread_([core = core_, identity = log::identity()] {
          log::ScopedIdentity scoped(identity);
          run(*core);
        }) {}
  // Finishes the queued jobs, then joins. When the last owner lets go inside
  // one of this executor's own jobs (a completion callback held the last
  // reference), joining would deadlock: the thread is detached instead, and
  // the jobs still queued fail, since what they use is being destroyed.
  ~SerialExecutor() {
    const bool self = thread_.get_id() == std::this_thread::get_id();
    {
      std::lock_guard<std::mutex> lock(core_->mutex);
      core_->stopping = true;
      core_->abandoned = self;
    }
    core_->cv.notify_all();
    if (self) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  // Queues `work`; the returned future completes with `result` once it has
  // run, or with its exception.
  FuturePtr post(c10::IValue result, std::function<void()> work) {
    auto done = c10::make_intrusive<c10::ivalue::Future>(result.type());
    {
      std::lock_guard<std::mutex> lock(core_->mutex);
      core_->jobs.push_back({std::move(result), std::move(work), done});
    }
    core_->cv.notify_all();
    return done;
  }

 private:
  struct Job {
    c10::IValue result;
    std::function<void()> work;
    FuturePtr done;
  };
  // Shared with the thread, which may outlive the executor (see the destructor).
  struct Core {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<Job> jobs;
    bool stopping = false;
    bool abandoned = false;
  };

  static void run(Core& core) {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(core.mutex);
        core.cv.wait(lock, [&] { return core.stopping || !core.jobs.empty(); });
        if (core.abandoned) {
          for (auto& left : core.jobs) {
            left.done->setError(std::make_exception_ptr(std::runtime_error("its executor was destroyed")));
          }
          core.jobs.clear();
        }
        if (core.jobs.empty()) return;
        job = std::move(core.jobs.front());
        core.jobs.pop_front();
      }
      try {
        job.work();
        job.done->markCompleted(std::move(job.result));
      } catch (...) {
        job.done->setError(std::current_exception());
      }
    }
  }

  std::shared_ptr<Core> core_;
  std::thread thread_;  // last: starts once core_ exists
};

}  // namespace dtrain
