// The lighthouse's answers to requests no quorum can serve
// (include/dtrain/ft/lighthouse.h, Lighthouse::end_of_training).
//
// Note [End of training]
// A request behind the newest step (a restarted group, at step 0 or its
// checkpoint's) needs an up-to-date member to recover from. When none asks,
// the lighthouse looks at why, and answers such requests with a text in
// place of a quorum, which the client throws:
//   finished             "step replica": written by a client when its
//                        training reached its last step
//                        (LighthouseClient::finish). If it is there, the
//                        training is over: "finished S" (S that last
//                        step) -> TrainingFinishedError. The launcher
//                        then does not restart that group: the job ends with
//                        the finished groups' state (exit 0).
//   the holders gone     every member of the last quorum at the newest step
//                        (up_to_date_) is superseded (its replica id
//                        registered again: that process is gone) or has not
//                        beaten for heartbeat_timeout + join_timeout (a
//                        stopped or cut-off process given the join timeout to
//                        come back): the newest state is lost. "lost S ids"
//                        -> ReplicaStateLostError on every request behind,
//                        now and later, and check() throws it, so `dtrain
//                        run` restarts the whole job from its checkpoint
//                        (as for any whole-job failure).
// While a holder may still come back (live, or silent for less than that),
// the requests wait, as before.
#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/comm/store_keys.h"
#include "dtrain/ft/lighthouse.h"
#include "dtrain/log.h"
#include "lighthouse_replica.h"

namespace dtrain::ft {

using Clock = std::chrono::steady_clock;

std::string Lighthouse::end_of_training(Clock::time_point now) {
  if (!end_.empty()) return end_;
  // Any group that finished: the training is over (Note [End of training]).
  if (const auto finished = dist::get_if_present(store_, "finished"); finished) {
    std::istringstream in(*finished);
    std::int64_t step = 0;
    int who = 0;
    in >> step >> who;
    end_ = "finished " + std::to_string(step);
    DTRAIN_LOG(kInfo) << "lighthouse: the training finished at step " << step << " (replica " << who
                      << " reached it); requests behind it are told so";
    return end_;
  }
  if (up_to_date_.empty()) {
    // The newest step came from the requests' floors only (this lighthouse
    // took over, or restarted: Note [Lighthouse failover]); its holders
    // never registered here. They are given the join and heartbeat timeouts
    // from this lighthouse's start to come, while no live replica that has
    // not asked yet could be one.
    if (highest_step_ == 0 || now - started_at_ < options_.heartbeat_timeout + options_.join_timeout) return {};
    for (const auto& r : replicas_) {
      if (!r->pending && now - r->last_beat < options_.heartbeat_timeout) return {};
    }
    end_ = "lost " + std::to_string(highest_step_) + " unknown to this lighthouse";
    std::lock_guard lock(mutex_);
    lost_ = "no replica group that held the newest step, " + std::to_string(highest_step_) +
            " (reported by the groups' last quorums), came to this lighthouse since it started; the groups left "
            "are behind it";
    DTRAIN_LOG(kError) << "lighthouse: " << lost_;
    return end_;
  }
  std::vector<int> lost_ids;
  for (const auto& [incarnation, id] : up_to_date_) {
    const Replica* r = replica(incarnation);
    if (r != nullptr && now - r->last_beat < options_.heartbeat_timeout + options_.join_timeout) return {};
    lost_ids.push_back(id);
  }
  // Ascending replica ids, not the groups' order of arrival: one message for
  // the same loss whichever group registered first.
  std::sort(lost_ids.begin(), lost_ids.end());
  std::string ids;
  for (const int id : lost_ids) ids += (ids.empty() ? "" : " ") + std::to_string(id);
  end_ = "lost " + std::to_string(highest_step_) + " " + ids;
  {
    std::lock_guard lock(mutex_);
    lost_ = "every replica group that held the newest step, " + std::to_string(highest_step_) + " (replica" +
            (up_to_date_.size() == 1 ? " " : "s ") + ids + "), is gone; the groups left are behind it";
    DTRAIN_LOG(kError) << "lighthouse: " << lost_;
  }
  return end_;
}

void Lighthouse::answer_without_quorum(const std::vector<Replica*>& asking, const std::string& text) {
  std::vector<std::string> keys;
  for (Replica* r : asking) {
    const std::string id = std::to_string(r->incarnation) + "/" + std::to_string(r->seq);
    if (store_.compare_set("claim/" + id, "", "lighthouse") == "lighthouse") keys.push_back("answer/" + id);
    // else withdrawn: its client gave up on it
    r->answered_seq = r->seq;
    r->answer_kept = r->seq;
    r->pending = false;
  }
  if (!keys.empty()) dist::multi_set(store_, keys, std::vector<std::string>(keys.size(), text));
}

}  // namespace dtrain::ft
