// The join context for uneven inputs (torch.distributed.algorithms.Join).
#include "dtrain/parallel/ddp/join.h"

#include <ATen/Functions.h>

#include "dtrain/error.h"
#include "dtrain/log.h"

namespace dtrain {
namespace {
[[noreturn]] void throw_exhausted() {
  throw CommunicationError("a rank ran out of inputs while others still train (throw_on_early_termination).",
                           "give every rank the same number of batches, or use Join without "
                           "throw_on_early_termination to let exhausted ranks shadow the others");
}
}  // namespace

dist::Work Joinable::notify_join_context() {
  if (!join_config_.enable || !join_config_.is_first_joinable) return {};
  auto& group = join_group();
  const auto options = at::TensorOptions().device(join_device());
  at::Tensor ones = at::ones({1}, options);
  dist::Work work = group.all_reduce(ones);
  if (join_config_.throw_on_early_termination) {
    at::Tensor zeros = at::zeros({1}, options);
    group.all_reduce(zeros).wait();
    if (zeros.item<double>() != 0.0) throw_exhausted();
  }
  return work;
}

Join::Join(std::vector<Joinable*> joinables, JoinOptions options)
    : joinables_(std::move(joinables)), options_(options) {
  DTRAIN_CHECK(!joinables_.empty(), ConfigError, "Join needs at least one joinable.", "pass e.g. {&ddp.joinable()}");
  bool first = true;
  for (Joinable* j : joinables_) {
    DTRAIN_CHECK(j != nullptr, ConfigError, "Join got a null joinable.", "pass the address of each joinable");
    j->join_config_ = JoinConfig{.enable = options_.enable,
                                 .throw_on_early_termination = options_.throw_on_early_termination,
                                 .is_first_joinable = first};
    first = false;
  }
}

Join::~Join() {
  for (Joinable* j : joinables_) j->join_config_ = JoinConfig{};
}

void Join::finish() {
  if (!options_.enable || finished_) return;
  finished_ = true;
  Joinable& lead = *joinables_.front();
  const auto options = at::TensorOptions().device(lead.join_device());
  bool is_last_joiner = true;
  for (std::int64_t round = 0;; ++round) {
    // Ranks still training contribute 1 through notify_join_context.
    at::Tensor active = at::zeros({1}, options);
    lead.join_group().all_reduce(active).wait();
    if (active.item<double>() == 0.0) break;
    if (options_.throw_on_early_termination) {
      at::Tensor ones = at::ones({1}, options);
      lead.join_group().all_reduce(ones).wait();
      throw_exhausted();
    }
    if (round == 1000) {
      DTRAIN_LOG(kWarning) << "this rank has shadowed 1000 iterations of ranks with more inputs; uneven inputs this "
                              "skewed waste this rank's device";
    }
    for (Joinable* j : joinables_) j->join_main_hook();
    is_last_joiner = false;
  }
  for (Joinable* j : joinables_) j->join_post_hook(is_last_joiner);
}

}  // namespace dtrain
