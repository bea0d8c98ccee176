// The Trainer's loop. See trainer.h for what one step does.
#include "dtrain/trainer/trainer.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dtrain/amp/autocast.h"
#include "dtrain/amp/grad_scaler.h"
#include "dtrain/data/loader.h"
#include "dtrain/elastic/error_file.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "dtrain/trainer/checkpoint.h"
#include "dtrain/trainer/clip.h"
#include "dtrain/trainer/metrics.h"
#include "dtrain/trainer/progress.h"
#include "dtrain/trainer/trace.h"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

struct Trainer::State {
  torch::optim::Optimizer& optimizer;
  std::shared_ptr<const Dataset> train_set;
  TrainerOptions options;
  LossFn loss = [](const at::Tensor& output, const at::Tensor& target) {
    return torch::nn::functional::cross_entropy(output, target);
  };
  std::shared_ptr<ScheduledLR> schedule;
  std::shared_ptr<const Dataset> eval_set;
  std::function<void(const EvalReport&)> on_eval;
  std::int64_t step = 0;  // for error messages
};

Trainer::Trainer(std::shared_ptr<Strategy> strategy, torch::optim::Optimizer& optimizer,
                 std::shared_ptr<const Dataset> train_set, TrainerOptions options)
    : state_(std::make_unique<State>(
          State{.optimizer = optimizer, .train_set = std::move(train_set), .options = std::move(options)})),
      strategy_(std::move(strategy)) {
  const auto& o = state_->options;
  DTRAIN_CHECK(strategy_ != nullptr && state_->train_set != nullptr, ConfigError,
               "the Trainer needs a strategy and a training set.", "pass both");
  DTRAIN_CHECK(o.epochs >= 1 && o.batch_size >= 1 && o.accumulate >= 1 && o.eval_batch_size >= 1 && o.log_every >= 1 &&
                   o.max_steps >= 0 && o.clip_norm >= 0,
               ConfigError,
               "TrainerOptions: epochs " << o.epochs << ", batch_size " << o.batch_size << ", accumulate "
                                         << o.accumulate << ", eval_batch_size " << o.eval_batch_size << ", log_every "
                                         << o.log_every << ", max_steps " << o.max_steps << ", clip_norm "
                                         << o.clip_norm << ".",
               "counts must be at least 1 (max_steps and clip_norm at least 0)");
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
void Trainer::set_eval_dataset(std::shared_ptr<const Dataset> eval_set) {
  state_->eval_set = std::move(eval_set);
}
void Trainer::on_eval(std::function<void(const EvalReport&)> callback) {
  state_->on_eval = std::move(callback);
}

EvalResult Trainer::evaluate() {
  EvalResult result;
  if (!state_->eval_set) return result;
  Strategy& s = *strategy_;
  const auto& o = state_->options;
  torch::NoGradGuard no_grad;
  s.module().eval();
  // Rank r of w takes the r-th contiguous share: every example exactly once.
  const std::int64_t n = state_->eval_set->size();
  const std::int64_t begin = n * s.data_rank() / s.data_world();
  const std::int64_t end = n * (s.data_rank() + 1) / s.data_world();
  double loss_sum = 0;
  std::int64_t correct = 0, examples = 0;
  for (std::int64_t start = begin; start < end; start += o.eval_batch_size) {
    std::vector<std::int64_t> indices;
    for (std::int64_t i = start; i < std::min(end, start + o.eval_batch_size); ++i) indices.push_back(i);
    const auto batch = data::collate_tensors(state_->eval_set->get_many(indices));
    const at::Tensor target = batch.target.to(s.output_device());
    at::Tensor output, loss;
    {
      std::optional<amp::Autocast> autocast;
      if (o.amp_dtype) autocast.emplace(s.input_device().type(), amp::AutocastOptions{.dtype = o.amp_dtype});
      output = s.eval_forward(batch.data.to(s.input_device()));
      if (output.defined()) loss = state_->loss(output, target);
    }
    if (!output.defined()) continue;  // another rank of this pipeline has the outputs
    loss_sum += loss.item<double>() * static_cast<double>(indices.size());
    correct += output.argmax(-1).eq(target).sum().item<std::int64_t>();
    examples += static_cast<std::int64_t>(indices.size());
  }
  s.module().train();
  at::Tensor totals = at::tensor({loss_sum, static_cast<double>(correct), static_cast<double>(examples)}, at::kDouble);
  if (auto group = s.group()) {
    totals = totals.to(group->device());
    group->all_reduce(totals).wait();
    totals = totals.cpu();
  }
  const auto* t = totals.data_ptr<double>();
  result.examples = static_cast<std::int64_t>(t[2]);
  if (result.examples > 0) {
    result.loss = t[0] / t[2];
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
  std::unique_ptr<data::TensorLoader> loader;
  std::unique_ptr<amp::GradScaler> scaler;
  std::optional<Checkpointer> checkpoints;
  std::unique_ptr<Tracer> tracer;
  std::ofstream sample_log;
  std::vector<std::int64_t> step_indices;  // the current step's examples, for sample_log
  std::optional<MetricsLogger> metrics;    // rank 0
  TrainingState position;
  TrainSummary summary;
  at::Tensor last_norm;
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

  Run(Trainer& t, State& state) : trainer(t), s(*t.strategy_), st(state), o(state.options), group(s.group()) {
    rank = group ? group->rank() : 0;
    world = group ? group->size() : 1;
    want_metrics = !o.metrics_jsonl.empty() || !o.tensorboard_dir.empty();
  }

  void setup() {
    const std::int64_t n = o.train_limit > 0 ? std::min(o.train_limit, st.train_set->size()) : st.train_set->size();
    DTRAIN_CHECK(n / s.data_world() > 0, ConfigError,
                 n << " training examples cannot be shared by " << s.data_world() << " ranks.",
                 "use more examples or fewer ranks");
    auto sampler = std::make_shared<data::DistributedSampler>(data::DistributedSamplerOptions{
        .dataset_size = n, .num_replicas = s.data_world(), .rank = s.data_rank(), .seed = o.seed, .drop_last = true});
    loader = data::make_tensor_loader(
        st.train_set, sampler,
        {.batch_size = o.batch_size, .drop_last = s.needs_whole_batches(), .num_workers = o.num_workers});
    scaler = std::make_unique<amp::GradScaler>(amp::GradScalerOptions{
        .enabled = o.grad_scaler.value_or(o.amp_dtype == at::kHalf), .found_inf_group = s.found_inf_group()});
    if (!o.checkpoint_dir.empty()) resume();
    st.step = position.step;
    if (!o.sample_log.empty()) {
      const auto& f = o.sample_log;
      const auto path = f.parent_path() / (f.stem().string() + ".rank" + std::to_string(rank) + f.extension().string());
      sample_log.open(path, std::ios::app);
      DTRAIN_CHECK(sample_log.good(), ConfigError, "cannot open the sample log " << path.string() << ".",
                   "check that the sample log's folder exists and is writable");
    }
    if (!o.trace_file.empty()) {
      tracer = std::make_unique<Tracer>(per_rank_path(o.trace_file, rank, world), rank);
      s.set_tracer(tracer.get());
    }
    if (want_metrics && rank == 0) {
      metrics.emplace(MetricsOptions{.jsonl = o.metrics_jsonl, .tensorboard_dir = o.tensorboard_dir});
    }
    DTRAIN_LOG(kDebug) << s.name() << " training on " << n / s.data_world() << " examples per rank, " << o.epochs
                       << " epochs, micro-batch " << o.batch_size << " x " << o.accumulate << " per rank"
                       << (o.amp_dtype ? std::string(", autocast ") + c10::toString(*o.amp_dtype) : std::string());
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
    if (auto resumed = s.load(*checkpoints, st.optimizer)) {
      position = *resumed;
      last_saved_step = position.step;
      loader->load_state(resumed->sampler);
    }
  }

  void save() {
    position.sampler = loader->state();
    s.save(*checkpoints, position, st.optimizer);
    last_saved_step = position.step;
  }

  void evaluate(std::int64_t epoch) {
    if (!st.eval_set) return;
    EvalReport report{.epoch = epoch,
                      .step = position.step,
                      .train_loss = eval_loss_steps > 0 ? eval_loss_sum / static_cast<double>(eval_loss_steps) : 0,
                      .eval = trainer.evaluate()};
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
      batch = loader->next();
      window.data_wait += seconds_since(wait_start);
    }
    DTRAIN_INTERNAL_ASSERT(batch.has_value(), "the loader ran out inside a planned step");
    if (sample_log.is_open()) {
      const auto indices = loader->last_indices();
      step_indices.insert(step_indices.end(), indices.begin(), indices.end());
    }
    const at::Tensor input = batch->data.to(s.input_device());
    const at::Tensor target = batch->target.to(s.output_device());
    if (s.fuses_loss()) {
      auto span = Tracer::span(tracer.get(), "forward_backward", "compute");
      std::optional<amp::Autocast> autocast;
      if (o.amp_dtype) autocast.emplace(s.input_device().type(), amp::AutocastOptions{.dtype = o.amp_dtype});
      return s.forward_backward(input, target, scaler->is_enabled() ? scaler.get() : nullptr).to(at::kFloat);
    }
    auto no_sync = m + 1 < o.accumulate ? s.no_sync() : nullptr;
    at::Tensor loss;
    {
      auto span = Tracer::span(tracer.get(), "forward", "compute");
      std::optional<amp::Autocast> autocast;
      if (o.amp_dtype) autocast.emplace(s.input_device().type(), amp::AutocastOptions{.dtype = o.amp_dtype});
      loss = st.loss(s.forward(input), target);
      if (o.accumulate > 1) loss = loss / o.accumulate;
    }
    auto span = Tracer::span(tracer.get(), "backward", "compute");
    s.backward(scaler->scale(loss));
    return loss.detach().to(at::kFloat);
  }

  void log_samples() {
    const char* round = std::getenv("DTRAIN_RDZV_ROUND");
    const auto t =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
    sample_log << nlohmann::json{{"round", round != nullptr ? std::atoi(round) : -1},
                                 {"rank", rank},
                                 {"world", world},
                                 {"epoch", loader->state().epoch},
                                 {"step", position.step},
                                 {"t_ns", t},
                                 {"indices", step_indices}}
                      .dump()
               << '\n'
               << std::flush;
    step_indices.clear();
  }

  // One optimizer step over `accumulate` micro-batches; returns its loss.
  double step(bool log_now, Window& window) {
    if (tracer) tracer->set_step(position.step + 1);
    at::Tensor loss;
    {
      auto step_span = Tracer::span(tracer.get(), "step", "step");
      s.zero_grad(st.optimizer);
      for (int m = 0; m < o.accumulate; ++m) {
        const at::Tensor part = micro_step(m, window);
        loss = loss.defined() ? loss + part : part;
      }
      auto span = Tracer::span(tracer.get(), "optimizer", "compute");
      if (o.clip_norm > 0 || (want_metrics && log_now)) {
        scaler->unscale_(st.optimizer);
        last_norm = o.clip_norm > 0 ? s.clip_grad_norm(o.clip_norm) : grad_norm(*s.gradients());
      }
      if (!scaler->step(st.optimizer)) ++summary.skipped_steps;
      scaler->update();
      if (st.schedule) st.schedule->step();
    }
    ++position.step;
    st.step = position.step;
    if (sample_log.is_open()) log_samples();
    return loss.item<double>();
  }

  // Progress and metrics at the end of a window.
  void report(Window& window, Progress& progress, std::int64_t done_in_epoch) {
    double mean_loss = window.loss / static_cast<double>(window.steps);
    if (want_metrics && group) {  // the mean over ranks (every rank takes part)
      at::Tensor t = at::tensor({mean_loss}, at::kDouble).to(group->device());
      group->all_reduce(t).wait();
      mean_loss = t.cpu().item<double>() / world;
    }
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

  // Returns false once max_steps is reached.
  bool epoch(std::int64_t epoch) {
    loader->start_epoch(epoch);
    const std::int64_t steps = loader->remaining() / o.accumulate;  // a tail short of a whole step is not used
    if (steps == 0) return true;                                    // resumed at the end of this epoch
    Progress progress(steps, {.label = "epoch " + std::to_string(epoch + 1), .enabled = rank == 0 && o.progress});
    Window window;
    bool more = true;
    for (std::int64_t i = 0; i < steps && more; ++i) {
      const bool log_now = (i + 1) % o.log_every == 0 || i + 1 == steps;
      const auto step_start = Clock::now();
      const double loss = step(log_now, window);
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
    }
    progress.finish("loss " + std::to_string(summary.last_loss));
    if (checkpoints && o.checkpoint_every == 0) save();
    if (o.eval_every == 0) evaluate(epoch);
    return more;
  }

  TrainSummary run() {
    setup();
    bool more = o.max_steps == 0 || position.step < o.max_steps;
    for (std::int64_t e = position.sampler.epoch; e < o.epochs && more; ++e) more = epoch(e);
    // The end is always checkpointed: a finished run resumed (or restarted) trains nothing again.
    if (checkpoints && position.step > 0 && last_saved_step != position.step) save();
    if (o.eval_every > 0 && last_eval_step != position.step && position.step > 0) evaluate(position.sampler.epoch);
    if (tracer) tracer->write();
    summary.steps = position.step;
    return summary;
  }
};

TrainSummary Trainer::run() {
  return Run(*this, *state_).run();
}

}  // namespace dtrain
