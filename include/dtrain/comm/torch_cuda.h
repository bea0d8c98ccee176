// LibTorch's CUDA part on demand, for programs linked with its CPU part only
// (libdtrain's link, dtrain_torch_cpu_link).
#pragma once

namespace dtrain {

// Loads libtorch_cuda.so from libtorch_cpu.so's folder, once, when the CUDA
// driver sees a device (DeviceInventory::current()) or DTRAIN_TORCH_CUDA=load
// asks for it; returns whether it is loaded. Where no device is visible a
// process so skips LibTorch's CUDA libraries, their start-up time and
// resident memory (docs/build.md, "What links what").
// LibTorch decides once, at its first CUDA query (at::detail::getCUDAHooks(),
// which torch::manual_seed makes too), whether the process has CUDA, so this
// must run before any: the dtrain_torch_cuda_on_demand object that programs
// link runs it from a static initializer. A CPU-only LibTorch (no such file)
// returns false; a CUDA LibTorch whose CUDA part fails to load is reported on
// stderr (with dlopen's reason) and returns false, and the first CUDA tensor
// then fails with LibTorch's own error.
bool load_torch_cuda();

}  // namespace dtrain
