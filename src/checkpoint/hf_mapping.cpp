// Hugging Face folders from a model's name mapping (include/dtrain/checkpoint/hf_mapping.h).
#include "dtrain/checkpoint/hf_mapping.h"

#include <torch/serialize/archive.h>

#include <nlohmann/json.hpp>
#include <regex>

#include "dtrain/checkpoint/checkpoint_reader.h"
#include "dtrain/checkpoint/checkpointer.h"
#include "dtrain/error.h"
#include "file_io.h"

namespace dtrain::checkpoint {

namespace fs = std::filesystem;

std::optional<std::pair<std::string, bool>> HfMapping::hf_name(const std::string& name) const {
  for (const auto& rule : rules) {
    const std::regex pattern(rule.pattern);
    if (std::regex_match(name, pattern))
      return std::make_pair(std::regex_replace(name, pattern, rule.replacement), rule.transpose);
  }
  return std::nullopt;
}

NamedTensors HfMapping::apply(const NamedTensors& tensors) const {
  // Compiled once per call, not once per tensor.
  std::vector<std::regex> patterns;
  for (const auto& rule : rules) patterns.emplace_back(rule.pattern);
  NamedTensors out;
  for (const auto& [name, tensor] : tensors) {
    std::size_t i = 0;
    while (i < rules.size() && !std::regex_match(name, patterns[i])) ++i;
    DTRAIN_CHECK(i < rules.size(), DataError, "tensor " << name << " has no Hugging Face name in the mapping.",
                 "the checkpoint and the mapping it records are of different models");
    const at::Tensor t = tensor.detach().to(at::kCPU);
    out.emplace_back(std::regex_replace(name, patterns[i], rules[i].replacement),
                     rules[i].transpose ? t.t().contiguous() : t.contiguous());
  }
  for (const auto& z : zeros) out.emplace_back(z.name, at::zeros(z.shape));
  return out;
}

std::string HfMapping::to_json() const {
  nlohmann::json j{{"config", nlohmann::json::parse(config_json)},
                   {"rules", nlohmann::json::array()},
                   {"zeros", nlohmann::json::array()}};
  for (const auto& r : rules)
    j["rules"].push_back({{"pattern", r.pattern}, {"replacement", r.replacement}, {"transpose", r.transpose}});
  for (const auto& z : zeros) j["zeros"].push_back({{"name", z.name}, {"shape", z.shape}});
  return j.dump();
}

HfMapping HfMapping::from_json(const std::string& text) {
  try {
    const auto j = nlohmann::json::parse(text);
    HfMapping m{.config_json = j.at("config").dump(2)};
    for (const auto& r : j.at("rules"))
      m.rules.push_back(
          {r.at("pattern").get<std::string>(), r.at("replacement").get<std::string>(), r.value("transpose", false)});
    for (const auto& z : j.at("zeros"))
      m.zeros.push_back({z.at("name").get<std::string>(), z.at("shape").get<std::vector<std::int64_t>>()});
    for (const auto& r : m.rules) std::regex check(r.pattern);  // a bad pattern fails here, not mid-export
    return m;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    DTRAIN_CHECK(false, DataError, "the Hugging Face mapping is malformed: " << e.what() << ".",
                 "it is written by hf_mapping_state; the checkpoint may be damaged");
  }
  return {};
}

void save_hf_folder(const fs::path& dir, const HfMapping& mapping, const NamedTensors& tensors,
                    const ShardedSafetensorsOptions& options) {
  fs::create_directories(dir);
  save_safetensors_sharded(dir, mapping.apply(tensors), options);
  // Atomic as the weights are: an export that stops midway leaves no
  // truncated config.json, and several writers of one folder (each replica
  // group's rank 0 under fault tolerance) each replace it whole.
  const std::string config = nlohmann::json::parse(mapping.config_json).dump(2) + "\n";
  detail::write_file_atomically(dir / "config.json", options.durable,
                                [&](const detail::ChunkSink& sink) { sink(config.data(), config.size()); });
}

namespace {

class HfMappingState : public Stateful {
 public:
  explicit HfMappingState(HfMapping mapping) : json_(mapping.to_json()) {}
  void save_state(torch::serialize::OutputArchive& archive) const override {
    archive.write("json", c10::IValue(json_));
  }
  void load_state(torch::serialize::InputArchive& /*archive*/) override {}
  // Read by `dtrain ckpt convert --to hf`, not by a resumed run: checkpoints
  // saved before runs recorded it still resume.
  bool needed_to_resume() const override { return false; }

 private:
  std::string json_;
};

}  // namespace

std::shared_ptr<Stateful> hf_mapping_state(HfMapping mapping) {
  return std::make_shared<HfMappingState>(std::move(mapping));
}

std::optional<HfMapping> read_hf_mapping(const CheckpointFolder& folder) {
  const fs::path file = folder.dir / (std::string(kHfMappingState) + ".pt");
  if (!fs::exists(file)) return std::nullopt;
  torch::serialize::InputArchive archive;
  archive.load_from(file.string());
  c10::IValue value;
  archive.read("json", value);
  return HfMapping::from_json(value.toStringRef());
}

}  // namespace dtrain::checkpoint
