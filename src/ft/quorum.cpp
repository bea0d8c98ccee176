// Quorum arithmetic and its text form (include/dtrain/ft/quorum.h).
#include "dtrain/ft/quorum.h"

#include <algorithm>
#include <sstream>

#include "dtrain/error.h"

namespace dtrain::ft {

int Quorum::index_of(int replica_id) const {
  for (std::size_t i = 0; i < members.size(); ++i) {
    if (members[i].replica_id == replica_id) return static_cast<int>(i);
  }
  return -1;
}

std::int64_t Quorum::max_step() const {
  std::int64_t best = 0;
  for (const auto& m : members) best = std::max(best, m.step);
  return best;
}

std::vector<int> Quorum::behind() const {
  std::vector<int> out;
  const std::int64_t top = max_step();
  for (std::size_t i = 0; i < members.size(); ++i) {
    if (members[i].step < top) out.push_back(static_cast<int>(i));
  }
  return out;
}

int Quorum::recovery_source(int index) const {
  const std::int64_t top = max_step();
  std::vector<int> healthy;
  for (std::size_t i = 0; i < members.size(); ++i) {
    if (members[i].step == top) healthy.push_back(static_cast<int>(i));
  }
  const auto late = behind();
  const auto it = std::find(late.begin(), late.end(), index);
  DTRAIN_INTERNAL_ASSERT(it != late.end() && !healthy.empty(),
                         "member " << index << " is not behind in " << describe());
  return healthy[static_cast<std::size_t>(it - late.begin()) % healthy.size()];
}

std::string Quorum::describe() const {
  std::ostringstream out;
  out << "round " << round << ", quorum " << quorum_id << ": replica" << (members.size() == 1 ? " " : "s ");
  for (std::size_t i = 0; i < members.size(); ++i) {
    out << (i == 0 ? "" : ", ") << members[i].replica_id << " (step " << members[i].step << ")";
  }
  return out.str();
}

std::string Quorum::to_text() const {
  std::ostringstream out;
  out << round << ' ' << quorum_id;
  for (const auto& m : members) out << ' ' << m.replica_id << ':' << m.incarnation << ':' << m.step;
  return out.str();
}

Quorum Quorum::from_text(const std::string& text) {
  std::istringstream in(text);
  Quorum q;
  DTRAIN_INTERNAL_ASSERT(static_cast<bool>(in >> q.round >> q.quorum_id), "malformed quorum '" << text << "'");
  std::string word;
  while (in >> word) {
    QuorumMember m;
    char c1 = 0, c2 = 0;
    std::istringstream w(word);
    DTRAIN_INTERNAL_ASSERT(
        static_cast<bool>(w >> m.replica_id >> c1 >> m.incarnation >> c2 >> m.step) && c1 == ':' && c2 == ':',
        "malformed quorum member '" << word << "' in '" << text << "'");
    q.members.push_back(m);
  }
  return q;
}

}  // namespace dtrain::ft
