// Error formatting (rank tag, hint) and rank-tagged log lines.
#include <gtest/gtest.h>

#include <thread>

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

TEST(Log, DebugIsOffByDefault) {
  EXPECT_FALSE(dtrain::log::enabled(dtrain::log::Level::kDebug));
  EXPECT_TRUE(dtrain::log::enabled(dtrain::log::Level::kError));
}
