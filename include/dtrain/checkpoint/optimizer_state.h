// A LibTorch optimizer's state in the structure of Python's
// optimizer.state_dict(), so that a checkpoint written with save_torch_file
// resumes in Python with optimizer.load_state_dict(torch.load(f,
// weights_only=True)["optimizer"]):
//   {"state": {0: {"step": tensor(3.), "exp_avg": ..., "exp_avg_sq": ...}, ...},
//    "param_groups": [{"lr": ..., "betas": (0.9, 0.999), ..., "params": [0, 1]}, ...]}
// Parameters are numbered in group order, as Python numbers them; a parameter
// with no state yet (never stepped) has no entry. AdamW and SGD (and their
// subclasses, such as the GPT example's FusedAdamW) are known; any other
// optimizer is a ConfigError.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <memory>

namespace torch::optim {
class Optimizer;
class OptimizerOptions;
}  // namespace torch::optim

namespace dtrain::checkpoint {

c10::IValue python_optimizer_state_dict(const torch::optim::Optimizer& optimizer);

// The reverse: Python's optimizer.state_dict() (as load_torch_file reads it)
// into a LibTorch AdamW or SGD built over the same parameters in the same
// groups, as optimizer.load_state_dict does in Python: the groups' options
// (lr, betas, eps, weight_decay, amsgrad; momentum, dampening, nesterov) and
// every parameter's state, shapes checked against the parameters. A state
// dict of another structure, group count or size is a DataError; Python's
// flags LibTorch lacks (maximize, foreach, fused, ...) must be at their
// defaults or it is a ConfigError.
void load_python_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state_dict);

// One param group's options in Python's structure (without "params"), as
// python_optimizer_state_dict writes them; AdamW and SGD options.
c10::impl::GenericDict python_param_group(const torch::optim::OptimizerOptions& options);
// The reverse: LibTorch AdamWOptions (a group with betas) or SGDOptions (with
// momentum) from a Python param group; other groups are a DataError, Python
// flags LibTorch lacks a ConfigError (as load_python_optimizer_state_dict).
std::shared_ptr<torch::optim::OptimizerOptions> options_from_python_param_group(const c10::impl::GenericDict& group);

}  // namespace dtrain::checkpoint
