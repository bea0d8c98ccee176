// The plan search (search.h).
#include "dtrain/plan/search.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "dtrain/error.h"
#include "dtrain/parallel/pipeline/schedule.h"
#include "replay_memo.h"

namespace dtrain::plan {

FixedFields FixedFields::parse(const std::string& text) {
  FixedFields f;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    if (item.empty()) continue;
    const auto eq = item.find('=');
    DTRAIN_CHECK(eq != std::string::npos, ConfigError, "'" << item << "' in --fixed is not field=value.",
                 "write e.g. tp=8,pp=8,dp=24");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    auto number = [&]() -> std::int64_t {
      try {
        std::size_t used = 0;
        const auto n = std::stoll(value, &used);
        if (used == value.size() && n >= 0) return n;
      } catch (const std::exception&) {
      }
      DTRAIN_CHECK(false, ConfigError, "'" << item << "' in --fixed: " << value << " is not a whole number.",
                   "write e.g. " << key << "=2");
    };
    if (key == "tp")
      f.tp = static_cast<int>(number());
    else if (key == "pp")
      f.pp = static_cast<int>(number());
    else if (key == "cp")
      f.cp = static_cast<int>(number());
    else if (key == "dp")
      f.dp = static_cast<int>(number());
    else if (key == "dp_replicate")
      f.dp_replicate = static_cast<int>(number());
    else if (key == "dp_shard")
      f.dp_shard = static_cast<int>(number());
    else if (key == "zero")
      f.zero = static_cast<int>(number());
    else if (key == "stages_per_rank")
      f.stages_per_rank = static_cast<int>(number());
    else if (key == "micro_batch")
      f.micro_batch = number();
    else if (key == "schedule")
      f.schedule = pipeline::to_string(pipeline::parse_schedule_kind(value));
    else if (key == "recompute")
      f.recompute = parse_recompute(value);
    else if (key == "sequence_parallel") {
      DTRAIN_CHECK(value == "true" || value == "false" || value == "1" || value == "0", ConfigError,
                   "sequence_parallel=" << value << "?", "write sequence_parallel=true or false");
      f.sequence_parallel = value == "true" || value == "1";
    } else {
      DTRAIN_CHECK(false, ConfigError, "unknown field '" << key << "' in --fixed.",
                   "use tp, pp, cp, dp, dp_replicate, dp_shard, zero, micro_batch, schedule, stages_per_rank, "
                   "recompute, sequence_parallel");
    }
  }
  return f;
}

namespace {

std::vector<int> divisors(std::int64_t n) {
  std::vector<int> d;
  for (std::int64_t k = 1; k <= n; ++k)
    if (n % k == 0) d.push_back(static_cast<int>(k));
  return d;
}

template <typename T, typename U>
bool allowed(const std::optional<T>& pin, const U& value) {
  return !pin || *pin == value;
}

bool better(const PlanEstimate& a, const PlanEstimate& b) {
  const double tolerance = 1e-3 * std::min(a.step_seconds, b.step_seconds);
  if (std::abs(a.step_seconds - b.step_seconds) > tolerance) return a.step_seconds < b.step_seconds;
  return a.comm_bytes < b.comm_bytes;
}

// Calls `visit` with every well-formed plan the options allow.
template <typename Visit>
void enumerate(const ModelSpec& model, const Cluster& cluster, const SearchOptions& o, Visit&& visit) {
  const FixedFields& f = o.fixed;
  const int world = cluster.gpus;
  const int max_tp = o.max_tp > 0 ? o.max_tp : cluster.gpus_per_node;
  for (int tp : divisors(world)) {
    if (!allowed(f.tp, tp) || (!f.tp && tp > max_tp)) continue;
    if (model.heads % tp || model.kv_heads % tp || model.ffn % tp || model.hidden % tp) continue;
    for (int cp : divisors(world / tp)) {
      if (!allowed(f.cp, cp) || (!f.cp && cp > o.max_cp)) continue;
      if (cp > 1 && model.seq % (2 * cp)) continue;
      for (int pp : divisors(world / tp / cp)) {
        if (!allowed(f.pp, pp) || pp > model.layers) continue;
        const int dp = world / tp / cp / pp;
        if (!allowed(f.dp, dp) || o.global_batch % dp) continue;
        const std::int64_t local = o.global_batch / dp;
        for (int zero = 0; zero <= 3; ++zero) {
          if (!allowed(f.zero, zero) || (zero > 0 && dp == 1)) continue;
          // ZeRO shards over all data-parallel ranks, or (HSDP) over those of
          // one node with replicas across nodes.
          std::vector<int> shards{zero == 0 ? 1 : dp};
          const int node_shard = cluster.gpus_per_node / (tp * cp);
          if (zero > 0 && node_shard > 1 && node_shard < dp && dp % node_shard == 0) shards.push_back(node_shard);
          if (zero > 0 && f.dp_shard && dp % *f.dp_shard == 0) shards = {*f.dp_shard};
          for (int dp_shard : shards) {
            const int dp_replicate = dp / dp_shard;
            if (!allowed(f.dp_shard, dp_shard) || !allowed(f.dp_replicate, dp_replicate)) continue;
            if (zero > 0 && dp_shard < 2) continue;
            for (int sp = 0; sp <= (tp > 1 ? 1 : 0); ++sp) {
              if (!allowed(f.sequence_parallel, sp == 1)) continue;
              for (auto rc : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
                if (!allowed(f.recompute, rc)) continue;
                for (int b : divisors(local)) {
                  if (!allowed(f.micro_batch, b) || (!f.micro_batch && b > o.max_micro_batch)) continue;
                  ParallelPlan p{.pp = pp,
                                 .dp_replicate = dp_replicate,
                                 .dp_shard = dp_shard,
                                 .cp = cp,
                                 .tp = tp,
                                 .zero_stage = zero,
                                 .sequence_parallel = sp == 1,
                                 .recompute = rc,
                                 .precision = o.precision,
                                 .global_batch = o.global_batch};
                  if (pp == 1) {
                    p.accumulate = static_cast<int>(local / b);
                    if (!f.schedule && allowed(f.stages_per_rank, 1)) visit(p);  // a pinned schedule means pp > 1
                    continue;
                  }
                  p.pipeline.micro_batches = static_cast<int>(local / b);
                  for (const char* schedule : {"gpipe", "1f1b", "zb", "interleaved"}) {
                    if (!allowed(f.schedule, std::string(schedule))) continue;
                    p.pipeline.schedule = schedule;
                    const bool interleaved = std::string(schedule) == "interleaved";
                    for (int v = interleaved ? 2 : 1; v <= (interleaved ? o.max_stages_per_rank : 1); ++v) {
                      if (!allowed(f.stages_per_rank, v) || model.layers % (static_cast<std::int64_t>(pp) * v))
                        continue;
                      p.pipeline.stages_per_rank = v;
                      visit(p);
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace

SearchResult search(const ModelSpec& model, const Cluster& cluster, const SearchOptions& options) {
  DTRAIN_CHECK(options.global_batch > 0, ConfigError, "the search needs a global batch.",
               "give --global-batch (sequences per step)");
  SearchResult result;
  CostOptions memory_only = options.cost;
  memory_only.memory_only = true;
  detail::ReplayMemo memo;  // Note [Replay memo]
  enumerate(model, cluster, options, [&](const ParallelPlan& p) {
    ++result.considered;
    PlanEstimate e = estimate(p, model, cluster, memory_only);
    if (!e.fits) {
      ++result.too_big;
      if (!result.smallest || e.peak() < result.smallest->peak()) result.smallest = e;
      return;
    }
    result.fitting.push_back(detail::estimate(p, model, cluster, options.cost, &memo));
  });
  std::sort(result.fitting.begin(), result.fitting.end(), better);
  if (result.smallest && result.fitting.empty())
    result.smallest = estimate(result.smallest->plan, model, cluster, options.cost);
  return result;
}

namespace {

std::vector<std::pair<std::string, std::string>> fields(const ParallelPlan& p) {
  auto n = [](auto v) { return std::to_string(v); };
  const std::int64_t micro = p.local_batch() / (p.pp > 1 ? p.pipeline.micro_batches : 1);
  std::vector<std::pair<std::string, std::string>> out{{"tp", n(p.tp)},
                                                       {"pp", n(p.pp)},
                                                       {"cp", n(p.cp)},
                                                       {"dp_replicate", n(p.dp_replicate)},
                                                       {"dp_shard", n(p.dp_shard)},
                                                       {"zero", n(p.zero_stage)},
                                                       {"micro_batch", n(micro)},
                                                       {"recompute", to_string(p.recompute)},
                                                       {"sequence_parallel", p.sequence_parallel ? "true" : "false"}};
  if (p.pp > 1) {
    out.emplace_back("schedule", p.pipeline.schedule);
    out.emplace_back("stages_per_rank", n(p.pipeline.stages_per_rank));
  }
  return out;
}

}  // namespace

std::string describe_change(const ParallelPlan& from, const ParallelPlan& to) {
  const auto a = fields(from), b = fields(to);
  std::string out;
  for (const auto& [key, value] : b) {
    std::string old = "-";
    for (const auto& [k, v] : a)
      if (k == key) old = v;
    if (old != value) out += (out.empty() ? "" : ", ") + key + " " + old + " -> " + value;
  }
  return out.empty() ? "no change" : out;
}

std::optional<PlanEstimate> cheapest_fitting_change(const ParallelPlan& plan, const ModelSpec& model,
                                                    const Cluster& cluster, const CostOptions& options) {
  const auto r =
      search(model, cluster, {.global_batch = plan.global_batch, .precision = plan.precision, .cost = options});
  std::optional<PlanEstimate> best;
  std::size_t best_changes = 0;
  for (const auto& e : r.fitting) {  // fastest first: the first of the fewest changes wins
    const auto change = describe_change(plan, e.plan);
    const std::size_t changes = static_cast<std::size_t>(std::count(change.begin(), change.end(), '>'));
    if (!best || changes < best_changes) {
      best = e;
      best_changes = changes;
    }
  }
  return best;
}

}  // namespace dtrain::plan
