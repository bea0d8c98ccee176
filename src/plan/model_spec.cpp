// ModelSpec: parsing, parameter and FLOP counts (model_spec.h).
#include "dtrain/plan/model_spec.h"

#include <map>
#include <sstream>

#include "dtrain/error.h"

namespace dtrain::plan {

std::int64_t ModelSpec::layer_matmul_params() const {
  const std::int64_t attention = hidden * (hidden + 2 * kv_width()) + hidden * hidden;
  const std::int64_t mlp = (gated_mlp ? 3 : 2) * hidden * ffn;
  return attention + mlp;
}

std::int64_t ModelSpec::layer_params() const {
  const std::int64_t norms = biases ? 4 * hidden : 2 * hidden;
  const std::int64_t bias = biases ? (hidden + 2 * kv_width()) + hidden + ffn + hidden : 0;
  return layer_matmul_params() + norms + bias;
}

std::int64_t ModelSpec::embedding_params() const {
  return vocab * hidden + (family == "gpt" ? seq * hidden : 0);
}

std::int64_t ModelSpec::output_params() const {
  return (tied_embeddings ? 0 : vocab * hidden) + (biases ? 2 * hidden : hidden);
}

std::int64_t ModelSpec::params() const {
  return layers * layer_params() + embedding_params() + output_params();
}

double ModelSpec::layer_forward_flops_per_sequence() const {
  const double s = static_cast<double>(seq), h = static_cast<double>(hidden);
  return 2.0 * s * static_cast<double>(layer_matmul_params()) + 4.0 * s * s * h;
}

double ModelSpec::model_flops_per_token() const {
  const double per_layer = layer_forward_flops_per_sequence() / static_cast<double>(seq);
  const double output = 2.0 * static_cast<double>(hidden) * static_cast<double>(vocab);
  return 3.0 * (static_cast<double>(layers) * per_layer + output);
}

void ModelSpec::validate() const {
  const std::pair<const char*, std::int64_t> fields[] = {
      {"layers", layers}, {"hidden", hidden}, {"heads", heads}, {"kv_heads", kv_heads},
      {"ffn", ffn},       {"vocab", vocab},   {"seq", seq}};
  for (const auto& [name, value] : fields)
    DTRAIN_CHECK(value > 0, ConfigError, "the model's " << name << " is " << value << ".",
                 "give " << name << "=N in --model (e.g. gpt:layers=24,hidden=2304,heads=24,seq=2048,vocab=51200)");
  DTRAIN_CHECK(hidden % heads == 0, ConfigError, "hidden " << hidden << " is not a multiple of heads " << heads << ".",
               "choose heads dividing hidden");
  DTRAIN_CHECK(heads % kv_heads == 0, ConfigError,
               "heads " << heads << " is not a multiple of kv_heads " << kv_heads << ".",
               "choose kv_heads dividing heads");
}

ModelSpec ModelSpec::parse(const std::string& text) {
  const auto colon = text.find(':');
  ModelSpec m;
  m.family = text.substr(0, colon);
  DTRAIN_CHECK(m.family == "gpt" || m.family == "llama", ConfigError, "unknown model family '" << m.family << "'.",
               "write gpt:layers=..,hidden=.. or llama:layers=..,hidden=..,ffn=..");
  if (m.family == "llama") {
    m.gated_mlp = true;
    m.tied_embeddings = false;
    m.dropout = false;
    m.biases = false;
    m.attention = Attention::kFlash;
    m.kernels = Kernels::kEager;
  }
  std::map<std::string, std::int64_t*> ints{
      {"layers", &m.layers}, {"hidden", &m.hidden}, {"heads", &m.heads}, {"kv_heads", &m.kv_heads},
      {"ffn", &m.ffn},       {"vocab", &m.vocab},   {"seq", &m.seq}};
  std::stringstream rest(colon == std::string::npos ? "" : text.substr(colon + 1));
  for (std::string item; std::getline(rest, item, ',');) {
    if (item.empty()) continue;
    const auto eq = item.find('=');
    DTRAIN_CHECK(eq != std::string::npos, ConfigError, "'" << item << "' in --model is not key=value.",
                 "write e.g. layers=24");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "attention") {
      DTRAIN_CHECK(value == "flash" || value == "materialized", ConfigError, "attention=" << value << "?",
                   "use attention=flash or attention=materialized");
      m.attention = value == "flash" ? Attention::kFlash : Attention::kMaterialized;
      continue;
    }
    if (key == "kernels") {
      DTRAIN_CHECK(value == "fused" || value == "eager", ConfigError, "kernels=" << value << "?",
                   "use kernels=fused or kernels=eager");
      m.kernels = value == "fused" ? Kernels::kFused : Kernels::kEager;
      continue;
    }
    if (key == "dropout" || key == "bias") {
      DTRAIN_CHECK(value == "0" || value == "1", ConfigError, key << "=" << value << "?",
                   "use " << key << "=1 (on) or " << key << "=0 (off)");
      (key == "dropout" ? m.dropout : m.biases) = value == "1";
      continue;
    }
    const auto it = ints.find(key);
    DTRAIN_CHECK(it != ints.end(), ConfigError, "unknown model field '" << key << "'.",
                 "use layers, hidden, heads, kv_heads, ffn, vocab, seq, attention, kernels, dropout, bias");
    try {
      *it->second = std::stoll(value);
    } catch (const std::exception&) {
      DTRAIN_CHECK(false, ConfigError, "'" << item << "' in --model is not a whole number.", "write e.g. layers=24");
    }
  }
  if (m.kv_heads == 0) m.kv_heads = m.heads;
  if (m.ffn == 0 && m.family == "gpt") m.ffn = 4 * m.hidden;
  m.validate();
  return m;
}

std::string ModelSpec::to_string() const {
  std::ostringstream s;
  s << family << ":layers=" << layers << ",hidden=" << hidden << ",heads=" << heads << ",kv_heads=" << kv_heads
    << ",ffn=" << ffn << ",seq=" << seq << ",vocab=" << vocab
    << ",attention=" << (attention == Attention::kFlash ? "flash" : "materialized")
    << ",kernels=" << (kernels == Kernels::kFused ? "fused" : "eager") << ",dropout=" << (dropout ? 1 : 0)
    << ",bias=" << (biases ? 1 : 0);
  return s.str();
}

}  // namespace dtrain::plan
