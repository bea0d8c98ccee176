// Tensor- and sequence-parallel layers against the unsplit layer: on 2 and 4
// rank threads, collectives over Gloo alone or through the shared-memory
// transport, each layer's output and the gradients of its input and
// parameters equal at::linear's, at::embedding's and at::cross_entropy's on
// the same inputs (fp32: rtol 1e-5, atol 1e-6 times the tensor's largest
// |value| where that is above 1; bf16 autocast: rtol 2e-2, atol 2e-2 times
// that, see BFloat16Autocast). Batches are odd (3); every rank draws the same
// global tensors from seeded generators and compares its part.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <csignal>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "dtrain/amp/autocast.h"
#include "dtrain/comm/mesh.h"
#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/error.h"
#include "dtrain/nn/parallel_linear.h"
#include "dtrain/nn/tp_comm.h"
#include "dtrain/nn/vocab_parallel.h"
#include "ranks.h"
#include "tensor_checks.h"

using dtrain::dist::DeviceMesh;
using namespace dtrain::nn;

using dtrain::testing::expect_all_close;

namespace {

constexpr auto kTimeout = std::chrono::seconds(60);

at::Tensor draw(std::vector<std::int64_t> sizes, std::uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(sizes, gen, at::TensorOptions().dtype(at::kFloat));
}

at::Tensor leaf(const at::Tensor& t) {
  return t.detach().clone().requires_grad_(true);
}

// Rank r's piece of `t` along `dim` (t split into `parts` equal pieces).
at::Tensor piece(const at::Tensor& t, int parts, int rank, std::int64_t dim) {
  return t.chunk(parts, dim)[static_cast<std::size_t>(rank)];
}

// body(rank, mesh) on `world` threads with a mesh of one dimension, tp;
// collectives through the shared-memory transport or through Gloo alone.
void on_tp_ranks(int world, bool shared_memory, const std::function<void(int, DeviceMesh&)>& body) {
  dtrain::testing::run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, world,
                                                  {.timeout = kTimeout, .intra_host_shared_memory = shared_memory});
    DeviceMesh mesh(group, {{"tp", world}});
    body(rank, mesh);
  });
}

std::string config_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const dtrain::ConfigError& e) {
    return e.what();
  }
  return "(no ConfigError)";
}

// (world size, shared-memory transport)
class TensorParallel : public ::testing::TestWithParam<std::tuple<int, bool>> {
 protected:
  bool shared_memory() const { return std::get<1>(GetParam()); }
  void check_cross_entropy(int world, std::int64_t vocab) const;
};

}  // namespace

TEST_P(TensorParallel, ColumnParallelLinearEqualsTheUnsplitLayer) {
  const int world = std::get<0>(GetParam());
  const at::Tensor x = draw({3, 5, 6}, 1), w = draw({8, 6}, 2), b = draw({8}, 3), g = draw({3, 5, 8}, 4);
  at::Tensor xr = leaf(x), wr = leaf(w), br = leaf(b);
  const at::Tensor yr = at::linear(xr, wr, br);
  (yr * g).sum().backward();
  for (bool gather : {false, true}) {
    on_tp_ranks(world, shared_memory(), [&](int rank, DeviceMesh& mesh) {
      ColumnParallelLinear layer(mesh, {.in_features = 6, .out_features = 8, .gather_output = gather});
      layer->copy_from_full(w, b);
      at::Tensor xi = leaf(x);
      const at::Tensor y = layer(xi);
      const std::string what = std::string(gather ? "gathered" : "split") + " rank " + std::to_string(rank);
      expect_all_close(y, gather ? yr : piece(yr, world, rank, -1), what + " output");
      (y * (gather ? g : piece(g, world, rank, -1))).sum().backward();
      expect_all_close(xi.grad(), xr.grad(), what + " input grad");
      expect_all_close(layer->weight.grad(), piece(wr.grad(), world, rank, 0), what + " weight grad");
      expect_all_close(layer->bias.grad(), piece(br.grad(), world, rank, 0), what + " bias grad");
    });
  }
}

TEST_P(TensorParallel, RowParallelLinearEqualsTheUnsplitLayer) {
  const int world = std::get<0>(GetParam());
  const at::Tensor x = draw({3, 5, 8}, 5), w = draw({6, 8}, 6), b = draw({6}, 7), g = draw({3, 5, 6}, 8);
  at::Tensor xr = leaf(x), wr = leaf(w), br = leaf(b);
  (at::linear(xr, wr, br) * g).sum().backward();
  const at::Tensor yr = at::linear(x, w, b);
  for (bool parallel_input : {true, false}) {
    on_tp_ranks(world, shared_memory(), [&](int rank, DeviceMesh& mesh) {
      RowParallelLinear layer(mesh, {.in_features = 8, .out_features = 6, .input_is_parallel = parallel_input});
      layer->copy_from_full(w, b);
      at::Tensor xi = leaf(parallel_input ? piece(x, world, rank, -1) : x);
      const at::Tensor y = layer(xi);
      const std::string what =
          std::string(parallel_input ? "split" : "replicated") + " input, rank " + std::to_string(rank);
      expect_all_close(y, yr, what + " output");
      (y * g).sum().backward();
      expect_all_close(xi.grad(), parallel_input ? piece(xr.grad(), world, rank, -1) : xr.grad(), what + " input grad");
      expect_all_close(layer->weight.grad(), piece(wr.grad(), world, rank, 1), what + " weight grad");
      expect_all_close(layer->bias.grad(), br.grad(), what + " bias grad");
    });
  }
}

// Sequence parallelism: the column layer's input and the row layer's output
// hold 1/t of the sequence (dimension 1).
TEST_P(TensorParallel, SequenceParallelLinearsEqualTheUnsplitLayers) {
  const int world = std::get<0>(GetParam());
  const at::Tensor x = draw({3, 8, 6}, 9), w1 = draw({8, 6}, 10), b1 = draw({8}, 11);
  const at::Tensor w2 = draw({6, 8}, 12), b2 = draw({6}, 13), g = draw({3, 8, 6}, 14);
  at::Tensor xr = leaf(x), w1r = leaf(w1), b1r = leaf(b1), w2r = leaf(w2), b2r = leaf(b2);
  const at::Tensor hr = at::linear(xr, w1r, b1r);
  const at::Tensor yr = at::linear(hr, w2r, b2r);
  hr.retain_grad();
  (yr * g).sum().backward();
  on_tp_ranks(world, shared_memory(), [&](int rank, DeviceMesh& mesh) {
    ColumnParallelLinear col(mesh, {.in_features = 6, .out_features = 8, .sequence_parallel = true});
    RowParallelLinear row(mesh, {.in_features = 8, .out_features = 6, .sequence_parallel = true});
    col->copy_from_full(w1, b1);
    row->copy_from_full(w2, b2);
    at::Tensor xi = leaf(piece(x, world, rank, 1));
    const at::Tensor h = col(xi);
    h.retain_grad();
    const at::Tensor y = row(h);
    const std::string what = "rank " + std::to_string(rank);
    expect_all_close(h, piece(hr.detach(), world, rank, -1), what + " column output (all of the sequence)");
    expect_all_close(y, piece(yr.detach(), world, rank, 1), what + " row output (1/t of the sequence)");
    (y * piece(g, world, rank, 1)).sum().backward();
    expect_all_close(h.grad(), piece(hr.grad(), world, rank, -1), what + " grad between the layers");
    expect_all_close(xi.grad(), piece(xr.grad(), world, rank, 1), what + " input grad");
    expect_all_close(col->weight.grad(), piece(w1r.grad(), world, rank, 0), what + " column weight grad");
    expect_all_close(col->bias.grad(), piece(b1r.grad(), world, rank, 0), what + " column bias grad");
    expect_all_close(row->weight.grad(), piece(w2r.grad(), world, rank, 1), what + " row weight grad");
    expect_all_close(row->bias.grad(), b2r.grad(), what + " row bias grad (summed over the sequence pieces)");
  });
}

// LayerNorm -> ColumnParallel -> gelu -> RowParallel, the transformer's MLP
// half, with and without sequence parallelism. Under SP the LayerNorm sees
// 1/t of the sequence, so its parameters enter through copy_to_region (their
// gradient summed over tp); without SP its input and gradient are replicated.
TEST_P(TensorParallel, LayerNormMlpBlockEqualsTheUnsplitBlock) {
  const int world = std::get<0>(GetParam());
  const std::int64_t h = 8, f = 16;
  const at::Tensor x = draw({3, 8, h}, 20), lnw = draw({h}, 21), lnb = draw({h}, 22), w1 = draw({f, h}, 23),
                   b1 = draw({f}, 24), w2 = draw({h, f}, 25), b2 = draw({h}, 26), g = draw({3, 8, h}, 27);
  at::Tensor xr = leaf(x), lnwr = leaf(lnw), lnbr = leaf(lnb), w1r = leaf(w1), b1r = leaf(b1), w2r = leaf(w2),
             b2r = leaf(b2);
  const at::Tensor yr = at::linear(at::gelu(at::linear(at::layer_norm(xr, {h}, lnwr, lnbr), w1r, b1r)), w2r, b2r);
  (yr * g).sum().backward();
  for (bool sp : {false, true}) {
    on_tp_ranks(world, shared_memory(), [&](int rank, DeviceMesh& mesh) {
      ColumnParallelLinear col(mesh, {.in_features = h, .out_features = f, .sequence_parallel = sp});
      RowParallelLinear row(mesh, {.in_features = f, .out_features = h, .sequence_parallel = sp});
      col->copy_from_full(w1, b1);
      row->copy_from_full(w2, b2);
      at::Tensor lnwi = leaf(lnw), lnbi = leaf(lnb);
      at::Tensor xi = leaf(sp ? piece(x, world, rank, 1) : x);
      auto& group = mesh["tp"];
      const at::Tensor normed =
          sp ? at::layer_norm(xi, {h}, tp::copy_to_region(lnwi, group), tp::copy_to_region(lnbi, group))
             : at::layer_norm(xi, {h}, lnwi, lnbi);
      const at::Tensor y = row(at::gelu(col(normed)));
      const std::string what = std::string(sp ? "SP" : "TP") + " rank " + std::to_string(rank);
      expect_all_close(y, sp ? piece(yr.detach(), world, rank, 1) : yr.detach(), what + " output");
      (y * (sp ? piece(g, world, rank, 1) : g)).sum().backward();
      expect_all_close(xi.grad(), sp ? piece(xr.grad(), world, rank, 1) : xr.grad(), what + " input grad");
      expect_all_close(lnwi.grad(), lnwr.grad(), what + " LayerNorm weight grad");
      expect_all_close(lnbi.grad(), lnbr.grad(), what + " LayerNorm bias grad");
      expect_all_close(col->weight.grad(), piece(w1r.grad(), world, rank, 0), what + " fc weight grad");
      expect_all_close(row->weight.grad(), piece(w2r.grad(), world, rank, 1), what + " proj weight grad");
      expect_all_close(row->bias.grad(), b2r.grad(), what + " proj bias grad");
    });
  }
}

// A vocabulary of 15 that neither degree divides: rows split by torch.chunk's
// rule (8 + 7; 4 + 4 + 4 + 3), as the layout says.
TEST_P(TensorParallel, VocabParallelEmbeddingEqualsTheUnsplitEmbedding) {
  const int world = std::get<0>(GetParam());
  const std::int64_t vocab = 15, dim = 5;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(30);
  const at::Tensor ids = at::randint(vocab, {3, 8}, gen, at::TensorOptions().dtype(at::kLong));
  const at::Tensor w = draw({vocab, dim}, 31), g = draw({3, 8, dim}, 32);
  at::Tensor wr = leaf(w);
  const at::Tensor yr = at::embedding(wr, ids);
  (yr * g).sum().backward();
  for (bool sp : {false, true}) {
    on_tp_ranks(world, shared_memory(), [&](int rank, DeviceMesh& mesh) {
      VocabParallelEmbedding emb(mesh, {.num_embeddings = vocab, .embedding_dim = dim, .sequence_parallel = sp});
      emb->copy_from_full(w);
      const at::Tensor y = emb(ids);
      const std::string what = std::string(sp ? "SP" : "TP") + " rank " + std::to_string(rank);
      expect_all_close(y, sp ? piece(yr.detach(), world, rank, 1) : yr.detach(), what + " output");
      (y * (sp ? piece(g, world, rank, 1) : g)).sum().backward();
      expect_all_close(emb->weight.grad(), piece(wr.grad(), world, rank, 0), what + " weight grad");
      EXPECT_THROW(emb(at::full({3, 2}, vocab, at::kLong)), dtrain::DataError) << what;
    });
  }
}

// Logits [3, 5, V] split by vocabulary, some targets ignored; mean, sum and
// per-token losses; V = 16 (even split, vocab_size left 0) and V = 15 (split
// by torch.chunk's rule, vocab_size given).
TEST_P(TensorParallel, VocabParallelCrossEntropyEqualsCrossEntropy) {
  const int world = std::get<0>(GetParam());
  for (const std::int64_t vocab : {16, 15}) check_cross_entropy(world, vocab);
}

void TensorParallel::check_cross_entropy(int world, std::int64_t vocab) const {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(40);
  at::Tensor targets = at::randint(vocab, {3, 5}, gen, at::TensorOptions().dtype(at::kLong));
  targets.index_put_({0, 1}, -100);
  targets.index_put_({2, 4}, -100);
  const at::Tensor logits = draw({3, 5, vocab}, 41) * 4;
  using Reduction = VocabParallelCrossEntropyOptions::Reduction;
  for (Reduction reduction : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
    const auto aten_reduction = reduction == Reduction::kMean  ? at::Reduction::Mean
                                : reduction == Reduction::kSum ? at::Reduction::Sum
                                                               : at::Reduction::None;
    at::Tensor lr = leaf(logits);
    const at::Tensor ref = at::cross_entropy_loss(lr.view({-1, vocab}), targets.view({-1}), {}, aten_reduction, -100);
    const at::Tensor gout = reduction == Reduction::kNone ? draw({3, 5}, 42) : at::ones({});
    (ref.view(gout.sizes()) * gout).sum().backward();
    on_tp_ranks(world, shared_memory(), [&](int rank, DeviceMesh& mesh) {
      at::Tensor li = leaf(piece(logits, world, rank, -1));
      const at::Tensor loss = vocab_parallel_cross_entropy(
          li, targets, mesh["tp"], {.reduction = reduction, .vocab_size = vocab == 16 ? 0 : vocab});
      const std::string what = "vocabulary " + std::to_string(vocab) + " reduction " +
                               std::to_string(static_cast<int>(reduction)) + " rank " + std::to_string(rank);
      expect_all_close(loss, ref.view(gout.sizes()).detach(), what + " loss");
      (loss * gout).sum().backward();
      expect_all_close(li.grad(), piece(lr.grad(), world, rank, -1), what + " logits grad");
    });
  }
}

// bf16 autocast: column -> gelu -> row under CPU autocast against the same
// unsplit layers under autocast. The split adds bf16 roundings (the row
// layer's partial sums are bf16 before their all-reduce, as under Megatron),
// so the tolerance is bf16's: rtol 2e-2 and atol 2e-2 times the tensor's
// largest |value|. Measured here: at most 0.0156 (one bf16 rounding at ~4)
// on outputs up to 4.4; at most 0.0044 of a tensor's largest value.
TEST_P(TensorParallel, BFloat16Autocast) {
  const int world = std::get<0>(GetParam());
  const at::Tensor x = draw({3, 8, 8}, 50), w1 = draw({16, 8}, 51) * 0.3, b1 = draw({16}, 52);
  const at::Tensor w2 = draw({8, 16}, 53) * 0.3, b2 = draw({8}, 54), g = draw({3, 8, 8}, 55);
  at::Tensor xr = leaf(x), w1r = leaf(w1), b1r = leaf(b1), w2r = leaf(w2), b2r = leaf(b2);
  at::Tensor yr;
  {
    dtrain::amp::Autocast autocast(c10::kCPU);
    yr = at::linear(at::gelu(at::linear(xr, w1r, b1r)), w2r, b2r);
  }
  ASSERT_EQ(yr.scalar_type(), at::kBFloat16);
  (yr.to(at::kFloat) * g).sum().backward();
  for (bool sp : {false, true}) {
    on_tp_ranks(world, shared_memory(), [&](int rank, DeviceMesh& mesh) {
      ColumnParallelLinear col(mesh, {.in_features = 8, .out_features = 16, .sequence_parallel = sp});
      RowParallelLinear row(mesh, {.in_features = 16, .out_features = 8, .sequence_parallel = sp});
      col->copy_from_full(w1, b1);
      row->copy_from_full(w2, b2);
      at::Tensor xi = leaf(sp ? piece(x, world, rank, 1) : x);
      at::Tensor y;
      {
        dtrain::amp::Autocast autocast(c10::kCPU);
        y = row(at::gelu(col(xi)));
      }
      const std::string what = std::string(sp ? "SP" : "TP") + " bf16 rank " + std::to_string(rank);
      EXPECT_EQ(y.scalar_type(), at::kBFloat16) << what;
      expect_all_close(y, sp ? piece(yr.detach(), world, rank, 1) : yr.detach(), what + " output", 2e-2, 2e-2);
      (y.to(at::kFloat) * (sp ? piece(g, world, rank, 1) : g)).sum().backward();
      expect_all_close(xi.grad(), sp ? piece(xr.grad(), world, rank, 1) : xr.grad(), what + " input grad", 2e-2, 2e-2);
      expect_all_close(col->weight.grad(), piece(w1r.grad(), world, rank, 0), what + " fc weight grad", 2e-2, 2e-2);
      expect_all_close(row->weight.grad(), piece(w2r.grad(), world, rank, 1), what + " proj weight grad", 2e-2, 2e-2);
      expect_all_close(row->bias.grad(), b2r.grad(), what + " proj bias grad", 2e-2, 2e-2);
    });
  }
}

// Every layer declares its parameters' layouts; named_layouts() finds them
// under any module tree, and each rank's part is its parameter's shape.
TEST_P(TensorParallel, ParametersCarryTheirLayouts) {
  const int world = std::get<0>(GetParam());
  on_tp_ranks(world, shared_memory(), [&](int rank, DeviceMesh& mesh) {
    auto root = std::make_shared<torch::nn::Module>();
    root->register_module("qkv", ColumnParallelLinear(mesh, {.in_features = 8, .out_features = 24, .partitions = 3}));
    root->register_module("proj", RowParallelLinear(mesh, {.in_features = 8, .out_features = 8}));
    root->register_module("wte", VocabParallelEmbedding(mesh, {.num_embeddings = 12, .embedding_dim = 8}));
    root->register_parameter("gain", at::ones({8}));
    std::map<std::string, std::string> seen;
    for (const auto& [name, layout] : dtrain::dist::named_layouts(*root, mesh)) seen[name] = layout.to_string();
    const std::string t = std::to_string(world);
    EXPECT_EQ(seen.at("qkv.weight"), "[3, 8, 8] on " + t + " (tp): S(1)");
    EXPECT_EQ(seen.at("qkv.bias"), "[3, 8] on " + t + " (tp): S(1)");
    EXPECT_EQ(seen.at("proj.weight"), "[8, 8] on " + t + " (tp): S(1)");
    EXPECT_EQ(seen.at("proj.bias"), "[8] on " + t + " (tp): R");
    EXPECT_EQ(seen.at("wte.weight"), "[12, 8] on " + t + " (tp): S(0)");
    EXPECT_EQ(seen.at("gain"), "[8] on " + t + " (tp): R");
    // A fused QKV: rank r holds its rows of q, of k and of v.
    const at::Tensor full = draw({24, 8}, 60);
    auto qkv = root->named_children()["qkv"]->as<ColumnParallelLinearImpl>();
    qkv->copy_from_full(full, draw({24}, 61));
    const auto q = piece(full.narrow(0, 0, 8), world, rank, 0), v = piece(full.narrow(0, 16, 8), world, rank, 0);
    const std::int64_t rows = 8 / world;
    expect_all_close(qkv->weight.narrow(0, 0, rows), q, "q rows");
    expect_all_close(qkv->weight.narrow(0, 2 * rows, rows), v, "v rows");
  });
}

TEST_P(TensorParallel, SizesTheDegreeDoesNotDivideAreConfigErrors) {
  const int world = std::get<0>(GetParam());
  on_tp_ranks(world, shared_memory(), [&](int rank, DeviceMesh& mesh) {
    const std::string t = std::to_string(world);
    EXPECT_NE(config_error([&] { (void)ColumnParallelLinear(mesh, {.in_features = 4, .out_features = 2 * world + 1}); })
                  .find("out_features " + std::to_string(2 * world + 1) +
                        " is not divisible by the tensor-parallel degree " + t),
              std::string::npos);
    EXPECT_NE(config_error([&] {
                (void)RowParallelLinear(mesh, {.in_features = 5, .out_features = 4});
              }).find("in_features 5 is not divisible by the tensor-parallel degree " + t),
              std::string::npos);
    // A transposed full weight (same number of elements) is not taken.
    RowParallelLinear square(mesh, {.in_features = 8, .out_features = 4});
    EXPECT_NE(config_error([&] {
                square->copy_from_full(at::zeros({8, 4}), at::zeros({4}));
              }).find("the full weight has shape [8, 4], the unsplit layer's is [4, 8]"),
              std::string::npos);
    // A vocabulary of world - 1 in pieces of 1 leaves the last rank no rows.
    EXPECT_NE(
        config_error([&] { (void)VocabParallelEmbedding(mesh, {.num_embeddings = world - 1, .embedding_dim = 4}); })
            .find("a vocabulary of " + std::to_string(world - 1) + " split over the tensor-parallel degree " + t +
                  " in pieces of 1 leaves the last rank no rows"),
        std::string::npos);
    // A sequence that does not split: refused on every rank before any
    // communication, so no rank is left waiting.
    RowParallelLinear row(mesh, {.in_features = 4, .out_features = 4, .sequence_parallel = true});
    EXPECT_NE(config_error([&] {
                row(at::ones({3, world + 1, 4 / world}));
              }).find("dimension 1 of size " + std::to_string(world + 1)),
              std::string::npos)
        << "rank " << rank;
  });
}

// A peer SIGKILLed inside a tensor-parallel region: the survivor's row layer
// (its all-reduce in forward) or column layer (the all-reduce of the input
// gradient in backward) throws a CommunicationError naming the operation; no
// hang. Processes, over Gloo and over the shared-memory transport.
class TensorParallelPeerDeath : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(TensorParallelPeerDeath, SurvivorGetsCommunicationError) {
  const auto [in_backward, shared_memory] = GetParam();
  const auto outcomes = dtrain::testing::run_rank_processes(
      2,
      [&](int rank) {
        auto group = dtrain::dist::init_process_group(
            {.timeout = std::chrono::seconds(10), .intra_host_shared_memory = shared_memory});
        DeviceMesh mesh(group, {{"tp", 2}});
        ColumnParallelLinear col(mesh, {.in_features = 4, .out_features = 8});
        RowParallelLinear row(mesh, {.in_features = 8, .out_features = 4});
        at::Tensor x = leaf(draw({3, 2, 4}, 70));
        try {
          if (!in_backward && rank == 1) std::raise(SIGKILL);  // gone before the row layer's all-reduce
          const at::Tensor y = row(at::gelu(col(x)));
          if (in_backward && rank == 1) std::raise(SIGKILL);  // gone before backward's all-reduces
          y.sum().backward();
          ADD_FAILURE() << "the tensor-parallel step completed without its peer";
        } catch (const dtrain::CommunicationError& e) {
          std::cerr << "rank 0 error: " << e.what() << std::endl;
        }
      },
      {.expect_success = false});
  EXPECT_NE(outcomes[0].output.find("rank 0 error: [rank 0/2] all_reduce(sum)"), std::string::npos)
      << outcomes[0].output;
  EXPECT_FALSE(outcomes[0].timed_out);
  EXPECT_EQ(outcomes[0].exit_code, 0) << "signal " << outcomes[0].signal;
}

INSTANTIATE_TEST_SUITE_P(Transports, TensorParallelPeerDeath, ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "backward_" : "forward_") +
                                  (std::get<1>(info.param) ? "shared_memory" : "gloo");
                         });

INSTANTIATE_TEST_SUITE_P(Worlds, TensorParallel, ::testing::Combine(::testing::Values(2, 4), ::testing::Bool()),
                         [](const auto& info) {
                           return "world" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_shared_memory" : "_gloo");
                         });
