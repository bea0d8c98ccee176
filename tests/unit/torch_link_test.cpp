// A program that links all of LibTorch (dtrain_torch_link: what programs that
// use CUDA themselves link, the GPU tests among them) uses std::filesystem safely, in its own code and in libdtrain's:
// Note [no libtorch.so] in cmake/DtrainTorch.cmake. Linked through
// libtorch.so, the 2.11 CUDA wheel's partial libstdc++ copies made these
// calls jump to address 0 (SIGSEGV, seen on an H100 and without a GPU); CI's
// 2.11 leg runs this binary with that wheel.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

#include "dtrain/checkpoint/checkpointer.h"
#include "proc_maps.h"

namespace fs = std::filesystem;

TEST(TorchLink, FilesystemCallsWorkBesideAllOfLibTorch) {
  const fs::path dir = fs::temp_directory_path() / ("dtrain-torch-link-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "a" / "b");
  std::ofstream(dir / "a" / "b" / "file") << "x";
  EXPECT_TRUE(fs::exists(dir / "a" / "b" / "file"));
  // libdtrain's own calls: saving prunes older checkpoints with remove_all.
  dtrain::Checkpointer checkpoints({.dir = dir / "ckpt", .keep = 1});
  for (std::int64_t step = 1; step <= 3; ++step) checkpoints.save({.step = step});
  EXPECT_EQ(checkpoints.latest_step(), 3);
  int kept = 0;
  for (const auto& entry : fs::directory_iterator(dir / "ckpt")) kept += entry.is_directory() ? 1 : 0;
  EXPECT_EQ(kept, 1);
  fs::remove_all(dir);
  EXPECT_FALSE(fs::exists(dir));
}

// Without libtorch.so the CUDA part must still load where the LibTorch has
// one: nothing references libtorch_cuda, yet it registers the CUDA hooks.
TEST(TorchLink, CudaPartOfLibTorchLoads) {
#if DTRAIN_TEST_TORCH_HAS_CUDA
  EXPECT_TRUE(dtrain::testing::process_maps_contain("libtorch_cuda"))
      << "libtorch_cuda.so is not loaded: the CUDA hooks are missing";
#else
  GTEST_SKIP() << "this LibTorch has no CUDA part";
#endif
  EXPECT_FALSE(dtrain::testing::process_maps_contain("/libtorch.so"))
      << "libtorch.so is loaded (Note [no libtorch.so])";
}
