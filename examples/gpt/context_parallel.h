// The GPT over the mesh's `cp` dimension (context parallelism): every rank of
// a cp group holds all the parameters (Replicate on cp) and 1/c of every
// sequence, in the zig-zag split of dtrain::nn::cp (rank r: chunks r and
// 2c-1-r of 2c). Only two things differ from the unsplit model:
//
//   embed    takes the whole batch [B, T], keeps this rank's tokens and adds
//            the position embeddings of their *global* positions -> [B, T/c, C]
//   attention  nn::cp::causal_attention (K/V passed round the cp ring, or
//            all-gathered) instead of at::scaled_dot_product_attention
//
// LayerNorms, the MLP and the head are per position and run on the rank's
// rows as they are; the logits are [B, T/c, V]. The targets are cut alike
// (cp_targets) and the loss, cp_lm_loss, is the mean over the rank's tokens
// with its value averaged over cp (nn::cp::mean_loss); gradients are then
// averaged over dp x cp (ContextParallelStrategy).
//
// apply_cp(layers, cp_group, options) returns a Sequential of the same layer
// and parameter names that *shares* the modules of gpt_layers(config):
// training it trains them, so the full weights (sample, --save-params) are
// the layers themselves. CpGpt holds it as Gpt holds gpt_layers, so the
// parameter names ("layers.block0.attn.c_attn.weight", ...) and checkpoints
// are the single-process model's: a run saved under cp resumes under any
// other cp degree or in one process.
//
// Activation recompute (GptConfig::recompute, per block as in gpt_layers):
// selective recomputes the ring attention in backward (its K/V passed round
// again, then its own ring backward), full the whole block; each rank's
// recompute runs the same collectives in the same order as its peers'
// (every cp rank runs the same blocks' backward in the same order), so the
// gradients equal the cp run without recompute bit for bit.
//
// Dropout (GptConfig::dropout, in training) draws from
// CpOptions::dropout_generator: each rank's rows of the masks one process
// draws (Note [CP dropout]).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"
#include "dtrain/error.h"
#include "dtrain/nn/context_parallel.h"
#include "dtrain/nn/gelu.h"
#include "model.h"

namespace gpt {

struct CpOptions {
  dtrain::nn::cp::KvExchange exchange = dtrain::nn::cp::KvExchange::kRing;
  // Where dropout draws (required when the config's dropout is above 0):
  // Note [CP dropout]. Every cp rank of a data-parallel replica seeds it
  // alike.
  std::optional<at::Generator> dropout_generator;
};

// ConfigError naming the size when 2 x cp does not divide the block size,
// when dropout is on without CpOptions::dropout_generator, or dropout or
// recompute under tp x cp (`tensor_parallel`: its blocks have neither yet).
inline void validate_cp(const GptConfig& c, std::int64_t cp, bool tensor_parallel = false,
                        bool dropout_generator = false) {
  DTRAIN_CHECK(c.block_size % (2 * cp) == 0, ConfigError,
               "GPT context parallelism: block_size " << c.block_size << " does not split into " << 2 * cp
                                                      << " zig-zag chunks (2 x cp " << cp << ").",
               "choose a block size that is a multiple of " << 2 * cp);
  DTRAIN_CHECK(!tensor_parallel || c.dropout == 0.0, ConfigError,
               "GPT tensor x context parallelism does not support dropout yet (dropout " << c.dropout << ").",
               "train with --dropout 0 under tp x cp (cp alone has dropout)");
  DTRAIN_CHECK(!tensor_parallel || c.recompute == dtrain::Recompute::kNone, ConfigError,
               "GPT tensor x context parallelism does not support activation recompute yet.",
               "train with --recompute none under tp x cp (cp alone recomputes)");
  DTRAIN_CHECK(tensor_parallel || c.dropout == 0.0 || dropout_generator, ConfigError,
               "GPT context parallelism with dropout " << c.dropout << " needs CpOptions::dropout_generator.",
               "pass CpOptions{.dropout_generator = at::make_generator<at::CPUGeneratorImpl>(seed)}, seeded alike on "
               "the cp ranks of a replica");
}

// Note [CP dropout]: a cp rank holds rows of every sequence, so each of its
// dropouts is the rows it holds of the mask one process would draw: every
// cp rank draws the whole sequence's mask, as at::dropout draws it
// (bernoulli(1 - p) noise divided by 1 - p, the same generator calls in the
// same order: the embedding's; per block the attention probabilities'
// [B, H, T, T], the attention's residual branch's, the MLP's) from
// CpOptions::dropout_generator, and keeps its zig-zag rows (of the
// attention's, its query rows against every key:
// AttentionOptions::dropout_scale). A cp run whose generator is in the state
// one process's default generator is in at its forward computes that
// process's dropout exactly (multirank/gpt_cp_dropout_test.cpp); the ranks
// need not agree for the gradients to be right (each applies its rows'
// masks where the rows are). Costs: drawing the whole sequence's masks (c
// times the local part's), the attention's [B, H, T, T] transiently and its
// [B, H, T/c, T] rows kept for backward, like one process's math attention.
// Under recompute the block's masks are drawn before the recomputed part
// and reused by the recompute.
struct CpDropout {
  double p = 0.0;
  std::optional<at::Generator> generator;
  int cp = 1, rank = 0;
  bool active(bool training) const { return training && p > 0.0 && generator; }
  // This rank's rows (zig-zag along `dim`) of the whole sequence's mask of `sizes`.
  at::Tensor rows(at::IntArrayRef sizes, std::int64_t dim, const at::TensorOptions& options) const {
    at::Generator gen = *generator;
    at::Tensor noise = at::empty(sizes, options);
    noise.bernoulli_(1 - p, gen);
    noise.div_(1 - p);
    return dtrain::nn::cp::zigzag_shard(noise, cp, rank, dim);
  }
};

// A block's masks, drawn in one process's order (Note [CP dropout]);
// undefined without dropout.
struct CpBlockMasks {
  at::Tensor attention, residual, mlp;
};

struct CpEmbedImpl : torch::nn::Module {
  CpEmbedImpl(const Embed& full, dtrain::dist::ProcessGroup group, const CpOptions& options)
      : cp(std::move(group)),
        drop{.p = full->config.dropout, .generator = options.dropout_generator, .cp = cp.size(), .rank = cp.rank()} {
    wte = register_module("wte", full->wte);
    wpe = register_module("wpe", full->wpe);
  }
  // idx [B, T] (the whole sequences) -> [B, T/c, C], this rank's zig-zag rows.
  at::Tensor forward(const at::Tensor& idx) {
    const at::Tensor mine = dtrain::nn::cp::zigzag_shard(idx, cp.size(), cp.rank(), 1);
    at::Tensor x = wte(mine) + wpe(dtrain::nn::cp::zigzag_positions(idx.size(1), cp.size(), cp.rank(), idx.options()));
    if (drop.active(is_training())) x = x * drop.rows({idx.size(0), idx.size(1), x.size(2)}, 1, x.options());
    return x;
  }

  dtrain::dist::ProcessGroup cp;
  CpDropout drop;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
};
TORCH_MODULE(CpEmbed);

struct CpAttentionImpl : torch::nn::Module {
  CpAttentionImpl(const CausalSelfAttention& full, dtrain::dist::ProcessGroup group, const CpOptions& options)
      : n_head(full->config.n_head),
        recompute(full->config.recompute),
        cp(std::move(group)),
        exchange(options.exchange) {
    c_attn = register_module("c_attn", full->c_attn);
    c_proj = register_module("c_proj", full->c_proj);
  }
  // x [B, T/c, C] -> the same shape; `masks`: its dropouts (CpBlock draws them).
  at::Tensor forward(const at::Tensor& x, const CpBlockMasks& masks = {}) {
    const auto b = x.size(0), t = x.size(1), c = x.size(2);
    auto qkv = apply_linear(c_attn, x).split(c, 2);
    auto heads = [&](const at::Tensor& m) { return m.view({b, t, n_head, c / n_head}).transpose(1, 2); };
    auto core = [this, dropout = masks.attention](const std::vector<at::Tensor>& in) {
      return dtrain::nn::cp::causal_attention(in[0], in[1], in[2], cp,
                                              {.exchange = exchange, .dropout_scale = dropout});
    };
    const std::vector<at::Tensor> qkv_heads{heads(qkv[0]), heads(qkv[1]), heads(qkv[2])};
    const at::Tensor y =
        recompute == dtrain::Recompute::kSelective ? dtrain::nn::checkpoint(core, qkv_heads) : core(qkv_heads);
    at::Tensor out = apply_linear(c_proj, y.transpose(1, 2).contiguous().view({b, t, c}));
    return masks.residual.defined() ? out * masks.residual : out;
  }

  std::int64_t n_head;
  dtrain::Recompute recompute;
  dtrain::dist::ProcessGroup cp;
  dtrain::nn::cp::KvExchange exchange;
  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(CpAttention);

struct CpBlockImpl : torch::nn::Module {
  CpBlockImpl(const Block& full, dtrain::dist::ProcessGroup group, const CpOptions& options)
      : recompute(full->config.recompute),
        n_head(full->config.n_head),
        gelu_tanh(full->config.gelu_tanh),
        drop{.p = full->config.dropout,
             .generator = options.dropout_generator,
             .cp = group.size(),
             .rank = group.rank()} {
    ln_1 = register_module("ln_1", full->ln_1);
    attn = register_module("attn", CpAttention(full->attn, std::move(group), options));
    ln_2 = register_module("ln_2", full->ln_2);
    mlp = register_module("mlp", full->mlp);
  }
  at::Tensor forward(const at::Tensor& x) {
    CpBlockMasks masks;
    if (drop.active(is_training())) {  // one process's order: attention, its residual, the MLP's
      const std::int64_t b = x.size(0), seq = x.size(1) * drop.cp, c = x.size(2);
      masks.attention = drop.rows({b, n_head, seq, seq}, 2, x.options());
      masks.residual = drop.rows({b, seq, c}, 1, x.options());
      masks.mlp = drop.rows({b, seq, c}, 1, x.options());
    }
    if (recompute != dtrain::Recompute::kFull) return body(x, masks);
    return dtrain::nn::checkpoint([this, masks](const std::vector<at::Tensor>& in) { return body(in[0], masks); }, {x},
                                  parameters());
  }
  at::Tensor body(at::Tensor x, const CpBlockMasks& masks) {
    x = x + attn->forward(ln_1(x), masks);
    if (!masks.mlp.defined()) return x + mlp(ln_2(x));
    const at::Tensor h = apply_linear(mlp->c_fc, ln_2(x));
    return x + apply_linear(mlp->c_proj, dtrain::nn::gelu(h, gelu_tanh ? "tanh" : "none")) * masks.mlp;
  }

  dtrain::Recompute recompute;
  std::int64_t n_head;
  bool gelu_tanh;
  CpDropout drop;
  LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CpAttention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(CpBlock);

// The context-parallel view of gpt_layers(config) `layers` on this rank (see
// the file comment). Collective over `cp` in forward and backward only.
inline torch::nn::Sequential apply_cp(const torch::nn::Sequential& layers, dtrain::dist::ProcessGroup cp,
                                      const CpOptions& options = {}) {
  const Embed embed(layers->ptr<EmbedImpl>(0));
  validate_cp(embed->config, cp.size(), /*tensor_parallel=*/false, options.dropout_generator.has_value());
  torch::nn::Sequential out;
  out->push_back("embed", CpEmbed(embed, cp, options));
  for (std::size_t i = 1; i + 1 < layers->size(); ++i)
    out->push_back("block" + std::to_string(i - 1), CpBlock(Block(layers->ptr<BlockImpl>(i)), cp, options));
  out->push_back("head", Head(layers->ptr<HeadImpl>(layers->size() - 1)));
  return out;
}

// apply_cp's layers under the name Gpt gives gpt_layers ("layers").
struct CpGptImpl : torch::nn::Module {
  explicit CpGptImpl(torch::nn::Sequential split) { layers = register_module("layers", std::move(split)); }
  at::Tensor forward(const at::Tensor& idx) { return layers->forward(idx); }

  torch::nn::Sequential layers{nullptr};
};
TORCH_MODULE(CpGpt);

// This rank's targets: the zig-zag rows of targets [B, T].
inline at::Tensor cp_targets(const at::Tensor& targets, dtrain::dist::ProcessGroup& cp) {
  return dtrain::nn::cp::zigzag_shard(targets, cp.size(), cp.rank(), 1);
}

// Mean cross-entropy of this rank's logits [B, T/c, V] against its targets
// [B, T/c] (cp_targets), its value averaged over cp: the loss of the whole
// sequences, on every cp rank. Collective over cp.
inline at::Tensor cp_lm_loss(const at::Tensor& logits, const at::Tensor& local_targets, dtrain::dist::ProcessGroup cp) {
  return dtrain::nn::cp::mean_loss(lm_loss(logits, local_targets), std::move(cp));
}

}  // namespace gpt
