// Parameters' layouts over a module tree (see parameter_layouts.h).
#include "dtrain/dist/parameter_layouts.h"

#include <map>

#include "dtrain/error.h"

namespace dtrain::dist {

NamedLayouts named_layouts(const torch::nn::Module& module, const DeviceMesh& mesh) {
  std::map<std::string, Layout> declared;
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const auto* declaring = dynamic_cast<const DeclaresLayouts*>(item.value().get());
    if (declaring == nullptr) continue;
    for (auto& [name, layout] : declaring->parameter_layouts())
      declared.emplace(item.key().empty() ? name : item.key() + "." + name, std::move(layout));
  }
  NamedLayouts out;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    auto it = declared.find(item.key());
    if (it == declared.end()) {
      out.emplace_back(item.key(), Layout::replicated(mesh, p.sizes().vec()));
      continue;
    }
    const std::int64_t local = it->second.local_box(mesh.coordinates()).numel();
    DTRAIN_CHECK(local == p.numel(), ConfigError,
                 "parameter " << item.key() << " of shape " << p.sizes() << " is declared with layout "
                              << it->second.to_string() << ", whose part at this rank has " << local << " elements.",
                 "declare the layout of the mesh the module was built on");
    out.emplace_back(item.key(), it->second);
  }
  return out;
}

at::Tensor local_part(const at::Tensor& global, const Layout& layout, const std::vector<int>& coordinates) {
  DTRAIN_CHECK(global.sizes().vec() == layout.global_shape, ConfigError,
               "local_part got a tensor of shape " << global.sizes() << " for the layout " << layout.to_string(),
               "pass the global tensor, shaped as the layout's global shape");
  const Box box = layout.local_box(coordinates);
  at::Tensor v = global;
  for (std::size_t d = 0; d < box.offsets.size(); ++d)
    v = v.narrow(static_cast<std::int64_t>(d), box.offsets[d], box.sizes[d]);
  return v;
}

}  // namespace dtrain::dist
