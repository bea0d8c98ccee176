// The vocabulary split over the mesh's `tp` dimension (t ranks), Megatron-LM's
// way: an embedding whose rows are sharded, and a cross-entropy over logits
// whose vocabulary is sharded, so no rank ever holds the full [tokens, vocab]
// logits (the largest activation of a language model).
//
//   VocabParallelEmbedding   W [vocab, dim] Shard(0): rank r holds rows
//                            r*ceil(vocab/t) .. (torch.chunk's split, as
//                            the layout's: when t does not divide the
//                            vocabulary the last part is shorter; a rank
//                            left without rows is a ConfigError); ids
//                            outside them look up zeros,
//                            and the ranks' results are summed (all-reduce,
//                            or reduce-scatter along the sequence with
//                            sequence parallelism).
//   vocab_parallel_cross_entropy(logits [.., vocab/t], targets [..])
//                            forward: max over the vocabulary (all-reduce
//                            max), then the target's logit and the sum of
//                            exponentials (one all-reduce of both); backward
//                            is local: softmax - one_hot(target) on this
//                            rank's columns, no communication.
//
// A tied output head is a column-parallel product with the embedding's
// weight: logits_r = copy_to_region(h) W_r^T ([.., vocab/t]), its gradient
// accumulating into the same sharded weight.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

#include "dtrain/comm/mesh.h"
#include "dtrain/dist/parameter_layouts.h"

namespace dtrain::nn {

struct VocabParallelEmbeddingOptions {
  std::int64_t num_embeddings = 0;  // the vocabulary
  std::int64_t embedding_dim = 0;
  // Reduce-scatter the result along sequence_dim (each rank keeps 1/t of the
  // sequence, the input of a sequence-parallel region) instead of
  // all-reducing it.
  bool sequence_parallel = false;
  std::int64_t sequence_dim = 1;
};

class VocabParallelEmbeddingImpl : public torch::nn::Module, public dist::DeclaresLayouts {
 public:
  // ConfigError when the split leaves a rank without rows.
  VocabParallelEmbeddingImpl(dist::DeviceMesh& mesh, const VocabParallelEmbeddingOptions& options);

  // ids: integer [..] in 0..num_embeddings-1 (DataError otherwise, checked
  // for CPU ids) -> [.., embedding_dim], replicated (or 1/t of the sequence).
  at::Tensor forward(const at::Tensor& ids);
  dist::NamedLayouts parameter_layouts() const override;
  // Copies this rank's rows of an unsplit embedding [num_embeddings, dim].
  void copy_from_full(const at::Tensor& weight);

  // This rank's rows: vocab_start() .. vocab_start() + weight.size(0) - 1.
  std::int64_t vocab_start() const;
  dist::ProcessGroup& group() { return tp_; }
  const VocabParallelEmbeddingOptions& options() const { return options_; }
  at::Tensor weight;

 private:
  VocabParallelEmbeddingOptions options_;
  dist::ProcessGroup tp_;
  std::vector<dist::MeshDim> mesh_dims_;
  std::vector<int> coordinates_;
};
// TORCH_MODULE's holder, plus a constructor that takes designated
// initialisers (VocabParallelEmbedding(mesh, {.num_embeddings = ...})).
class VocabParallelEmbedding : public torch::nn::ModuleHolder<VocabParallelEmbeddingImpl> {
 public:
  using torch::nn::ModuleHolder<VocabParallelEmbeddingImpl>::ModuleHolder;
  using torch::nn::ModuleHolder<VocabParallelEmbeddingImpl>::get;
  VocabParallelEmbedding(dist::DeviceMesh& mesh, const VocabParallelEmbeddingOptions& options)
      : ModuleHolder(std::make_shared<VocabParallelEmbeddingImpl>(mesh, options)) {}
};

struct VocabParallelCrossEntropyOptions {
  // Targets equal to this contribute no loss and no gradient (at::cross_entropy's).
  std::int64_t ignore_index = -100;
  enum class Reduction { kMean, kSum, kNone };
  // kMean: over the targets that are not ignored (at::cross_entropy's mean).
  Reduction reduction = Reduction::kMean;
  // The whole vocabulary V. 0: this rank's columns times the group size (tp
  // divides V). Needed when it does not: rank r holds columns
  // r*ceil(V/t) .. (torch.chunk's split, the last part shorter).
  std::int64_t vocab_size = 0;
};

// Cross-entropy of logits split over `group` along their last dimension
// (rank r holds vocabulary columns r*ceil(V/t) .., as VocabParallelEmbedding's
// rows; every rank the same rows)
// against global target ids [..] (logits' shape without its last dimension).
// Computed in fp32 whatever the logits' dtype (as autocast runs
// cross_entropy); the gradient flows back to `logits` only. Every rank gets
// the same loss. DataError for a target outside 0..V-1 that is not
// ignore_index (checked for CPU targets).
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, dist::ProcessGroup group,
                                        const VocabParallelCrossEntropyOptions& options = {});

}  // namespace dtrain::nn
