// dlopen/dlsym with dtrain's errors; see module_loader.h.
#include "dtrain/module_loader.h"

#include <dlfcn.h>

#include "dtrain/error.h"

namespace dtrain::detail {

void* load_module(const std::string& what, const std::string& path, bool lazy, const std::string& hint) {
  void* handle = ::dlopen(path.c_str(), (lazy ? RTLD_LAZY : RTLD_NOW) | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = ::dlerror();
    throw ConfigError("cannot load " + what + " from " + path + ": " + (why != nullptr ? why : "unknown reason") + ".",
                      hint);
  }
  return handle;
}

void* module_symbol(void* handle, const std::string& path, const char* name, const std::string& hint) {
  void* symbol = ::dlsym(handle, name);
  DTRAIN_CHECK(symbol != nullptr, ConfigError,
               path << " lacks " << name << "; it belongs to another version of dtrain.", hint);
  return symbol;
}

}  // namespace dtrain::detail
