// Gradient accumulation: one optimizer step over several micro-batches, with
// gradient synchronization only on the last one.
//
//   opt.zero_grad();
//   dtrain::accumulate_gradients(ddp, k, [&](int i) {
//     auto [x, y] = micro_batch(i);                    // k equal-sized parts of the batch
//     (loss_fn(ddp(x), y) / k).backward();             // or scaler.scale(loss / k).backward()
//   });
//   opt.step();                                        // == one step on the union of the k parts
//
// micro_step(0..k-2) run under model.no_sync(): DDP's backward then only adds
// into the local gradients, and the backward of micro_step(k-1) all-reduces
// their sum, once. With the loss of each micro-batch divided by k (and equal
// micro-batch sizes; otherwise weight each by its share of the examples), the
// summed gradient is the mean-loss gradient of the union: the same step as
// one big batch, at the memory of one micro-batch and one all-reduce per
// step. A model without no_sync() (a plain module, DataParallel) just runs the
// k micro-steps. See docs/amp.md.
#pragma once

#include <utility>

#include "dtrain/error.h"

namespace dtrain {

template <typename Model>
concept HasNoSync = requires(Model& model) {
  model.no_sync();
};

// Calls micro_step(i) for i = 0..micro_batches-1, all but the last under
// model.no_sync() when the model has one. micro_step must run a forward and a
// backward; it may throw (no_sync is left properly).
template <typename Model, typename MicroStep>
void accumulate_gradients(Model& model, int micro_batches, MicroStep&& micro_step) {
  DTRAIN_CHECK(micro_batches >= 1, ConfigError, "accumulate_gradients over " << micro_batches << " micro-batches",
               "pass the number of micro-batches per optimizer step, at least 1");
  for (int i = 0; i + 1 < micro_batches; ++i) {
    if constexpr (HasNoSync<Model>) {
      auto no_sync = model.no_sync();
      micro_step(i);
    } else {
      micro_step(i);
    }
  }
  std::forward<MicroStep>(micro_step)(micro_batches - 1);
}

}  // namespace dtrain
