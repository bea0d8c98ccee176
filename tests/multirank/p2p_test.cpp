// Point-to-point through shared memory (src/comm/shm_p2p.cpp) against Gloo's
// and against the data sent: rings filled past their size (the writer
// thread streams), receives out of tag order, repeated tags in send order,
// a wrong size, a sender that exits before the receiver reads, and a peer
// that dies before sending.
#include <ATen/Functions.h>
#include <gtest/gtest.h>

#include <unistd.h>
#include <atomic>
#include <csignal>
#include <filesystem>
#include <iostream>
#include <thread>

#include "dtrain/comm/process_group.h"
#include "dtrain/error.h"
#include "ranks.h"

using dtrain::dist::ProcessGroup;
using namespace dtrain::testing;

namespace {

at::Tensor payload(std::int64_t n, int seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn({n}, gen);
}

// Rank 0 sends, rank 1 receives, over a group with (shm) or without (Gloo)
// shared memory; the receiver posts everything first, then waits in an
// order different from the send order. Returns what rank 1 got.
void exchange(bool shared_memory) {
  // 3 x 3 MiB and small ones: more than the 4 MiB ring holds unread.
  const std::vector<std::pair<int, std::int64_t>> sends{{7, 786432}, {1, 10}, {7, 786432}, {2, 0},
                                                        {3, 786432}, {1, 3},  {9, 5}};
  run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(
        store, rank, 2, {.timeout = std::chrono::seconds(60), .intra_host_shared_memory = shared_memory});
    if (rank == 0) {
      std::vector<dtrain::dist::Work> works;
      for (std::size_t i = 0; i < sends.size(); ++i) {
        works.push_back(group.isend(payload(sends[i].second, static_cast<int>(i)), 1, sends[i].first));
      }
      for (auto& w : works) w.wait();
      return;
    }
    std::vector<at::Tensor> got;
    std::vector<dtrain::dist::Work> works;
    for (const auto& [tag, n] : sends) {
      got.push_back(at::empty({n}));
      works.push_back(group.irecv(got.back(), 0, tag));
    }
    for (std::size_t i : {4, 6, 1, 0, 5, 3, 2}) works[i].wait();  // tags 3, 9, 1, 7, 1, 2, 7
    for (std::size_t i = 0; i < sends.size(); ++i) {
      EXPECT_TRUE(at::equal(got[i], payload(sends[i].second, static_cast<int>(i)))) << "message " << i;
    }
  });
}

TEST(PointToPoint, SharedMemoryDeliversLikeGlooPastTheRingAndOutOfTagOrder) {
  exchange(true);
  exchange(false);
}

TEST(PointToPoint, BothWaysAtOnceWithRingsFull) {
  // Each rank sends 6 MiB before it receives anything: both rings fill, the
  // writer threads finish the sends as the peers read.
  run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(60)});
    const int peer = 1 - rank;
    std::vector<dtrain::dist::Work> sent;
    for (int i = 0; i < 3; ++i) sent.push_back(group.isend(payload(524288, 10 * rank + i), peer, i));
    for (int i = 0; i < 3; ++i) {
      at::Tensor in = at::empty({524288});
      group.recv(in, peer, i);
      EXPECT_TRUE(at::equal(in, payload(524288, 10 * peer + i)));
    }
    for (auto& w : sent) w.wait();
  });
}

TEST(PointToPoint, WrongSizeIsAClearErrorAndTheChannelStaysUsable) {
  run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(60)});
    if (rank == 0) {
      group.send(at::ones({6}), 1, 4);
      group.send(at::full({2}, 5.0), 1, 4);
      return;
    }
    at::Tensor wrong = at::empty({3});
    try {
      group.recv(wrong, 0, 4);
      ADD_FAILURE() << "a 3-float receive took a 6-float message";
    } catch (const dtrain::CommunicationError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("recv(tag 4) on gloo group 'world' (rank 1 of 2) with peer rank 0"), std::string::npos)
          << what;
      EXPECT_NE(what.find("sent 24 bytes with tag 4, but this receive takes 12 bytes"), std::string::npos) << what;
    }
    at::Tensor next = at::empty({2});
    group.recv(next, 0, 4);
    EXPECT_TRUE(at::equal(next, at::full({2}, 5.0)));
  });
}

TEST(PointToPoint, AfterATimedOutReceiveLaterOnesFailAtOnceNotWithAnotherMessage) {
  // The timed-out receive took its place in the order of its tag; handing
  // the next message to the receive after it would skip one silently.
  std::atomic<bool> timed_out{false};
  run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(1)});
    if (rank == 0) {
      group.send(at::ones({4}), 1, 1);  // makes the ring
      while (!timed_out) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      group.send(at::full({4}, 2.0), 1, 1);
      return;
    }
    at::Tensor in = at::empty({4});
    group.recv(in, 0, 1);
    EXPECT_THROW(group.recv(in, 0, 1), dtrain::CommunicationError);  // nothing comes within the timeout
    timed_out = true;
    const auto start = std::chrono::steady_clock::now();
    try {
      group.recv(in, 0, 1);
      ADD_FAILURE() << "a receive after a timed-out one completed with " << in;
    } catch (const dtrain::CommunicationError& e) {
      EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(500));
  });
}

TEST(PointToPoint, ReceiverGetsWhatAnExitedSenderSentAndNoFileIsLeft) {
  const auto outcomes = run_rank_processes(2, [&](int rank) {
    if (rank == 0) {
      std::cout << "sender pid " << ::getpid() << std::endl;
      auto group = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(30)});
      group.send(at::arange(1000, at::kFloat), 1, 2);
      return;  // the process, its group and the store it hosts are gone before rank 1 reads
    }
    auto group = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(30)});
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    at::Tensor in = at::empty({1000});
    group.recv(in, 0, 2);
    if (!at::equal(in, at::arange(1000, at::kFloat))) throw std::runtime_error("wrong data");
  });
  for (const auto& o : outcomes) EXPECT_EQ(o.exit_code, 0) << o.output;
  // The sender's files are named after its pid.
  const auto at = outcomes[0].output.find("sender pid ");
  ASSERT_NE(at, std::string::npos) << outcomes[0].output;
  const std::string prefix = "dtrain-" + std::to_string(std::stol(outcomes[0].output.substr(at + 11))) + "-";
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    EXPECT_NE(entry.path().filename().string().rfind(prefix, 0), 0u) << entry.path() << " was left behind";
  }
}

TEST(PointToPoint, PeerDeadBeforeItsFirstSendFailsNamingIt) {
  const auto outcomes =
      run_rank_processes(2,
                         [&](int rank) {
                           auto group = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(30)});
                           group.barrier();
                           if (rank == 1) std::raise(SIGKILL);
                           try {
                             at::Tensor in = at::empty({10});
                             group.recv(in, 1, 0);
                             ADD_FAILURE() << "recv completed without its peer";
                           } catch (const dtrain::CommunicationError& e) {
                             std::cerr << "survivor: " << e.what() << std::endl;
                           }
                         },
                         {.timeout = std::chrono::seconds(60), .expect_success = false});
  const std::string& out = outcomes[0].output;
  EXPECT_FALSE(outcomes[0].timed_out) << out;
  EXPECT_NE(out.find("survivor: [rank 0/2] recv on gloo group 'world' (rank 0 of 2) with peer rank 1"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("peer rank 1 (pid"), std::string::npos) << out;
  EXPECT_NE(out.find("exited"), std::string::npos) << out;
}

}  // namespace
