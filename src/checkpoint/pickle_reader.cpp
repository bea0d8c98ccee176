// A restricted unpickler for torch.save's data.pkl (see pickle_reader.h).
#include "pickle_reader.h"

#include <ATen/Functions.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <vector>

#include "dtrain/error.h"

namespace dtrain::checkpoint::detail {
namespace {

// What the pickle machine's stack holds: a value, a MARK, or one of the few
// allowed globals (callables, storage types and dtypes), which exist only
// as arguments and never reach the result.
struct Obj {
  enum class Kind { kValue, kMark, kTuple, kOrderedDict, kRebuildTensor, kRebuildParameter, kStorageType, kDtype };
  Kind kind = Kind::kValue;
  c10::IValue value;
  std::vector<std::shared_ptr<const Obj>> items;  // kTuple
  at::ScalarType dtype = at::kByte;               // kStorageType, kDtype
  int depth = 0;                                  // kTuple: tuples nested inside, itself included
};
using ObjPtr = std::shared_ptr<const Obj>;

ObjPtr make_value(c10::IValue v) {
  auto o = std::make_shared<Obj>();
  o->value = std::move(v);
  return o;
}
ObjPtr make_kind(Obj::Kind kind, at::ScalarType dtype = at::kByte) {
  auto o = std::make_shared<Obj>();
  o->kind = kind;
  o->dtype = dtype;
  return o;
}

struct NamedType {
  const char* name;
  at::ScalarType type;
};
// torch.<Name>Storage (the typed storages torch.save names for the classic
// dtypes) and torch.<dtype> (with UntypedStorage, for the others).
constexpr NamedType kStorageTypes[] = {{"DoubleStorage", at::kDouble},
                                       {"FloatStorage", at::kFloat},
                                       {"HalfStorage", at::kHalf},
                                       {"BFloat16Storage", at::kBFloat16},
                                       {"LongStorage", at::kLong},
                                       {"IntStorage", at::kInt},
                                       {"ShortStorage", at::kShort},
                                       {"CharStorage", at::kChar},
                                       {"ByteStorage", at::kByte},
                                       {"BoolStorage", at::kBool},
                                       {"ComplexFloatStorage", at::kComplexFloat},
                                       {"ComplexDoubleStorage", at::kComplexDouble}};
constexpr NamedType kDtypes[] = {{"float64", at::kDouble},
                                 {"float32", at::kFloat},
                                 {"float16", at::kHalf},
                                 {"bfloat16", at::kBFloat16},
                                 {"int64", at::kLong},
                                 {"int32", at::kInt},
                                 {"int16", at::kShort},
                                 {"int8", at::kChar},
                                 {"uint8", at::kByte},
                                 {"bool", at::kBool},
                                 {"complex64", at::kComplexFloat},
                                 {"complex128", at::kComplexDouble},
                                 {"float8_e4m3fn", at::kFloat8_e4m3fn},
                                 {"float8_e5m2", at::kFloat8_e5m2},
                                 {"float8_e4m3fnuz", at::kFloat8_e4m3fnuz},
                                 {"float8_e5m2fnuz", at::kFloat8_e5m2fnuz},
                                 {"uint16", at::kUInt16},
                                 {"uint32", at::kUInt32},
                                 {"uint64", at::kUInt64}};

// Fails the load with `message` (a stream expression) unless `cond` holds;
// inside Machine, whose fail() adds the file and the position.
#define DTRAIN_PICKLE_CHECK(cond, message) \
  do {                                     \
    if (!(cond)) {                         \
      std::ostringstream m_;               \
      m_ << message;                       \
      fail(m_.str());                      \
    }                                      \
  } while (false)

class Machine {
 public:
  Machine(std::string_view pickle, const StorageLoader& load_storage, const std::string& what)
      : in_(pickle), load_storage_(load_storage), what_(what) {}

  c10::IValue run() {
    while (true) {
      const auto op = static_cast<unsigned char>(read(1)[0]);
      if (op == '.') break;  // STOP
      step(op);
    }
    DTRAIN_PICKLE_CHECK(stack_.size() == 1, "ends with " << stack_.size() << " objects on the stack instead of one");
    return to_ivalue(stack_.back());
  }

 private:
  template <typename Message>
  void fail(const Message& message) const {
    DTRAIN_CHECK(false, DataError, what_ << ": " << message << " (pickle byte " << pos_ << ").",
                 "the file is not a torch.save file of tensors, dicts, lists and numbers, or it is corrupt");
  }

  std::string_view read(std::size_t n) {
    DTRAIN_PICKLE_CHECK(n <= in_.size() - pos_,
                        "is truncated: " << n << " bytes wanted, " << in_.size() - pos_ << " left");
    const auto out = in_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  template <typename T>
  T read_le() {
    T v;
    std::memcpy(&v, read(sizeof(T)).data(), sizeof(T));
    return v;
  }
  std::string read_line() {
    const auto end = in_.find('\n', pos_);
    DTRAIN_PICKLE_CHECK(end != std::string_view::npos, "has a GLOBAL with no end of line");
    std::string s(in_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return s;
  }

  ObjPtr pop() {
    DTRAIN_PICKLE_CHECK(!stack_.empty(), "pops an empty stack");
    auto o = std::move(stack_.back());
    stack_.pop_back();
    DTRAIN_PICKLE_CHECK(o->kind != Obj::Kind::kMark, "uses a MARK as an object");
    return o;
  }
  ObjPtr& top() {
    DTRAIN_PICKLE_CHECK(!stack_.empty() && stack_.back()->kind != Obj::Kind::kMark, "needs an object on the stack");
    return stack_.back();
  }
  // The objects since the last MARK, which is removed.
  std::vector<ObjPtr> pop_mark() {
    std::size_t i = stack_.size();
    while (i > 0 && stack_[i - 1]->kind != Obj::Kind::kMark) --i;
    DTRAIN_PICKLE_CHECK(i > 0, "has no MARK where one is needed");
    std::vector<ObjPtr> out(std::make_move_iterator(stack_.begin() + static_cast<std::ptrdiff_t>(i)),
                            std::make_move_iterator(stack_.end()));
    stack_.resize(i - 1);
    return out;
  }

  c10::IValue to_ivalue(const ObjPtr& o) {
    if (o->kind == Obj::Kind::kValue) return o->value;
    if (o->kind == Obj::Kind::kTuple) {
      std::vector<c10::IValue> items;
      for (const auto& i : o->items) items.push_back(to_ivalue(i));
      return c10::ivalue::Tuple::create(std::move(items));
    }
    fail("uses a class, function or dtype as a value");
    return {};
  }
  std::vector<ObjPtr> tuple_items(const ObjPtr& o, const char* what) {
    DTRAIN_PICKLE_CHECK(o->kind == Obj::Kind::kTuple, what << " is not a tuple");
    return o->items;
  }
  std::int64_t as_int(const ObjPtr& o, const char* what) {
    DTRAIN_PICKLE_CHECK(o->kind == Obj::Kind::kValue && o->value.isInt(), what << " is not an int");
    return o->value.toInt();
  }
  std::vector<std::int64_t> as_ints(const ObjPtr& o, const char* what) {
    std::vector<std::int64_t> out;
    for (const auto& i : tuple_items(o, what)) out.push_back(as_int(i, what));
    return out;
  }

  void push_global(const std::string& module, const std::string& name) {
    using K = Obj::Kind;
    if (module == "collections" && name == "OrderedDict") return stack_.push_back(make_kind(K::kOrderedDict));
    if (module == "torch._utils" && (name == "_rebuild_tensor_v2" || name == "_rebuild_tensor_v3"))
      return stack_.push_back(make_kind(K::kRebuildTensor));
    if (module == "torch._utils" && name == "_rebuild_parameter")
      return stack_.push_back(make_kind(K::kRebuildParameter));
    if (module == "torch.storage" && name == "UntypedStorage")
      return stack_.push_back(make_kind(K::kStorageType, at::kByte));
    if (module == "torch") {
      for (const auto& t : kStorageTypes)
        if (name == t.name) return stack_.push_back(make_kind(K::kStorageType, t.type));
      for (const auto& t : kDtypes)
        if (name == t.name) return stack_.push_back(make_kind(K::kDtype, t.type));
    }
    fail("refers to '" + module + "." + name +
         "', which a weights-only load does not allow (only tensors, dicts, lists, tuples, strings, numbers)");
  }

  // persistent_load(('storage', storage_type, key, location, numel))
  ObjPtr persistent_load(const ObjPtr& pid) {
    const auto items = tuple_items(pid, "a persistent id");
    DTRAIN_PICKLE_CHECK(items.size() == 5 && items[0]->kind == Obj::Kind::kValue && items[0]->value.isString() &&
                            items[0]->value.toStringRef() == "storage" && items[1]->kind == Obj::Kind::kStorageType &&
                            items[2]->kind == Obj::Kind::kValue && items[2]->value.isString(),
                        "has a persistent id that is not ('storage', type, key, location, size)");
    const std::int64_t numel = as_int(items[4], "a storage size");
    DTRAIN_PICKLE_CHECK(numel >= 0, "has a storage of negative size");
    const auto key = items[2]->value.toStringRef();
    auto it = storages_.find(key);
    if (it == storages_.end()) {
      std::size_t bytes = 0;
      DTRAIN_PICKLE_CHECK(
          !__builtin_mul_overflow(static_cast<std::size_t>(numel), c10::elementSize(items[1]->dtype), &bytes),
          "has a storage too large");
      it = storages_.emplace(key, load_storage_(key, bytes)).first;
      storage_dtypes_[it->second.unsafeGetStorageImpl()] = items[1]->dtype;
    }
    return make_value(c10::IValue(it->second));
  }

  // _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])
  // _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype[, metadata])
  ObjPtr rebuild_tensor(const std::vector<ObjPtr>& args, at::ScalarType storage_dtype) {
    DTRAIN_PICKLE_CHECK(args.size() >= 6 && args[0]->kind == Obj::Kind::kValue && args[0]->value.isStorage(),
                        "rebuilds a tensor from something other than a storage");
    at::ScalarType dtype = storage_dtype;
    if (args.size() >= 7 && args[6]->kind == Obj::Kind::kDtype) dtype = args[6]->dtype;
    const at::Storage storage = args[0]->value.toStorage();
    const auto offset = as_int(args[1], "a tensor's storage offset");
    const auto size = as_ints(args[2], "a tensor's size");
    const auto stride = as_ints(args[3], "a tensor's stride");
    DTRAIN_PICKLE_CHECK(size.size() == stride.size(), "has a tensor whose size and stride differ in length");
    // The last element the view reaches must lie inside the storage.
    std::int64_t last = offset;
    bool empty = false;
    DTRAIN_PICKLE_CHECK(offset >= 0, "has a negative storage offset");
    for (std::size_t d = 0; d < size.size(); ++d) {
      DTRAIN_PICKLE_CHECK(size[d] >= 0 && stride[d] >= 0, "has a negative size or stride");
      if (size[d] == 0) empty = true;
      std::int64_t reach = 0;
      DTRAIN_PICKLE_CHECK(!__builtin_mul_overflow(size[d] == 0 ? 0 : size[d] - 1, stride[d], &reach) &&
                              !__builtin_add_overflow(last, reach, &last),
                          "has a tensor too large");
    }
    const auto elements = static_cast<std::int64_t>(storage.nbytes() / c10::elementSize(dtype));
    DTRAIN_PICKLE_CHECK(empty || last < elements,
                        "has a tensor reaching element " << last << " of a storage of " << elements);
    if (empty) return make_value(c10::IValue(at::empty(size, at::TensorOptions().dtype(dtype))));
    auto t = at::empty({0}, at::TensorOptions().dtype(dtype));
    t.set_(storage, offset, size, stride);
    return make_value(c10::IValue(t));
  }

  void reduce() {
    const auto args_obj = pop();
    const auto callable = pop();
    const auto args = tuple_items(args_obj, "REDUCE's arguments");
    switch (callable->kind) {
      case Obj::Kind::kOrderedDict:
        DTRAIN_PICKLE_CHECK(args.empty(), "calls OrderedDict with arguments");
        stack_.push_back(make_value(c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get())));
        return;
      case Obj::Kind::kRebuildTensor: {
        DTRAIN_PICKLE_CHECK(!args.empty() && args[0]->kind == Obj::Kind::kValue && args[0]->value.isStorage(),
                            "rebuilds a tensor from something other than a storage");
        const auto dtype = storage_dtypes_.find(args[0]->value.toStorage().unsafeGetStorageImpl());
        DTRAIN_PICKLE_CHECK(dtype != storage_dtypes_.end(), "rebuilds a tensor from a storage it did not load");
        stack_.push_back(rebuild_tensor(args, dtype->second));
        return;
      }
      case Obj::Kind::kRebuildParameter:
        DTRAIN_PICKLE_CHECK(args.size() >= 1 && args[0]->kind == Obj::Kind::kValue && args[0]->value.isTensor(),
                            "rebuilds a parameter from something other than a tensor");
        stack_.push_back(args[0]);
        return;
      default: fail("calls something that is not an allowed function");
    }
  }

  void set_items(const ObjPtr& dict_obj, const std::vector<ObjPtr>& kv) {
    DTRAIN_PICKLE_CHECK(dict_obj->kind == Obj::Kind::kValue && dict_obj->value.isGenericDict(),
                        "sets items on a non-dict");
    DTRAIN_PICKLE_CHECK(kv.size() % 2 == 0, "sets a key without a value");
    auto dict = dict_obj->value.toGenericDict();
    for (std::size_t i = 0; i < kv.size(); i += 2) {
      const auto key = to_ivalue(kv[i]);
      DTRAIN_PICKLE_CHECK(key.isString() || key.isInt() || key.isDouble() || key.isBool(),
                          "uses a dict key that is not a string or number");
      dict.insert_or_assign(key, to_ivalue(kv[i + 1]));
    }
  }
  void append(const ObjPtr& list_obj, const std::vector<ObjPtr>& items) {
    DTRAIN_PICKLE_CHECK(list_obj->kind == Obj::Kind::kValue && list_obj->value.isList(), "appends to a non-list");
    auto list = list_obj->value.toList();
    for (const auto& i : items) list.push_back(to_ivalue(i));
  }
  void memo_put(std::uint32_t id) { memo_[id] = top(); }
  void memo_get(std::uint32_t id) {
    const auto it = memo_.find(id);
    DTRAIN_PICKLE_CHECK(it != memo_.end(), "refers to memo entry " << id << ", which was never stored");
    stack_.push_back(it->second);
  }
  std::string utf8(std::size_t n) { return std::string(read(n)); }

  // Tuples are converted (and freed) recursively: their nesting is bounded
  // so that a hostile pickle cannot overflow the stack.
  void push_tuple(const std::shared_ptr<Obj>& t) {
    for (const auto& i : t->items) t->depth = std::max(t->depth, i->kind == Obj::Kind::kTuple ? i->depth : 0);
    t->depth += 1;
    DTRAIN_PICKLE_CHECK(t->depth <= kMaxTupleDepth, "nests tuples deeper than " << kMaxTupleDepth);
    stack_.push_back(t);
  }
  static constexpr int kMaxTupleDepth = 1000;

  void step(unsigned char op) {
    using K = Obj::Kind;
    switch (op) {
      case 0x80: read(1); return;  // PROTO
      case 0x95: read(8); return;  // FRAME (protocol 4): only a length hint
      case '}': stack_.push_back(make_value(c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get()))); return;
      case ']': stack_.push_back(make_value(c10::impl::GenericList(c10::AnyType::get()))); return;
      case ')': stack_.push_back(make_kind(K::kTuple)); return;
      case '(': stack_.push_back(make_kind(K::kMark)); return;
      case 't': {
        auto t = std::make_shared<Obj>();
        t->kind = K::kTuple;
        t->items = pop_mark();
        push_tuple(t);
        return;
      }
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        auto t = std::make_shared<Obj>();
        t->kind = K::kTuple;
        t->items.resize(op - 0x84);
        for (auto i = t->items.rbegin(); i != t->items.rend(); ++i) *i = pop();
        push_tuple(t);
        return;
      }
      case 'q': memo_put(static_cast<unsigned char>(read(1)[0])); return;              // BINPUT
      case 'r': memo_put(read_le<std::uint32_t>()); return;                            // LONG_BINPUT
      case 0x94: memo_put(static_cast<std::uint32_t>(memo_.size())); return;           // MEMOIZE
      case 'h': memo_get(static_cast<unsigned char>(read(1)[0])); return;              // BINGET
      case 'j': memo_get(read_le<std::uint32_t>()); return;                            // LONG_BINGET
      case 'X': stack_.push_back(make_value(utf8(read_le<std::uint32_t>()))); return;  // BINUNICODE
      case 0x8c: stack_.push_back(make_value(utf8(static_cast<unsigned char>(read(1)[0])))); return;
      case 0x8d: stack_.push_back(make_value(utf8(read_le<std::uint64_t>()))); return;  // BINUNICODE8
      case 'J': stack_.push_back(make_value(static_cast<std::int64_t>(read_le<std::int32_t>()))); return;
      case 'K': stack_.push_back(make_value(static_cast<std::int64_t>(static_cast<unsigned char>(read(1)[0])))); return;
      case 'M': stack_.push_back(make_value(static_cast<std::int64_t>(read_le<std::uint16_t>()))); return;
      case 0x8a: {  // LONG1: little-endian two's complement, at most 8 bytes here
        const auto n = static_cast<unsigned char>(read(1)[0]);
        DTRAIN_PICKLE_CHECK(n <= 8, "has an integer of " << n << " bytes, larger than int64");
        const auto bytes = read(n);
        std::uint64_t v = 0;
        for (std::size_t i = 0; i < n; ++i)
          v |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
        if (n > 0 && n < 8 && (static_cast<unsigned char>(bytes[n - 1]) & 0x80)) v |= ~std::uint64_t{0} << (8 * n);
        stack_.push_back(make_value(static_cast<std::int64_t>(v)));
        return;
      }
      case 'G': {  // BINFLOAT: big-endian double
        auto b = read(8);
        std::uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = (bits << 8) | static_cast<unsigned char>(b[i]);
        double d;
        std::memcpy(&d, &bits, 8);
        stack_.push_back(make_value(d));
        return;
      }
      case 0x88: stack_.push_back(make_value(true)); return;
      case 0x89: stack_.push_back(make_value(false)); return;
      case 'N': stack_.push_back(make_value(c10::IValue())); return;
      case 'a': {
        auto v = pop();
        append(top(), {v});
        return;
      }  // APPEND
      case 'e': {
        auto items = pop_mark();
        append(top(), items);
        return;
      }  // APPENDS
      case 's': {
        auto v = pop();
        auto k = pop();
        set_items(top(), {k, v});
        return;
      }  // SETITEM
      case 'u': {
        auto kv = pop_mark();
        set_items(top(), kv);
        return;
      }  // SETITEMS
      case 'c': {
        auto module = read_line();
        auto name = read_line();
        push_global(module, name);
        return;
      }
      case 0x93: {  // STACK_GLOBAL
        auto name = to_ivalue(pop()), module = to_ivalue(pop());
        DTRAIN_PICKLE_CHECK(name.isString() && module.isString(), "has a STACK_GLOBAL without names");
        push_global(module.toStringRef(), name.toStringRef());
        return;
      }
      case 'Q': stack_.push_back(persistent_load(pop())); return;  // BINPERSID
      case 'R': reduce(); return;
      case 'b': {  // BUILD: only an OrderedDict's attributes (state_dict's _metadata), dropped
        pop();
        DTRAIN_PICKLE_CHECK(top()->kind == K::kValue && top()->value.isGenericDict(),
                            "sets the state of an object that is not a dict");
        return;
      }
      default: fail("uses pickle opcode 0x" + to_hex(op) + ", which a state dict does not need");
    }
  }
  static std::string to_hex(unsigned char c) {
    const char* digits = "0123456789abcdef";
    return {digits[c >> 4], digits[c & 15]};
  }

  std::string_view in_;
  std::size_t pos_ = 0;
  const StorageLoader& load_storage_;
  const std::string& what_;
  std::vector<ObjPtr> stack_;
  std::map<std::uint32_t, ObjPtr> memo_;
  std::map<std::string, at::Storage> storages_;
  std::map<const c10::StorageImpl*, at::ScalarType> storage_dtypes_;
};

#undef DTRAIN_PICKLE_CHECK

}  // namespace

c10::IValue read_weights_only_pickle(std::string_view pickle, const StorageLoader& load_storage,
                                     const std::string& what) {
  return Machine(pickle, load_storage, what).run();
}

}  // namespace dtrain::checkpoint::detail
