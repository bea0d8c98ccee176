// The Trainer's loop. See trainer.h for what one step does.
#include "dtrain/trainer/trainer.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dtrain/amp/autocast.h"
#include "dtrain/amp/grad_scaler.h"
#include "dtrain/checkpoint/checkpointer.h"
#include "dtrain/data/loader.h"
#include "dtrain/dist/clip.h"
#include "dtrain/elastic/error_file.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "dtrain/trainer/metrics.h"
#include "dtrain/trainer/progress.h"
#include "dtrain/trainer/trace.h"
#include "fault_tolerant_step.h"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// `file` with ".<tag>" before its extension (samples.jsonl, rank3 ->
// samples.rank3.jsonl).
std::filesystem::path tagged(const std::filesystem::path& file, const std::string& tag) {
  return file.parent_path() / (file.stem().string() + "." + tag + file.extension().string());
}

}  // namespace

struct Trainer::State {
  torch::optim::Optimizer& optimizer;
  std::shared_ptr<BatchSource> source;
  TrainerOptions options;
  LossFn loss = [](const at::Tensor& output, const at::Tensor& target) {
    return torch::nn::functional::cross_entropy(output, target);
  };
  std::shared_ptr<ScheduledLR> schedule;
  std::shared_ptr<const Dataset> eval_set;
  std::int64_t eval_batch_count = 0;  // set_eval_batches
  EvalBatchFn eval_batch;
  std::function<void(const EvalReport&)> on_eval;
  std::function<void(const StepReport&)> on_step;
  std::int64_t step = 0;  // for error messages
  struct ExtraState {
    std::string name;
    std::shared_ptr<Stateful> object;
    StateScope scope;
  };
  std::vector<ExtraState> checkpoint_states;  // add_checkpoint_state
};

Trainer::Trainer(std::shared_ptr<Strategy> strategy, torch::optim::Optimizer& optimizer,
                 std::shared_ptr<const Dataset> train_set, TrainerOptions options)
    : Trainer(std::move(strategy), optimizer,
              train_set ? std::make_shared<EpochSource>(std::move(train_set),
                                                        EpochSourceOptions{.seed = options.seed,
                                                                           .num_workers = options.num_workers,
                                                                           .train_limit = options.train_limit})
                        : nullptr,
              options) {}

Trainer::Trainer(std::shared_ptr<Strategy> strategy, torch::optim::Optimizer& optimizer,
                 std::shared_ptr<BatchSource> source, TrainerOptions options)
    : state_(std::make_unique<State>(
          State{.optimizer = optimizer, .source = std::move(source), .options = std::move(options)})),
      strategy_(std::move(strategy)) {
  const auto& o = state_->options;
  DTRAIN_CHECK(strategy_ != nullptr && state_->source != nullptr, ConfigError,
               "the Trainer needs a strategy and a training set (or batch source).", "pass both");
  DTRAIN_CHECK(o.epochs >= 1 && o.batch_size >= 1 && o.accumulate >= 1 && o.eval_batch_size >= 1 && o.log_every >= 1 &&
                   o.max_steps >= 0 && o.clip_norm >= 0 && o.eval_limit >= 0,
               ConfigError,
               "TrainerOptions: epochs " << o.epochs << ", batch_size " << o.batch_size << ", accumulate "
                                         << o.accumulate << ", eval_batch_size " << o.eval_batch_size << ", log_every "
                                         << o.log_every << ", max_steps " << o.max_steps << ", clip_norm "
                                         << o.clip_norm << ", eval_limit " << o.eval_limit << ".",
               "counts must be at least 1 (max_steps, clip_norm and eval_limit at least 0)");
  DTRAIN_CHECK(!strategy_->fuses_loss() || o.accumulate == 1, ConfigError,
               "TrainerOptions::accumulate is " << o.accumulate << ", but strategy '" << strategy_->name()
                                                << "' splits each batch into micro-batches itself",
               "set accumulate to 1 and give the strategy more micro-batches (e.g. PipelineOptions::micro_batches)");
  DTRAIN_CHECK(!o.amp_dtype || *o.amp_dtype == at::kBFloat16 || *o.amp_dtype == at::kHalf, ConfigError,
               "TrainerOptions::amp_dtype must be bfloat16 or float16.", "use at::kBFloat16 on CPU");
}

Trainer::~Trainer() = default;

void Trainer::set_loss(LossFn loss) {
  state_->loss = std::move(loss);
}
void Trainer::set_schedule(std::shared_ptr<ScheduledLR> schedule) {
  state_->schedule = std::move(schedule);
}
void Trainer::add_checkpoint_state(const std::string& name, std::shared_ptr<Stateful> object, StateScope scope) {
  state_->checkpoint_states.push_back({name, std::move(object), scope});
}
void Trainer::set_eval_dataset(std::shared_ptr<const Dataset> eval_set) {
  state_->eval_set = std::move(eval_set);
  state_->eval_batch_count = 0;
  state_->eval_batch = nullptr;
}
void Trainer::set_eval_batches(std::int64_t count, EvalBatchFn batch) {
  DTRAIN_CHECK(count >= 1 && batch != nullptr, ConfigError,
               "set_eval_batches needs at least one batch and a function (got " << count << ").",
               "pass count >= 1 and a function from k to a batch");
  state_->eval_set = nullptr;
  state_->eval_batch_count = count;
  state_->eval_batch = std::move(batch);
}
void Trainer::on_eval(std::function<void(const EvalReport&)> callback) {
  state_->on_eval = std::move(callback);
}
void Trainer::on_step(std::function<void(const StepReport&)> callback) {
  state_->on_step = std::move(callback);
}

namespace {

// Which batches this rank evaluates: the k-th of `count` is load(k); k past
// `count` (a collective forward's extra rounds) loads a batch every rank has
// (the first of rank 0), run and left uncounted.
struct EvalPlan {
  std::int64_t count = 0;
  std::function<data::TensorBatch(std::int64_t k)> load;
};

// This rank's evaluation batches: a contiguous share of the eval dataset in
// batches of eval_batch_size (every example of the first `limit`, 0: all,
// exactly once), or the fixed batches r, r + w, ... of set_eval_batches.
EvalPlan eval_plan(const std::shared_ptr<const data::Dataset<data::TensorExample>>& set, std::int64_t batch_count,
                   const Trainer::EvalBatchFn& batch, std::int64_t eval_batch_size, std::int64_t limit, int rank,
                   int world) {
  if (batch) {
    const std::int64_t count = (batch_count - rank + world - 1) / world;
    return {.count = count,
            .load = [&batch, rank, world, count](std::int64_t k) { return batch(k < count ? k * world + rank : 0); }};
  }
  const std::int64_t n = limit > 0 ? std::min(limit, set->size()) : set->size();
  const std::int64_t begin = n * rank / world;
  const std::int64_t end = n * (rank + 1) / world;
  const std::int64_t count = (end - begin + eval_batch_size - 1) / eval_batch_size;
  return {.count = count, .load = [set, begin, end, n, world, eval_batch_size, count](std::int64_t k) {
            const std::int64_t first = k < count ? begin + k * eval_batch_size : 0;
            const std::int64_t last = k < count ? end : std::min(n, std::max<std::int64_t>(1, n / world));
            std::vector<std::int64_t> indices;
            for (std::int64_t i = first; i < std::min(last, first + eval_batch_size); ++i) indices.push_back(i);
            return data::collate_tensors(set->get_many(indices));
          }};
}

}  // namespace

EvalResult Trainer::evaluate() {
  EvalResult result;
  if (!state_->eval_set && !state_->eval_batch) return result;
  Strategy& s = *strategy_;
  const auto& o = state_->options;
  auto group = s.group();
  const EvalPlan plan = eval_plan(state_->eval_set, state_->eval_batch_count, state_->eval_batch, o.eval_batch_size,
                                  o.eval_limit, s.data_rank(), s.data_world());
  // A collective forward runs as often on every rank: the most any rank has.
  std::int64_t rounds = plan.count;
  if (s.collective_forward() && group) {
    at::Tensor most = at::full({1}, static_cast<double>(plan.count), at::kDouble).to(group->device());
    group->all_reduce(most, dist::ReduceOp::kMax).wait();
    rounds = static_cast<std::int64_t>(most.cpu().item<double>());
  }
  torch::NoGradGuard no_grad;
  s.module().eval();
  double loss_sum = 0;
  std::int64_t correct = 0, elements = 0, examples = 0;
  for (std::int64_t k = 0; k < rounds; ++k) {
    const bool counted = k < plan.count;
    const auto batch = plan.load(k);
    const at::Tensor target = s.local_target(batch.target.to(s.output_device()));
    at::Tensor output, loss;
    {
      std::optional<amp::Autocast> autocast;
      if (o.amp_dtype) autocast.emplace(s.input_device().type(), amp::AutocastOptions{.dtype = o.amp_dtype});
      output = s.eval_forward(batch.data.to(s.input_device()));
      if (output.defined() && counted) loss = state_->loss(output, target);
    }
    if (!output.defined() || !counted) continue;  // another rank of this pipeline has the outputs
    const std::int64_t n = target.size(0);
    loss_sum += loss.item<double>() * static_cast<double>(n);
    correct += output.argmax(-1).eq(target).sum().item<std::int64_t>();
    elements += target.numel();
    examples += n;
  }
  s.module().train();
  at::Tensor totals =
      at::tensor({loss_sum, static_cast<double>(correct), static_cast<double>(elements), static_cast<double>(examples)},
                 at::kDouble);
  if (group) {
    totals = totals.to(group->device());
    group->all_reduce(totals).wait();
    totals = totals.cpu();
  }
  const auto* t = totals.data_ptr<double>();
  result.examples = static_cast<std::int64_t>(t[3]);
  if (result.examples > 0) {
    result.loss = t[0] / t[3];
    result.accuracy = t[1] / t[2];
  }
  return result;
}

TrainSummary Trainer::fit() {
  try {
    return run();
  } catch (const std::exception& e) {
    DTRAIN_LOG(kError) << "training failed at step " << state_->step << ": " << e.what();
    elastic::write_error_file(e.what());
    throw;
  }
}

// One fit(): the objects of the run and the loop's parts.
struct Trainer::Run {
  Trainer& trainer;
  Strategy& s;
  State& st;
  const TrainerOptions& o;
  std::optional<dist::ProcessGroup> group;
  int rank = 0;
  int world = 1;
  bool want_metrics = false;  // the same on every rank: decides collectives
  BatchSource& source;
  std::unique_ptr<amp::GradScaler> scaler;
  std::unique_ptr<detail::FaultTolerantStep> ft;  // TrainerOptions::fault_tolerance
  const TrainerFtReplay* replay = nullptr;        // or its replay
  std::vector<int> step_members;                  // the replica groups of the last committed step
  std::optional<Checkpointer> checkpoints;
  std::unique_ptr<Tracer> tracer;
  std::ofstream sample_log;
  std::vector<std::int64_t> step_indices;  // the current step's examples, for sample_log
  std::optional<MetricsLogger> metrics;    // rank 0
  TrainingState position;
  TrainSummary summary;
  at::Tensor last_norm;
  double last_lr = 0;  // the rate of the current step
  std::int64_t last_eval_step = -1;
  std::int64_t last_saved_step = -1;
  double eval_loss_sum = 0;  // step losses since the last evaluation
  std::int64_t eval_loss_steps = 0;

  // The measurement window between two metric records.
  struct Window {
    Clock::time_point start = Clock::now();
    double data_wait = 0;
    double loss = 0;
    std::int64_t steps = 0;
  };

  StepTimes times;

  Run(Trainer& t, State& state)
      : trainer(t), s(*t.strategy_), st(state), o(state.options), group(s.group()), source(*state.source) {
    rank = group ? group->rank() : 0;
    world = group ? group->size() : 1;
    want_metrics = !o.metrics_jsonl.empty() || !o.tensorboard_dir.empty();
  }

  void setup() {
    // Before anything else that talks to the other ranks or allocates for
    // training: every rank refuses together (Note [One pre-flight decision]).
    if (o.memory_check) {
      MemoryCheck check = *o.memory_check;
      if (!check.runs_on) check.runs_on = s.output_device();
      check_memory(check, group);
    }
    scaler = std::make_unique<amp::GradScaler>(amp::GradScalerOptions{
        .enabled = o.grad_scaler.value_or(o.amp_dtype == at::kHalf), .found_inf_group = s.found_inf_group()});
    if (o.fault_tolerance) setup_fault_tolerance();
    source.setup(source_context(ft ? ft->data_rank() : s.data_rank()));
    DTRAIN_CHECK(o.max_steps > 0 || source.epoch_examples() > 0, ConfigError,
                 "the Trainer's batch source is endless (a StepStream), but TrainerOptions::max_steps is 0.",
                 "set max_steps to the number of optimizer steps to train");
    if (!o.checkpoint_dir.empty()) resume();
    if (ft && position.step > 0) ft->resume_at(position.step);
    st.step = position.step;
    // Under fault tolerance every replica group has a rank 0, so each
    // rank's files are named by its place among all groups' ranks: rank r of
    // group g writes sample log and trace g * W + r (W the group's ranks; the
    // data rank under DDP and ZeRO, one file per stage under a pipeline).
    const int file_rank = ft ? ft->replica_id() * world + rank : rank;
    const int file_world = ft ? ft->replicas() * world : world;
    if (!o.sample_log.empty()) {
      const auto path = tagged(o.sample_log, "rank" + std::to_string(file_rank));
      sample_log.open(path, std::ios::app);
      DTRAIN_CHECK(sample_log.good(), ConfigError, "cannot open the sample log " << path.string() << ".",
                   "check that the sample log's folder exists and is writable");
    }
    if (!o.trace_file.empty()) {
      tracer = std::make_unique<Tracer>(per_rank_path(o.trace_file, file_rank, file_world), file_rank);
      s.set_tracer(tracer.get());
    }
    if (want_metrics && rank == 0) {
      // A replica group's metrics are its own (its ranks' mean loss over its
      // data), and groups come and go: each group's rank 0 writes them to a
      // file and a TensorBoard run of its own (metrics.jsonl ->
      // metrics.replica<g>.jsonl, <dir>/replica<g>), which one that restarts
      // appends to.
      MetricsOptions m{.jsonl = o.metrics_jsonl, .tensorboard_dir = o.tensorboard_dir};
      if (ft) {
        const std::string tag = "replica" + std::to_string(ft->replica_id());
        if (!m.jsonl.empty()) m.jsonl = tagged(m.jsonl, tag);
        if (!m.tensorboard_dir.empty()) m.tensorboard_dir /= tag;
      }
      metrics.emplace(m);
    }
    DTRAIN_LOG(kDebug) << s.name() << " training on " << source.epoch_examples() / s.data_world()
                       << " examples per rank and epoch (0: a stream), " << o.epochs << " epochs, micro-batch "
                       << o.batch_size << " x " << o.accumulate << " per rank"
                       << (o.amp_dtype ? std::string(", autocast ") + c10::toString(*o.amp_dtype) : std::string());
  }

  // The batch source's view of this rank: under fault tolerance (or its
  // replay) data rank g * W + r of every replica group's ranks.
  BatchSource::Context source_context(int data_rank) const {
    return {.data_rank = data_rank,
            .data_world = ft       ? ft->data_world()
                          : replay ? replay->replicas * s.data_world()
                                   : s.data_world(),
            .batch_size = o.batch_size,
            .accumulate = o.accumulate,
            .whole_batches = s.needs_whole_batches()};
  }

  void setup_fault_tolerance() {
    DTRAIN_CHECK(source.epoch_examples() == 0 && o.max_steps > 0, ConfigError,
                 "TrainerOptions::fault_tolerance needs a StepStream and max_steps: a recovered replica group "
                 "finds its data position from the step.",
                 "train from a StepStream (batches a function of the step) with max_steps set");
    if (o.fault_tolerance->replay) {
      replay = &*o.fault_tolerance->replay;
      detail::check_replay(*replay, o.max_steps);
      return;
    }
    ft = std::make_unique<detail::FaultTolerantStep>(*o.fault_tolerance, s, st.optimizer, scaler.get(), st.schedule,
                                                     o.max_steps);
  }

  // Checkpoints hold, besides the strategy's model and optimizer, the scaler
  // and the schedule; the position and every rank's generators come back too.
  void resume() {
    checkpoints.emplace(CheckpointOptions{.dir = o.checkpoint_dir, .keep = o.keep_checkpoints}, group);
    if (scaler->is_enabled()) {
      amp::GradScaler* sc = scaler.get();
      checkpoints->add_state("grad_scaler", json_state([sc] { return to_json(*sc->state_dict()); },
                                                       [sc](const std::string& j) {
                                                         sc->load_state_dict(amp::grad_scaler_state_from_json(j));
                                                       }));
    }
    if (st.schedule) {
      auto schedule = st.schedule;
      checkpoints->add_state("lr_schedule", json_state([schedule] { return schedule->to_json(); },
                                                       [schedule](const std::string& j) { schedule->load_json(j); }));
    }
    for (const auto& extra : st.checkpoint_states) checkpoints->add_state(extra.name, extra.object, extra.scope);
    if (auto resumed = s.load(*checkpoints, st.optimizer)) {
      position = *resumed;
      last_saved_step = position.step;
      source.load_state(resumed->sampler);
      DTRAIN_LOG(kInfo) << "resumed at step " << position.step;
    }
  }

  // Under fault tolerance the replica groups hold the same state after a
  // committed step: one writes it (Note [Checkpoints of replica groups]).
  // A write that fails under fault tolerance is a warning (Note [Failed
  // checkpoint writes] in fault_tolerant_step.cpp).
  void save() {
    if (ft && !ft->writes_checkpoints()) return;
    position.sampler = source.state();
    auto write = [this] { s.save(*checkpoints, position, st.optimizer); };
    if (ft && !ft->save_checkpoint(position.step, write)) return;
    if (!ft) write();
    last_saved_step = position.step;
  }

  void evaluate(std::int64_t epoch) {
    if (!st.eval_set && !st.eval_batch) return;
    const double train_loss = eval_loss_steps > 0 ? eval_loss_sum / static_cast<double>(eval_loss_steps) : 0;
    EvalReport report{
        .epoch = epoch, .step = position.step, .train_loss = mean_over_ranks(train_loss), .eval = trainer.evaluate()};
    eval_loss_sum = 0;
    eval_loss_steps = 0;
    last_eval_step = position.step;
    summary.last_eval = report.eval;
    if (metrics)
      metrics->log(position.step, {{"eval/loss", report.eval.loss}, {"eval/accuracy", report.eval.accuracy}});
    if (st.on_eval) st.on_eval(report);
  }

  // One micro-batch: forward and loss (under Autocast), backward of the scaled loss.
  at::Tensor micro_step(int m, Window& window) {
    std::optional<data::TensorBatch> batch;
    {
      auto span = Tracer::span(tracer.get(), "data wait", "data");
      const auto wait_start = Clock::now();
      batch = source.next(position.step, m);
      window.data_wait += seconds_since(wait_start);
    }
    if (sample_log.is_open()) {
      const auto indices = source.last_indices();
      step_indices.insert(step_indices.end(), indices.begin(), indices.end());
    }
    const at::Tensor input = batch->data.to(s.input_device());
    const at::Tensor target = batch->target.to(s.output_device());
    const auto forward_start = Clock::now();
    if (s.fuses_loss()) {
      auto span = Tracer::span(tracer.get(), "forward_backward", "compute");
      std::optional<amp::Autocast> autocast;
      if (o.amp_dtype) autocast.emplace(s.input_device().type(), amp::AutocastOptions{.dtype = o.amp_dtype});
      at::Tensor loss = s.forward_backward(input, target, scaler->is_enabled() ? scaler.get() : nullptr).to(at::kFloat);
      times.forward += seconds_since(forward_start);
      return loss;
    }
    auto no_sync = m + 1 < o.accumulate ? s.no_sync() : nullptr;
    at::Tensor loss;
    {
      auto span = Tracer::span(tracer.get(), "forward", "compute");
      std::optional<amp::Autocast> autocast;
      if (o.amp_dtype) autocast.emplace(s.input_device().type(), amp::AutocastOptions{.dtype = o.amp_dtype});
      loss = st.loss(s.forward(input), s.local_target(target));
      if (o.accumulate > 1) loss = loss / o.accumulate;
    }
    const auto backward_start = Clock::now();
    times.forward += std::chrono::duration<double>(backward_start - forward_start).count();
    auto span = Tracer::span(tracer.get(), "backward", "compute");
    s.backward(scaler->scale(loss));
    times.backward += seconds_since(backward_start);
    return loss.detach().to(at::kFloat);
  }

  void log_samples() {
    const char* round = std::getenv("DTRAIN_RDZV_ROUND");
    const auto t =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
    nlohmann::json line{{"round", round != nullptr ? std::atoi(round) : -1},
                        {"rank", rank},
                        {"world", world},
                        {"epoch", source.state().epoch},
                        {"step", position.step},
                        {"t_ns", t},
                        {"pid", static_cast<std::int64_t>(::getpid())},
                        {"indices", step_indices}};
    if (ft) line["replica"] = ft->replica_id();
    if (ft || replay) line["members"] = step_members;
    sample_log << line.dump() << '\n' << std::flush;
    step_indices.clear();
  }

  // One committed optimizer step; under fault tolerance a step another
  // replica group failed runs again (same step, same data), and a recovery
  // moves the step to the live peer's.
  double committed_step(bool log_now, Window& window) {
    for (;;) {
      if (ft) position.step = ft->begin(position.step);
      if (const auto loss = step(log_now, window)) return *loss;
    }
  }

  // One optimizer step over `accumulate` micro-batches; returns its loss, or
  // nullopt when the replica groups did not commit it (fault tolerance).
  std::optional<double> step(bool log_now, Window& window) {
    if (tracer) tracer->set_step(position.step + 1);
    at::Tensor loss;
    last_lr = st.optimizer.param_groups().front().options().get_lr();
    {
      auto step_span = Tracer::span(tracer.get(), "step", "step");
      s.zero_grad(st.optimizer);
      const auto micro_steps = [&] {
        at::Tensor sum;
        for (int m = 0; m < o.accumulate; ++m) {
          const at::Tensor part = micro_step(m, window);
          sum = sum.defined() ? sum + part : part;
        }
        return sum;
      };
      if (replay) {
        loss = detail::replay_gradients(*replay, position.step, s, st.optimizer, [&](int data_rank) {
          source.setup(source_context(data_rank));
          return micro_steps();
        });
        step_members = replay->members[static_cast<std::size_t>(position.step)];
      } else {
        loss = micro_steps();
      }
      if (ft && !ft->commit(position.step)) {
        step_indices.clear();
        return std::nullopt;
      }
      if (ft) step_members = ft->members();
      auto span = Tracer::span(tracer.get(), "optimizer", "compute");
      const auto optimizer_start = Clock::now();
      if (o.clip_norm > 0 || (want_metrics && log_now)) {
        scaler->unscale_(st.optimizer);
        last_norm = o.clip_norm > 0 ? s.clip_grad_norm(o.clip_norm) : grad_norm(s.gradients());
      }
      if (!scaler->step(st.optimizer)) ++summary.skipped_steps;
      scaler->update();
      if (st.schedule) st.schedule->step();
      times.optimizer += seconds_since(optimizer_start);
    }
    ++position.step;
    st.step = position.step;
    if (sample_log.is_open()) log_samples();
    return loss.item<double>();
  }

  // The mean of `value` over every rank (collective over the group): a step
  // loss is its data-parallel replica's on each of the replica's ranks (tp
  // and cp ranks hold the same value, a pipeline broadcasts it), and every
  // replica has as many ranks, so this is the mean over the data-parallel
  // ranks, the loss of the global batch.
  double mean_over_ranks(double value) {
    if (!group || world == 1) return value;
    at::Tensor t = at::tensor({value}, at::kDouble).to(group->device());
    group->all_reduce(t).wait();
    return t.cpu().item<double>() / world;
  }

  // Progress and metrics at the end of a window.
  void report(Window& window, Progress& progress, std::int64_t done_in_epoch) {
    double mean_loss = window.loss / static_cast<double>(window.steps);
    if (want_metrics) mean_loss = mean_over_ranks(mean_loss);
    summary.last_loss = mean_loss;
    char status[48];
    std::snprintf(status, sizeof status, "loss %.4f", mean_loss);
    progress.update(done_in_epoch, status);
    if (metrics) {
      const double elapsed = seconds_since(window.start);
      const double examples = static_cast<double>(o.batch_size) * o.accumulate * s.data_world() * window.steps;
      std::vector<std::pair<std::string, double>> values = {
          {"train/loss", mean_loss},
          {"train/lr", st.optimizer.param_groups().front().options().get_lr()},
          {"train/examples_per_second", examples / elapsed},
          {"train/data_wait_share", window.data_wait / elapsed}};
      if (scaler->is_enabled()) values.emplace_back("train/scale", scaler->get_scale());
      if (last_norm.defined()) values.emplace_back("train/grad_norm", last_norm.item<double>());
      metrics->log(position.step, values);
    }
    window = Window{};
  }

  // Returns false once max_steps is reached (an endless source's one pass).
  bool epoch(std::int64_t epoch) {
    const std::optional<std::int64_t> left = source.start_epoch(epoch);
    const std::int64_t steps = left ? *left : o.max_steps - position.step;
    if (steps <= 0) return left.has_value();  // resumed at the end of this epoch
    Progress progress(steps, {.label = left ? "epoch " + std::to_string(epoch + 1) : std::string("train"),
                              .enabled = rank == 0 && o.progress});
    Window window;
    bool more = true;
    for (std::int64_t i = 0; i < steps && more; ++i) {
      const bool log_now = (i + 1) % o.log_every == 0 || i + 1 == steps;
      const auto step_start = Clock::now();
      const double loss = committed_step(log_now, window);
      summary.train_seconds += seconds_since(step_start);
      summary.examples += o.batch_size * o.accumulate * s.data_world();
      window.loss += loss;
      ++window.steps;
      eval_loss_sum += loss;
      ++eval_loss_steps;
      more = o.max_steps == 0 || position.step < o.max_steps;
      if (log_now || !more) report(window, progress, i + 1);
      if (checkpoints && o.checkpoint_every > 0 && position.step % o.checkpoint_every == 0) save();
      if (o.eval_every > 0 && position.step % o.eval_every == 0) evaluate(epoch);
      if (st.on_step) st.on_step({.step = position.step, .loss = loss, .lr = last_lr});
    }
    progress.finish("loss " + std::to_string(summary.last_loss));
    if (checkpoints && o.checkpoint_every == 0) save();
    if (o.eval_every == 0) evaluate(epoch);
    return more && left.has_value();
  }

  TrainSummary run() {
    setup();
    if (o.eval_at_start && position.step == 0) evaluate(position.sampler.epoch);
    bool more = o.max_steps == 0 || position.step < o.max_steps;
    for (std::int64_t e = position.sampler.epoch; e < o.epochs && more; ++e) more = epoch(e);
    // The end is always checkpointed: a finished run resumed (or restarted) trains nothing again.
    if (checkpoints && position.step > 0 && last_saved_step != position.step) save();
    if (o.eval_every > 0 && last_eval_step != position.step && position.step > 0) evaluate(position.sampler.epoch);
    if (tracer) tracer->write();
    summary.steps = position.step;
    summary.step_times = times;
    return summary;
  }
};

TrainSummary Trainer::run() {
  return Run(*this, *state_).run();
}

}  // namespace dtrain
