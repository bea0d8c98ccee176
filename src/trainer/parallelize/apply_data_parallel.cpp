// The data-parallel appliers over whole replicas: DDP over dp_replicate
// (over a ModelParallel split of this process's devices: the hybrid), and
// one process (one device, DataParallel, ModelParallel).
#include "appliers.h"
#include "dtrain/comm/device.h"
#include "dtrain/log.h"
#include "dtrain/parallel/data_parallel/data_parallel.h"
#include "dtrain/parallel/model_parallel/model_parallel.h"

namespace dtrain::detail {

namespace {

// The layers placed over this process's devices (balanced parameter memory).
ModelParallel model_parallel_split(const ApplyContext& c) {
  ModelParallel split(c.parts.layers(), ModelParallelOptions{.devices = c.devices()});
  if (c.lead()) {
    DTRAIN_LOG(kInfo) << "layers placed on " << format_devices(split->device_of_layer());
  }
  return split;
}

std::function<at::Tensor(const at::Tensor&)> forward_of(ModelParallel split, c10::Device input) {
  return [split, input](const at::Tensor& x) mutable { return split->forward(x.to(input)); };
}

}  // namespace

Parallelized apply_ddp(const ApplyContext& c) {
  const c10::Device first = c.device();
  if (c.options.local == LocalSplit::kModelParallel) {
    ModelParallel split = model_parallel_split(c);
    auto s =
        std::make_shared<DdpStrategy<ModelParallel>>(split, c.group(), first, split->output_device(), c.options.ddp);
    return trained_module_is_whole(s, split.ptr(), forward_of(split, first));
  }
  LayerStack stack = c.stack(c.parts.layers());
  stack->to(first);
  auto s = std::make_shared<DdpStrategy<LayerStack>>(stack, c.group(), first, first, c.options.ddp);
  return trained_module_is_whole(s, stack.ptr(), forward_on(stack, first));
}

Parallelized apply_local(const ApplyContext& c) {
  const c10::Device first = c.device();
  if (c.options.local == LocalSplit::kModelParallel) {
    ModelParallel split = model_parallel_split(c);
    auto s = std::make_shared<ForwardStrategy>(
        ForwardStrategy::Parts{.name = "model-parallel",
                               .module = split.ptr(),
                               .forward = [split](const at::Tensor& x) mutable { return split->forward(x); },
                               .input_device = first,
                               .output_device = split->output_device()});
    return trained_module_is_whole(s, split.ptr(), forward_of(split, first));
  }
  LayerStack stack = c.stack(c.parts.layers());
  stack->to(first);
  std::shared_ptr<Strategy> s;
  if (c.options.local == LocalSplit::kDataParallel) {
    auto dp = std::make_shared<DataParallel<LayerStack>>(stack, DataParallelOptions{.devices = c.devices()});
    s = std::make_shared<ForwardStrategy>(
        ForwardStrategy::Parts{.name = "dp",
                               .module = stack.ptr(),
                               .forward = [dp](const at::Tensor& x) { return (*dp)(x); },
                               .input_device = first,
                               .output_device = first});
  } else {
    s = std::make_shared<SingleDeviceStrategy<LayerStack>>(stack, first);
  }
  return trained_module_is_whole(s, stack.ptr(), forward_on(stack, first));
}

}  // namespace dtrain::detail
