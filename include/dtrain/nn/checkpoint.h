// Activation checkpointing: run a piece of the network without keeping the
// tensors its backward needs, and run it again in backward to get them
// (Chen et al. 2016; PyTorch's torch.utils.checkpoint, which LibTorch lacks).
//
//   at::Tensor y = dtrain::nn::checkpoint(
//       [&](const std::vector<at::Tensor>& in) { return block(in[0]); }, {x}, block->parameters());
//
// Between forward and backward only `inputs` (and the output, which the
// caller holds) stay alive; in backward, fn runs once more on the saved
// inputs with autograd on, and the gradients of the inputs and of `params`
// come from that recomputed graph. Memory falls by everything fn's ops would
// have saved; time grows by one forward of fn.
//
// Contract:
//  - fn is a function of `inputs` and of the tensors in `params` only.
//    Parameters fn reads must be listed in `params`, or they get no gradient
//    (fn may read them through the module; they need not be passed to it).
//  - fn runs twice. Random ops see the same generator state both times (the
//    CPU default generator, and each accelerator device's of the inputs, are
//    saved at forward and restored for the recompute, then put back), and
//    autocast is on or off with the same dtype as at forward. So gradients
//    equal those of fn run directly, bit for bit where fn's kernels are
//    deterministic.
//  - Inputs that are not floating point (token ids) are saved and passed
//    again; they get no gradient.
//  - Without grad mode, or when nothing requires grad, it is fn(inputs).
//  - Higher-order gradients (backward with create_graph) are not supported:
//    ConfigError in backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace dtrain::nn {

using CheckpointFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

at::Tensor checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& params = {});

}  // namespace dtrain::nn
