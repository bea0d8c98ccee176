// safetensors: the header's checks, mmap'd loading, atomic and sharded saving.
#include "dtrain/checkpoint/safetensors.h"

#include <ATen/Functions.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>

#include "dtrain/error.h"
#include "file_io.h"

namespace fs = std::filesystem;

namespace dtrain::checkpoint {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors data are little-endian; so must the host be");

// The format's own limit (Rust safetensors' MAX_HEADER_SIZE): a larger length
// is a corrupt file, and refusing it keeps a bad length from allocating.
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";

struct DtypeName {
  const char* name;
  at::ScalarType type;
};
// Every dtype the format names that LibTorch has (Python's safetensors.torch
// maps the same ones).
constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble},
    {"F32", at::kFloat},
    {"F16", at::kHalf},
    {"BF16", at::kBFloat16},
    {"I64", at::kLong},
    {"I32", at::kInt},
    {"I16", at::kShort},
    {"I8", at::kChar},
    {"U8", at::kByte},
    {"BOOL", at::kBool},
    {"F8_E4M3", at::kFloat8_e4m3fn},
    {"F8_E4M3FNUZ", at::kFloat8_e4m3fnuz},
    {"F8_E5M2", at::kFloat8_e5m2},
    {"F8_E5M2FNUZ", at::kFloat8_e5m2fnuz},
    {"C64", at::kComplexFloat},
    {"U16", at::kUInt16},
    {"U32", at::kUInt32},
    {"U64", at::kUInt64},
};

std::optional<at::ScalarType> dtype_of(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.type;
  return std::nullopt;
}

const char* name_of(at::ScalarType type) {
  for (const auto& d : kDtypes)
    if (type == d.type) return d.name;
  return nullptr;
}

// One tensor as the header describes it, checked.
struct Entry {
  std::string name;
  at::ScalarType dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin, end;
};

#define DTRAIN_BAD_FILE(cond, file, message) \
  DTRAIN_CHECK(cond, DataError, (file).string() << ": " << message << ".", "the file is not a valid safetensors file")

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::ostringstream s;
  s << '[';
  for (std::size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << ']';
  return s.str();
}

Entry parse_entry(const fs::path& file, const std::string& name, const nlohmann::json& info) {
  DTRAIN_BAD_FILE(info.is_object(), file,
                  "tensor '" << name << "' is described by " << info.type_name() << ", not an object");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    DTRAIN_BAD_FILE(info.contains(key), file, "tensor '" << name << "' has no \"" << key << "\"");
  const auto& dtype = info["dtype"];
  DTRAIN_BAD_FILE(dtype.is_string(), file, "tensor '" << name << "': dtype is not a string");
  const auto type = dtype_of(dtype.get<std::string>());
  DTRAIN_BAD_FILE(type, file, "tensor '" << name << "' has unknown dtype '" << dtype.get<std::string>() << "'");
  Entry entry{.name = name, .dtype = *type, .shape = {}, .begin = 0, .end = 0};
  const auto& shape = info["shape"];
  DTRAIN_BAD_FILE(shape.is_array(), file, "tensor '" << name << "': shape is not a list");
  std::uint64_t numel = 1;
  bool overflow = false;
  for (const auto& d : shape) {
    DTRAIN_BAD_FILE(d.is_number_unsigned() && d.get<std::uint64_t>() <= std::uint64_t{INT64_MAX}, file,
                    "tensor '" << name << "': shape holds " << d.dump() << ", not a size");
    entry.shape.push_back(d.get<std::int64_t>());
    overflow = overflow || __builtin_mul_overflow(numel, d.get<std::uint64_t>(), &numel);
  }
  const auto& offsets = info["data_offsets"];
  DTRAIN_BAD_FILE(
      offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() && offsets[1].is_number_unsigned(),
      file, "tensor '" << name << "': data_offsets " << offsets.dump() << " are not two offsets");
  entry.begin = offsets[0].get<std::uint64_t>();
  entry.end = offsets[1].get<std::uint64_t>();
  DTRAIN_BAD_FILE(
      entry.begin <= entry.end, file,
      "tensor '" << name << "': data_offsets [" << entry.begin << ", " << entry.end << "] end before they begin");
  std::uint64_t bytes = 0;
  overflow = overflow || __builtin_mul_overflow(numel, c10::elementSize(entry.dtype), &bytes);
  DTRAIN_BAD_FILE(!overflow && bytes == entry.end - entry.begin, file,
                  "tensor '" << name << "': shape " << shape_string(entry.shape) << " of " << dtype.get<std::string>()
                             << " is " << (overflow ? std::string("too many") : std::to_string(bytes))
                             << " bytes, but data_offsets [" << entry.begin << ", " << entry.end << "] hold "
                             << entry.end - entry.begin);
  return entry;
}

// Parses and checks the header; entries come sorted by offset, and they cover
// the data area [0, data_bytes) exactly.
std::vector<Entry> parse_header(const fs::path& file, std::string_view header, std::uint64_t data_bytes,
                                std::map<std::string, std::string>& metadata) {
  // nlohmann keeps the last of duplicate keys; the callback sees them all.
  std::set<std::string> names;
  std::string duplicate;
  const auto on_event = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    if (event == nlohmann::json::parse_event_t::key && depth == 1 && !names.insert(parsed.get<std::string>()).second)
      duplicate = parsed.get<std::string>();
    return true;
  };
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(header.begin(), header.end(), on_event);
  } catch (const nlohmann::json::exception& e) {
    DTRAIN_BAD_FILE(false, file, "the header is not valid JSON (" << e.what() << ")");
  }
  DTRAIN_BAD_FILE(duplicate.empty(), file, "the header names tensor '" << duplicate << "' twice");
  DTRAIN_BAD_FILE(json.is_object(), file, "the header is a JSON " << json.type_name() << ", not an object");
  std::vector<Entry> entries;
  for (const auto& [name, info] : json.items()) {
    if (name == kMetadataKey) {
      DTRAIN_BAD_FILE(info.is_object(), file, "\"__metadata__\" is not an object");
      for (const auto& [key, value] : info.items()) {
        DTRAIN_BAD_FILE(value.is_string(), file, "\"__metadata__\"[\"" << key << "\"] is not a string");
        metadata[key] = value.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(file, name, info));
  }
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  std::uint64_t covered = 0;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    DTRAIN_BAD_FILE(e.end <= data_bytes, file,
                    "tensor '" << e.name << "': data_offsets [" << e.begin << ", " << e.end
                               << "] run past the data area (" << data_bytes << " bytes; truncated file?)");
    DTRAIN_BAD_FILE(e.begin >= covered, file,
                    "tensor '" << e.name << "' at [" << e.begin << ", " << e.end << ") overlaps tensor '"
                               << entries[i - 1].name << "' (which ends at " << covered << ")");
    DTRAIN_BAD_FILE(e.begin == covered, file,
                    "bytes [" << covered << ", " << e.begin << ") of the data area belong to no tensor (before '"
                              << e.name << "')");
    covered = e.end;
  }
  DTRAIN_BAD_FILE(
      covered == data_bytes, file,
      "the data area has " << data_bytes - covered << " bytes after the last tensor's, which belong to none");
  return entries;
}

}  // namespace

SafetensorsContents load_safetensors(const fs::path& file, const SafetensorsLoadOptions& options) {
  const auto mapping = detail::MappedFile::open(file);
  const std::uint64_t size = mapping->size();
  DTRAIN_BAD_FILE(size >= 8, file, "the file is " << size << " bytes, shorter than the 8-byte header length");
  std::uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, mapping->data(), 8);
  DTRAIN_BAD_FILE(header_bytes <= kMaxHeaderBytes, file,
                  "the header length " << header_bytes << " exceeds the format's limit of " << kMaxHeaderBytes);
  DTRAIN_BAD_FILE(8 + header_bytes <= size, file,
                  "the header length " << header_bytes << " runs past the end of the file (" << size << " bytes)");
  const std::string_view header(reinterpret_cast<const char*>(mapping->data()) + 8, header_bytes);
  SafetensorsContents contents;
  const auto entries = parse_header(file, header, size - 8 - header_bytes, contents.metadata);
  std::byte* data = mapping->data() + 8 + header_bytes;
  for (const auto& e : entries) {
    std::byte* p = data + e.begin;
    const auto bytes = static_cast<std::size_t>(e.end - e.begin);
    if (e.dtype == at::kBool) {
      // A bool byte other than 0 or 1 is undefined behaviour in C++.
      const auto* bad = std::find_if(p, p + bytes, [](std::byte b) { return static_cast<unsigned>(b) > 1; });
      DTRAIN_BAD_FILE(bad == p + bytes, file,
                      "tensor '" << e.name << "' (BOOL) holds byte " << static_cast<unsigned>(*bad) << " at element "
                                 << bad - p << "; BOOL bytes are 0 or 1");
    }
    const auto type_options = at::TensorOptions().dtype(e.dtype);
    at::Tensor tensor;
    if (options.copy || reinterpret_cast<std::uintptr_t>(p) % c10::elementSize(e.dtype) != 0 || bytes == 0) {
      tensor = at::empty(e.shape, type_options);
      if (bytes > 0) std::memcpy(tensor.data_ptr(), p, bytes);
    } else {
      tensor = at::from_blob(
          p, e.shape, [mapping](void*) {}, type_options);
    }
    contents.tensors.emplace_back(e.name, std::move(tensor));
  }
  return contents;
}

void save_safetensors(const fs::path& file, const NamedTensors& tensors, const SafetensorsSaveOptions& options) {
  std::vector<at::Tensor> cpu;
  std::set<std::string> names;
  for (const auto& [name, t] : tensors) {
    DTRAIN_CHECK(name != kMetadataKey, ConfigError, "a tensor cannot be named \"__metadata__\" in a safetensors file.",
                 "rename it");
    DTRAIN_CHECK(names.insert(name).second, ConfigError,
                 "tensor '" << name << "' is given twice for " << file.string() << ".",
                 "names in a safetensors file are unique");
    DTRAIN_CHECK(t.defined() && t.layout() == at::kStrided && !t.is_quantized(), ConfigError,
                 "tensor '" << name << "' is not a dense tensor; safetensors holds dense tensors only.",
                 "convert it with to_dense() or dequantize() first");
    DTRAIN_CHECK(name_of(t.scalar_type()), ConfigError,
                 "tensor '" << name << "' has dtype " << t.scalar_type() << ", which safetensors has no name for.",
                 "convert it to a supported dtype (F64..U64, see safetensors.h)");
    cpu.push_back(t.detach().to(at::kCPU).contiguous());
  }
  std::vector<std::size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const auto sa = cpu[a].element_size(), sb = cpu[b].element_size();
    return sa != sb ? sa > sb : tensors[a].first < tensors[b].first;
  });
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!options.metadata.empty()) header[kMetadataKey] = options.metadata;
  std::uint64_t offset = 0;
  for (const auto i : order) {
    const auto bytes = static_cast<std::uint64_t>(cpu[i].nbytes());
    header[tensors[i].first] = {{"dtype", name_of(cpu[i].scalar_type())},
                                {"shape", cpu[i].sizes().vec()},
                                {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data start 8-byte aligned, as Python's writer pads
  const std::uint64_t length = text.size();
  detail::write_file_atomically(file, options.durable, [&](const detail::ChunkSink& sink) {
    sink(&length, 8);
    sink(text.data(), text.size());
    for (const auto i : order) sink(cpu[i].data_ptr(), cpu[i].nbytes());
  });
}

std::vector<fs::path> save_safetensors_sharded(const fs::path& dir, const NamedTensors& tensors,
                                               const ShardedSafetensorsOptions& options) {
  DTRAIN_CHECK(options.max_shard_bytes > 0, ConfigError, "max_shard_bytes is " << options.max_shard_bytes << ".",
               "give a positive shard size");
  fs::create_directories(dir);
  std::vector<NamedTensors> shards(1);
  std::int64_t shard_bytes = 0, total_bytes = 0;
  for (const auto& named : tensors) {
    const auto bytes = static_cast<std::int64_t>(named.second.nbytes());
    if (!shards.back().empty() && shard_bytes + bytes > options.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(named);
    shard_bytes += bytes;
    total_bytes += bytes;
  }
  const SafetensorsSaveOptions save_options{.metadata = options.metadata, .durable = options.durable};
  const fs::path index = dir / (options.prefix + ".safetensors.index.json");
  if (shards.size() == 1) {
    const fs::path file = dir / (options.prefix + ".safetensors");
    save_safetensors(file, shards[0], save_options);
    fs::remove(index);  // a stale index would be read instead of the new file
    return {file};
  }
  std::vector<fs::path> files;
  nlohmann::json weight_map = nlohmann::json::object();
  for (std::size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    files.push_back(dir / (options.prefix + name));
    save_safetensors(files.back(), shards[s], save_options);
    for (const auto& named : shards[s]) weight_map[named.first] = files.back().filename().string();
  }
  const std::string text =
      nlohmann::json{{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}}.dump(2) + "\n";
  detail::write_file_atomically(index, options.durable,
                                [&](const detail::ChunkSink& sink) { sink(text.data(), text.size()); });
  files.push_back(index);
  return files;
}

SafetensorsContents load_safetensors_dir(const fs::path& dir, const std::string& prefix,
                                         const SafetensorsLoadOptions& options) {
  const fs::path index = dir / (prefix + ".safetensors.index.json");
  if (!fs::exists(index)) {
    const fs::path single = dir / (prefix + ".safetensors");
    DTRAIN_CHECK(
        fs::exists(single), DataError,
        dir.string() << " has neither " << index.filename().string() << " nor " << single.filename().string() << ".",
        "give the folder save_safetensors_sharded or save_pretrained wrote");
    return load_safetensors(single, options);
  }
  const auto mapping = detail::MappedFile::open(index);
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(reinterpret_cast<const char*>(mapping->data()),
                                 reinterpret_cast<const char*>(mapping->data()) + mapping->size());
  } catch (const nlohmann::json::exception& e) {
    DTRAIN_BAD_FILE(false, index, "not valid JSON (" << e.what() << ")");
  }
  DTRAIN_BAD_FILE(json.is_object() && json.contains("weight_map") && json["weight_map"].is_object(), index,
                  "no \"weight_map\" object");
  std::map<std::string, std::set<std::string>> names_by_shard;  // sorted: HF's shard names sort in order
  for (const auto& [name, shard] : json["weight_map"].items()) {
    DTRAIN_BAD_FILE(shard.is_string(), index, "weight_map[\"" << name << "\"] is not a file name");
    const auto file = shard.get<std::string>();
    DTRAIN_BAD_FILE(!file.empty() && fs::path(file).filename() == fs::path(file) && file != "." && file != "..", index,
                    "weight_map[\"" << name << "\"] names '" << file << "', not a file in the folder");
    names_by_shard[file].insert(name);
  }
  SafetensorsContents contents;
  bool first = true;
  for (const auto& [file, names] : names_by_shard) {
    auto shard = load_safetensors(dir / file, options);
    if (first) contents.metadata = std::move(shard.metadata);
    first = false;
    for (auto& named : shard.tensors) {
      DTRAIN_BAD_FILE(names.count(named.first), dir / file,
                      "holds tensor '" << named.first << "', which " << index.filename().string()
                                       << " does not place in this file");
      contents.tensors.push_back(std::move(named));
    }
    DTRAIN_BAD_FILE(shard.tensors.size() == names.size(), dir / file,
                    "holds " << shard.tensors.size() << " tensors, but " << index.filename().string() << " places "
                             << names.size() << " in it");
  }
  return contents;
}

}  // namespace dtrain::checkpoint
