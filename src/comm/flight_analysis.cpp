// The analysis of flight-recorder dumps (flight_analysis.h). Sequence
// numbers are per group (collectives) and per group, peer and direction
// (point-to-point), so the same number names the same operation on every
// rank of a group that issued the same operations (Note [Flight recorder],
// flight_recorder.cpp). A ring keeps only the last N entries: a rank whose
// ring holds nothing of a group is taken to have issued nothing on it.
#include "dtrain/comm/flight_analysis.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "dtrain/error.h"

namespace dtrain::dist {
namespace {

struct Entry {
  std::string group;
  std::vector<int> group_ranks;
  int rank = -1;
  std::uint64_t seq = 0;
  bool p2p = false;
  std::string op, sizes, state;
  int peer = -1;
  std::int64_t enqueued_us = 0, ended_us = 0;
  bool done() const { return state == "completed"; }
  std::string group_key() const {
    std::string key = group + "[";
    for (int r : group_ranks) key += std::to_string(r) + ",";
    return key + "]";
  }
};

struct Dump {
  int rank = -1;
  int world_size = 0;
  std::int64_t dumped_at_us = 0;
  std::vector<Entry> entries;
};

constexpr const char* kDumpHint =
    "pass the folder the ranks dumped to (DTRAIN_FLIGHT_RECORDER_DIR), with its rank_<R>.json files";

Dump read_dump(const std::filesystem::path& path) {
  std::ifstream in(path);
  try {
    const auto j = nlohmann::json::parse(in);
    Dump d;
    d.rank = j.at("rank").get<int>();
    d.world_size = j.value("world_size", 0);
    // Bounds before use: the analysis makes a slot per rank of the world.
    constexpr int kMaxRanks = 1 << 24;
    const auto in_range = [](int r) { return r >= 0 && r < kMaxRanks; };
    if (!in_range(d.rank) || d.world_size < 0 || d.world_size > kMaxRanks) {
      throw DataError(path.string() + " names rank " + std::to_string(d.rank) + " of world size " +
                          std::to_string(d.world_size) + ": not a dump a rank wrote.",
                      "remove the file from the folder, or pass the folder the ranks dumped to");
    }
    d.dumped_at_us = j.at("dumped_at_us").get<std::int64_t>();
    if (!j.at("entries").is_array()) throw DataError(path.string() + ": 'entries' is not a list.", kDumpHint);
    for (const auto& e : j.at("entries")) {
      d.entries.push_back({.group = e.at("group").get<std::string>(),
                           .group_ranks = e.at("group_ranks").get<std::vector<int>>(),
                           .rank = e.at("rank").get<int>(),
                           .seq = e.at("seq").get<std::uint64_t>(),
                           .p2p = e.at("kind").get<std::string>() == "p2p",
                           .op = e.at("op").get<std::string>(),
                           .sizes = e.value("sizes", ""),
                           .state = e.at("state").get<std::string>(),
                           .peer = e.value("peer", -1),
                           .enqueued_us = e.at("enqueued_us").get<std::int64_t>(),
                           .ended_us = e.value("ended_us", std::int64_t{0})});
    }
    return d;
  } catch (const nlohmann::json::exception& e) {
    throw DataError(path.string() + " is not a flight-recorder dump: " + e.what(), kDumpHint);
  }
}

// "all_reduce(sum) #418 of group dp_replicate", "recv #77 from rank 2 of group pp".
std::string describe(const Entry& e) {
  std::string s = e.op + " #" + std::to_string(e.seq);
  if (e.p2p) s += (e.op.rfind("send", 0) == 0 ? " to rank " : " from rank ") + std::to_string(e.peer);
  return s + " of group " + e.group;
}

std::string seconds(std::int64_t us) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", static_cast<double>(us) / 1e6);
  return text;
}

std::string last_op(const Dump& d) {
  const Entry* last = nullptr;
  for (const Entry& e : d.entries) {
    if (last == nullptr || e.enqueued_us >= last->enqueued_us) last = &e;
  }
  if (last == nullptr) return "rank " + std::to_string(d.rank) + " recorded no operation";
  return "rank " + std::to_string(d.rank) + "'s last op: " + describe(*last) + " (" + last->state + ")";
}

// How long rank `d` has been waiting in `e`: until it ended, or until the dump.
std::int64_t waited_us(const Dump& d, const Entry& e) {
  return (e.ended_us > 0 ? e.ended_us : d.dumped_at_us) - e.enqueued_us;
}

class Analysis {
 public:
  explicit Analysis(std::map<int, Dump> dumps) : dumps_(std::move(dumps)) {}

  void run(FlightReport& report) {
    std::map<std::string, std::vector<int>> groups;  // key -> members
    for (const auto& [rank, d] : dumps_) {
      for (const Entry& e : d.entries) groups.emplace(e.group_key(), e.group_ranks);
    }
    for (const auto& [key, members] : groups) collectives(key, members);
    for (const auto& [key, members] : groups) point_to_point(key);
    report.findings = std::move(mismatches_);
    report.findings.insert(report.findings.end(), missing_.begin(), missing_.end());
    report.findings.insert(report.findings.end(), p2p_.begin(), p2p_.end());
    report.findings.insert(report.findings.end(), stuck_.begin(), stuck_.end());
  }

 private:
  // The group's collectives on rank r, by sequence number.
  std::map<std::uint64_t, const Entry*> collectives_of(int r, const std::string& key) const {
    std::map<std::uint64_t, const Entry*> out;
    for (const Entry& e : dumps_.at(r).entries) {
      if (!e.p2p && e.group_key() == key) out[e.seq] = &e;
    }
    return out;
  }

  void collectives(const std::string& key, const std::vector<int>& members) {
    std::map<int, std::map<std::uint64_t, const Entry*>> by_rank;
    std::vector<int> absent;
    for (int m : members) {
      if (dumps_.count(m) != 0) {
        by_rank[m] = collectives_of(m, key);
      } else {
        absent.push_back(m);
      }
    }
    if (by_rank.empty()) return;
    // Ranks that issued different operations under one number: the first such number.
    std::set<std::uint64_t> seqs;
    for (const auto& [m, ops] : by_rank) {
      for (const auto& [seq, e] : ops) seqs.insert(seq);
    }
    for (std::uint64_t seq : seqs) {
      std::map<std::string, std::vector<int>> issued;  // "op (sizes)" -> ranks
      const Entry* any = nullptr;
      for (const auto& [m, ops] : by_rank) {
        if (auto it = ops.find(seq); it != ops.end()) {
          issued[it->second->op + " (" + it->second->sizes + ")"].push_back(m);
          any = it->second;
        }
      }
      if (issued.size() < 2) continue;
      auto majority = std::max_element(issued.begin(), issued.end(),
                                       [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
      std::string sentence;
      for (const auto& [what, ranks] : issued) {
        if (what == majority->first) continue;
        sentence += (sentence.empty() ? "" : "; ") + std::string(ranks.size() == 1 ? "rank " : "ranks ") +
                    format_ranks(ranks) + " issued " + what + " as #" + std::to_string(seq) + " of group " + any->group;
      }
      mismatches_.push_back(sentence + " where " + (majority->second.size() == 1 ? "rank " : "ranks ") +
                            format_ranks(majority->second) + " issued " + majority->first +
                            ": the ranks issue different collectives");
      return;  // later numbers are out of step anyway
    }
    // The first number some rank never entered, and who waits in it.
    std::uint64_t lowest = UINT64_MAX, highest = 0;
    for (const auto& [m, ops] : by_rank) {
      const std::uint64_t last = ops.empty() ? 0 : ops.rbegin()->first;
      lowest = std::min(lowest, last);
      highest = std::max(highest, last);
    }
    if (lowest < highest) {
      const std::uint64_t seq = lowest + 1;
      std::vector<int> behind, waiting;
      const Entry* example = nullptr;
      std::int64_t waited = 0;
      for (const auto& [m, ops] : by_rank) {
        const auto it = ops.find(seq);
        if (ops.empty() || ops.rbegin()->first < seq) {
          behind.push_back(m);
        } else if (it != ops.end() && !it->second->done()) {
          waiting.push_back(m);
          example = it->second;
          waited = std::max(waited, waited_us(dumps_.at(m), *it->second));
        }
      }
      if (example == nullptr) return;  // nobody waits in it: the others moved on (a mismatch found above)
      for (int b : behind) {
        missing_.push_back("rank " + std::to_string(b) + " never entered " + describe(*example) + "; " +
                           (waiting.size() == 1 ? "rank " : "ranks ") + format_ranks(waiting) + " waited " +
                           seconds(waited) + "; " + last_op(dumps_.at(b)));
      }
      no_dump(absent, *example, waiting, waited);
      return;
    }
    // Every dumped rank entered the last number: is anyone still in it?
    std::vector<int> waiting;
    const Entry* example = nullptr;
    std::int64_t waited = 0;
    for (const auto& [m, ops] : by_rank) {
      if (ops.empty()) continue;
      const Entry* e = ops.rbegin()->second;
      if (!e->done()) {
        waiting.push_back(m);
        example = e;
        waited = std::max(waited, waited_us(dumps_.at(m), *e));
      }
    }
    if (example == nullptr) return;
    if (!absent.empty()) {
      no_dump(absent, *example, waiting, waited);
    } else if (waiting.size() == by_rank.size()) {
      stuck_.push_back("every rank of group " + example->group + " entered " + describe(*example) +
                       " and none completed it: no rank is missing from it (a transport or the network is stuck, or "
                       "a rank died inside it)");
    }
  }

  void no_dump(const std::vector<int>& absent, const Entry& e, const std::vector<int>& waiting, std::int64_t waited) {
    if (absent.empty() || waiting.empty()) return;
    missing_.push_back(std::string(absent.size() == 1 ? "rank " : "ranks ") + format_ranks(absent) +
                       " never completed " + describe(e) + "; " + (waiting.size() == 1 ? "rank " : "ranks ") +
                       format_ranks(waiting) + " waited " + seconds(waited) + "; no dump from " +
                       (absent.size() == 1 ? "rank " : "ranks ") + format_ranks(absent) +
                       " (it did not answer: stopped, hung outside dtrain, or dead)");
  }

  // Receives that wait for a send the peer never issued.
  void point_to_point(const std::string& key) {
    for (const auto& [r, d] : dumps_) {
      for (const Entry& e : d.entries) {
        if (!e.p2p || e.done() || e.group_key() != key || e.op.rfind("recv", 0) != 0) continue;
        const std::string waits =
            "rank " + std::to_string(r) + " waited " + seconds(waited_us(d, e)) + " in " + describe(e);
        const auto peer = dumps_.find(e.peer);
        if (peer == dumps_.end()) {
          p2p_.push_back(waits + "; no dump from rank " + std::to_string(e.peer));
          continue;
        }
        std::uint64_t sent = 0;
        for (const Entry& s : peer->second.entries) {
          if (s.p2p && s.group_key() == key && s.peer == r && s.op.rfind("send", 0) == 0) sent = std::max(sent, s.seq);
        }
        if (sent < e.seq) {
          p2p_.push_back("rank " + std::to_string(e.peer) + " never entered send #" + std::to_string(e.seq) +
                         " to rank " + std::to_string(r) + " of group " + e.group + "; " + waits + "; " +
                         last_op(peer->second));
        }
      }
    }
  }

  std::map<int, Dump> dumps_;
  std::vector<std::string> mismatches_, missing_, p2p_, stuck_;
};

}  // namespace

std::string format_ranks(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  std::string out;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(ranks[i]);
    if (j > i) out += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

std::string FlightReport::text() const {
  std::string out;
  for (const auto& f : findings) out += f + "\n";
  if (findings.empty()) {
    out = ranks_dumped.empty() ? "no flight-recorder dump found\n"
                               : "the dumps show no rank missing from an operation the others wait in\n";
  }
  if (!ranks_missing.empty()) out += "no dump from rank(s) " + format_ranks(ranks_missing) + "\n";
  return out;
}

FlightReport analyze_flight_dumps(const std::string& dir) {
  namespace fs = std::filesystem;
  DTRAIN_CHECK(fs::is_directory(dir), ConfigError, "'" << dir << "' is not a folder of flight-recorder dumps.",
               "pass the folder the ranks dumped to (DTRAIN_FLIGHT_RECORDER_DIR)");
  std::map<int, Dump> dumps;
  int world_size = 0;
  for (const auto& file : fs::directory_iterator(dir)) {
    const std::string name = file.path().filename().string();
    if (name.rfind("rank_", 0) != 0 || file.path().extension() != ".json") continue;
    Dump d = read_dump(file.path());
    world_size = std::max(world_size, d.world_size);
    dumps[d.rank] = std::move(d);
  }
  FlightReport report;
  std::set<int> expected;
  for (int r = 0; r < world_size; ++r) expected.insert(r);
  for (const auto& [rank, d] : dumps) {
    report.ranks_dumped.push_back(rank);
    for (const Entry& e : d.entries) expected.insert(e.group_ranks.begin(), e.group_ranks.end());
  }
  for (int r : expected) {
    if (dumps.count(r) == 0) report.ranks_missing.push_back(r);
  }
  try {
    Analysis(std::move(dumps)).run(report);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw DataError("the dumps in " + dir + " do not fit together: " + e.what(), kDumpHint);
  }
  return report;
}

}  // namespace dtrain::dist
