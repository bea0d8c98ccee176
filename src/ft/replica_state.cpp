// ReplicaState for a module and an optimizer (include/dtrain/ft/replicas.h).
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include "dtrain/ft/replicas.h"

namespace dtrain::ft {

ReplicaState module_and_optimizer_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                                        ReplicaState extra) {
  ReplicaState state;
  state.save = [&module, &optimizer, extra](torch::serialize::OutputArchive& archive) {
    for (const auto& p : module.named_parameters()) archive.write("param/" + p.key(), p.value());
    for (const auto& b : module.named_buffers()) archive.write("buffer/" + b.key(), b.value());
    torch::serialize::OutputArchive opt;
    optimizer.save(opt);
    archive.write("optimizer", opt);
    if (extra.save) extra.save(archive);
  };
  state.load = [&module, &optimizer, extra](torch::serialize::InputArchive& archive) {
    torch::NoGradGuard no_grad;
    // Copies, not set_(): the receiver's tensors stay the ones its optimizer,
    // hooks and views refer to.
    auto copy_into = [&archive](const std::string& key, at::Tensor& into) {
      at::Tensor read;
      archive.read(key, read);
      into.copy_(read);
    };
    for (auto& p : module.named_parameters()) copy_into("param/" + p.key(), p.value());
    for (auto& b : module.named_buffers()) copy_into("buffer/" + b.key(), b.value());
    torch::serialize::InputArchive opt;
    archive.read("optimizer", opt);
    optimizer.load(opt);
    if (extra.load) extra.load(archive);
  };
  return state;
}

}  // namespace dtrain::ft
