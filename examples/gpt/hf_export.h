// The GPT as a Hugging Face GPT-2 folder, both ways: config.json plus
// model.safetensors (sharded with an index past 5 GB), which
// transformers.GPT2LMHeadModel.from_pretrained(DIR) loads with no missing or
// unexpected keys, and such a folder (one transformers wrote, too) loaded
// into the GPT.
//
// The example's network is GPT-2's: pre-LayerNorm blocks, learned positions,
// a final LayerNorm, the head tied to the token embedding, attention scaled by
// 1/sqrt(head size), LayerNorm eps 1e-5. Where it differs, the config says so
// or the export fills in:
//  - GELU: nanoGPT's exact (erf) GELU is transformers' "gelu"; GPT-2's own
//    tanh approximation is "gelu_new" (GptConfig::gelu_tanh either way);
//  - biases: GPT-2 always has them; a model without (nanoGPT's default
//    --bias off) exports zeros, which compute the same, and an import turns
//    biases on;
//  - weights: GPT-2's Conv1D stores [in, out], the transpose of nn.Linear's
//    [out, in]; lm_head.weight is not written (tied, as save_pretrained does).
// Names: dtrain's embed.wte/wpe, blockN.{ln_1,attn.c_attn,attn.c_proj,ln_2,
// mlp.c_fc,mlp.c_proj}, head.ln_f (under any prefix: the Gpt's "layers.", a
// ModelParallel's) are transformer.wte/wpe, transformer.h.N.*, transformer.ln_f.
#pragma once

#include <torch/nn/module.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>

#include "dtrain/checkpoint/hf_mapping.h"
#include "dtrain/checkpoint/safetensors.h"
#include "dtrain/error.h"
#include "model.h"

namespace gpt {

inline nlohmann::json hf_config(const GptConfig& c) {
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"vocab_size", c.vocab_size},
          {"n_positions", c.block_size},
          {"n_embd", c.n_embd},
          {"n_layer", c.n_layer},
          {"n_head", c.n_head},
          {"n_inner", nullptr},
          {"activation_function", c.gelu_tanh ? "gelu_new" : "gelu"},
          {"resid_pdrop", c.dropout},
          {"embd_pdrop", c.dropout},
          {"attn_pdrop", c.dropout},
          {"layer_norm_epsilon", 1e-5},
          {"initializer_range", 0.02},
          {"scale_attn_weights", true},
          {"scale_attn_by_inverse_layer_idx", false},
          {"reorder_and_upcast_attn", false},
          {"tie_word_embeddings", true},
          {"bos_token_id", nullptr},
          {"eos_token_id", nullptr},
          {"dtype", "float32"}};
}

// The GptConfig a Hugging Face GPT-2 config.json describes (biases on).
inline GptConfig config_from_hf(const std::filesystem::path& dir) {
  std::ifstream in(dir / "config.json");
  DTRAIN_CHECK(in.good(), ConfigError, dir.string() << " has no config.json.", "give a save_pretrained folder");
  const auto j = nlohmann::json::parse(in);
  DTRAIN_CHECK(j.value("model_type", "") == "gpt2", ConfigError,
               dir.string() << "/config.json is a '" << j.value("model_type", "") << "' model, not gpt2.",
               "only GPT-2 folders map onto the GPT example");
  const std::string act = j.value("activation_function", "gelu_new");
  DTRAIN_CHECK(act == "gelu" || act == "gelu_new" || act == "gelu_pytorch_tanh", ConfigError,
               "activation_function '" << act << "' has no counterpart in the GPT example.",
               "use gelu, gelu_new or gelu_pytorch_tanh");
  DTRAIN_CHECK(j.value("n_inner", nlohmann::json()).is_null() && j.value("tie_word_embeddings", true) &&
                   !j.value("scale_attn_by_inverse_layer_idx", false) && j.value("scale_attn_weights", true),
               ConfigError, dir.string() << "/config.json asks for a GPT-2 variant the example does not build.",
               "n_inner null, tied embeddings, plain 1/sqrt(d) attention scaling");
  const double dropout = j.value("resid_pdrop", 0.0);
  return {.vocab_size = j.at("vocab_size").get<std::int64_t>(),
          .block_size = j.at("n_positions").get<std::int64_t>(),
          .n_layer = j.at("n_layer").get<std::int64_t>(),
          .n_head = j.at("n_head").get<std::int64_t>(),
          .n_embd = j.at("n_embd").get<std::int64_t>(),
          .dropout = dropout,
          .bias = true,
          .gelu_tanh = act != "gelu"};
}

// The GPT's Hugging Face mapping (checkpoint/hf_mapping.h): the names (under
// any prefix), the Conv1D weights stored transposed, zero biases for a model
// without, and config.json. The export below uses it, and a run records it in
// its checkpoints so that `dtrain ckpt convert --to hf` needs no GPT code.
inline dtrain::checkpoint::HfMapping hf_mapping(const GptConfig& c) {
  dtrain::checkpoint::HfMapping m{
      .config_json = hf_config(c).dump(2),
      .rules = {{R"((?:.*\.)?block(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight)",
                 "transformer.h.$1.$2.weight", true},
                {R"((?:.*\.)?block(\d+)\.(ln_1|ln_2|attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.(weight|bias))",
                 "transformer.h.$1.$2.$3", false},
                {R"((?:.*\.)?embed\.(wte|wpe)\.weight)", "transformer.$1.weight", false},
                {R"((?:.*\.)?head\.ln_f\.(weight|bias))", "transformer.ln_f.$1", false}}};
  if (!c.bias) {  // every bias GPT-2 has
    for (std::int64_t i = 0; i < c.n_layer; ++i) {
      const std::string p = "transformer.h." + std::to_string(i) + ".";
      m.zeros.push_back({p + "ln_1.bias", {c.n_embd}});
      m.zeros.push_back({p + "attn.c_attn.bias", {3 * c.n_embd}});
      m.zeros.push_back({p + "attn.c_proj.bias", {c.n_embd}});
      m.zeros.push_back({p + "ln_2.bias", {c.n_embd}});
      m.zeros.push_back({p + "mlp.c_fc.bias", {4 * c.n_embd}});
      m.zeros.push_back({p + "mlp.c_proj.bias", {c.n_embd}});
    }
    m.zeros.push_back({"transformer.ln_f.bias", {c.n_embd}});
  }
  return m;
}

// The model's parameters under GPT-2's names and layouts, on the CPU.
inline dtrain::checkpoint::NamedTensors to_hf(torch::nn::Module& model, const GptConfig& c) {
  dtrain::checkpoint::NamedTensors params;
  for (const auto& item : model.named_parameters()) params.emplace_back(item.key(), item.value());
  return hf_mapping(c).apply(params);
}

// Writes DIR/config.json and DIR/model.safetensors (or shards and an index).
// Call it where the full weights are readable (rank 0, within gather_full).
inline void export_hf(torch::nn::Module& model, const GptConfig& c, const std::filesystem::path& dir) {
  dtrain::checkpoint::NamedTensors params;
  for (const auto& item : model.named_parameters()) params.emplace_back(item.key(), item.value());
  dtrain::checkpoint::save_hf_folder(dir, hf_mapping(c), params);
}

// Copies a GPT-2 folder's weights into `model` (built from config_from_hf's
// GptConfig, or one with the same sizes). Every parameter must be found with
// its shape; lm_head.weight, if present, must equal the embedding (tied);
// biases the model lacks must be zero.
inline void load_hf(torch::nn::Module& model, const GptConfig& c, const std::filesystem::path& dir) {
  const auto mapping = hf_mapping(c);
  std::map<std::string, at::Tensor> hf;
  for (auto& [name, t] : dtrain::checkpoint::load_safetensors_dir(dir).tensors) hf[name] = t;
  torch::NoGradGuard no_grad;
  at::Tensor wte;
  for (auto& item : model.named_parameters()) {
    const auto mapped = mapping.hf_name(item.key());
    DTRAIN_CHECK(mapped, InternalError, "parameter " << item.key() << " has no GPT-2 name.", "");
    const auto& [name, conv] = *mapped;
    if (name == "transformer.wte.weight") wte = item.value();
    const auto it = hf.find(name);
    DTRAIN_CHECK(it != hf.end(), DataError, dir.string() << " has no " << name << " (for " << item.key() << ").",
                 "give a GPT-2 folder of this model's sizes");
    const at::Tensor src = conv ? it->second.t() : it->second;
    DTRAIN_CHECK(src.sizes() == item.value().sizes(), DataError,
                 dir.string() << ": " << name << " has shape " << it->second.sizes() << ", the model's " << item.key()
                              << " needs " << item.value().sizes() << (conv ? " (transposed)" : "") << ".",
                 "build the model from config_from_hf(dir)");
    item.value().copy_(src);
    hf.erase(it);
  }
  if (const auto head = hf.find("lm_head.weight"); head != hf.end()) {
    DTRAIN_CHECK(wte.defined() && at::equal(head->second, wte.to(at::kCPU)), DataError,
                 dir.string() << ": lm_head.weight differs from transformer.wte.weight.",
                 "the GPT example ties its head to the embedding");
    hf.erase(head);
  }
  for (const auto& z : mapping.zeros) {  // biases the model lacks
    const auto it = hf.find(z.name);
    DTRAIN_CHECK(it == hf.end() || !it->second.any().item<bool>(), DataError,
                 dir.string() << ": " << z.name << " is not zero, and the model has no biases.",
                 "build the model with bias on (config_from_hf does)");
    if (it != hf.end()) hf.erase(it);
  }
  for (auto it = hf.begin(); it != hf.end();)  // non-persistent attention masks older versions saved
    it = it->first.ends_with(".attn.bias") || it->first.ends_with(".attn.masked_bias") ? hf.erase(it) : std::next(it);
  DTRAIN_CHECK(
      hf.empty(), DataError,
      dir.string() << " has " << hf.size() << " tensors the GPT has no place for, e.g. " << hf.begin()->first << ".",
      "give a GPT2LMHeadModel folder");
}

}  // namespace gpt
