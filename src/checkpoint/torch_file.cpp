// torch.save files: LibTorch's zip reader and writer, dtrain's weights-only
// pickle reader, LibTorch's pickler over untyped containers.
#include "dtrain/checkpoint/torch_file.h"

#include <ATen/Functions.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <set>

#include "dtrain/error.h"
#include "file_io.h"
#include "pickle_reader.h"

namespace fs = std::filesystem;

namespace dtrain::checkpoint {
namespace {

// LibTorch's typed containers pickle through torch.jit globals; untyped
// ones (element type Any) pickle as plain dicts and lists.
c10::IValue untyped(const c10::IValue& v) {
  if (v.isTensor()) {
    // LibTorch's pickler names torch.<Type>Storage for every dtype; Python has
    // such classes only for these (float8 and uint16-64 it writes as
    // UntypedStorage plus a dtype, which LibTorch's pickler cannot).
    const auto t = v.toTensor();
    static const std::set<at::ScalarType> kTyped = {at::kDouble, at::kFloat, at::kHalf,         at::kBFloat16,
                                                    at::kLong,   at::kInt,   at::kShort,        at::kChar,
                                                    at::kByte,   at::kBool,  at::kComplexFloat, at::kComplexDouble};
    DTRAIN_CHECK(kTyped.count(t.scalar_type()), ConfigError,
                 "a " << t.scalar_type() << " tensor cannot be written into a torch.save file here.",
                 "write it with save_safetensors (every dtype), or convert it");
    return t.detach().to(at::kCPU);
  }
  if (v.isGenericDict()) {
    c10::impl::GenericDict out(c10::AnyType::get(), c10::AnyType::get());
    for (const auto& kv : v.toGenericDict()) out.insert(kv.key(), untyped(kv.value()));
    return out;
  }
  if (v.isList()) {
    c10::impl::GenericList out(c10::AnyType::get());
    for (const auto& item : v.toListRef()) out.push_back(untyped(item));
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> items;
    for (const auto& item : v.toTupleRef().elements()) items.push_back(untyped(item));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  DTRAIN_CHECK(v.isNone() || v.isBool() || v.isInt() || v.isDouble() || v.isString(), ConfigError,
               "a " << v.tagKind() << " cannot be written into a torch.save file that weights_only opens.",
               "keep to dicts, lists, tuples, strings, numbers, bools, None and tensors");
  return v;
}

}  // namespace

c10::IValue load_torch_file(const fs::path& file) {
  const auto mapping = detail::MappedFile::open(file);  // a readable regular file, or a DataError saying why
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
  try {
    reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(file.string());
  } catch (const c10::Error& e) {
    DTRAIN_CHECK(false, DataError,
                 file.string() << " is not a torch.save zip archive (" << e.what_without_backtrace() << ").",
                 "files from torch.save with _use_new_zipfile_serialization=False (before PyTorch 1.6) are not read");
  }
  try {
    if (reader->hasRecord("byteorder")) {
      const auto [data, size] = reader->getRecord("byteorder");
      const std::string order(static_cast<const char*>(data.get()), size);
      DTRAIN_CHECK(order == "little", DataError, file.string() << " holds " << order << "-endian data.",
                   "load and save it again with torch on a little-endian machine");
    }
    DTRAIN_CHECK(
        reader->hasRecord("data.pkl"), DataError, file.string() << " has no data.pkl record.",
        "it is a zip file but not one torch.save wrote (a TorchScript archive? load it with torch::jit::load)");
    const auto [pickle, pickle_size] = reader->getRecord("data.pkl");
    const auto load_storage = [&](const std::string& key, std::size_t bytes) {
      const std::string record = "data/" + key;
      DTRAIN_CHECK(reader->hasRecord(record), DataError, file.string() << " has no record " << record << ".",
                   "the file is truncated or corrupt");
      auto [data, size] = reader->getRecord(record);
      DTRAIN_CHECK(
          size == bytes, DataError,
          file.string() << ": record " << record << " holds " << size << " bytes, its pickle says " << bytes << ".",
          "the file is corrupt");
      return at::Storage(at::Storage::use_byte_size_t(), size, std::move(data), nullptr, false);
    };
    return detail::read_weights_only_pickle(std::string_view(static_cast<const char*>(pickle.get()), pickle_size),
                                            load_storage, file.string());
  } catch (const c10::Error& e) {
    DTRAIN_CHECK(false, DataError, file.string() << ": " << e.what_without_backtrace(),
                 "the file is truncated or corrupt");
  }
  return {};
}

NamedTensors load_torch_state_dict(const fs::path& file, const std::string& key) {
  c10::IValue value = load_torch_file(file);
  if (!key.empty()) {
    DTRAIN_CHECK(value.isGenericDict() && value.toGenericDict().contains(key), DataError,
                 file.string() << " has no entry '" << key << "' at its top level.",
                 "name the entry that holds the state dict");
    value = value.toGenericDict().at(key);
  }
  DTRAIN_CHECK(value.isGenericDict(), DataError,
               file.string() << (key.empty() ? "" : " ['" + key + "']") << " holds a " << value.tagKind()
                             << ", not a state dict.",
               "save model.state_dict(), or name the entry that holds it");
  NamedTensors out;
  for (const auto& kv : value.toGenericDict()) {
    DTRAIN_CHECK(
        kv.key().isString() && kv.value().isTensor(), DataError,
        file.string() << ": state dict entry " << kv.key() << " is a " << kv.value().tagKind() << ", not a tensor.",
        "a state dict maps names to tensors; for a file holding several (a training checkpoint), name the "
        "entry: load_torch_state_dict's key, `dtrain ckpt --key`");
    out.emplace_back(kv.key().toStringRef(), kv.value().toTensor());
  }
  return out;
}

void save_torch_file(const fs::path& file, const c10::IValue& value, const TorchSaveOptions& options) {
  const c10::IValue plain = untyped(value);
  std::vector<char> pickle;
  torch::jit::Pickler pickler(
      [&](const char* data, std::size_t size) { pickle.insert(pickle.end(), data, data + size); }, nullptr, nullptr,
      nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(plain);
  pickler.stop();
  detail::write_file_atomically(file, options.durable, [&](const detail::ChunkSink& sink) {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, std::size_t size) {
      sink(data, size);
      return size;
    });
    // torch.save's archive name is the file's stem; torch.load does not care.
    torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(), writer);
    writer.writeEndOfFile();
  });
}

c10::IValue state_dict_value(const NamedTensors& tensors) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [name, t] : tensors) {
    DTRAIN_CHECK(!dict.contains(name), ConfigError, "tensor '" << name << "' is given twice.", "names are unique");
    dict.insert(name, t);
  }
  return dict;
}

void save_torch_state_dict(const fs::path& file, const NamedTensors& tensors, const TorchSaveOptions& options) {
  save_torch_file(file, state_dict_value(tensors), options);
}

}  // namespace dtrain::checkpoint
