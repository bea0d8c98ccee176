// Private: one thread that runs DDP bucket jobs in arrival order and
// completes their futures (see Note [PowerSGD worker] in comm_hooks.cpp).
// The Reducer hands buckets over in the same order on every rank, so jobs that
// run collectives match across ranks, while the autograd thread carries on
// with backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace dtrain::detail {

class BucketWorker {
 public:
  using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

  BucketWorker() : thread_([this] { run(); }) {}
  // Finishes the queued jobs, then joins.
  ~BucketWorker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  BucketWorker(const BucketWorker&) = delete;
  BucketWorker& operator=(const BucketWorker&) = delete;

  // Queues `work`; the returned future completes with `buffer` once it has
  // run, or with its exception.
  FuturePtr post(at::Tensor buffer, std::function<void()> work) {
    auto done = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back({std::move(buffer), std::move(work), done});
    }
    cv_.notify_all();
    return done;
  }

 private:
  struct Job {
    at::Tensor buffer;
    std::function<void()> work;
    FuturePtr done;
  };

  void run() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      try {
        job.work();
        job.done->markCompleted(c10::IValue(job.buffer));
      } catch (...) {
        job.done->setError(std::current_exception());
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace dtrain::detail
