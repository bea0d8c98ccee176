// The small tensor-parallel model of the composition tests (tp with ZeRO,
// pipelines and cp): blocks of dtrain::nn's column- and row-parallel layers
// with odd sizes, the same network unsplit as the one-process reference, and
// the comparison of a rank's parameters with the reference's through their
// layouts. Shared by the tp_*_test.cpp files of dtrain_tp_compose_tests.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "dtrain/comm/mesh.h"
#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/nn/context_parallel.h"
#include "dtrain/nn/parallel_linear.h"

namespace dtrain::testing::tp_compose {

constexpr std::int64_t kWidth = 7, kClasses = 5;

// x + row(tanh(col(LayerNorm(x)))): one column-parallel and one row-parallel
// layer (a Megatron MLP), hidden split over tp; the LayerNorm (optional) is
// replicated.
struct TpBlockImpl : torch::nn::Module {
  TpBlockImpl(dist::DeviceMesh& mesh, std::int64_t hidden, bool layer_norm)
      : col(register_module("col", nn::ColumnParallelLinear(mesh, {.in_features = kWidth, .out_features = hidden}))),
        row(register_module("row", nn::RowParallelLinear(mesh, {.in_features = hidden, .out_features = kWidth}))) {
    if (layer_norm) ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
  }
  at::Tensor forward(const at::Tensor& x) {
    return x + row->forward(at::tanh(col->forward(ln.is_empty() ? x : ln->forward(x))));
  }
  nn::ColumnParallelLinear col;
  nn::RowParallelLinear row;
  torch::nn::LayerNorm ln{nullptr};
};
TORCH_MODULE(TpBlock);

// The same block unsplit, with the same parameter names.
struct RefBlockImpl : torch::nn::Module {
  RefBlockImpl(std::int64_t hidden, bool layer_norm)
      : col(register_module("col", torch::nn::Linear(kWidth, hidden))),
        row(register_module("row", torch::nn::Linear(hidden, kWidth))) {
    if (layer_norm) ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
  }
  at::Tensor forward(const at::Tensor& x) {
    return x + row->forward(at::tanh(col->forward(ln.is_empty() ? x : ln->forward(x))));
  }
  torch::nn::Linear col, row;
  torch::nn::LayerNorm ln{nullptr};
};
TORCH_MODULE(RefBlock);

// Hidden sizes and LayerNorms of the three blocks: tp 2 leaves 6, 5 and 2
// hidden units per rank, and units of 111, 82 and 51 elements per tp rank
// (ZeRO over 2 ranks pads the odd ones).
struct BlockShape {
  std::int64_t hidden;
  bool layer_norm;
};
inline const BlockShape kBlocks[] = {{12, true}, {10, false}, {4, true}};

// Three blocks and a replicated head Linear(7, 5): four layers, "0".."3".
inline torch::nn::Sequential reference_net() {
  torch::manual_seed(2511);
  torch::nn::Sequential net;
  for (std::size_t b = 0; b < 3; ++b)
    net->push_back(std::to_string(b), RefBlock(kBlocks[b].hidden, kBlocks[b].layer_norm));
  net->push_back("3", torch::nn::Linear(kWidth, kClasses));
  // LayerNorm starts at 1 and 0; perturb it so its gradient path is tested.
  torch::NoGradGuard no_grad;
  for (auto& item : net->named_parameters()) {
    if (item.key().find(".ln.") != std::string::npos) item.value().add_(at::rand_like(item.value()).sub_(0.5));
  }
  return net;
}

// The reference's network split over mesh["tp"], holding this rank's parts
// of the reference's weights.
inline torch::nn::Sequential tp_net(dist::DeviceMesh& mesh) {
  torch::nn::Sequential ref = reference_net();
  torch::nn::Sequential net;
  for (std::size_t b = 0; b < 3; ++b) {
    TpBlock block(mesh, kBlocks[b].hidden, kBlocks[b].layer_norm);
    auto src = ref[b]->as<RefBlockImpl>();
    block->col->copy_from_full(src->col->weight, src->col->bias);
    block->row->copy_from_full(src->row->weight, src->row->bias);
    if (kBlocks[b].layer_norm) {
      torch::NoGradGuard no_grad;
      block->ln->weight.copy_(src->ln->weight);
      block->ln->bias.copy_(src->ln->bias);
    }
    net->push_back(std::to_string(b), block);
  }
  torch::nn::Linear head(kWidth, kClasses);
  {
    torch::NoGradGuard no_grad;
    auto src = ref[3]->as<torch::nn::LinearImpl>();
    head->weight.copy_(src->weight);
    head->bias.copy_(src->bias);
  }
  net->push_back("3", head);
  return net;
}

inline at::Tensor compose_loss(const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

struct ComposeBatch {
  at::Tensor x, y;
};
// The union batch of a step (every rank draws the same).
inline ComposeBatch compose_batch(std::int64_t size, int step) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(700 + step);
  return {at::randn({size, kWidth}, gen), at::randint(0, kClasses, {size}, gen)};
}

inline bool compose_close(const at::Tensor& a, const at::Tensor& b, const std::string& what, std::ostream& failures) {
  if (a.sizes() == b.sizes() && at::allclose(a, b, 1e-5, 1e-6)) return true;
  failures << what << ": " << (a.sizes() == b.sizes() ? "max difference " : "shapes differ ")
           << (a.sizes() == b.sizes() ? (a - b).abs().max().item<double>() : -1.0) << "\n";
  return false;
}

// Each parameter of `module` (this rank's part, full parameters in hand)
// against its part of the reference's parameter of the same name, through
// its layout over `mesh` (whose global shape may be a view of the
// parameter's: a fused QKV weight). Returns how many were compared.
inline int compare_parts(const torch::nn::Module& module, dist::DeviceMesh& mesh,
                         const torch::nn::Sequential& reference, const std::string& where, std::ostream& failures) {
  const auto ref = reference->named_parameters();
  const dist::NamedLayouts layouts = dist::named_layouts(module, mesh);
  const auto params = module.named_parameters();
  int compared = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const at::Tensor* full = ref.find(params[i].key());
    if (full == nullptr) {
      failures << where << ": no reference parameter " << params[i].key() << "\n";
      continue;
    }
    const dist::Layout& layout = layouts[i].second;
    const at::Tensor part = dist::local_part(full->detach().reshape(layout.global_shape), layout, mesh.coordinates());
    compose_close(params[i].value().detach(), part.reshape(params[i].value().sizes()), where + " " + params[i].key(),
                  failures);
    ++compared;
  }
  return compared;
}

// Attention for tp x cp: heads split over tp, the sequence over cp.
constexpr std::int64_t kTpCpWidth = 8, kTpCpHeads = 4, kTpCpSeq = 8, kTpCpBatch = 3;

// ln -> qkv (column, 3 partitions) -> causal attention over cp -> proj (row) -> + x.
struct TpCpAttentionImpl : torch::nn::Module {
  TpCpAttentionImpl(dist::DeviceMesh& mesh)
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kTpCpWidth})))),
        qkv(register_module("qkv",
                            nn::ColumnParallelLinear(
                                mesh, {.in_features = kTpCpWidth, .out_features = 3 * kTpCpWidth, .partitions = 3}))),
        proj(register_module("proj",
                             nn::RowParallelLinear(mesh, {.in_features = kTpCpWidth, .out_features = kTpCpWidth}))),
        cp(mesh["cp"]),
        local_heads(kTpCpHeads / mesh.size("tp")) {}
  at::Tensor forward(const at::Tensor& x) {
    const std::int64_t b = x.size(0), t = x.size(1), d = kTpCpWidth / kTpCpHeads;
    const at::Tensor h = qkv->forward(ln->forward(x)).view({b, t, 3, local_heads, d}).permute({2, 0, 3, 1, 4});
    const at::Tensor y = nn::cp::causal_attention(h[0].contiguous(), h[1].contiguous(), h[2].contiguous(), cp);
    return x + proj->forward(y.transpose(1, 2).reshape({b, t, local_heads * d}));
  }
  torch::nn::LayerNorm ln;
  nn::ColumnParallelLinear qkv;
  nn::RowParallelLinear proj;
  dist::ProcessGroup cp;
  std::int64_t local_heads;
};
TORCH_MODULE(TpCpAttention);

struct RefAttentionImpl : torch::nn::Module {
  RefAttentionImpl()
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kTpCpWidth})))),
        qkv(register_module("qkv", torch::nn::Linear(kTpCpWidth, 3 * kTpCpWidth))),
        proj(register_module("proj", torch::nn::Linear(kTpCpWidth, kTpCpWidth))) {}
  at::Tensor forward(const at::Tensor& x) {
    const std::int64_t b = x.size(0), t = x.size(1), d = kTpCpWidth / kTpCpHeads;
    const at::Tensor h = qkv->forward(ln->forward(x)).view({b, t, 3, kTpCpHeads, d}).permute({2, 0, 3, 1, 4});
    const at::Tensor y = at::scaled_dot_product_attention(h[0], h[1], h[2], {}, 0.0, /*is_causal=*/true);
    return x + proj->forward(y.transpose(1, 2).reshape({b, t, kTpCpWidth}));
  }
  torch::nn::LayerNorm ln;
  torch::nn::Linear qkv, proj;
};
TORCH_MODULE(RefAttention);

}  // namespace dtrain::testing::tp_compose
