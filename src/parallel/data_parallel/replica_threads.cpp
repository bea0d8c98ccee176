#include "replica_threads.h"

#include <ATen/ThreadLocalState.h>

#include "dtrain/error.h"
#include "dtrain/log.h"

namespace dtrain::detail {

ReplicaThreads::ReplicaThreads(std::size_t workers) {
  threads_.reserve(workers);
  for (std::size_t i = 0; i < workers; ++i) {
    // Replica threads speak for the rank that made them.
    threads_.emplace_back([this, i, identity = log::identity()] {
      log::ScopedIdentity scoped(identity);
      worker_loop(i);
    });
  }
}

ReplicaThreads::~ReplicaThreads() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ReplicaThreads::run(std::size_t count, const std::function<void(std::size_t)>& task) {
  DTRAIN_INTERNAL_ASSERT(count >= 1 && count <= threads_.size() + 1,
                         "ReplicaThreads::run(" << count << ") with " << threads_.size() << " workers");
  bool expected = false;
  if (!busy_.compare_exchange_strong(expected, true)) {
    std::exception_ptr first;
    for (std::size_t i = 0; i < count; ++i) {
      try {
        task(i);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
    return;
  }
  // Captured here, installed in each worker for the duration of its task.
  at::ThreadLocalState caller_state;
  const std::function<void(std::size_t)> wrapped = [&](std::size_t i) {
    at::ThreadLocalStateGuard guard(caller_state);
    task(i);
  };
  {
    std::lock_guard<std::mutex> lock(mutex_);
    errors_.assign(count, nullptr);
    count_ = count;
    task_ = &wrapped;
    active_ = count - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  try {
    task(0);
  } catch (...) {
    errors_[0] = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return active_ == 0; });
  task_ = nullptr;
  busy_ = false;
  for (auto& e : errors_) {
    if (e) std::rethrow_exception(e);
  }
}

void ReplicaThreads::worker_loop(std::size_t index) {
  std::size_t seen = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    start_cv_.wait(lock, [&] { return stopping_ || generation_ != seen; });
    if (stopping_) return;
    seen = generation_;
    const std::size_t task_index = index + 1;
    if (task_index >= count_) continue;  // not needed this round
    const auto* task = task_;
    lock.unlock();
    std::exception_ptr error;
    try {
      (*task)(task_index);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    errors_[task_index] = error;
    if (--active_ == 0) done_cv_.notify_one();
  }
}

}  // namespace dtrain::detail
