// Context-parallel causal attention against unsplit attention: on 2 and 4
// rank threads, K/V passed round a ring or all-gathered, collectives over
// Gloo alone or through the shared-memory transport; each rank's output and
// the gradients of its q, k, v equal its zig-zag rows of
// at::scaled_dot_product_attention's (is_causal) on the same global tensors
// (fp32: rtol 1e-5, atol 1e-6 times the tensor's largest |value| where that
// is above 1). Batches are odd (3). Also the zig-zag split, the cp loss mean,
// and a peer SIGKILLed inside a ring step (processes).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <csignal>
#include <functional>
#include <iostream>
#include <string>
#include <tuple>
#include <vector>

#include "dtrain/error.h"
#include "dtrain/nn/context_parallel.h"
#include "ranks.h"
#include "tensor_checks.h"

namespace cp = dtrain::nn::cp;

using dtrain::testing::expect_all_close;

namespace {

constexpr auto kCpTimeout = std::chrono::seconds(60);

at::Tensor cp_draw(std::vector<std::int64_t> sizes, std::uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(sizes, gen, at::TensorOptions().dtype(at::kFloat));
}

// The unsplit reference: output and gradients of q, k, v for `grad_out`.
struct Unsplit {
  at::Tensor y, dq, dk, dv;
};

Unsplit unsplit_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& grad_out) {
  at::Tensor lq = q.clone().requires_grad_(true), lk = k.clone().requires_grad_(true),
             lv = v.clone().requires_grad_(true);
  at::Tensor y = at::scaled_dot_product_attention(lq, lk, lv, {}, 0.0, /*is_causal=*/true);
  y.backward(grad_out);
  return {y.detach(), lq.grad(), lk.grad(), lv.grad()};
}

// Every rank's output and q, k, v gradients against its rows of the unsplit
// ones; q, k, v [3, 2, T, 8] with T = 4 x cp (two rows per zig-zag chunk).
void expect_matches_unsplit(int rank, dtrain::dist::ProcessGroup& group, const cp::AttentionOptions& options) {
  const int c = group.size();
  const std::int64_t t = 4 * c;
  const at::Tensor q = cp_draw({3, 2, t, 8}, 1), k = cp_draw({3, 2, t, 8}, 2), v = cp_draw({3, 2, t, 8}, 3);
  const at::Tensor grad_out = cp_draw({3, 2, t, 8}, 4);
  const Unsplit ref = unsplit_attention(q, k, v, grad_out);
  auto part = [&](const at::Tensor& x) { return cp::zigzag_shard(x, c, rank, 2); };
  at::Tensor lq = part(q).requires_grad_(true), lk = part(k).requires_grad_(true), lv = part(v).requires_grad_(true);
  const at::Tensor y = cp::causal_attention(lq, lk, lv, group, options);
  y.backward(part(grad_out));
  const std::string who = "rank " + std::to_string(rank) + " of " + std::to_string(c);
  expect_all_close(y, part(ref.y), who + " output");
  expect_all_close(lq.grad(), part(ref.dq), who + " dq");
  expect_all_close(lk.grad(), part(ref.dk), who + " dk");
  expect_all_close(lv.grad(), part(ref.dv), who + " dv");
}

void on_cp_ranks(int world, bool shared_memory, const std::function<void(int, dtrain::dist::ProcessGroup&)>& body) {
  dtrain::testing::run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, world,
                                                  {.timeout = kCpTimeout, .intra_host_shared_memory = shared_memory});
    body(rank, group);
  });
}

class ContextParallelAttention
    : public ::testing::TestWithParam<std::tuple<int, cp::KvExchange, cp::BlockKernel, bool>> {};

TEST_P(ContextParallelAttention, ForwardAndGradientsEqualUnsplit) {
  const auto [world, exchange, kernel, shared_memory] = GetParam();
  on_cp_ranks(world, shared_memory, [&](int rank, dtrain::dist::ProcessGroup& group) {
    expect_matches_unsplit(rank, group, {.exchange = exchange, .kernel = kernel});
  });
}

INSTANTIATE_TEST_SUITE_P(
    Worlds, ContextParallelAttention,
    ::testing::Values(std::make_tuple(2, cp::KvExchange::kRing, cp::BlockKernel::kAuto, false),
                      std::make_tuple(2, cp::KvExchange::kRing, cp::BlockKernel::kAuto, true),
                      std::make_tuple(4, cp::KvExchange::kRing, cp::BlockKernel::kAuto, false),
                      std::make_tuple(4, cp::KvExchange::kRing, cp::BlockKernel::kAuto, true),
                      std::make_tuple(2, cp::KvExchange::kAllGather, cp::BlockKernel::kAuto, false),
                      std::make_tuple(4, cp::KvExchange::kAllGather, cp::BlockKernel::kAuto, true),
                      std::make_tuple(4, cp::KvExchange::kRing, cp::BlockKernel::kMath, false),
                      std::make_tuple(4, cp::KvExchange::kAllGather, cp::BlockKernel::kMath, false)),
    [](const auto& info) {
      return "cp" + std::to_string(std::get<0>(info.param)) +
             (std::get<1>(info.param) == cp::KvExchange::kRing ? "_ring" : "_allgather") +
             (std::get<2>(info.param) == cp::BlockKernel::kMath ? "_math" : "") +
             (std::get<3>(info.param) ? "_shared_memory" : "_gloo");
    });

// One process (cp 1): the whole sequence, the kernel alone.
TEST(ContextParallelSplit, OneRankIsPlainCausalAttention) {
  on_cp_ranks(1, false, [&](int rank, dtrain::dist::ProcessGroup& group) { expect_matches_unsplit(rank, group, {}); });
}

// The zig-zag parts of all ranks hold every position once; rank r holds
// chunks r and 2c-1-r; the tokens and their positions are cut alike.
TEST(ContextParallelSplit, ZigzagPartsAndPositions) {
  const std::int64_t t = 24;
  const at::Tensor tokens = at::arange(100, 100 + t).view({1, t});
  for (int c : {1, 2, 3, 4}) {
    std::vector<at::Tensor> all;
    for (int r = 0; r < c; ++r) {
      const at::Tensor pos = cp::zigzag_positions(t, c, r, at::TensorOptions());
      ASSERT_EQ(pos.size(0), t / c);
      const std::int64_t chunk = t / (2 * c);
      EXPECT_EQ(pos[0].item<std::int64_t>(), r * chunk) << "cp " << c << " rank " << r;
      EXPECT_EQ(pos[chunk].item<std::int64_t>(), (2 * c - 1 - r) * chunk) << "cp " << c << " rank " << r;
      EXPECT_TRUE(at::equal(cp::zigzag_shard(tokens, c, r, 1)[0], pos + 100));
      all.push_back(pos);
    }
    EXPECT_TRUE(at::equal(std::get<0>(at::cat(all).sort()), at::arange(t))) << "cp " << c;
  }
  try {
    cp::zigzag_shard(tokens, 5, 0, 1);
    ADD_FAILURE() << "24 positions split into 10 chunks";
  } catch (const dtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("into 10 zig-zag chunks"), std::string::npos) << e.what();
  }
}

// The loss value is the mean over cp, its gradient this rank's alone.
TEST(ContextParallelSplit, MeanLossValueIsTheGroupsMeanGradientIsLocal) {
  on_cp_ranks(2, false, [&](int rank, dtrain::dist::ProcessGroup& group) {
    at::Tensor x = at::full({}, 1.0 + rank, at::kFloat).requires_grad_(true);
    const at::Tensor loss = cp::mean_loss(x * x, group);
    EXPECT_FLOAT_EQ(loss.item<float>(), (1.0f + 4.0f) / 2.0f);
    loss.backward();
    EXPECT_FLOAT_EQ(x.grad().item<float>(), 2.0f * (1.0f + static_cast<float>(rank)));
  });
}

// A part that is not two equal chunks is refused before anything is sent.
TEST(ContextParallelSplit, OddLocalSequenceIsConfigError) {
  on_cp_ranks(2, false, [&](int /*rank*/, dtrain::dist::ProcessGroup& group) {
    // Both ranks connected before either throws: a rank whose group is made
    // may otherwise close it while its peer is still connecting (1 run in
    // ~10 failed with "connection closed by peer" at load 12).
    group.barrier();
    const at::Tensor x = at::zeros({1, 1, 3, 4});
    try {
      cp::causal_attention(x, x, x, group);
      ADD_FAILURE() << "3 local rows accepted";
    } catch (const dtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("multiple of 2 x cp (4)"), std::string::npos) << e.what();
    }
  });
}

// A peer SIGKILLed inside a ring step: the survivor's forward (receiving the
// next K/V block) or backward (the K/V gradients) throws a
// CommunicationError naming the receive and the dead peer; no hang.
// Processes, over Gloo and over the shared-memory transport.
class ContextParallelPeerDeath : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(ContextParallelPeerDeath, SurvivorGetsCommunicationError) {
  const auto [in_backward, shared_memory] = GetParam();
  const auto outcomes = dtrain::testing::run_rank_processes(
      2,
      [&](int rank) {
        auto group = dtrain::dist::init_process_group(
            {.timeout = std::chrono::seconds(10), .intra_host_shared_memory = shared_memory});
        at::Tensor q = cp_draw({1, 2, 8, 4}, 7).requires_grad_(true);
        try {
          if (!in_backward && rank == 1) std::raise(SIGKILL);  // gone before the first ring step
          const at::Tensor y = cp::causal_attention(q, q, q, group);
          if (in_backward && rank == 1) std::raise(SIGKILL);  // gone before backward's ring
          y.sum().backward();
          ADD_FAILURE() << "the context-parallel step completed without its peer";
        } catch (const dtrain::CommunicationError& e) {
          std::cerr << "rank 0 error: " << e.what() << std::endl;
        }
      },
      {.expect_success = false});
  EXPECT_NE(outcomes[0].output.find("rank 0 error: [rank 0/2] "), std::string::npos) << outcomes[0].output;
  EXPECT_NE(outcomes[0].output.find("with peer rank 1"), std::string::npos) << outcomes[0].output;
  EXPECT_FALSE(outcomes[0].timed_out);
  EXPECT_EQ(outcomes[0].exit_code, 0) << "signal " << outcomes[0].signal;
}

INSTANTIATE_TEST_SUITE_P(Transports, ContextParallelPeerDeath, ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "backward_" : "forward_") +
                                  (std::get<1>(info.param) ? "shared_memory" : "gloo");
                         });

}  // namespace
