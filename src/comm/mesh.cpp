// DeviceMesh: a named N-D mesh and its groups (see mesh.h, Note [Mesh groups]).
#include "dtrain/comm/mesh.h"

#include <algorithm>
#include <sstream>

#include "dtrain/error.h"
#include "group_state.h"

namespace dtrain::dist {

namespace {

std::string known_names() {
  std::string s;
  for (const auto& n : mesh_dim_names()) s += (s.empty() ? "" : ", ") + n;
  return s;
}

// Calls `visit` with every index vector of `sizes`, row-major (last fastest).
template <typename Visit>
void for_each_index(const std::vector<int>& sizes, Visit visit) {
  std::vector<int> index(sizes.size(), 0);
  while (true) {
    visit(index);
    std::size_t d = sizes.size();
    while (d > 0 && ++index[d - 1] == sizes[d - 1]) index[--d] = 0;
    if (d == 0) return;
  }
}

}  // namespace

DeviceMesh::DeviceMesh(ProcessGroup group, std::vector<MeshDim> dims, MeshOptions options)
    : group_(std::move(group)), dims_(std::move(dims)) {
  const auto& names = mesh_dim_names();
  std::ptrdiff_t last = -1;
  long long product = 1;
  for (const auto& d : dims_) {
    const auto it = std::find(names.begin(), names.end(), d.name);
    DTRAIN_CHECK(it != names.end(), ConfigError, "mesh dimension '" << d.name << "' is not one dtrain knows.",
                 "name dimensions among " << known_names());
    const auto position = it - names.begin();
    DTRAIN_CHECK(position != last, ConfigError, "mesh dimension '" << d.name << "' is listed twice.",
                 "list each dimension once");
    DTRAIN_CHECK(position > last, ConfigError, "mesh dimension '" << d.name << "' comes after one that is inside it.",
                 "list dimensions outermost first: " << known_names());
    DTRAIN_CHECK(d.size >= 1, ConfigError, "mesh dimension '" << d.name << "' has size " << d.size << ".",
                 "give every dimension a size of at least 1 (1 where it is not used)");
    last = position;
    product *= d.size;
  }
  DTRAIN_CHECK(product == group_.size(), ConfigError,
               "a " << describe() << " mesh holds " << product << " ranks, but its group has " << group_.size() << ".",
               "choose dimension sizes whose product is the world size " << group_.size());
  // Row-major coordinates of this rank.
  coordinates_.assign(dims_.size(), 0);
  int rest = group_.rank();
  for (std::size_t d = dims_.size(); d-- > 0;) {
    coordinates_[d] = rest % dims_[d].size;
    rest /= dims_[d].size;
  }
  // Every join is checked before any group is made: a bad one must fail on
  // every rank alike, before the others start connecting a group that this
  // rank would abandon (they got "connection closed" instead of the ConfigError).
  std::vector<unsigned> join_spans;
  for (const auto& j : options.joins) join_spans.push_back(span_of(j, "a join"));
  for (std::size_t d = 0; d < dims_.size(); ++d) make_groups(1u << d);
  for (const unsigned span : join_spans) make_groups(span);
}

std::optional<std::size_t> DeviceMesh::index_of(std::string_view name) const {
  for (std::size_t d = 0; d < dims_.size(); ++d)
    if (dims_[d].name == name) return d;
  return std::nullopt;
}

bool DeviceMesh::has(std::string_view name) const {
  return index_of(name).has_value();
}

int DeviceMesh::size(std::string_view name) const {
  const auto d = index_of(name);
  return d ? dims_[*d].size : 1;
}

int DeviceMesh::coordinate(std::string_view name) const {
  const auto d = index_of(name);
  return d ? coordinates_[*d] : 0;
}

int DeviceMesh::rank_at(const std::vector<int>& coordinates) const {
  DTRAIN_CHECK(coordinates.size() == dims_.size(), ConfigError,
               "rank_at got " << coordinates.size() << " coordinates for a " << describe() << " mesh.",
               "give one coordinate per mesh dimension");
  int rank = 0;
  for (std::size_t d = 0; d < dims_.size(); ++d) {
    DTRAIN_CHECK(coordinates[d] >= 0 && coordinates[d] < dims_[d].size, ConfigError,
                 "coordinate " << coordinates[d] << " is outside mesh dimension " << dims_[d].name << " of size "
                               << dims_[d].size << ".",
                 "give coordinates in 0..size-1");
    rank = rank * dims_[d].size + coordinates[d];
  }
  return rank;
}

unsigned DeviceMesh::span_of(const std::vector<std::string>& names, const char* what) const {
  unsigned span = 0;
  for (const auto& n : names) {
    DTRAIN_CHECK(std::find(mesh_dim_names().begin(), mesh_dim_names().end(), n) != mesh_dim_names().end(), ConfigError,
                 what << " names mesh dimension '" << n << "', which dtrain does not know.",
                 "name dimensions among " << known_names());
    if (const auto d = index_of(n)) span |= 1u << *d;
  }
  return span;
}

void DeviceMesh::make_groups(unsigned span) {
  if (groups_.count(span) != 0) return;
  // The sizes of the dimensions outside the span (which pick a group) and
  // inside it (which pick a member), each in mesh order.
  std::vector<std::size_t> outer_dims, inner_dims;
  for (std::size_t d = 0; d < dims_.size(); ++d) ((span >> d) & 1u ? inner_dims : outer_dims).push_back(d);
  // The groups' name in errors and flight-recorder dumps: "tp", "dp_shard+cp".
  std::string name;
  for (auto d : inner_dims) name += (name.empty() ? "" : "+") + dims_[d].name;
  std::vector<int> outer_sizes, inner_sizes;
  for (auto d : outer_dims) outer_sizes.push_back(dims_[d].size);
  for (auto d : inner_dims) inner_sizes.push_back(dims_[d].size);
  std::vector<int> at(dims_.size(), 0);
  for_each_index(outer_sizes, [&](const std::vector<int>& outer) {
    for (std::size_t k = 0; k < outer_dims.size(); ++k) at[outer_dims[k]] = outer[k];
    std::vector<int> ranks;
    for_each_index(inner_sizes, [&](const std::vector<int>& inner) {
      for (std::size_t k = 0; k < inner_dims.size(); ++k) at[inner_dims[k]] = inner[k];
      ranks.push_back(rank_at(at));
    });
    if (auto made = group_.new_group(ranks)) {
      detail::rename_group(*made->state(), name);
      groups_.emplace(span, std::move(*made));
    }
  });
  DTRAIN_INTERNAL_ASSERT(groups_.count(span) == 1, "mesh rank " << group_.rank() << " is in no group of a span");
}

ProcessGroup& DeviceMesh::operator[](std::string_view name) {
  const auto d = index_of(name);
  DTRAIN_CHECK(d.has_value(), ConfigError, "the " << describe() << " mesh has no dimension '" << name << "'.",
               "add it to the mesh (size 1 where it is not split), or ask for one it has");
  return groups_.at(1u << *d);
}

ProcessGroup& DeviceMesh::join(const std::vector<std::string>& names) {
  const unsigned span = span_of(names, "join");
  const auto it = groups_.find(span);
  DTRAIN_CHECK(it != groups_.end(), ConfigError,
               "the " << describe() << " mesh made no group for this join of dimensions.",
               "list the join in MeshOptions::joins when making the mesh");
  return it->second;
}

std::string DeviceMesh::describe() const {
  std::ostringstream s;
  for (std::size_t d = 0; d < dims_.size(); ++d) s << (d ? " x " : "") << dims_[d].size << " (" << dims_[d].name << ")";
  if (dims_.empty()) s << "1 (no dimensions)";
  return s.str();
}

}  // namespace dtrain::dist
