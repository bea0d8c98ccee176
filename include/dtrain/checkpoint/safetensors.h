// safetensors files (Hugging Face's tensor format), read and written in C++.
//
// A file is: 8 bytes, the little-endian length N of the header; N bytes of
// JSON, {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]},
// ..., "__metadata__": {"key": "value"}}; then the raw little-endian data,
// offsets relative to its start. Files this writes open in Python with
// `safetensors.torch.load_file`, and files Python writes open here.
//
// Reading maps the file (mmap) and checks the header completely before any
// tensor is made: offsets inside the data area, every byte of it covered by
// exactly one tensor (no overlap, no gap), shape times element size equal to
// the byte range, known dtypes, no duplicate names, header length within the
// file. Any failure is a dtrain::DataError naming the file and the problem.
// By default tensors are views into the mapping (zero copy; pages are read
// when touched; the mapping lives until the last tensor from it is freed).
// They are private copy-on-write pages: writing into a tensor never reaches
// the file. A file truncated by another process while mapped raises SIGBUS on
// access, as with any mmap; pass `copy = true` to own the memory instead.
//
// Sharded folders follow Hugging Face's layout: model-00001-of-00003.safetensors
// ... and model.safetensors.index.json, {"metadata": {"total_size": bytes},
// "weight_map": {"name": "model-00001-of-00003.safetensors", ...}}; a model
// that fits one shard is a single model.safetensors and no index, as
// `transformers`' save_pretrained writes it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::checkpoint {

// Tensors by name, in a stated order (a model's, or a file's header order).
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

struct SafetensorsContents {
  NamedTensors tensors;                         // in the order of their data in the file
  std::map<std::string, std::string> metadata;  // the header's "__metadata__"
};

struct SafetensorsSaveOptions {
  std::map<std::string, std::string> metadata;  // written as "__metadata__"
  // fsync the file before renaming it into place and the folder after, so a
  // crash leaves the old file or the new one (Python's safetensors does not).
  bool durable = true;
};

struct SafetensorsLoadOptions {
  // false: views into the file's mapping (a tensor whose offset is not a
  // multiple of its element size is copied all the same, so every tensor
  // handed out is aligned). true: every tensor owns its memory.
  bool copy = false;
};

// Writes `tensors` (CPU or not: each is copied to the CPU, made contiguous)
// to `file` atomically (a temporary file renamed into place). Names must be
// unique and not "__metadata__"; sparse or quantized tensors are a
// ConfigError, as is a dtype the format has no name for. Data are laid out
// largest element size first, then by name, as Python's safetensors does, so
// every tensor is aligned to its element size in the file.
void save_safetensors(const std::filesystem::path& file, const NamedTensors& tensors,
                      const SafetensorsSaveOptions& options = {});

SafetensorsContents load_safetensors(const std::filesystem::path& file, const SafetensorsLoadOptions& options = {});

struct ShardedSafetensorsOptions {
  // A shard is closed before a tensor that would take it past this many bytes
  // of data (a single larger tensor gets a shard of its own), as
  // `save_pretrained(max_shard_size=...)` does. Default: HF's 5 GB.
  std::int64_t max_shard_bytes = 5'000'000'000;
  std::string prefix = "model";                 // <prefix>-00001-of-0000N.safetensors
  std::map<std::string, std::string> metadata;  // every shard's "__metadata__"
  bool durable = true;                          // as SafetensorsSaveOptions::durable
};

// Writes `tensors` into `dir` (created if missing) as shards in the given
// order plus <prefix>.safetensors.index.json, or as the single file
// <prefix>.safetensors when everything fits one shard. Returns the files
// written, the index last.
std::vector<std::filesystem::path> save_safetensors_sharded(const std::filesystem::path& dir,
                                                            const NamedTensors& tensors,
                                                            const ShardedSafetensorsOptions& options = {});

// Reads a folder written as above (or by transformers' save_pretrained):
// through <prefix>.safetensors.index.json when it exists, else
// <prefix>.safetensors. Every name the index lists must be in the shard it
// names; tensors come in the index's order of shards, each shard's own order
// within it; metadata are the first shard's.
SafetensorsContents load_safetensors_dir(const std::filesystem::path& dir, const std::string& prefix = "model",
                                         const SafetensorsLoadOptions& options = {});

}  // namespace dtrain::checkpoint
