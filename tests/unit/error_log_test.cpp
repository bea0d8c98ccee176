// Error formatting (rank tag, hint) and rank-tagged log lines.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <stdexcept>
#include <thread>

#include "dtrain/comm/env.h"
#include "dtrain/elastic/error_file.h"
#include "dtrain/error.h"
#include "dtrain/log.h"

namespace {
// Restores the calling thread's rank identity when a test ends.
struct RankScope {
  RankScope(int rank, int world) { dtrain::log::set_rank(rank, world); }
  ~RankScope() { dtrain::log::set_rank(-1, 0); }
};
}  // namespace

TEST(Error, CarriesMessageHintAndRankTag) {
  RankScope scope(1, 4);
  try {
    DTRAIN_CHECK(1 + 1 == 3, ConfigError, "value " << 7 << " is bad.", "use " << 8);
    FAIL() << "no throw";
  } catch (const dtrain::Error& e) {
    EXPECT_STREQ(e.what(), "[rank 1/4] value 7 is bad. Hint: use 8");
    EXPECT_EQ(e.message(), "value 7 is bad.");
    EXPECT_EQ(e.hint(), "use 8");
  }
}

TEST(Error, NoRankTagBeforeInit) {
  dtrain::DataError e("broken file.");
  EXPECT_STREQ(e.what(), "broken file.");
}

TEST(Error, CheckPassesWhenConditionHolds) {
  const auto check = [](int n) { DTRAIN_CHECK(n > 0, ConfigError, "n=" << n, "positive"); };
  EXPECT_NO_THROW(check(1));
  EXPECT_THROW(check(0), dtrain::ConfigError);
}

TEST(Error, InternalAssertNamesConditionAndLocation) {
  try {
    DTRAIN_INTERNAL_ASSERT(2 < 1, "sizes " << 2);
    FAIL() << "no throw";
  } catch (const dtrain::InternalError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("2 < 1 failed: sizes 2"), std::string::npos) << what;
    EXPECT_NE(what.find("error_log_test.cpp"), std::string::npos) << what;
    EXPECT_NE(what.find("dtrain bug"), std::string::npos) << what;
  }
}

TEST(Log, LinesCarryRankTagPerThread) {
  testing::internal::CaptureStderr();
  std::thread a([] {
    RankScope s(0, 2);
    DTRAIN_LOG(kInfo) << "hello from a";
  });
  a.join();
  std::thread b([] {
    RankScope s(1, 2);
    DTRAIN_LOG(kWarning) << "hello from b";
  });
  b.join();
  DTRAIN_LOG(kInfo) << "no rank";
  const std::string out = testing::internal::GetCapturedStderr();
  EXPECT_NE(out.find("dtrain I [rank 0/2] hello from a\n"), std::string::npos) << out;
  EXPECT_NE(out.find("dtrain W [rank 1/2] hello from b\n"), std::string::npos) << out;
  EXPECT_NE(out.find("dtrain I no rank\n"), std::string::npos) << out;
}

// A launched worker's rank tags its errors before any process group exists
// (an example's flag check) and its helper threads, once it has read its
// contract; a thread's own identity still wins; the contract's line is
// logged once however often the program reads it.
TEST(Log, ThreadsWithoutTheirOwnRankTakeTheProcesssFromItsContract) {
  for (const auto& [name, value] : {std::pair{"RANK", "3"}, std::pair{"WORLD_SIZE", "4"},
                                    std::pair{"MASTER_ADDR", "127.0.0.1"}, std::pair{"MASTER_PORT", "29500"}}) {
    ::setenv(name, value, 1);
  }
  EXPECT_EQ(dtrain::log::rank_tag(), "");
  testing::internal::CaptureStderr();
  EXPECT_EQ(dtrain::dist::read_env_contract().rank, 3);
  EXPECT_EQ(dtrain::dist::read_env_contract().world_size, 4);
  const std::string out = testing::internal::GetCapturedStderr();
  EXPECT_EQ(out.find("environment:"), out.rfind("environment:")) << out;
  EXPECT_NE(out.find("dtrain I [rank 3/4] environment:"), std::string::npos) << out;
  EXPECT_EQ(dtrain::log::rank_tag(), "[rank 3/4]");
  std::string in_thread, own;
  std::thread plain([&] {
    try {
      DTRAIN_CHECK(false, ConfigError, "bad flag.", "fix it");
    } catch (const dtrain::Error& e) {
      in_thread = e.what();
    }
  });
  plain.join();
  std::thread scoped([&] {
    RankScope s(1, 2);
    own = dtrain::log::rank_tag();
  });
  scoped.join();
  EXPECT_EQ(in_thread, "[rank 3/4] bad flag. Hint: fix it");
  EXPECT_EQ(own, "[rank 1/2]");
  dtrain::log::set_process_rank(-1, 0);
  EXPECT_EQ(dtrain::log::rank_tag(), "");
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(name);
}

TEST(Log, DebugIsOffByDefault) {
  EXPECT_FALSE(dtrain::log::enabled(dtrain::log::Level::kDebug));
  EXPECT_TRUE(dtrain::log::enabled(dtrain::log::Level::kError));
}

// An exception that escapes where it cannot be caught (a destructor, a
// thread) ends in std::terminate: the error file names it, and the SIGABRT
// that follows does not overwrite it with "fatal signal SIGABRT" (the chaos
// soak's full disk showed only that, hiding LibTorch's "file write failed").
TEST(ErrorFile, TerminateKeepsTheUncaughtExceptionsMessage) {
  const auto path = std::filesystem::temp_directory_path() / ("dtrain-error-file-" + std::to_string(::getpid()));
  std::filesystem::remove(path);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::setenv("TORCHELASTIC_ERROR_FILE", path.c_str(), 1);
    dtrain::elastic::install_error_handlers();
    try {
      throw std::runtime_error("boom from a destructor");
    } catch (...) {
      std::terminate();  // as a throwing destructor ends: with the exception current
    }
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT) << "status " << status;
  const std::string message = dtrain::elastic::read_error_message(path.string());
  EXPECT_EQ(message, "uncaught exception: boom from a destructor");
  std::filesystem::remove(path);
}
