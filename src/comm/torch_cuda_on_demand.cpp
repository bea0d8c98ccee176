// The dtrain_torch_cuda_on_demand object: linked into a program built with
// LibTorch's CPU part only (as libdtrain is) that may put tensors on CUDA
// devices. Its static initializer loads LibTorch's CUDA part before main()
// where the CUDA driver sees a device, and not elsewhere (load_torch_cuda()
// in dtrain/comm/torch_cuda.h says why it must run before any CUDA query). It
// runs after the initializers of the shared libraries it needs (LibTorch's,
// libdtrain's), and before the program's code.
#include "dtrain/comm/torch_cuda.h"

namespace {
[[maybe_unused]] const bool torch_cuda_loaded = dtrain::load_torch_cuda();
}  // namespace
