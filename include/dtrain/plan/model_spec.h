// A transformer as the planner sees it: the shapes that decide its
// parameters, FLOPs and activations, read from "gpt:layers=..,hidden=.." or
// "llama:layers=..,hidden=..,heads=..,kv_heads=..,ffn=..,seq=..,vocab=..".
//
//   auto m = dtrain::plan::ModelSpec::parse("gpt:layers=80,hidden=12288,heads=96,seq=2048,vocab=51200");
//   m.params();                 // 145.6e9
//   m.model_flops_per_token();  // 6 x matmul parameters + 12 x layers x hidden x seq
//
// The two families differ in more than shapes (see docs/planner.md):
//  - gpt: Megatron-LM's GPT: LayerNorm with biases, GeLU MLP (ffn 4 x hidden),
//    dropout, tied input/output embeddings, learned positions, attention
//    scores materialised (softmax, dropout) and Megatron's fused kernels.
//  - llama: torchtitan's Llama: RMSNorm, SwiGLU MLP (three matrices), grouped
//    KV heads, no dropout, untied output, flash attention (causal) and eager
//    element-wise kernels.
// Either default can be overridden in the string: attention=flash|materialized,
// kernels=fused|eager, dropout=0|1, bias=0|1 (e.g. examples/gpt: nanoGPT's
// GPT without biases or dropout, LibTorch's eager kernels and its CPU flash
// attention: gpt:...,attention=flash,kernels=eager,dropout=0,bias=0).
#pragma once

#include <cstdint>
#include <string>

namespace dtrain::plan {

enum class Attention { kMaterialized, kFlash };
enum class Kernels { kFused, kEager };

struct ModelSpec {
  std::string family = "gpt";  // gpt | llama
  std::int64_t layers = 0, hidden = 0, heads = 0, kv_heads = 0, ffn = 0, vocab = 0, seq = 0;
  bool gated_mlp = false;       // SwiGLU: three ffn matrices instead of two
  bool tied_embeddings = true;  // the output layer reuses the input embedding
  bool dropout = true;          // dropout masks are kept for backward
  bool biases = true;           // Linear and norm biases
  Attention attention = Attention::kMaterialized;
  Kernels kernels = Kernels::kFused;

  std::int64_t head_dim() const { return hidden / heads; }
  std::int64_t kv_width() const { return kv_heads * head_dim(); }
  // Weights of one transformer layer's matrices (QKV, output, MLP).
  std::int64_t layer_matmul_params() const;
  // All parameters of one layer (matrices, biases, norms).
  std::int64_t layer_params() const;
  // Input embedding (+ learned positions for gpt).
  std::int64_t embedding_params() const;
  // Output projection (0 when tied) + final norm.
  std::int64_t output_params() const;
  std::int64_t params() const;
  // Forward FLOPs of one layer for one sequence: 2 x matmul weights per token
  // plus 4 x seq x hidden per token for scores and their product with V
  // (Megatron's convention: the whole seq x seq square, causal or not).
  double layer_forward_flops_per_sequence() const;
  // Model FLOPs per trained token, no recompute: 3 x forward of all layers and
  // the output projection (Narayanan et al. 2021, eq. 3 without the recompute).
  double model_flops_per_token() const;

  // ConfigError naming the missing or bad field.
  void validate() const;
  // "gpt:key=value,..." / "llama:key=value,...". Keys: layers, hidden, heads,
  // kv_heads (default heads), ffn (gpt: 4 x hidden; llama: required), vocab,
  // seq, attention, kernels.
  static ModelSpec parse(const std::string& text);
  std::string to_string() const;
};

}  // namespace dtrain::plan
