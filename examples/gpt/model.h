// A character-level GPT: nanoGPT's model (karpathy/nanoGPT, model.py) in
// LibTorch, header-only so the example, the tests and the benchmark share it.
//
//   embed    token + position embeddings (+ dropout)
//   block i  x + attn(ln_1(x)), then x + mlp(ln_2(x)): pre-LayerNorm causal
//            self-attention (dtrain::nn::causal_attention: oneDNN's products
//            for short sequences, at::scaled_dot_product_attention else) and
//            a GELU MLP of width 4 x n_embd (dtrain::nn::gelu: the derivative
//            written in forward, backward one multiplication)
//   head     final LayerNorm and logits = x @ wte^T (the output projection is
//            the token embedding: one parameter, trained by both ends)
//
// The network is a Sequential of these n_layer + 2 layers (gpt_layers), so
// model parallelism and pipelining split it by block; Gpt wraps that
// Sequential as one Cloneable module for single-device, DataParallel and DDP
// training. Parameter names match bench/gpt/peer.py's Python model
// ("layers.block0.attn.c_attn.weight", ...), so weights move between the two.
//
// init_weights() is GPT-2's initialisation (normal(0, 0.02) for every matrix
// and embedding, the residual projections c_proj scaled by 1/sqrt(2 n_layer),
// zero biases, unit LayerNorm gains), drawn from its own generator in
// named_parameters order: the same seed gives bit-identical weights here and in
// the Python peer, independent of the global RNG.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "dtrain/nn/attention.h"
#include "dtrain/nn/checkpoint.h"
#include "dtrain/nn/gelu.h"
#include "dtrain/nn/linear.h"
#include "dtrain/plan/plan.h"

#include <cmath>
#include <cstdint>
#include <string>

namespace gpt {

struct GptConfig {
  std::int64_t vocab_size = 65;
  std::int64_t block_size = 64;  // longest context
  std::int64_t n_layer = 4;
  std::int64_t n_head = 4;
  std::int64_t n_embd = 128;
  double dropout = 0.0;
  bool bias = false;  // biases in Linear and LayerNorm (nanoGPT's default: none)
  // The MLP's GELU: exact (erf, nanoGPT's nn.GELU()) or the tanh approximation
  // (GPT-2's "gelu_new"); a model imported from Hugging Face uses its config's.
  bool gelu_tanh = false;
  // Activation recompute (dtrain::nn::checkpoint) of blocks 0, k, 2k, ...:
  // full recomputes the whole block in backward, keeping only its input;
  // selective recomputes the attention core (Korthikanti et al. 2022: the
  // softmax region, kept as q, k, v), keeping every matmul's input.
  dtrain::Recompute recompute = dtrain::Recompute::kNone;
  std::int64_t recompute_every = 1;
};

// LayerNorm with an optional bias (LibTorch's has both or neither).
struct LayerNormImpl : torch::nn::Cloneable<LayerNormImpl> {
  LayerNormImpl(std::int64_t n, bool bias) : n_(n), has_bias_(bias) { reset(); }
  void reset() override {
    weight = register_parameter("weight", at::ones({n_}));
    if (has_bias_) bias = register_parameter("bias", at::zeros({n_}));
  }
  at::Tensor forward(const at::Tensor& x) { return at::layer_norm(x, {n_}, weight, bias, 1e-5); }

  at::Tensor weight, bias;

 private:
  std::int64_t n_;
  bool has_bias_;
};
TORCH_MODULE(LayerNorm);

inline torch::nn::Linear make_linear(std::int64_t in, std::int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

// A Linear's product through dtrain::nn::linear (oneDNN's matmul on the CPU in
// fp32, at::linear elsewhere): the module holds the parameters, so names and
// checkpoints are those of torch::nn::Linear.
inline at::Tensor apply_linear(const torch::nn::Linear& layer, const at::Tensor& x) {
  return dtrain::nn::linear(x, layer->weight, layer->bias);
}

struct EmbedImpl : torch::nn::Cloneable<EmbedImpl> {
  explicit EmbedImpl(const GptConfig& c) : config(c) { reset(); }
  void reset() override {
    wte = register_module("wte", torch::nn::Embedding(config.vocab_size, config.n_embd));
    wpe = register_module("wpe", torch::nn::Embedding(config.block_size, config.n_embd));
    drop = register_module("drop", torch::nn::Dropout(config.dropout));
  }
  // idx: int64 [B, T] with T <= block_size -> [B, T, n_embd].
  at::Tensor forward(const at::Tensor& idx) {
    const at::Tensor pos = at::arange(idx.size(1), idx.options());
    return drop(wte(idx) + wpe(pos));
  }

  GptConfig config;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Embed);

struct CausalSelfAttentionImpl : torch::nn::Cloneable<CausalSelfAttentionImpl> {
  explicit CausalSelfAttentionImpl(const GptConfig& c) : config(c) { reset(); }
  void reset() override {
    TORCH_CHECK(config.n_embd % config.n_head == 0, "n_embd ", config.n_embd, " is not a multiple of n_head ",
                config.n_head);
    c_attn = register_module("c_attn", make_linear(config.n_embd, 3 * config.n_embd, config.bias));
    c_proj = register_module("c_proj", make_linear(config.n_embd, config.n_embd, config.bias));
    resid_drop = register_module("resid_drop", torch::nn::Dropout(config.dropout));
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto b = x.size(0), t = x.size(1), c = x.size(2), h = config.n_head;
    auto qkv = apply_linear(c_attn, x).split(c, 2);  // each [B, T, C] -> [B, h, T, C / h]
    auto heads = [&](const at::Tensor& m) { return m.view({b, t, h, c / h}).transpose(1, 2); };
    const double dropout = is_training() ? config.dropout : 0.0;
    auto core = [dropout](const std::vector<at::Tensor>& in) {
      return dtrain::nn::causal_attention(in[0], in[1], in[2], dropout);
    };
    const std::vector<at::Tensor> qkv_heads{heads(qkv[0]), heads(qkv[1]), heads(qkv[2])};
    at::Tensor y =
        config.recompute == dtrain::Recompute::kSelective ? dtrain::nn::checkpoint(core, qkv_heads) : core(qkv_heads);
    return resid_drop(apply_linear(c_proj, y.transpose(1, 2).contiguous().view({b, t, c})));
  }

  GptConfig config;
  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};
  torch::nn::Dropout resid_drop{nullptr};
};
TORCH_MODULE(CausalSelfAttention);

struct MlpImpl : torch::nn::Cloneable<MlpImpl> {
  explicit MlpImpl(const GptConfig& c) : config(c) { reset(); }
  void reset() override {
    c_fc = register_module("c_fc", make_linear(config.n_embd, 4 * config.n_embd, config.bias));
    c_proj = register_module("c_proj", make_linear(4 * config.n_embd, config.n_embd, config.bias));
    drop = register_module("drop", torch::nn::Dropout(config.dropout));
  }
  at::Tensor forward(const at::Tensor& x) {
    return drop(apply_linear(c_proj, dtrain::nn::gelu(apply_linear(c_fc, x), config.gelu_tanh ? "tanh" : "none")));
  }

  GptConfig config;
  torch::nn::Linear c_fc{nullptr}, c_proj{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Mlp);

struct BlockImpl : torch::nn::Cloneable<BlockImpl> {
  explicit BlockImpl(const GptConfig& c) : config(c) { reset(); }
  void reset() override {
    ln_1 = register_module("ln_1", LayerNorm(config.n_embd, config.bias));
    attn = register_module("attn", CausalSelfAttention(config));
    ln_2 = register_module("ln_2", LayerNorm(config.n_embd, config.bias));
    mlp = register_module("mlp", Mlp(config));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (config.recompute != dtrain::Recompute::kFull) return body(x);
    return dtrain::nn::checkpoint([this](const std::vector<at::Tensor>& in) { return body(in[0]); }, {x}, parameters());
  }
  at::Tensor body(at::Tensor x) {
    x = x + attn(ln_1(x));
    return x + mlp(ln_2(x));
  }

  GptConfig config;
  LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CausalSelfAttention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(Block);

// Final LayerNorm and the tied output projection. The token embedding is
// held by reference, not registered: the parameter belongs to `embed`. Across
// devices (model parallelism) the weight is copied to the head's device in
// forward, and autograd carries its gradient back to the embedding.
struct HeadImpl : torch::nn::Cloneable<HeadImpl> {
  HeadImpl(const GptConfig& c, Embed tied) : config(c), embed(std::move(tied)) { reset(); }
  void reset() override { ln_f = register_module("ln_f", LayerNorm(config.n_embd, config.bias)); }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = ln_f(x);
    return dtrain::nn::linear(h, embed->wte->weight.to(h.device()));
  }

  GptConfig config;
  Embed embed;  // not a submodule
  LayerNorm ln_f{nullptr};
};
TORCH_MODULE(Head);

// The n_layer + 2 layers: "embed", "block0".."block{n-1}", "head".
inline torch::nn::Sequential gpt_layers(const GptConfig& config) {
  torch::nn::Sequential layers;
  Embed embed(config);
  layers->push_back("embed", embed);
  for (std::int64_t i = 0; i < config.n_layer; ++i) {
    GptConfig block = config;
    if (i % config.recompute_every != 0) block.recompute = dtrain::Recompute::kNone;
    layers->push_back("block" + std::to_string(i), Block(block));
  }
  layers->push_back("head", Head(config, embed));
  return layers;
}

// The whole network as one module: idx int64 [B, T] -> logits [B, T, vocab].
struct GptImpl : torch::nn::Cloneable<GptImpl> {
  explicit GptImpl(const GptConfig& c) : config(c) { reset(); }
  void reset() override { layers = register_module("layers", gpt_layers(config)); }
  at::Tensor forward(const at::Tensor& idx) { return layers->forward(idx); }

  // Cloneable copies each layer on its own, so a clone's head would still
  // point at the original's embedding: tie it to the clone's (DataParallel's
  // replicas are clones).
  std::shared_ptr<torch::nn::Module> clone(const std::optional<c10::Device>& device = std::nullopt) const override {
    auto copy = std::dynamic_pointer_cast<GptImpl>(torch::nn::Cloneable<GptImpl>::clone(device));
    copy->layers->ptr<HeadImpl>(copy->layers->size() - 1)->embed = Embed(copy->layers->ptr<EmbedImpl>(0));
    return copy;
  }

  GptConfig config;
  torch::nn::Sequential layers{nullptr};
};
TORCH_MODULE(Gpt);

// GPT-2's initialisation (see the file comment) of a Gpt, a gpt_layers
// Sequential, or anything holding one (ModelParallel).
inline void init_weights(torch::nn::Module& model, std::int64_t n_layer, std::uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(n_layer));
  for (auto& item : model.named_parameters()) {
    const std::string& name = item.key();
    at::Tensor& p = item.value();
    const bool is_norm = name.find(".ln_") != std::string::npos;
    const bool is_bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
    const bool is_residual = name.find("c_proj.weight") != std::string::npos;
    if (is_bias) {
      p.zero_();
    } else if (is_norm) {
      p.fill_(1.0);
    } else {
      // Drawn on the CPU and copied, so placement does not change the values.
      p.copy_(at::empty(p.sizes(), p.options().device(at::kCPU)).normal_(0.0, is_residual ? residual_std : 0.02, gen));
    }
  }
}

// Mean cross-entropy of logits [B, T, V] against targets [B, T].
inline at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}).to(logits.device()));
}

}  // namespace gpt
