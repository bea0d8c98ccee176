// A rank that writes to a dead peer's connection gets its CommunicationError
// and goes on; it is not killed by SIGPIPE (Note [Broken pipes],
// src/core/broken_pipes.cpp). Gloo writes with writev(), which has no
// MSG_NOSIGNAL; SIGPIPE's default action ends the process.
#include <ATen/Functions.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/process_group.h"
#include "dtrain/error.h"
#include "ranks.h"

namespace {

// Writes to a connection whose other end is closed: -1 with EPIPE when SIGPIPE
// is ignored; the process dies by signal 13 when its action is the default.
int write_to_a_broken_connection() {
  int fds[2] = {-1, -1};
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) return -1;
  ::close(fds[1]);
  const char byte = 'x';
  const ssize_t written = ::write(fds[0], &byte, 1);
  const int error = errno;
  ::close(fds[0]);
  return written < 0 ? error : 0;
}

// Gloo's writes and a TCPStore server's are not the only ones a rank makes,
// but they are the ones dtrain cannot flag: the rank as a whole must survive
// them. Deterministic, unlike the race below.
TEST(BrokenPipe, ARankThatMadeAGroupSurvivesWritesToBrokenConnections) {
  const auto outcomes = dtrain::testing::run_rank_processes(2, [](int) {
    auto group = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(20)});
    const int error = write_to_a_broken_connection();
    std::cout << "write failed with " << std::strerror(error) << std::endl;
    group.barrier();
  });
  for (const auto& o : outcomes) {
    EXPECT_EQ(o.signal, 0) << o.output;
    EXPECT_NE(o.output.find("write failed with " + std::string(std::strerror(EPIPE))), std::string::npos) << o.output;
  }
}

int g_pipes_seen = 0;
void count_pipes(int) {
  ++g_pipes_seen;
}

// Only the default action is replaced: a program's own handler stays its choice.
TEST(BrokenPipe, AProgramsOwnHandlerIsKept) {
  const auto outcomes = dtrain::testing::run_rank_processes(2, [](int) {
    std::signal(SIGPIPE, count_pipes);
    auto group = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(20)});
    write_to_a_broken_connection();
    std::cout << "handler saw " << g_pipes_seen << std::endl;
    group.barrier();
  });
  for (const auto& o : outcomes) {
    EXPECT_NE(o.output.find("handler saw 1"), std::string::npos) << o.output;
  }
}

// The race that killed a survivor in the suite: rank 1 dies while rank 0
// streams sends to it, so that its reset arrives while rank 0 is writing.
// When rank 0's own write reads the reset (ECONNRESET, which Gloo's
// asynchronous pairs pass over) and queues the rest, the pair's device thread
// writes again before it reads, and that write raises SIGPIPE. Unfixed, that
// happened in about one round in five here (8 runs of this test: the
// survivor died by signal 13 in each, at rounds 0 to 13), so the test runs
// up to kRounds rounds and stops at the first failure. Sends between ranks on
// one host with intra_host_shared_memory use no socket (shm_p2p.cpp), nor do
// that transport's collectives; the Gloo operations of such a group write as
// here, and the test above covers them.
constexpr int kRounds = 25;
constexpr auto kLifetime = std::chrono::milliseconds(100);
constexpr int kMostSends = 1 << 20;

TEST(BrokenPipe, SurvivorOfAPeerDeathMidStreamGetsCommunicationError) {
  for (int round = 0; round < kRounds && !::testing::Test::HasFailure(); ++round) {
    const auto outcomes = dtrain::testing::run_rank_processes(
        2,
        [&](int rank) {
          auto group = dtrain::dist::init_process_group(
              {.timeout = std::chrono::seconds(20), .intra_host_shared_memory = false});
          group.barrier();
          if (rank == 1) {
            // Receives nothing: rank 0's sends stay announced, each one a write on the connection.
            std::this_thread::sleep_for(kLifetime);
            std::raise(SIGKILL);
          }
          const at::Tensor one = at::ones({1});
          std::vector<dtrain::dist::Work> works;
          try {
            for (int i = 0; i < kMostSends; ++i) works.push_back(group.isend(one, 1, i));
            for (auto& w : works) w.wait();
            ADD_FAILURE() << "the sends completed without their peer";
          } catch (const dtrain::CommunicationError& e) {
            std::cerr << "survivor: " << e.what() << std::endl;
          }
        },
        {.timeout = std::chrono::seconds(60), .expect_success = false});
    const auto& survivor = outcomes[0];
    EXPECT_EQ(outcomes[1].signal, SIGKILL) << outcomes[1].output;
    EXPECT_FALSE(survivor.timed_out) << survivor.output;
    EXPECT_EQ(survivor.signal, 0) << "round " << round << ": the survivor died by signal " << survivor.signal << "\n"
                                  << survivor.output;
    EXPECT_EQ(survivor.exit_code, 0) << survivor.output;
    EXPECT_NE(survivor.output.find("survivor: [rank 0/2] send"), std::string::npos) << survivor.output;
  }
}

}  // namespace
