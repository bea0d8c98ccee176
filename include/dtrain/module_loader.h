// Internal to dtrain (public only so that the CLI includes no private
// header; not a stable API): loading the modules dtrain loads on demand — libdtrain from the
// `dtrain run` CLI (which links no LibTorch) and libdtrain_nccl from
// libdtrain (so CPU processes never load CUDA). One place for dlopen and
// dlsym and their error messages.
#pragma once

#include <string>

namespace dtrain::detail {

// dlopen()s `path` (RTLD_LOCAL; RTLD_LAZY when `lazy`, else RTLD_NOW).
// Throws ConfigError "cannot load WHAT from PATH: reason", with `hint`.
void* load_module(const std::string& what, const std::string& path, bool lazy, const std::string& hint);

// The symbol `name` of a module loaded from `path`; ConfigError "PATH lacks
// NAME" (a module of another dtrain version) with `hint`.
void* module_symbol(void* handle, const std::string& path, const char* name, const std::string& hint);

}  // namespace dtrain::detail
