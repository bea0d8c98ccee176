// Vocabulary-parallel embedding and cross-entropy (see vocab_parallel.h).
#include "dtrain/nn/vocab_parallel.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "dtrain/error.h"
#include "dtrain/nn/parallel_linear.h"
#include "dtrain/nn/tp_comm.h"
#include "group_capsule.h"

namespace dtrain::nn {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows of every rank's part; ids on a CPU checked against the vocabulary.
void check_ids(const at::Tensor& ids, std::int64_t vocab, std::int64_t ignore_index, bool allow_ignore,
               const char* what) {
  if (!ids.device().is_cpu() || ids.numel() == 0) return;
  const at::Tensor bad = (ids < 0) | (ids >= vocab);
  const at::Tensor wrong = allow_ignore ? bad & (ids != ignore_index) : bad;
  if (!wrong.any().item<bool>()) return;
  const std::int64_t first = ids.masked_select(wrong).view(-1)[0].item<std::int64_t>();
  DTRAIN_CHECK(false, DataError,
               what << " holds id " << first << ", outside the vocabulary 0.." << vocab - 1
                    << (allow_ignore ? " (and not the ignore index " + std::to_string(ignore_index) + ")" : ""),
               "check the tokenizer's vocabulary size against the model's");
}

// Rows per rank: torch.chunk's (and dist::Layout's) rule, ceil(V / t), the
// last rank's part shorter when t does not divide V.
std::int64_t vocab_chunk(std::int64_t vocab, std::int64_t parts) {
  return (vocab + parts - 1) / parts;
}

// ConfigError unless every rank gets at least one row of the vocabulary.
void check_vocab_split(std::int64_t vocab, std::int64_t parts, const char* what) {
  DTRAIN_CHECK(vocab >= 1 && (parts - 1) * vocab_chunk(vocab, parts) < vocab, ConfigError,
               what << ": a vocabulary of " << vocab << " split over the tensor-parallel degree " << parts
                    << " in pieces of " << vocab_chunk(vocab, parts) << " leaves the last rank no rows.",
               "use a tp degree for which every rank gets a row of the vocabulary");
}

// Megatron's vocab-parallel cross-entropy: per-row losses [N] of logits
// [N, V/t] split over the group; backward local (softmax - one_hot).
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            const c10::IValue& group_capsule, std::int64_t ignore_index, std::int64_t start) {
    dist::ProcessGroup group = detail::group_in(group_capsule);
    const std::int64_t local_vocab = logits.size(1);

    // Shift by the global row maximum, so exp() cannot overflow.
    at::Tensor max = std::get<0>(logits.max(1));
    group.all_reduce(max, dist::ReduceOp::kMax).wait();
    at::Tensor shifted = logits - max.unsqueeze(1);

    const at::Tensor valid = targets != ignore_index;
    const at::Tensor mine = valid & (targets >= start) & (targets < start + local_vocab);
    const at::Tensor local_targets = (targets - start).masked_fill(~mine, 0);
    const at::Tensor target_logit = shifted.gather(1, local_targets.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0);

    // One all-reduce for the target's logit and the sum of exponentials.
    at::Tensor exp = shifted.exp_();  // shifted is ours: reuse its memory
    at::Tensor sums = at::stack({target_logit, exp.sum(1)});
    group.all_reduce(sums, dist::ReduceOp::kSum).wait();
    at::Tensor loss = (sums[1].log() - sums[0]).masked_fill_(~valid, 0.0);

    exp.div_(sums[1].unsqueeze(1));  // the softmax, kept for backward
    ctx->save_for_backward({exp, local_targets, mine, valid});
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &softmax = saved[0], &local_targets = saved[1], &mine = saved[2], &valid = saved[3];
    at::Tensor grad = softmax.clone();
    grad.scatter_add_(1, local_targets.unsqueeze(1), -mine.to(grad.scalar_type()).unsqueeze(1));
    grad.mul_((grads[0] * valid.to(grads[0].scalar_type())).unsqueeze(1));
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

// ---- VocabParallelEmbedding ----

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(dist::DeviceMesh& mesh,
                                                       const VocabParallelEmbeddingOptions& options)
    : options_(options), tp_(mesh["tp"]), mesh_dims_(mesh.dims()), coordinates_(mesh.coordinates()) {
  DTRAIN_CHECK(options_.embedding_dim > 0, ConfigError,
               "VocabParallelEmbedding: embedding_dim " << options_.embedding_dim, "embedding_dim is at least 1");
  check_vocab_split(options_.num_embeddings, tp_.size(), "VocabParallelEmbedding");
  // torch::nn::Embedding's default initialisation, N(0, 1).
  const std::int64_t end =
      std::min(options_.num_embeddings, vocab_start() + vocab_chunk(options_.num_embeddings, tp_.size()));
  weight = register_parameter("weight", at::randn({end - vocab_start(), options_.embedding_dim}));
}

std::int64_t VocabParallelEmbeddingImpl::vocab_start() const {
  return tp_.rank() * vocab_chunk(options_.num_embeddings, tp_.size());
}

dist::NamedLayouts VocabParallelEmbeddingImpl::parameter_layouts() const {
  return {{"weight",
           {.mesh = mesh_dims_,
            .placements = detail::tp_placements(mesh_dims_, 0),
            .global_shape = {options_.num_embeddings, options_.embedding_dim}}}};
}

void VocabParallelEmbeddingImpl::copy_from_full(const at::Tensor& full) {
  const dist::Layout layout = parameter_layouts()[0].second;
  DTRAIN_CHECK(
      full.sizes().vec() == layout.global_shape, ConfigError,
      "VocabParallelEmbedding::copy_from_full got shape " << full.sizes() << ", the layer's is " << layout.to_string(),
      "pass the unsplit embedding's weight");
  c10::NoGradGuard no_grad;
  weight.copy_(dist::local_part(full, layout, coordinates_));
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  check_ids(ids, options_.num_embeddings, 0, false, "VocabParallelEmbedding: the input");
  const std::int64_t start = vocab_start(), rows = weight.size(0);
  const at::Tensor outside = (ids < start) | (ids >= start + rows);
  const at::Tensor local = at::embedding(weight, (ids - start).masked_fill(outside, 0));
  const at::Tensor partial = local.masked_fill(outside.unsqueeze(-1), 0.0);
  return options_.sequence_parallel ? tp::reduce_scatter_to_sequence(partial, tp_, options_.sequence_dim)
                                    : tp::reduce_from_region(partial, tp_);
}

// ---- cross-entropy ----

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, dist::ProcessGroup group,
                                        const VocabParallelCrossEntropyOptions& options) {
  DTRAIN_CHECK(logits.dim() >= 1 && targets.sizes() == logits.sizes().slice(0, logits.dim() - 1), ConfigError,
               "vocab_parallel_cross_entropy: logits " << logits.sizes() << " and targets " << targets.sizes()
                                                       << " do not match",
               "pass logits [.., vocab / tp] and targets [..]");
  const std::int64_t parts = group.size();
  const std::int64_t vocab = options.vocab_size > 0 ? options.vocab_size : logits.size(-1) * parts;
  check_vocab_split(vocab, parts, "vocab_parallel_cross_entropy");
  const std::int64_t start = group.rank() * vocab_chunk(vocab, parts);
  const std::int64_t rows = std::min(vocab, start + vocab_chunk(vocab, parts)) - start;
  DTRAIN_CHECK(logits.size(-1) == rows, ConfigError,
               "vocab_parallel_cross_entropy: this rank's logits have "
                   << logits.size(-1) << " vocabulary columns; a vocabulary of " << vocab << " over " << parts
                   << " ranks gives it " << rows,
               "pass options.vocab_size, the whole vocabulary, when tp does not divide it");
  check_ids(targets, vocab, options.ignore_index, true, "vocab_parallel_cross_entropy: the targets");
  const at::Tensor flat_logits = logits.reshape({-1, logits.size(-1)}).to(at::kFloat);
  const at::Tensor flat_targets = targets.reshape({-1}).to(at::kLong);
  const at::Tensor losses = VocabParallelCrossEntropy::apply(
      flat_logits, flat_targets, detail::capsule_of(std::move(group)), options.ignore_index, start);
  using Reduction = VocabParallelCrossEntropyOptions::Reduction;
  switch (options.reduction) {
    case Reduction::kNone: return losses.view(targets.sizes());
    case Reduction::kSum: return losses.sum();
    case Reduction::kMean: return losses.sum() / (flat_targets != options.ignore_index).sum().to(losses.scalar_type());
  }
  return losses;
}

}  // namespace dtrain::nn
