// The library's CUDA-specific paths, each on one GPU where it can run there:
// device selection under CUDA_VISIBLE_DEVICES, every NCCL collective, NCCL
// send/recv of pipeline-shaped activations, GradScaler with fp16 autocast on
// CUDA tensors, pinned batches and non-blocking copies from the loader, CUDA
// generator state in checkpoints, and the NCCL module's lazy load. Each test
// skips where no (or too few) GPUs are visible.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include <unistd.h>

#include "dtrain/amp/autocast.h"
#include "dtrain/amp/grad_scaler.h"
#include "dtrain/checkpoint/checkpointer.h"
#include "dtrain/comm/device.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/data/loader.h"
#include "dtrain/error.h"
#include "gpu.h"
#include "ranks.h"

namespace {

using dtrain::dist::ReduceOp;

dtrain::dist::ProcessGroup nccl_group(int rank) {
  return dtrain::dist::init_process_group(dtrain::dist::GroupOptions{
      .device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(rank)), .timeout = std::chrono::seconds(60)});
}

bool maps_contain(const std::string& library) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find(library) != std::string::npos) return true;
  }
  return false;
}

class Ramp : public dtrain::data::Dataset<dtrain::data::TensorExample> {
 public:
  std::int64_t size() const override { return 10; }
  dtrain::data::TensorExample get(std::int64_t i) const override {
    return {at::full({3}, static_cast<float>(i)), at::full({}, i, at::kLong)};
  }
};

}  // namespace

TEST(GpuDevices, CudaVisibleDevicesNarrowsWhatIsSeen) {
  DTRAIN_REQUIRE_GPU();
  // Each child starts CUDA afresh under its own CUDA_VISIBLE_DEVICES.
  dtrain::testing::run_rank_processes(
      2,
      [](int rank) {
        const auto inv = dtrain::DeviceInventory::current();
        if (rank == 0) {  // CUDA_VISIBLE_DEVICES=0: one GPU, cuda:1 is not there
          EXPECT_EQ(inv.cuda_count, 1);
          EXPECT_EQ(dtrain::parse_devices("cuda", inv).size(), 1u);
          EXPECT_THROW(dtrain::parse_devices("cuda:1", inv), dtrain::DeviceError);
          EXPECT_EQ(dtrain::device_for_local_rank("cuda", 0, 1, inv), c10::Device(c10::kCUDA, 0));
          EXPECT_THROW(dtrain::device_for_local_rank("cuda", 1, 2, inv), dtrain::DeviceError);
        } else {  // CUDA_VISIBLE_DEVICES empty: no GPU, and the error says why
          EXPECT_EQ(inv.cuda_count, 0);
          try {
            dtrain::parse_devices("cuda", inv);
            ADD_FAILURE() << "parse_devices(\"cuda\") with no visible GPU did not throw";
          } catch (const dtrain::DeviceError& e) {
            EXPECT_NE(std::string(e.what()).find("CUDA_VISIBLE_DEVICES"), std::string::npos) << e.what();
          }
        }
      },
      {.env_for_rank = [](int rank) {
        return std::map<std::string, std::optional<std::string>>{
            {"CUDA_VISIBLE_DEVICES", rank == 0 ? std::string("0") : std::string("")}};
      }});
}

// Every collective over NCCL, one rank per GPU (one rank on a one-GPU machine).
TEST(GpuNccl, EveryCollective) {
  DTRAIN_REQUIRE_GPU();
  const int n = std::min(dtrain::testing::visible_gpus(), 2);
  dtrain::testing::run_rank_processes(n, [n](int rank) {
    auto group = nccl_group(rank);
    ASSERT_EQ(group.backend(), dtrain::dist::BackendKind::kNccl);
    const auto on = at::TensorOptions().device(group.device());
    const float r = static_cast<float>(rank + 1);
    const float sum = static_cast<float>(n * (n + 1) / 2);
    struct Case {
      ReduceOp op;
      float want;
    };
    float product = 1;
    for (int i = 1; i <= n; ++i) product *= static_cast<float>(i);
    for (const Case c :
         {Case{ReduceOp::kSum, sum}, Case{ReduceOp::kAvg, sum / static_cast<float>(n)},
          Case{ReduceOp::kProduct, product}, Case{ReduceOp::kMin, 1.0f}, Case{ReduceOp::kMax, static_cast<float>(n)}}) {
      at::Tensor t = at::full({513}, r, on);
      group.all_reduce(t, c.op).wait();
      EXPECT_FLOAT_EQ(t.cpu()[512].item<float>(), c.want) << to_string(c.op);
      at::Tensor in = at::full({n * 4}, r, on), out = at::empty({4}, on);
      group.reduce_scatter(out, in, c.op).wait();
      EXPECT_FLOAT_EQ(out.cpu()[3].item<float>(), c.want) << "reduce_scatter " << to_string(c.op);
    }
    std::vector<at::Tensor> several{at::full({3}, r, on), at::full({5}, r, on)};
    group.all_reduce_coalesced(several).wait();
    EXPECT_FLOAT_EQ(several[1].cpu()[4].item<float>(), sum);
    at::Tensor b = at::full({6}, r, on);
    group.broadcast(b, n - 1).wait();
    EXPECT_FLOAT_EQ(b.cpu()[0].item<float>(), static_cast<float>(n));
    at::Tensor gathered = at::empty({n * 2}, on.dtype(at::kBFloat16));
    group.all_gather_into(gathered, at::full({2}, r, on.dtype(at::kBFloat16))).wait();
    for (int i = 0; i < n; ++i) EXPECT_FLOAT_EQ(gathered.cpu()[2 * i + 1].item<float>(), static_cast<float>(i + 1));
    const auto parts = group.all_gather(at::full({2, 2}, r, on));
    ASSERT_EQ(parts.size(), static_cast<std::size_t>(n));
    EXPECT_EQ(parts.back().sizes(), at::IntArrayRef({2, 2}));
    group.barrier();
  });
}

// NCCL send/recv of what a pipeline moves between stages: activations
// [micro-batch, sequence, width] in fp32 and bf16, and their gradients back.
TEST(GpuNccl, SendRecvPipelineShapes) {
  DTRAIN_REQUIRE_GPUS(2) << " (NCCL refuses two ranks on one GPU)";
  dtrain::testing::run_rank_processes(2, [](int rank) {
    auto group = nccl_group(rank);
    const auto on = at::TensorOptions().device(group.device());
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      for (const auto& shape : std::vector<std::vector<std::int64_t>>{{4, 64, 128}, {1, 1, 1}, {3, 7, 5}}) {
        at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(shape[1]);
        const at::Tensor want = at::randn(shape, gen).to(dtype);
        if (rank == 0) {
          group.send(want.to(group.device()), 1, /*tag=*/0);
          at::Tensor grad = at::empty(shape, on.dtype(dtype));
          group.recv(grad, 1, /*tag=*/1);
          EXPECT_TRUE(at::equal(grad.cpu(), want * 2));
        } else {
          at::Tensor got = at::empty(shape, on.dtype(dtype));
          group.recv(got, 0, /*tag=*/0);
          EXPECT_TRUE(at::equal(got.cpu(), want));
          group.send(got * 2, 0, /*tag=*/1);
        }
      }
    }
    group.barrier();
  });
}

// fp16 autocast on CUDA with GradScaler: a finite step equals the unscaled
// fp32 step; an inf gradient skips the step and backs the scale off.
TEST(GpuAmp, GradScalerWithFp16AutocastOnCuda) {
  DTRAIN_REQUIRE_GPU();
  const c10::Device gpu(c10::kCUDA, 0);
  torch::manual_seed(0);
  torch::nn::Linear model(16, 4), reference(16, 4);
  model->to(gpu);
  reference->to(gpu);
  {
    torch::NoGradGuard no_grad;
    reference->weight.copy_(model->weight);
    reference->bias.copy_(model->bias);
  }
  torch::optim::SGD opt(model->parameters(), 0.1), ref_opt(reference->parameters(), 0.1);
  dtrain::amp::GradScaler scaler;
  const at::Tensor x = at::randn({8, 16}, at::TensorOptions().device(gpu)) * 0.1;
  at::Tensor loss;
  {
    dtrain::amp::Autocast autocast(c10::kCUDA, {.dtype = at::kHalf});
    const at::Tensor out = model->forward(x);
    EXPECT_EQ(out.scalar_type(), at::kHalf);
    loss = out.to(at::kFloat).pow(2).mean();
  }
  opt.zero_grad();
  scaler.scale(loss).backward();
  EXPECT_EQ(model->weight.grad().scalar_type(), at::kFloat);
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  ref_opt.zero_grad();
  reference->forward(x).pow(2).mean().backward();
  ref_opt.step();
  EXPECT_TRUE(at::allclose(model->weight.cpu(), reference->weight.cpu(), 1e-3, 1e-4));

  const double before = scaler.get_scale();
  const at::Tensor weight = model->weight.detach().clone();
  opt.zero_grad();
  scaler.scale(model->forward(x).pow(2).mean()).backward();
  model->weight.mutable_grad()[0][0] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(scaler.step(opt));
  scaler.update();
  EXPECT_LT(scaler.get_scale(), before);
  EXPECT_TRUE(at::equal(model->weight.detach(), weight));
}

// pin_memory: batches arrive in page-locked memory, so copies to the GPU can
// be asynchronous; the copied values are the batch's.
TEST(GpuLoader, PinnedBatchesCopyNonBlocking) {
  DTRAIN_REQUIRE_GPU();
  ASSERT_TRUE(dtrain::data::detail::can_pin_memory());
  auto loader = dtrain::data::make_tensor_loader(std::make_shared<Ramp>(),
                                                 {.batch_size = 4, .num_workers = 2, .pin_memory = true});
  loader->start_epoch(0);
  int batches = 0;
  while (auto batch = loader->next()) {
    EXPECT_TRUE(batch->data.is_pinned());
    EXPECT_TRUE(batch->target.is_pinned());
    const at::Tensor on_gpu = batch->data.to(c10::Device(c10::kCUDA, 0), /*non_blocking=*/true);
    EXPECT_TRUE(at::equal(on_gpu.cpu(), batch->data));
    ++batches;
  }
  EXPECT_EQ(batches, 3);
}

// A checkpoint carries each device's CUDA generator state: what is drawn
// after restoring equals what was drawn after saving.
TEST(GpuCheckpoint, RestoresCudaGeneratorState) {
  DTRAIN_REQUIRE_GPU();
  const auto dir = std::filesystem::temp_directory_path() / ("dtrain-gpu-ckpt-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const auto on = at::TensorOptions().device(c10::Device(c10::kCUDA, 0));
  torch::manual_seed(5);
  at::randn({3}, on);  // move the CUDA generator off its seed
  dtrain::Checkpointer checkpoints({.dir = dir});
  checkpoints.save({.step = 1});
  const at::Tensor after_save = at::randn({64}, on).cpu();
  const at::Tensor dropout_after_save = at::dropout(at::ones({64}, on), 0.5, /*train=*/true).cpu();
  at::randn({1000}, on);  // draw more, then go back
  ASSERT_TRUE(checkpoints.load_latest().has_value());
  EXPECT_TRUE(at::equal(at::randn({64}, on).cpu(), after_save));
  EXPECT_TRUE(at::equal(at::dropout(at::ones({64}, on), 0.5, /*train=*/true).cpu(), dropout_after_save));
  std::filesystem::remove_all(dir);
}

// libdtrain loads its NCCL module (libdtrain_nccl.so) only when a process
// first makes an NCCL group.
TEST(GpuNccl, ModuleLoadsOnFirstNcclGroup) {
  DTRAIN_REQUIRE_GPU();
  dtrain::testing::run_rank_processes(1, [](int rank) {
    EXPECT_FALSE(maps_contain("libdtrain_nccl"));
    auto group = nccl_group(rank);
    EXPECT_TRUE(maps_contain("libdtrain_nccl"));
    at::Tensor t = at::ones({2}, at::TensorOptions().device(group.device()));
    group.all_reduce(t).wait();
    EXPECT_FLOAT_EQ(t.cpu()[0].item<float>(), 1.0f);
  });
}
