// dtrain::Trainer: the training loop that ties a strategy, a data loader, AMP,
// accumulation, clipping, evaluation, checkpoints, progress and metrics
// together.
//
//   auto strategy = std::make_shared<dtrain::DdpStrategy<Net>>(net, group, device, device);
//   torch::optim::AdamW opt(net->parameters(), 1e-3);
//   dtrain::Trainer trainer(strategy, opt, train_set, {.epochs = 2, .batch_size = 64,
//                                                      .amp_dtype = at::kBFloat16, .accumulate = 2,
//                                                      .clip_norm = 1.0, .checkpoint_dir = "ckpt"});
//   trainer.set_eval_dataset(test_set);
//   const auto summary = trainer.fit();
//
// One optimizer step takes `accumulate` micro-batches of batch_size examples
// per data-parallel rank (the first accumulate-1 under the strategy's
// no_sync), each loss divided by accumulate; under amp_dtype the forward and
// loss run in Autocast and a GradScaler scales the loss (on by default for
// fp16 only); gradients are unscaled, clipped by global norm over the
// strategy's GradientSet, and the optimizer steps (unless the scaler skips),
// then the schedule. Checkpoints hold the model and optimizer (through the
// strategy), the scaler, the schedule, the sampler position and every rank's
// generators, so a resumed run equals an uninterrupted one bit for bit.
//
// Batches come from a BatchSource (batch_source.h): epochs over a Dataset
// (the constructor taking a dataset), or a stream indexed by the global step
// (e.g. a language model's random windows), which runs to max_steps.
//
// Every piece is public and usable from a hand-written loop: Autocast,
// GradScaler, accumulate_gradients, clip_grad_norm_, Checkpointer, the
// schedules, MetricsLogger and Tracer. See docs/trainer.md.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "dtrain/data/dataset.h"
#include "dtrain/trainer/batch_source.h"
#include "dtrain/trainer/fault_tolerance.h"
#include "dtrain/trainer/lr_schedule.h"
#include "dtrain/trainer/memory_check.h"
#include "dtrain/trainer/strategy.h"

namespace dtrain {

struct TrainerOptions {
  int epochs = 1;
  std::int64_t max_steps = 0;    // stop after this many optimizer steps (0: run all epochs; needed by a StepStream)
  std::int64_t batch_size = 64;  // examples per micro-batch per data-parallel rank
  int accumulate = 1;            // micro-batches per optimizer step
  // The dataset constructor's EpochSource (batch_source.h):
  std::uint64_t seed = 0;        // the sampler's shuffling (seed + epoch)
  int num_workers = 0;           // loader threads per rank
  std::int64_t train_limit = 0;  // train on the first N examples only (0: all)

  std::optional<c10::ScalarType> amp_dtype;  // at::kBFloat16 / at::kHalf: autocast the forward
  std::optional<bool> grad_scaler;           // default: on for fp16 only
  double clip_norm = 0;                      // > 0: clip gradients to this global norm

  std::int64_t eval_every = 0;  // steps between evaluations (0: at the end of each epoch)
  bool eval_at_start = false;   // also evaluate before the first step of a run that starts at step 0
  std::int64_t eval_batch_size = 1000;
  std::int64_t eval_limit = 0;  // evaluate on the first N examples of set_eval_dataset's set only (0: all)

  std::filesystem::path checkpoint_dir;  // "" = no checkpoints
  std::int64_t checkpoint_every = 0;     // steps between checkpoints (0: at the end of each epoch)
  int keep_checkpoints = 2;

  bool progress = true;         // the bar / progress lines on rank 0 (stderr)
  std::int64_t log_every = 20;  // steps between progress updates and metric records

  // Observability, off by default. Under fault_tolerance each replica group
  // G of W ranks keeps its own: metrics <stem>.replica<G><ext> and
  // <tensorboard_dir>/replica<G> from its rank 0, and rank r's trace
  // trace.rank<G * W + r>.json (as its sample log; trace.json when the job
  // is one group of one rank).
  std::filesystem::path metrics_jsonl;    // JSON lines, rank 0
  std::filesystem::path tensorboard_dir;  // TensorBoard event file, rank 0
  std::filesystem::path trace_file;       // Chrome trace, one per rank (trace.rank<R>.json)
  // Audit of the data each step trained on, for elastic and fault-injected
  // runs: rank R appends one JSON line per optimizer step to
  // <stem>.rank<R><ext>: {"round","rank","world","epoch","step","t_ns","pid","indices"}
  // (round: the launcher's DTRAIN_RDZV_ROUND, -1 without one; pid: which
  // incarnation of the rank trained it, for audits of killed ranks; under
  // fault tolerance also "replica" and "members"). The step a
  // run last executed is the one its checkpoints hold (bench/chaos checks it).
  std::filesystem::path sample_log;

  // Train as one fault-tolerant replica group (fault_tolerance.h): a quorum
  // per step, the gradients averaged over the live replica groups, live
  // recovery of a restarted one. Needs a StepStream and max_steps.
  std::optional<TrainerFaultTolerance> fault_tolerance;

  // Before the first step, the plan's predicted peak memory per rank
  // against what a rank may use (memory_check.h): a plan that does not fit
  // stops on every rank with a ConfigError saying what does not fit, by how
  // much and the nearest plan that fits. Collective: set it on every rank
  // or on none. MemoryCheck::enabled false skips it (--no-memory-check).
  std::optional<MemoryCheck> memory_check;
};

struct EvalResult {
  double loss = 0;      // mean over examples (each batch's loss weighted by its examples)
  double accuracy = 0;  // argmax over the last dimension == target, over every target element
  std::int64_t examples = 0;
};

// What on_eval callbacks receive.
struct EvalReport {
  std::int64_t epoch = 0;  // 0-based
  std::int64_t step = 0;   // optimizer steps taken
  double train_loss = 0;   // the mean step loss since the previous evaluation, over every data-parallel rank
  EvalResult eval;
};

// What on_step callbacks receive, on every rank, after each optimizer step
// (and after that step's checkpoint and evaluation, if any).
struct StepReport {
  std::int64_t step = 0;  // optimizer steps taken
  double loss = 0;        // this step's loss on this rank (a pipeline's on every rank)
  double lr = 0;          // the first parameter group's rate the step used
};

// Seconds of this run's steps by phase (a strategy that fuses forward, loss
// and backward, such as a pipeline, counts the whole as forward).
struct StepTimes {
  double forward = 0, backward = 0, optimizer = 0;
};

struct TrainSummary {
  std::int64_t steps = 0;          // optimizer steps in total (including before a resume)
  std::int64_t skipped_steps = 0;  // skipped by the GradScaler in this run
  std::optional<EvalResult> last_eval;
  double train_seconds = 0;   // this run's, excluding evaluation
  StepTimes step_times;       // this run's, by phase
  std::int64_t examples = 0;  // trained in this run, all ranks together
  double last_loss = 0;
};

class Trainer {
 public:
  using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;
  using Dataset = data::Dataset<data::TensorExample>;

  using EvalBatchFn = std::function<data::TensorBatch(std::int64_t k)>;

  // The optimizer must be over strategy->parameters(). Default loss: cross-entropy.
  // Epochs over train_set (an EpochSource from options' seed, num_workers, train_limit).
  Trainer(std::shared_ptr<Strategy> strategy, torch::optim::Optimizer& optimizer,
          std::shared_ptr<const Dataset> train_set, TrainerOptions options);
  // Batches from `source`.
  Trainer(std::shared_ptr<Strategy> strategy, torch::optim::Optimizer& optimizer, std::shared_ptr<BatchSource> source,
          TrainerOptions options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  void set_loss(LossFn loss);
  void set_schedule(std::shared_ptr<ScheduledLR> schedule);
  // Evaluated every eval_every steps and at the end; every rank takes an equal share.
  void set_eval_dataset(std::shared_ptr<const Dataset> eval_set);
  // Or `count` fixed batches, batch(k) for k in [0, count): data rank r of w
  // evaluates k = r, r + w, ... (a batch is a whole batch of the model's, not
  // a rank's share). Replaces an eval dataset.
  void set_eval_batches(std::int64_t count, EvalBatchFn batch);
  // Called on every rank after each evaluation (e.g. to print it on rank 0).
  void on_eval(std::function<void(const EvalReport&)> callback);
  // Adds a state to every checkpoint the run saves and loads (as
  // Checkpointer::add_state, checked there; with TrainerOptions::checkpoint_dir),
  // e.g. checkpoint::hf_mapping_state, so the checkpoints convert to a
  // Hugging Face folder. The object must outlive fit().
  void add_checkpoint_state(const std::string& name, std::shared_ptr<Stateful> object,
                            StateScope scope = StateScope::kReplicated);
  // Called on every rank after each optimizer step.
  void on_step(std::function<void(const StepReport&)> callback);

  // Resumes from the newest checkpoint when there is one, then trains.
  // Errors are logged with this rank and step, written to the launcher's
  // error file, and rethrown.
  TrainSummary fit();
  // Loss and accuracy over the eval dataset, combined over the strategy's group.
  EvalResult evaluate();

  Strategy& strategy() { return *strategy_; }

 private:
  TrainSummary run();
  struct State;
  struct Run;
  std::unique_ptr<State> state_;
  std::shared_ptr<Strategy> strategy_;
};

}  // namespace dtrain
