// Private to checkpoint/: the pickle of a torch.save file, read the way
// Python's torch.load(weights_only=True) reads it.
//
// LibTorch's own unpickler (torch::pickle_load) cannot be used for this: it
// fails on collections.OrderedDict, which every model.state_dict() is, with an
// internal assert (pytorch/pytorch#100741; the fix, #139750, was not merged),
// and it accepts globals a weights_only load refuses. This reader knows
// protocol 2-4's opcodes for dicts, lists, tuples, strings, numbers, bools and
// None, and only the globals that tensors and state dicts need:
//   collections.OrderedDict                       -> a dict (its attributes, such as
//                                                    _metadata, are dropped)
//   torch._utils._rebuild_tensor_v2/_v3,
//   torch._utils._rebuild_parameter               -> a tensor
//   torch.<Type>Storage, torch.storage.UntypedStorage, torch.<dtype>
//                                                 -> only as arguments of the above
// Any other global is refused at once with a DataError naming it, before
// anything is called, as weights_only refuses it. Every read is bounds-checked.
#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <string>
#include <string_view>

namespace dtrain::checkpoint::detail {

// Returns the storage saved under `key` (the archive's data/<key>) holding
// `bytes` bytes; throws DataError when it has another size or is missing.
using StorageLoader = std::function<at::Storage(const std::string& key, std::size_t bytes)>;

// Dicts come back as GenericDicts (insertion order kept), lists as
// GenericLists, tuples as Tuples. `what` names the file in errors.
c10::IValue read_weights_only_pickle(std::string_view pickle, const StorageLoader& load_storage,
                                     const std::string& what);

}  // namespace dtrain::checkpoint::detail
