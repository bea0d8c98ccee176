// PyTorch's own checkpoint files both ways: what Python's torch.save writes
// (a zip archive holding data.pkl, a pickle, and one record per storage),
// read here; and files written here that Python's
// torch.load(f, weights_only=True) opens as plain dicts of tensors.
//
// Reading takes what a weights_only load takes: dicts (OrderedDict too: a
// model.state_dict()), lists, tuples, strings, ints, floats, bools, None and
// tensors (any dtype, any strides, views sharing a storage stay views of one
// storage); a pickle that names any other class or function is refused with a
// DataError naming it, before anything of it runs. The archive is read with
// LibTorch's own zip reader (caffe2::serialize::PyTorchStreamReader); the
// pickle by dtrain's restricted reader, because LibTorch's torch::pickle_load
// fails on OrderedDict (pytorch/pytorch#100741). Tensors saved on a GPU load
// on the CPU (as map_location="cpu").
//
// Writing uses LibTorch's pickler and zip writer (torch::jit::Pickler,
// PyTorchStreamWriter), with every dict and list rewritten as an untyped one
// first: LibTorch's typed containers pickle through torch.jit globals
// (restore_type_tag, build_intlist) that weights_only refuses.
//
//   Python:  torch.save(model.state_dict(), "model.pt")
//   C++:     auto sd = dtrain::checkpoint::load_torch_state_dict("model.pt");
//   C++:     dtrain::checkpoint::save_torch_state_dict("out.pt", sd);
//   Python:  model.load_state_dict(torch.load("out.pt", weights_only=True))
#pragma once

#include <ATen/core/ivalue.h>

#include <filesystem>
#include <string>

#include "dtrain/checkpoint/safetensors.h"  // NamedTensors

namespace dtrain::checkpoint {

// The whole object a torch.save file holds: dicts as GenericDicts (insertion
// order kept), lists as GenericLists, tuples as Tuples.
c10::IValue load_torch_file(const std::filesystem::path& file);

// A file holding a dict of name -> tensor (a state dict), or such a dict
// under `key` of the top-level dict ({"model": state_dict, ...} with key
// "model"). Any value that is not a tensor is a DataError.
NamedTensors load_torch_state_dict(const std::filesystem::path& file, const std::string& key = "");

struct TorchSaveOptions {
  bool durable = true;  // fsync before the rename, as SafetensorsSaveOptions::durable
};

// Writes `value` (nested dicts with string or int keys, lists, tuples,
// strings, numbers, bools, None, tensors) atomically. Tensors are copied to
// the CPU; each is written with its own storage (views are not shared).
// Tensors of dtypes Python has no typed storage for (float8, uint16/32/64)
// are a ConfigError: LibTorch's pickler names classes Python lacks for them;
// save_safetensors writes them.
void save_torch_file(const std::filesystem::path& file, const c10::IValue& value, const TorchSaveOptions& options = {});

// A dict of name -> tensor in the given order.
void save_torch_state_dict(const std::filesystem::path& file, const NamedTensors& tensors,
                           const TorchSaveOptions& options = {});

// The dict save_torch_state_dict writes, to nest in a larger checkpoint.
c10::IValue state_dict_value(const NamedTensors& tensors);

}  // namespace dtrain::checkpoint
