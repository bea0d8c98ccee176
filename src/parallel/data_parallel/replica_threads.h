// A fixed set of threads that run one task per replica, for DataParallel.
//
// Threads are created once (not per forward, which costs tens of
// microseconds per thread), and every task runs under the caller's
// thread-local state (grad mode, autocast, inference mode, dispatch keys), so
// a forward under torch::NoGradGuard records no graph on any replica.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dtrain::detail {

class ReplicaThreads {
 public:
  // `workers` threads; run() uses them for tasks 1..count-1.
  explicit ReplicaThreads(std::size_t workers);
  ~ReplicaThreads();
  ReplicaThreads(const ReplicaThreads&) = delete;
  ReplicaThreads& operator=(const ReplicaThreads&) = delete;

  // Runs task(i) for i in [0, count): task 0 on the calling thread, task i on
  // worker i-1, concurrently. Returns when all have finished; if any threw,
  // rethrows the exception of the lowest index. count <= workers + 1.
  // While another run() is in progress (a reentrant call, e.g. from inside a
  // task), the tasks run one after another on the calling thread instead.
  void run(std::size_t count, const std::function<void(std::size_t)>& task);

 private:
  void worker_loop(std::size_t index);

  std::atomic<bool> busy_{false};  // set for the duration of a parallel run()
  std::mutex mutex_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  std::size_t generation_ = 0;  // bumped per run(); workers wait for a new one
  std::size_t active_ = 0;      // workers still running the current generation
  std::size_t count_ = 0;
  const std::function<void(std::size_t)>* task_ = nullptr;
  std::vector<std::exception_ptr> errors_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace dtrain::detail
