// Context-parallel attention on CUDA tensors: the blocks run on ATen's
// memory-efficient kernel with its log-sum-exp (Note [CUDA block kernel] in
// src/nn/block_attention.cpp), cp 1 in one process and cp 2 as two processes
// sharing one GPU over Gloo. Each rank's output and q, k, v gradients equal
// its zig-zag rows of unsplit causal attention computed on the CPU in fp64;
// the math kernel (BlockKernel::kMath) on the same CUDA tensors is checked
// alike, so a failure tells the kernel from the ring. Skips without a GPU.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"
#include "dtrain/nn/context_parallel.h"
#include "gpu.h"
#include "ranks.h"

namespace cp = dtrain::nn::cp;

namespace {

const c10::Device kCpGpu(c10::kCUDA, 0);

at::Tensor cp_gpu_draw(std::vector<std::int64_t> sizes, std::uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(sizes, gen, at::TensorOptions().dtype(at::kFloat));
}

void expect_close_to(const at::Tensor& got, const at::Tensor& want, double rtol, double atol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const at::Tensor a = got.to(at::kCPU, at::kDouble), e = want.to(at::kDouble);
  EXPECT_TRUE(at::allclose(a, e, rtol, atol)) << what << ": max |difference| " << (a - e).abs().max().item<double>();
}

// q, k, v [3, 4, T, 64] (T = 16 x cp), head dimension 64 as the GPT's.
void expect_cuda_cp_matches_unsplit(int rank, dtrain::dist::ProcessGroup& group, at::ScalarType type,
                                    cp::BlockKernel kernel) {
  const int c = group.size();
  const std::int64_t t = 16 * c;
  const at::Tensor q = cp_gpu_draw({3, 4, t, 64}, 1), k = cp_gpu_draw({3, 4, t, 64}, 2),
                   v = cp_gpu_draw({3, 4, t, 64}, 3), grad_out = cp_gpu_draw({3, 4, t, 64}, 4);
  // The reference, unsplit, on the CPU in fp64, from the inputs as rounded to `type`.
  auto reference_input = [&](const at::Tensor& x) { return x.to(type).to(at::kDouble).requires_grad_(true); };
  at::Tensor rq = reference_input(q), rk = reference_input(k), rv = reference_input(v);
  const at::Tensor ry = at::scaled_dot_product_attention(rq, rk, rv, {}, 0.0, /*is_causal=*/true);
  ry.backward(grad_out.to(type).to(at::kDouble));
  auto part = [&](const at::Tensor& x) { return cp::zigzag_shard(x, c, rank, 2); };
  auto on_gpu = [&](const at::Tensor& x) { return part(x).to(kCpGpu, type).requires_grad_(true); };
  at::Tensor lq = on_gpu(q), lk = on_gpu(k), lv = on_gpu(v);
  const at::Tensor y = cp::causal_attention(lq, lk, lv, group, {.kernel = kernel});
  ASSERT_TRUE(y.is_cuda());
  y.backward(part(grad_out).to(kCpGpu, type));
  const bool fp32 = type == at::kFloat;
  const double rtol = fp32 ? 1e-4 : 2e-2, atol = fp32 ? 1e-5 : 2e-2;
  const std::string who = std::string(kernel == cp::BlockKernel::kAuto ? "efficient" : "math") + " kernel, " +
                          c10::toString(type) + ", rank " + std::to_string(rank) + " of " + std::to_string(c);
  expect_close_to(y, part(ry.detach()), rtol, atol, who + " output");
  expect_close_to(lq.grad(), part(rq.grad()), rtol, atol, who + " dq");
  expect_close_to(lk.grad(), part(rk.grad()), rtol, atol, who + " dk");
  expect_close_to(lv.grad(), part(rv.grad()), rtol, atol, who + " dv");
}

void run_cuda_cp(int world) {
  dtrain::testing::run_rank_processes(world, [](int rank) {
    auto group = dtrain::dist::init_process_group(dtrain::dist::GroupOptions{
        .backend = dtrain::dist::BackendKind::kGloo, .device = kCpGpu, .timeout = std::chrono::seconds(60)});
    for (at::ScalarType type : {at::kFloat, at::kBFloat16}) {
      for (cp::BlockKernel kernel : {cp::BlockKernel::kAuto, cp::BlockKernel::kMath}) {
        expect_cuda_cp_matches_unsplit(rank, group, type, kernel);
      }
    }
  });
}

}  // namespace

TEST(GpuContextParallel, OneRankOnCudaEqualsUnsplit) {
  DTRAIN_REQUIRE_GPU();
  run_cuda_cp(1);
}

TEST(GpuContextParallel, TwoRanksSharingOneGpuEqualUnsplit) {
  DTRAIN_REQUIRE_GPU();
  run_cuda_cp(2);
}
