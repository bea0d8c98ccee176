// The GPT split over the mesh's `tp` dimension the Megatron way (Shoeybi et
// al. 2019), optionally with sequence parallelism (Korthikanti et al. 2022):
//
//   embed    wte vocab-parallel (rows Shard(0)), wpe replicated
//   block    attention by heads: c_attn column-parallel with the q, k, v
//            partitions split alike (rank r computes heads r*h/t ..), c_proj
//            row-parallel; MLP: c_fc column-parallel, c_proj row-parallel;
//            LayerNorms replicated
//   head     ln_f, then logits of this rank's vocabulary rows [B, T, ~V/t]
//            with the tied (sharded) wte; the loss is
//            vocab_parallel_cross_entropy (tp_lm_loss), so no rank holds
//            the full logits
//
// apply_tp(layers, mesh, options) turns gpt_layers(config) (weights already
// initialised, e.g. by init_weights) into a new Sequential of the same layer
// and parameter names holding this rank's parts, copied through the layers'
// layouts: every tp rank starts from one process's weights.
//
// With sequence parallelism the residual stream between blocks holds 1/t of
// the sequence ([B, T/t, C]): LayerNorms and residual additions run on it,
// the column layers all-gather it and the row layers reduce-scatter back; the
// LayerNorm gains and wpe, whose gradients are then partial sums, enter
// through copy_to_region (summed over tp in backward).
//
// The vocabulary splits by torch.chunk's rule (the layout's), so the 65
// Shakespeare characters run under tp 2 as 33 + 32 rows.
//
// Inside context parallelism (TpOptions::cp: tp x cp, a cp group of the
// ranks with this tp coordinate) the split also keeps this rank's zig-zag
// part of every sequence, as apply_cp does: the embedding takes the whole
// batch [B, T] and keeps its rows (position embeddings of their global
// positions), attention on this rank's heads runs nn::cp::causal_attention
// over cp, and the logits are [B, T/c, V/t] (the loss: tp_lm_loss on
// cp_targets, averaged over cp by nn::cp::mean_loss). With sequence
// parallelism as well, the residual stream holds this tp rank's 1/t of those
// rows ([B, T/(c t), C]). Not with dropout or recompute (validate_cp).
//
// Dropout (Note [TP dropout]) draws from TpOptions::rng, a
// dtrain::nn::RngTracker: masks of regions every tp rank holds alike (the
// embedding's output, the residual branches under plain TP) from its
// kReplicated stream, equal on every tp rank; masks of split regions (the
// attention probabilities of this rank's heads; under SP every dropout, each
// rank holding its own part of the sequence) from its kTensorParallel
// stream, different per tp rank. Megatron draws the same way.
//
// Not yet: cloning (DataParallel replicas).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "context_parallel.h"
#include "dtrain/comm/mesh.h"
#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/error.h"
#include "dtrain/nn/context_parallel.h"
#include "dtrain/nn/gelu.h"
#include "dtrain/nn/linear.h"
#include "dtrain/nn/parallel_linear.h"
#include "dtrain/nn/rng_tracker.h"
#include "dtrain/nn/tp_comm.h"
#include "dtrain/nn/vocab_parallel.h"
#include "model.h"

namespace gpt {

struct TpOptions {
  bool sequence_parallel = false;
  // The dropout streams of this rank (RngTracker::for_tp(seed, tp rank));
  // required when the config's dropout is above 0.
  std::shared_ptr<dtrain::nn::RngTracker> rng;
  // tp x cp: the cp group of this rank (every sequence split over it, see
  // the file comment) and how K/V reach its other ranks; unset: no cp.
  std::optional<dtrain::dist::ProcessGroup> cp;
  dtrain::nn::cp::KvExchange exchange = dtrain::nn::cp::KvExchange::kRing;
};

// ConfigError naming the size when the tp degree does not divide the heads,
// the width or the vocabulary, when the block size does not split under
// sequence parallelism, or when dropout is on without TpOptions::rng.
inline void validate_tp(const GptConfig& c, std::int64_t tp, const TpOptions& options) {
  auto require = [&](std::int64_t size, const char* what) {
    DTRAIN_CHECK(size % tp == 0, ConfigError,
                 "GPT tensor parallelism: " << what << " " << size << " is not divisible by the tp degree " << tp
                                            << " (each rank holds an equal part).",
                 "choose a tp degree that divides " << what << ", or change the model");
  };
  require(c.n_head, "n_head");
  require(c.n_embd, "n_embd");
  // The vocabulary splits unevenly (torch.chunk's rule) as long as every
  // rank gets a row: 65 characters over tp 2 are 33 + 32.
  const std::int64_t chunk = (c.vocab_size + tp - 1) / tp;
  DTRAIN_CHECK((tp - 1) * chunk < c.vocab_size, ConfigError,
               "GPT tensor parallelism: vocab_size " << c.vocab_size << " in pieces of " << chunk << " over tp " << tp
                                                     << " leaves the last rank no rows.",
               "use a smaller tp degree");
  // Sequence parallelism splits the rows a rank holds: the whole sequence,
  // or under cp its T/c zig-zag rows.
  const std::int64_t cp = options.cp ? options.cp->size() : 1;
  DTRAIN_CHECK(!options.sequence_parallel || c.block_size % (cp * tp) == 0, ConfigError,
               "GPT sequence parallelism: block_size " << c.block_size << " does not split over cp " << cp << " x tp "
                                                       << tp << " (each rank holds an equal part).",
               "choose a block size that is a multiple of " << cp * tp);
  DTRAIN_CHECK(c.dropout == 0.0 || options.rng, ConfigError,
               "GPT tensor parallelism with dropout " << c.dropout
                                                      << " needs the dropout streams (TpOptions::rng) and has none.",
               "pass TpOptions{.rng = std::make_shared<dtrain::nn::RngTracker>(RngTracker::for_tp(seed, tp_rank))}");
}

namespace detail {

// LayerNorm of a module's parameters; under sequence parallelism the gains
// enter through f, so their gradient (from 1/t of the sequence) is summed.
inline at::Tensor tp_layer_norm(const LayerNorm& ln, const at::Tensor& x, dtrain::dist::ProcessGroup& tp, bool sp) {
  auto param = [&](const at::Tensor& p) { return sp && p.defined() ? dtrain::nn::tp::copy_to_region(p, tp) : p; };
  return at::layer_norm(x, {x.size(-1)}, param(ln->weight), param(ln->bias), 1e-5);
}

inline LayerNorm copy_layer_norm(const LayerNorm& full, const GptConfig& c) {
  LayerNorm ln(c.n_embd, c.bias);
  torch::NoGradGuard no_grad;
  ln->weight.copy_(full->weight);
  if (c.bias) ln->bias.copy_(full->bias);
  return ln;
}

inline at::Tensor bias_of(const torch::nn::Linear& l) {
  return l->bias.defined() ? l->bias : at::Tensor();
}

// Note [TP dropout]: where each dropout of the GPT draws under tp.
//   embedding output, residual branches (attention's c_proj, the MLP):
//     plain TP: the tensor is replicated over tp, so every rank must drop
//     the same elements: kReplicated. SP: each rank holds its own part of
//     the sequence: kTensorParallel.
//   attention probabilities: this rank's heads: kTensorParallel.
// The unsplit GPT with the masks the ranks drew put together (heads and
// sequence parts concatenated in rank order, the replicated ones as they
// are) is the reference (tests/multirank/gpt_tp_dropout_test.cpp).
struct TpDropout {
  double p = 0.0;
  std::shared_ptr<dtrain::nn::RngTracker> rng;
  bool sp = false;

  // A replicated-region dropout (kTensorParallel under SP); identity in eval.
  at::Tensor operator()(const at::Tensor& x, bool training) const {
    if (!training || p == 0.0) return x;
    return rng->dropout(x, p, sp ? dtrain::nn::RngTracker::kTensorParallel : dtrain::nn::RngTracker::kReplicated);
  }
};

// Causal attention of q, k, v [B, heads, T, d] whose probabilities are
// dropped with a mask from the kTensorParallel stream: SDPA's math kernel
// (softmax(q k^T / sqrt(d)) masked, then times v), with our mask, as
// at::_scaled_dot_product_attention_math(..., dropout_mask) computes it.
inline at::Tensor causal_attention_with_dropout(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const TpDropout& drop) {
  const std::int64_t t = q.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const at::Tensor future = at::ones({t, t}, q.options().dtype(at::kBool)).triu(1);
  const at::Tensor probs =
      at::softmax(at::matmul(q, k.transpose(-2, -1)).mul(scale).masked_fill(future, -INFINITY), -1);
  const at::Tensor mask =
      drop.rng->draw_mask(dtrain::nn::RngTracker::kTensorParallel, probs.sizes(), drop.p, probs.options());
  return at::matmul(dtrain::nn::apply_dropout_mask(probs, mask, drop.p), v);
}

}  // namespace detail

struct TpEmbedImpl : torch::nn::Module {
  TpEmbedImpl(const EmbedImpl& full, dtrain::dist::DeviceMesh& mesh, const TpOptions& options)
      : config(full.config),
        sp(options.sequence_parallel),
        tp(mesh["tp"]),
        cp(options.cp),
        drop{.p = full.config.dropout, .rng = options.rng, .sp = options.sequence_parallel} {
    wte = register_module("wte", dtrain::nn::VocabParallelEmbedding(mesh, {.num_embeddings = config.vocab_size,
                                                                           .embedding_dim = config.n_embd,
                                                                           .sequence_parallel = sp}));
    wte->copy_from_full(full.wte->weight);
    wpe = register_module("wpe", torch::nn::Embedding(config.block_size, config.n_embd));
    torch::NoGradGuard no_grad;
    wpe->weight.copy_(full.wpe->weight);
  }
  // idx [B, T] -> [B, T, C], or [B, T/t, C] (this rank's part) under SP, or
  // [B, T/c, C] (this rank's zig-zag rows) under cp, [B, T/(c t), C] (this
  // tp rank's part of them) under cp and SP.
  at::Tensor forward(const at::Tensor& idx) {
    const std::int64_t t = idx.size(1);
    // The rows this rank's sequences hold (cp: its zig-zag rows) and their
    // global positions.
    at::Tensor rows = idx;
    at::Tensor pos = at::arange(t, idx.options());
    if (cp) {
      rows = dtrain::nn::cp::zigzag_shard(idx, cp->size(), cp->rank(), 1);
      pos = dtrain::nn::cp::zigzag_positions(t, cp->size(), cp->rank(), idx.options());
    }
    if (!sp) return drop(wte(rows) + wpe(pos), is_training());
    // SP: wte reduce-scatters to this tp rank's part of the rows; wpe's
    // gradient (from that part) is summed over tp.
    const std::int64_t part = rows.size(1) / tp.size();
    return drop(wte(rows) + at::embedding(dtrain::nn::tp::copy_to_region(wpe->weight, tp),
                                          pos.narrow(0, tp.rank() * part, part)),
                is_training());
  }

  GptConfig config;
  bool sp;
  dtrain::dist::ProcessGroup tp;
  std::optional<dtrain::dist::ProcessGroup> cp;
  detail::TpDropout drop;
  dtrain::nn::VocabParallelEmbedding wte{nullptr};
  torch::nn::Embedding wpe{nullptr};
};
TORCH_MODULE(TpEmbed);

struct TpAttentionImpl : torch::nn::Module {
  TpAttentionImpl(const CausalSelfAttentionImpl& full, dtrain::dist::DeviceMesh& mesh, const TpOptions& options)
      : config(full.config),
        tp_size(mesh.size("tp")),
        cp(options.cp),
        exchange(options.exchange),
        drop{.p = full.config.dropout, .rng = options.rng, .sp = options.sequence_parallel} {
    const std::int64_t c = config.n_embd;
    c_attn = register_module("c_attn",
                             dtrain::nn::ColumnParallelLinear(mesh, {.in_features = c,
                                                                     .out_features = 3 * c,
                                                                     .bias = config.bias,
                                                                     .sequence_parallel = options.sequence_parallel,
                                                                     .partitions = 3}));
    c_attn->copy_from_full(full.c_attn->weight, detail::bias_of(full.c_attn));
    c_proj = register_module("c_proj",
                             dtrain::nn::RowParallelLinear(mesh, {.in_features = c,
                                                                  .out_features = c,
                                                                  .bias = config.bias,
                                                                  .sequence_parallel = options.sequence_parallel}));
    c_proj->copy_from_full(full.c_proj->weight, detail::bias_of(full.c_proj));
  }
  // x [B, T or T/t, C] -> the same shape; this rank computes h/t heads.
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor qkv_all = c_attn(x);  // [B, T, 3C/t] = [q_r, k_r, v_r]
    const auto b = qkv_all.size(0), t = qkv_all.size(1), local = config.n_embd / tp_size;
    const auto h = config.n_head / tp_size, d = config.n_embd / config.n_head;
    auto qkv = qkv_all.split(local, 2);
    auto heads = [&](const at::Tensor& m) { return m.view({b, t, h, d}).transpose(1, 2); };
    const bool dropping = is_training() && drop.p > 0;
    at::Tensor y;
    if (cp) {  // this rank's heads of its zig-zag rows, K/V over cp (no dropout: validate_cp)
      y = dtrain::nn::cp::causal_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), *cp, {.exchange = exchange});
    } else if (dropping) {
      y = detail::causal_attention_with_dropout(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), drop);
    } else {
      y = at::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), {}, 0.0, /*is_causal=*/true);
    }
    return drop(c_proj(y.transpose(1, 2).contiguous().view({b, t, local})), is_training());
  }

  GptConfig config;
  std::int64_t tp_size;
  std::optional<dtrain::dist::ProcessGroup> cp;
  dtrain::nn::cp::KvExchange exchange;
  detail::TpDropout drop;
  dtrain::nn::ColumnParallelLinear c_attn{nullptr};
  dtrain::nn::RowParallelLinear c_proj{nullptr};
};
TORCH_MODULE(TpAttention);

struct TpMlpImpl : torch::nn::Module {
  TpMlpImpl(const MlpImpl& full, dtrain::dist::DeviceMesh& mesh, const TpOptions& options)
      : gelu_tanh(full.config.gelu_tanh),
        drop{.p = full.config.dropout, .rng = options.rng, .sp = options.sequence_parallel} {
    const auto& c = full.config;
    c_fc = register_module("c_fc",
                           dtrain::nn::ColumnParallelLinear(mesh, {.in_features = c.n_embd,
                                                                   .out_features = 4 * c.n_embd,
                                                                   .bias = c.bias,
                                                                   .sequence_parallel = options.sequence_parallel}));
    c_fc->copy_from_full(full.c_fc->weight, detail::bias_of(full.c_fc));
    c_proj = register_module("c_proj",
                             dtrain::nn::RowParallelLinear(mesh, {.in_features = 4 * c.n_embd,
                                                                  .out_features = c.n_embd,
                                                                  .bias = c.bias,
                                                                  .sequence_parallel = options.sequence_parallel}));
    c_proj->copy_from_full(full.c_proj->weight, detail::bias_of(full.c_proj));
  }
  at::Tensor forward(const at::Tensor& x) {
    return drop(c_proj(dtrain::nn::gelu(c_fc(x), gelu_tanh ? "tanh" : "none")), is_training());
  }

  bool gelu_tanh;  // the full MLP's GELU (model.h)
  detail::TpDropout drop;
  dtrain::nn::ColumnParallelLinear c_fc{nullptr};
  dtrain::nn::RowParallelLinear c_proj{nullptr};
};
TORCH_MODULE(TpMlp);

struct TpBlockImpl : torch::nn::Module {
  TpBlockImpl(const BlockImpl& full, dtrain::dist::DeviceMesh& mesh, const TpOptions& options)
      : sp(options.sequence_parallel), tp(mesh["tp"]) {
    ln_1 = register_module("ln_1", detail::copy_layer_norm(full.ln_1, full.config));
    attn = register_module("attn", TpAttention(*full.attn, mesh, options));
    ln_2 = register_module("ln_2", detail::copy_layer_norm(full.ln_2, full.config));
    mlp = register_module("mlp", TpMlp(*full.mlp, mesh, options));
  }
  at::Tensor forward(at::Tensor x) {
    x = x + attn(detail::tp_layer_norm(ln_1, x, tp, sp));
    return x + mlp(detail::tp_layer_norm(ln_2, x, tp, sp));
  }

  bool sp;
  dtrain::dist::ProcessGroup tp;
  LayerNorm ln_1{nullptr}, ln_2{nullptr};
  TpAttention attn{nullptr};
  TpMlp mlp{nullptr};
};
TORCH_MODULE(TpBlock);

// ln_f and the tied head: logits of this rank's vocabulary rows.
struct TpHeadImpl : torch::nn::Module {
  TpHeadImpl(const HeadImpl& full, TpEmbed tied, const TpOptions& options)
      : sp(options.sequence_parallel), tp(tied->tp), embed(std::move(tied)) {
    ln_f = register_module("ln_f", detail::copy_layer_norm(full.ln_f, full.config));
  }
  // x [B, T or T/t, C] -> logits [B, T, V/t].
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = detail::tp_layer_norm(ln_f, x, tp, sp);
    const at::Tensor full = sp ? dtrain::nn::tp::gather_from_sequence(h, tp, 1) : dtrain::nn::tp::copy_to_region(h, tp);
    return dtrain::nn::linear(full, embed->wte->weight);
  }

  bool sp;
  dtrain::dist::ProcessGroup tp;
  TpEmbed embed;  // not a submodule: the weight belongs to the embedding
  LayerNorm ln_f{nullptr};
};
TORCH_MODULE(TpHead);

// The tensor-parallel copy of gpt_layers(config) `layers` on this rank (see
// the file comment). Collective over mesh["tp"] (and TpOptions::cp) only in
// forward/backward.
inline torch::nn::Sequential apply_tp(const torch::nn::Sequential& layers, dtrain::dist::DeviceMesh& mesh,
                                      const TpOptions& options = {}) {
  const auto& embed = *layers->ptr<EmbedImpl>(0);
  validate_tp(embed.config, mesh.size("tp"), options);
  if (options.cp) validate_cp(embed.config, options.cp->size(), /*tensor_parallel=*/true);
  torch::nn::Sequential out;
  TpEmbed tp_embed(embed, mesh, options);
  out->push_back("embed", tp_embed);
  for (std::size_t i = 1; i + 1 < layers->size(); ++i)
    out->push_back("block" + std::to_string(i - 1), TpBlock(*layers->ptr<BlockImpl>(i), mesh, options));
  out->push_back("head", TpHead(*layers->ptr<HeadImpl>(layers->size() - 1), tp_embed, options));
  return out;
}

// Mean cross-entropy of vocabulary-split logits [B, T, this rank's part of
// vocab_size] against targets [B, T]: equal to lm_loss of the full logits, on
// every tp rank.
inline at::Tensor tp_lm_loss(const at::Tensor& logits, const at::Tensor& targets, dtrain::dist::ProcessGroup tp,
                             std::int64_t vocab_size) {
  return dtrain::nn::vocab_parallel_cross_entropy(logits, targets.to(logits.device()), std::move(tp),
                                                  {.vocab_size = vocab_size});
}

}  // namespace gpt
