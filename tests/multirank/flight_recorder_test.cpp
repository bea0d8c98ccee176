// The flight recorder's pieces: dist::traffic() against the sizes
// handed to each operation; the ring and its dump (capacity, sequence
// numbers, states, bytes) on real rank processes; the analysis of dumps
// (flight_analysis.h) on synthetic dump folders, through the library and
// through `dtrain trace analyze`.
#include <ATen/Functions.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "dtrain/comm/flight_analysis.h"
#include "dtrain/comm/flight_recorder.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/traffic.h"
#include "dtrain/error.h"
#include "ranks.h"
#include "test_paths.h"

using dtrain::dist::OpKind;
using dtrain::dist::ProcessGroup;
using namespace dtrain::testing;
namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("dtrain-fr-" + std::to_string(::getpid()) + "-" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// Every kind of operation once (two all_reduces, one coalesced over two
// dtypes), and the traffic they must have counted on a `world`-rank group.
void issue_and_check_traffic(ProcessGroup& g) {
  const int world = g.size(), rank = g.rank();
  at::Tensor a = at::ones({37});
  g.all_reduce(a).wait();
  at::Tensor b = at::ones({5}, at::kDouble);
  g.all_reduce(b, dtrain::dist::ReduceOp::kAvg).wait();
  std::vector<at::Tensor> coalesced{at::ones({3}), at::ones({4}), at::ones({2}, at::kLong)};
  g.all_reduce_coalesced(coalesced).wait();
  at::Tensor c = at::ones({11});
  g.broadcast(c, 0).wait();
  at::Tensor in = at::ones({9}), out = at::empty({9 * world});
  g.all_gather_into(out, in).wait();
  at::Tensor rs_in = at::ones({6 * world}), rs_out = at::empty({6});
  g.reduce_scatter(rs_out, rs_in).wait();
  g.barrier();
  at::Tensor msg = at::ones({13});
  if (rank == 0) g.send(msg, 1);
  if (rank == 1) g.recv(msg, 0);

  const dtrain::dist::Traffic t = dtrain::dist::traffic(g);
  // The coalesced call is one all_reduce per dtype: floats (7) and longs (2).
  EXPECT_EQ(t[OpKind::kAllReduce].ops, 4);
  EXPECT_EQ(t[OpKind::kAllReduce].bytes, 37 * 4 + 5 * 8 + 7 * 4 + 2 * 8);
  EXPECT_EQ(t[OpKind::kBroadcast].ops, 1);
  EXPECT_EQ(t[OpKind::kBroadcast].bytes, 11 * 4);
  EXPECT_EQ(t[OpKind::kAllGather].ops, 1);
  EXPECT_EQ(t[OpKind::kAllGather].bytes, 9 * 4);
  EXPECT_EQ(t[OpKind::kReduceScatter].ops, 1);
  EXPECT_EQ(t[OpKind::kReduceScatter].bytes, 6 * world * 4);
  EXPECT_EQ(t[OpKind::kBarrier].ops, 1);
  EXPECT_EQ(t[OpKind::kBarrier].bytes, 0);
  EXPECT_EQ(t[OpKind::kSend].ops, rank == 0 ? 1 : 0);
  EXPECT_EQ(t[OpKind::kSend].bytes, rank == 0 ? 13 * 4 : 0);
  EXPECT_EQ(t[OpKind::kRecv].ops, rank == 1 ? 1 : 0);
  EXPECT_EQ(t[OpKind::kRecv].bytes, rank == 1 ? 13 * 4 : 0);
}

// Entries as a vector: a braced list of one json would be that json, not an array.
void write_dump(const fs::path& dir, int rank, int world, std::int64_t dumped_at_us,
                const std::vector<nlohmann::json>& entries) {
  std::ofstream(dir / ("rank_" + std::to_string(rank) + ".json")) << nlohmann::json{
      {"version", 1},        {"rank", rank},
      {"world_size", world}, {"pid", 1},
      {"reason", "test"},    {"dumped_at_us", dumped_at_us},
      {"capacity", 64},      {"entries", nlohmann::json(entries)}}.dump();
}

nlohmann::json entry(const std::string& group, std::vector<int> members, int rank, std::uint64_t seq,
                     const std::string& op, const std::string& state, std::int64_t enqueued_us, int peer = -1) {
  int group_rank = 0;
  while (members[static_cast<std::size_t>(group_rank)] != rank) ++group_rank;
  return {{"group", group},
          {"group_ranks", members},
          {"group_rank", group_rank},
          {"backend", "gloo"},
          {"rank", rank},
          {"seq", seq},
          {"kind", peer >= 0 ? "p2p" : "collective"},
          {"op", op},
          {"peer", peer},
          {"sizes", "float[1024]"},
          {"dtype", "float"},
          {"bytes", 4096},
          {"state", state},
          {"enqueued_us", enqueued_us},
          {"started_us", enqueued_us},
          {"ended_us", state == "completed" ? enqueued_us + 10 : 0}};
}

constexpr std::int64_t kT0 = 1'700'000'000'000'000;  // microseconds

}  // namespace

TEST(Traffic, CountsEveryOperationOnSharedMemoryAndGloo) {
  run_rank_threads(3, [](int rank, dtrain::dist::Store store) {
    auto shm = dtrain::dist::init_process_group(store, rank, 3, {.timeout = std::chrono::seconds(60)});
    issue_and_check_traffic(shm);
    EXPECT_TRUE(shm.uses_shared_memory());
    auto gloo = dtrain::dist::init_process_group(
        store, rank, 3, {.timeout = std::chrono::seconds(60), .name = "gloo", .intra_host_shared_memory = false});
    issue_and_check_traffic(gloo);
  });
}

TEST(FlightRecorder, RingKeepsTheLastOperationsWithSequenceNumbersAndStates) {
  const fs::path dir = fresh_dir("ring");
  run_rank_processes(2,
                     [](int rank) {
                       auto world = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(30)});
                       ASSERT_TRUE(dtrain::dist::flight_recorder_enabled());
                       for (int i = 0; i < 7; ++i) {
                         at::Tensor t = at::ones({100 + i});
                         world.all_reduce(t).wait();
                       }
                       at::Tensor msg = at::ones({3}, at::kDouble);
                       for (int i = 0; i < 2; ++i) rank == 0 ? world.send(msg, 1) : world.recv(msg, 0);
                       ASSERT_FALSE(dtrain::dist::dump_flight_recorder("test").empty());
                     },
                     {.env_for_rank = [dir](int) {
                       return std::map<std::string, std::optional<std::string>>{
                           {"DTRAIN_FLIGHT_RECORDER", "6"}, {"DTRAIN_FLIGHT_RECORDER_DIR", dir.string()}};
                     }});
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream in(dir / ("rank_" + std::to_string(rank) + ".json"));
    const auto dump = nlohmann::json::parse(in);
    EXPECT_EQ(dump["rank"], rank);
    EXPECT_EQ(dump["reason"], "test");
    const auto& entries = dump["entries"];
    ASSERT_EQ(entries.size(), 6u);  // the capacity: the last 6 of 9 operations, oldest first
    for (int i = 0; i < 4; ++i) {
      const auto& e = entries[static_cast<std::size_t>(i)];
      EXPECT_EQ(e["op"], "all_reduce(sum)");
      EXPECT_EQ(e["kind"], "collective");
      EXPECT_EQ(e["group"], "world");
      EXPECT_EQ(e["seq"], 4 + i);
      EXPECT_EQ(e["bytes"], (100 + 3 + i) * 4);
      EXPECT_EQ(e["dtype"], "Float");
      EXPECT_EQ(e["state"], "completed");
      EXPECT_LE(e["enqueued_us"].get<std::int64_t>(), e["ended_us"].get<std::int64_t>());
    }
    for (int i = 4; i < 6; ++i) {
      const auto& e = entries[static_cast<std::size_t>(i)];
      EXPECT_EQ(e["op"], rank == 0 ? "send" : "recv");
      EXPECT_EQ(e["kind"], "p2p");
      EXPECT_EQ(e["peer"], 1 - rank);
      EXPECT_EQ(e["seq"], i - 3);  // per peer and direction
      EXPECT_EQ(e["state"], "completed");
      EXPECT_EQ(e["bytes"], 3 * 8);
    }
  }
  fs::remove_all(dir);
}

// The launcher's SIGUSR1 reaches every live worker; one that has not made
// its first group yet must survive it (the handler is installed when
// libdtrain loads) and dump once its ring exists.
TEST(FlightRecorder, SigusrOneBeforeTheFirstGroupDoesNotKillTheWorker) {
  const fs::path dir = fresh_dir("early-signal");
  const auto outcomes =
      run_rank_processes(1,
                         [](int) {
                           ASSERT_EQ(::raise(SIGUSR1), 0);  // no group yet: the default action would end the process
                           auto world = dtrain::dist::init_process_group(dtrain::dist::Store::in_memory(), 0, 1);
                           // (the child's own fresh_dir differs: the folder comes from the environment)
                           const fs::path dump = fs::path(std::getenv("DTRAIN_FLIGHT_RECORDER_DIR")) / "rank_0.json";
                           for (int i = 0; i < 200 && !fs::exists(dump); ++i)
                             std::this_thread::sleep_for(std::chrono::milliseconds(10));
                         },
                         {.env_for_rank = [dir](int) {
                           return std::map<std::string, std::optional<std::string>>{
                               {"DTRAIN_FLIGHT_RECORDER", "16"}, {"DTRAIN_FLIGHT_RECORDER_DIR", dir.string()}};
                         }});
  ASSERT_EQ(outcomes.size(), 1u);
  EXPECT_EQ(outcomes[0].signal, 0) << outcomes[0].output;
  EXPECT_TRUE(fs::exists(dir / "rank_0.json")) << "the signal that came before the ring was not answered";
  fs::remove_all(dir);
}

TEST(FlightAnalysis, NamesTheRankThatNeverEnteredAndItsLastOp) {
  // The issue's example: ranks 0-2 wait in all_reduce #418 of dp_replicate;
  // rank 3 is stuck in (or after) a receive from rank 2 on the pipeline group.
  const fs::path dir = fresh_dir("never-entered");
  const std::vector<int> dp{0, 1, 2, 3}, pp{2, 3};
  for (int r = 0; r < 3; ++r) {
    write_dump(dir, r, 4, kT0 + 30'000'000,
               {entry("dp_replicate", dp, r, 417, "all_reduce(sum)", "completed", kT0 - 1000),
                entry("dp_replicate", dp, r, 418, "all_reduce(sum)", "failed", kT0)});
  }
  write_dump(dir, 3, 4, kT0 + 31'000'000,
             {entry("dp_replicate", dp, 3, 417, "all_reduce(sum)", "completed", kT0 - 1000),
              entry("pp", pp, 3, 77, "recv", "completed", kT0 - 500, /*peer=*/2)});
  const auto report = dtrain::dist::analyze_flight_dumps(dir.string());
  ASSERT_EQ(report.findings.size(), 1u) << report.text();
  EXPECT_EQ(report.findings[0],
            "rank 3 never entered all_reduce(sum) #418 of group dp_replicate; ranks 0-2 waited 30.0 s; rank 3's last "
            "op: recv #77 from rank 2 of group pp (completed)");
  EXPECT_TRUE(report.ranks_missing.empty());
  fs::remove_all(dir);
}

TEST(FlightAnalysis, NamesTheRankThatIssuedAnotherCollective) {
  const fs::path dir = fresh_dir("mismatch");
  const std::vector<int> world{0, 1, 2};
  for (int r = 0; r < 3; ++r) {
    write_dump(dir, r, 3, kT0 + 5'000'000,
               {entry("world", world, r, 1, "all_reduce(sum)", "completed", kT0 - 100),
                entry("world", world, r, 2, r == 1 ? "all_gather" : "all_reduce(sum)", "failed", kT0)});
  }
  const auto report = dtrain::dist::analyze_flight_dumps(dir.string());
  ASSERT_FALSE(report.findings.empty());
  EXPECT_EQ(report.findings[0],
            "rank 1 issued all_gather (float[1024]) as #2 of group world where ranks 0, 2 issued all_reduce(sum) "
            "(float[1024]): the ranks issue different collectives");
  fs::remove_all(dir);
}

TEST(FlightAnalysis, NamesARankWithNoDumpAndASenderThatNeverSent) {
  const fs::path dir = fresh_dir("absent");
  const std::vector<int> world{0, 1, 2, 3}, pair{0, 1};
  // Rank 3 left no dump; ranks 0-2 wait in all_reduce #5. Rank 1 waits in
  // recv #2 from rank 0 on another group, whose send #2 rank 0 never issued.
  write_dump(dir, 0, 4, kT0 + 2'000'000,
             {entry("pair", pair, 0, 1, "send", "completed", kT0 - 300, 1),
              entry("world", world, 0, 5, "all_reduce(sum)", "started", kT0)});
  write_dump(dir, 1, 4, kT0 + 2'000'000,
             {entry("pair", pair, 1, 1, "recv", "completed", kT0 - 300, 0),
              entry("pair", pair, 1, 2, "recv", "started", kT0 - 200, 0),
              entry("world", world, 1, 5, "all_reduce(sum)", "started", kT0)});
  write_dump(dir, 2, 4, kT0 + 2'000'000, {entry("world", world, 2, 5, "all_reduce(sum)", "started", kT0)});
  const auto report = dtrain::dist::analyze_flight_dumps(dir.string());
  const std::string text = report.text();
  EXPECT_NE(text.find("rank 3 never completed all_reduce(sum) #5 of group world; ranks 0-2 waited 2.0 s; no dump from "
                      "rank 3"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("rank 0 never entered send #2 to rank 1 of group pair; rank 1 waited 2.0 s in recv #2 from rank "
                      "0 of group pair"),
            std::string::npos)
      << text;
  EXPECT_EQ(report.ranks_missing, std::vector<int>{3});
  fs::remove_all(dir);
}

TEST(FlightAnalysis, TraceAnalyzeCommandPrintsTheSameReport) {
  const fs::path dir = fresh_dir("cli");
  const std::vector<int> world{0, 1};
  write_dump(dir, 0, 2, kT0 + 1'500'000, {entry("world", world, 0, 1, "broadcast(root 0)", "failed", kT0)});
  write_dump(dir, 1, 2, kT0 + 1'500'000, {});
  const auto report = dtrain::dist::analyze_flight_dumps(dir.string());
  ASSERT_EQ(report.findings.size(), 1u) << report.text();
  EXPECT_NE(report.findings[0].find("rank 1 never entered broadcast(root 0) #1 of group world; rank 0 waited 1.5 s"),
            std::string::npos);
  const std::string command = dtrain::testing::binary_dir() + "/tools/dtrain trace analyze " + dir.string();
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buffer[4096];
  while (const std::size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) out.append(buffer, n);
  EXPECT_EQ(::pclose(pipe), 0);
  EXPECT_EQ(out, report.text());
  EXPECT_THROW(dtrain::dist::analyze_flight_dumps((dir / "none").string()), dtrain::ConfigError);
  fs::remove_all(dir);
}

// Malformed dumps: a clear error naming the file and exit code 2, never an
// uncaught exception (or an allocation the size of a forged world).
TEST(FlightAnalysis, TraceAnalyzeRejectsMalformedDumpsClearly) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"truncated", R"({"version": 1, "rank": 0, "entr)"},
      {"wrong-types", R"({"version": 1, "rank": "zero", "dumped_at_us": 1, "entries": []})"},
      {"entries-not-a-list", R"({"version": 1, "rank": 0, "dumped_at_us": 1, "entries": {"a": 1}})"},
      {"forged-world", R"({"version": 1, "rank": 0, "world_size": 2147483647, "dumped_at_us": 1, "entries": []})"},
      {"negative-rank", R"({"version": 1, "rank": -3, "dumped_at_us": 1, "entries": []})"},
  };
  for (const auto& [name, text] : cases) {
    const fs::path dir = fresh_dir("malformed-" + name);
    std::ofstream(dir / "rank_0.json") << text;
    EXPECT_THROW(dtrain::dist::analyze_flight_dumps(dir.string()), dtrain::DataError) << name;
    const std::string command = dtrain::testing::binary_dir() + "/tools/dtrain trace analyze " + dir.string() + " 2>&1";
    FILE* pipe = ::popen(command.c_str(), "r");
    ASSERT_NE(pipe, nullptr);
    std::string out;
    char buffer[4096];
    while (const std::size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) out.append(buffer, n);
    const int status = ::pclose(pipe);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << name << ": " << out;
    EXPECT_NE(out.find("dtrain trace: error: "), std::string::npos) << name << ": " << out;
    EXPECT_NE(out.find("rank_0.json"), std::string::npos) << name << ": " << out;
    fs::remove_all(dir);
  }
}
