// LayoutState (include/dtrain/checkpoint/layout_state.h), the layout-keyed
// checkpoint store, on its own: tensors saved by 2 rank threads under one
// layout load under others (3 ranks sharding another dimension, 1 rank)
// as exactly their parts of the global tensors; a replicated tensor is
// written once; a different global shape, a missing tensor and a partial
// sum are errors naming the tensor.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/serialize/archive.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/checkpoint/checkpointer.h"
#include "dtrain/checkpoint/layout_state.h"
#include "dtrain/comm/mesh.h"
#include "dtrain/error.h"
#include "ranks.h"

namespace {

using dtrain::dist::Layout;
using dtrain::dist::Placement;

// Global tensors: "w" [5, 7] (values 0..34) and "b" [4].
at::Tensor global_w() {
  return at::arange(35, at::kFloat).view({5, 7});
}
at::Tensor global_b() {
  return at::arange(4, at::kFloat).add(100);
}

struct LaidOutRank {
  std::shared_ptr<dtrain::dist::DeviceMesh> mesh;
  at::Tensor w, b;
  dtrain::LaidOutTensors tensors() const {
    return {{"w", {.local = w, .layout = w_layout, .coordinates = mesh->coordinates()}},
            {"b", {.local = b, .layout = Layout::replicated(*mesh, {4}), .coordinates = mesh->coordinates()}}};
  }
  Layout w_layout;
};

// This rank's parts of the globals under w's placement `w_on` (over "x").
LaidOutRank make_rank(dtrain::dist::ProcessGroup group, int world, Placement w_on, bool filled) {
  LaidOutRank r;
  r.mesh = std::make_shared<dtrain::dist::DeviceMesh>(group, std::vector<dtrain::dist::MeshDim>{{"dp_shard", world}});
  r.w_layout = {.mesh = r.mesh->dims(), .placements = {w_on}, .global_shape = {5, 7}};
  const auto box = r.w_layout.local_box(r.mesh->coordinates());
  r.w = filled ? dtrain::dist::local_part(global_w(), r.w_layout, r.mesh->coordinates()).clone()
               : at::full(box.sizes, -1.0F);
  r.b = filled ? global_b() : at::full({4}, -1.0F);
  return r;
}

// Registers "laid_out" with `checkpointer`: the one tensor "w", of which
// this rank holds `w` under `layout` at `coordinates`.
void add_laid_out_w(dtrain::Checkpointer& checkpointer, at::Tensor& w, const Layout& layout,
                    const std::vector<int>& coordinates) {
  checkpointer.add_state(
      "laid_out", std::make_shared<dtrain::LayoutState>([&w, layout, coordinates] {
        return dtrain::LaidOutTensors{{"w", {.local = w, .layout = layout, .coordinates = coordinates}}};
      }),
      dtrain::StateScope::kSharded);
}

std::filesystem::path layout_state_dir(const std::string& name) {
  auto dir =
      std::filesystem::temp_directory_path() / ("dtrain-layout-state-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir;
}

void save_two_ranks(const std::filesystem::path& dir) {
  dtrain::testing::run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(30)});
    LaidOutRank r = make_rank(group, 2, Placement::shard(0), true);  // rows 3 + 2
    dtrain::Checkpointer checkpointer({.dir = dir}, group);
    checkpointer.add_state("laid_out", std::make_shared<dtrain::LayoutState>([&r] { return r.tensors(); }),
                           dtrain::StateScope::kSharded);
    checkpointer.save({.step = 1});
  });
}

}  // namespace

TEST(LayoutState, LoadsEachRanksPartsUnderAnotherLayoutAndWorld) {
  const auto dir = layout_state_dir("reshard");
  save_two_ranks(dir);
  // The replicated "b" was written once: only rank 0's part names it.
  for (int r : {0, 1}) {
    torch::serialize::InputArchive part;
    part.load_from((dir / "step_1" / ("rank_" + std::to_string(r)) / "laid_out.pt").string());
    c10::IValue names;
    part.read("laid_out.names", names);
    EXPECT_EQ(names.toStringRef(), r == 0 ? "w\nb" : "w") << "rank " << r;
  }
  for (int world : {3, 1}) {
    dtrain::testing::run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
      auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(30)});
      LaidOutRank r = make_rank(group, world, Placement::shard(1), false);  // columns 3 + 3 + 1
      auto state = std::make_shared<dtrain::LayoutState>([&r] { return r.tensors(); });
      dtrain::Checkpointer checkpointer({.dir = dir}, group);
      checkpointer.add_state("laid_out", state, dtrain::StateScope::kSharded);
      ASSERT_TRUE(checkpointer.load_latest().has_value());
      EXPECT_TRUE(at::equal(r.w, dtrain::dist::local_part(global_w(), r.w_layout, r.mesh->coordinates())))
          << "world " << world << " rank " << rank << ": " << r.w;
      EXPECT_TRUE(at::equal(r.b, global_b())) << "world " << world << " rank " << rank;
      EXPECT_TRUE(state->loaded("w"));
    });
  }
  std::filesystem::remove_all(dir);
}

TEST(LayoutState, ShapeMismatchMissingTensorsAndPartialSumsAreErrors) {
  const auto dir = layout_state_dir("errors");
  save_two_ranks(dir);
  auto load_error = [&](const std::function<dtrain::LaidOutTensors(dtrain::dist::DeviceMesh&)>& tensors) {
    std::string message = "(no error)";
    dtrain::testing::run_rank_threads(1, [&](int rank, dtrain::dist::Store store) {
      auto group = dtrain::dist::init_process_group(store, rank, 1, {.timeout = std::chrono::seconds(30)});
      dtrain::dist::DeviceMesh mesh(group, {{"dp_shard", 1}});
      dtrain::Checkpointer checkpointer({.dir = dir}, group);
      checkpointer.add_state("laid_out", std::make_shared<dtrain::LayoutState>([&] { return tensors(mesh); }),
                             dtrain::StateScope::kSharded);
      try {
        checkpointer.load_latest();
      } catch (const dtrain::DataError& e) {
        message = e.what();
      }
    });
    return message;
  };
  const std::string shape = load_error([](dtrain::dist::DeviceMesh& mesh) {
    return dtrain::LaidOutTensors{
        {"w", {.local = at::zeros({5, 8}), .layout = Layout::replicated(mesh, {5, 8}), .coordinates = {0}}}};
  });
  EXPECT_NE(shape.find("w was saved with the global shape [5, 7]"), std::string::npos) << shape;
  const std::string missing = load_error([](dtrain::dist::DeviceMesh& mesh) {
    return dtrain::LaidOutTensors{
        {"v", {.local = at::zeros({2}), .layout = Layout::replicated(mesh, {2}), .coordinates = {0}}}};
  });
  EXPECT_NE(missing.find("the checkpoint has no v"), std::string::npos) << missing;
  // Optional tensors may be absent and are left as they are.
  EXPECT_EQ(
      load_error([](dtrain::dist::DeviceMesh& mesh) {
        return dtrain::LaidOutTensors{
            {"v",
             {.local = at::zeros({2}), .layout = Layout::replicated(mesh, {2}), .coordinates = {0}, .optional = true}}};
      }),
      "(no error)");

  dtrain::testing::run_rank_threads(1, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 1, {.timeout = std::chrono::seconds(30)});
    dtrain::dist::DeviceMesh mesh(group, {{"dp_shard", 1}});
    const Layout partial{.mesh = mesh.dims(), .placements = {Placement::partial()}, .global_shape = {2}};
    dtrain::LayoutState state([&] {
      return dtrain::LaidOutTensors{{"g", {.local = at::zeros({2}), .layout = partial, .coordinates = {0}}}};
    });
    torch::serialize::OutputArchive archive;
    try {
      state.save_state(archive);
      ADD_FAILURE() << "a partial sum was saved";
    } catch (const dtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("g is a partial sum"), std::string::npos) << e.what();
    }
  });
  std::filesystem::remove_all(dir);
}

// Note [Another shape of the same tensor]: w saved in parts of [5, 7] loads
// into one rank holding it whole as [35], and w saved whole loads into the
// parts of 2 ranks holding it as [7, 5] rows: each exactly the same elements
// in row-major order. Parts of [35] from parts of [5, 7] are refused, naming
// w and both shapes, and leave the tensor as it was.
TEST(LayoutState, AnotherShapeOfTheSameElementsLoadsWhereOneSideIsWhole) {
  const auto parts = layout_state_dir("shape-parts");
  save_two_ranks(parts);
  const auto whole = layout_state_dir("shape-whole");
  dtrain::testing::run_rank_threads(1, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 1, {.timeout = std::chrono::seconds(30)});
    LaidOutRank r = make_rank(group, 1, Placement::shard(0), true);
    dtrain::Checkpointer checkpointer({.dir = whole}, group);
    checkpointer.add_state("laid_out", std::make_shared<dtrain::LayoutState>([&r] { return r.tensors(); }),
                           dtrain::StateScope::kSharded);
    checkpointer.save({.step = 1});
  });
  // Loads "w" laid out as `global` sharded on dim 0 over `world` ranks from
  // `dir`; returns each rank's tensor (or the error's message).
  auto load = [](const std::filesystem::path& dir, int world, std::vector<std::int64_t> global) {
    std::vector<at::Tensor> out(static_cast<std::size_t>(world));
    std::vector<std::string> errors(static_cast<std::size_t>(world));
    dtrain::testing::run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
      auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(30)});
      dtrain::dist::DeviceMesh mesh(group, {{"dp_shard", world}});
      const Layout layout{.mesh = mesh.dims(), .placements = {Placement::shard(0)}, .global_shape = global};
      at::Tensor w = at::full(layout.local_box(mesh.coordinates()).sizes, -1.0F);
      dtrain::Checkpointer checkpointer({.dir = dir}, group);
      add_laid_out_w(checkpointer, w, layout, mesh.coordinates());
      try {
        checkpointer.load_latest();
      } catch (const dtrain::DataError& e) {
        errors[static_cast<std::size_t>(rank)] = e.what();
      }
      out[static_cast<std::size_t>(rank)] = w;
    });
    return std::make_pair(out, errors);
  };
  const auto [as_one, none] = load(parts, 1, {35});
  EXPECT_EQ(none[0], "");
  EXPECT_TRUE(at::equal(as_one[0], global_w().view({35}))) << as_one[0];
  const auto [as_rows, none2] = load(whole, 2, {7, 5});
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(none2[static_cast<std::size_t>(r)], "");
    EXPECT_TRUE(at::equal(as_rows[static_cast<std::size_t>(r)], global_w().view({7, 5}).chunk(2)[r])) << "rank " << r;
  }
  const auto [untouched, refused] = load(parts, 2, {35});
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(refused[static_cast<std::size_t>(r)].find("w was saved in parts of the global shape [5, 7]"),
              std::string::npos)
        << refused[static_cast<std::size_t>(r)];
    const at::Tensor& t = untouched[static_cast<std::size_t>(r)];
    EXPECT_TRUE(t.numel() == (r == 0 ? 18 : 17) && at::equal(t, at::full_like(t, -1.0F))) << "rank " << r << ": " << t;
  }
  std::filesystem::remove_all(parts);
  std::filesystem::remove_all(whole);
}

namespace {

// A model of named parameters for parameter_state, replicated on one rank.
struct ParameterModel {
  std::vector<std::pair<std::string, at::Tensor>> params;
  std::vector<at::Tensor> tensors() const {
    std::vector<at::Tensor> out;
    for (const auto& [name, p] : params) out.push_back(p);
    return out;
  }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, p] : params) out.push_back(name);
    return out;
  }
  std::vector<dtrain::LaidOutParameter> laid_out() const {
    std::vector<dtrain::LaidOutParameter> out;
    for (const auto& [name, p] : params) {
      const std::vector<std::int64_t> shape(p.sizes().begin(), p.sizes().end());
      out.push_back(
          {.name = name,
           .tensor = {
               .local = p,
               .layout = {.mesh = {{"replicas", 1}}, .placements = {Placement::replicate()}, .global_shape = shape},
               .coordinates = {0}}});
    }
    return out;
  }
};

ParameterModel parameter_model(std::vector<std::pair<std::string, std::vector<std::int64_t>>> shapes, float value) {
  ParameterModel m;
  for (const auto& [name, shape] : shapes) m.params.emplace_back(name, at::full(shape, value).requires_grad_());
  return m;
}

// One AdamW step on `m` (gradients all ones), so it has optimizer state.
void step_once(ParameterModel& m, torch::optim::AdamW& opt) {
  for (auto& [name, p] : m.params) p.mutable_grad() = at::ones_like(p);
  opt.step();
}

// The model and optimizer of `m` saved at step 1 into `dir`.
void save_parameter_model(const std::filesystem::path& dir, ParameterModel& m) {
  torch::optim::AdamW opt(m.tensors(), torch::optim::AdamWOptions(0.1));
  step_once(m, opt);
  dtrain::Checkpointer checkpointer({.dir = dir});
  checkpointer.add_state("laid_out", dtrain::parameter_state([&m] { return m.laid_out(); }, &opt, m.names()),
                         dtrain::StateScope::kSharded);
  checkpointer.save({.step = 1});
}

}  // namespace

// A checkpoint of another model (a parameter missing, extra or mis-shaped) is
// a DataError naming the parameter, and changes nothing: the parameters keep
// their values and a fresh optimizer gets no state (Note [Checking before
// filling]); a failed load leaves the state saving what exists, as before it.
TEST(LayoutState, CheckpointOfAnotherModelNamesTheParameterAndChangesNothing) {
  const auto dir = layout_state_dir("other-model");
  ParameterModel saved = parameter_model({{"a", {2, 3}}, {"b", {3}}}, 1.0F);
  save_parameter_model(dir, saved);
  int calls = 0;
  auto load_error = [&](ParameterModel m) {
    torch::optim::AdamW opt(m.tensors(), torch::optim::AdamWOptions(0.1));
    dtrain::Checkpointer checkpointer({.dir = dir});
    auto state = dtrain::parameter_state([&m] { return m.laid_out(); }, &opt, m.names());
    checkpointer.add_state("laid_out", state, dtrain::StateScope::kSharded);
    std::string message = "(no error)";
    try {
      checkpointer.load_latest();
    } catch (const dtrain::DataError& e) {
      message = e.what();
    }
    for (const auto& [name, p] : m.params) EXPECT_TRUE(p.eq(7.0F).all().item<bool>()) << name << " changed";
    EXPECT_TRUE(opt.state().empty()) << "a failed load left optimizer state behind";
    // The state is not stuck loading: a save writes only what exists (no
    // optimizer state for a fresh optimizer).
    dtrain::Checkpointer again({.dir = dir / ("again" + std::to_string(calls++))});
    again.add_state("laid_out", state, dtrain::StateScope::kSharded);
    again.save({.step = 1});
    EXPECT_TRUE(opt.state().empty()) << "a save after a failed load created optimizer state";
    return message;
  };
  const std::string missing = load_error(parameter_model({{"a", {2, 3}}, {"b", {3}}, {"c", {4}}}, 7.0F));
  EXPECT_NE(missing.find("the checkpoint has no model.c"), std::string::npos) << missing;
  const std::string extra = load_error(parameter_model({{"a", {2, 3}}}, 7.0F));
  EXPECT_NE(extra.find("holds model.b, which this model does not have"), std::string::npos) << extra;
  const std::string shape = load_error(parameter_model({{"a", {2, 3}}, {"b", {4}}}, 7.0F));
  EXPECT_NE(shape.find("model.b was saved with the global shape [3], the model's is [4]"), std::string::npos) << shape;

  // The same model loads: parameters and AdamW state (moments and step) as saved.
  ParameterModel m = parameter_model({{"a", {2, 3}}, {"b", {3}}}, 7.0F);
  torch::optim::AdamW opt(m.tensors(), torch::optim::AdamWOptions(0.1));
  dtrain::Checkpointer checkpointer({.dir = dir});
  checkpointer.add_state("laid_out", dtrain::parameter_state([&m] { return m.laid_out(); }, &opt, m.names()),
                         dtrain::StateScope::kSharded);
  ASSERT_TRUE(checkpointer.load_latest());
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    const at::Tensor& p = m.params[i].second;
    EXPECT_TRUE(p.equal(saved.params[i].second)) << m.params[i].first;
    const auto& s = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
    EXPECT_EQ(s.step(), 1);
    EXPECT_TRUE(s.exp_avg().allclose(at::full(p.sizes(), 0.1F))) << s.exp_avg();  // (1 - beta1) * grad
  }
  std::filesystem::remove_all(dir);
}

// State saved in another format (ZeRO's flat shards, made whole) is checked
// as a laid-out checkpoint is: a tensor this model does not have is a
// DataError naming it, and nothing is filled.
TEST(LayoutState, LoadWholeNamesATensorThisModelDoesNotHave) {
  ParameterModel m = parameter_model({{"a", {2, 3}}}, 7.0F);
  torch::optim::AdamW opt(m.tensors(), torch::optim::AdamWOptions(0.1));
  auto state = dtrain::parameter_state([&m] { return m.laid_out(); }, &opt, m.names());
  const std::map<std::string, at::Tensor> whole{{"model.a", at::ones({2, 3})}, {"model.b", at::ones({3})}};
  auto find = [&whole](const std::string& name) {
    const auto it = whole.find(name);
    return it == whole.end() ? at::Tensor() : it->second;
  };
  std::string message = "(no error)";
  try {
    state->load_whole(find, {"model.a", "model.b"});
  } catch (const dtrain::DataError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("holds model.b, which this model does not have"), std::string::npos) << message;
  EXPECT_TRUE(m.params[0].second.eq(7.0F).all().item<bool>()) << "a refused load filled a tensor";
  // The same tensors without the stranger load.
  state->load_whole(find, {"model.a"});
  EXPECT_TRUE(m.params[0].second.eq(1.0F).all().item<bool>());
}

// flat_range_boxes: every range of a 3-D box (offsets [1, 0, 2] in a larger
// tensor) is tiled, in order and exactly, by the boxes it returns: the
// elements they hold, read in turn, are the range of the box's flattening.
TEST(LayoutState, FlatRangeBoxesTileEveryRangeInOrder) {
  const at::Tensor global = at::arange(4 * 4 * 9, at::kFloat).view({4, 4, 9});
  const dtrain::dist::Box box{.offsets = {1, 0, 2}, .sizes = {3, 4, 5}};
  const at::Tensor flat = global.narrow(0, 1, 3).narrow(2, 2, 5).reshape({-1});
  for (std::int64_t begin = 0; begin <= 60; ++begin) {
    for (std::int64_t size = 0; begin + size <= 60; ++size) {
      const auto boxes = dtrain::flat_range_boxes(box, begin, size);
      EXPECT_LE(boxes.size(), 5u) << begin << " + " << size;
      std::vector<at::Tensor> read;
      for (const auto& b : boxes) {
        at::Tensor t = global;
        for (std::size_t d = 0; d < 3; ++d) t = t.narrow(static_cast<std::int64_t>(d), b.offsets[d], b.sizes[d]);
        read.push_back(t.reshape({-1}));
      }
      const at::Tensor got = read.empty() ? at::empty({0}) : at::cat(read);
      ASSERT_TRUE(at::equal(got, flat.narrow(0, begin, size))) << begin << " + " << size;
    }
  }
}

namespace {

// "w" [5, 8] split over tp 2 by columns ([5, 4] parts), each part cut into
// two flat ranges at `cut` (as ZeRO cuts the flattened part into chunks),
// held as 1-D tensors; the values are w's (filled) or -1.
struct FlatRangeRank {
  Layout layout;
  std::vector<int> coordinates;
  std::vector<std::pair<std::int64_t, at::Tensor>> pieces;  // (begin, values)
  dtrain::LaidOutTensors tensors() const {
    dtrain::LaidOutTensors out;
    for (const auto& [begin, t] : pieces)
      out.emplace_back("w", dtrain::LaidOutTensor{
                                .local = t,
                                .layout = layout,
                                .coordinates = coordinates,
                                .flat_range = dtrain::LaidOutTensor::FlatRange{.begin = begin, .size = t.numel()}});
    return out;
  }
};

at::Tensor global_w8() {
  return at::arange(40, at::kFloat).view({5, 8});
}

FlatRangeRank flat_range_rank(const dtrain::dist::DeviceMesh& mesh, std::int64_t cut, bool filled) {
  FlatRangeRank r{.layout = {.mesh = mesh.dims(), .placements = {Placement::shard(1)}, .global_shape = {5, 8}},
                  .coordinates = mesh.coordinates()};
  const at::Tensor part = dtrain::dist::local_part(global_w8(), r.layout, r.coordinates).reshape({-1});
  for (const auto& [begin, end] : {std::pair<std::int64_t, std::int64_t>{0, cut}, {cut, 20}}) {
    r.pieces.emplace_back(begin, filled ? part.narrow(0, begin, end - begin).clone() : at::full({end - begin}, -1.0F));
  }
  return r;
}

}  // namespace

// Flat ranges of tp parts (ZeRO's pieces of them) saved by 2 ranks load
// into one rank holding w whole, into 2 ranks holding rows, and into flat
// ranges cut elsewhere: each exactly its elements of w.
TEST(LayoutState, FlatRangesOfPartsLoadUnderAnyLayout) {
  const auto dir = layout_state_dir("flat-ranges");
  dtrain::testing::run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(30)});
    dtrain::dist::DeviceMesh mesh(group, {{"tp", 2}});
    FlatRangeRank r = flat_range_rank(mesh, 7, true);
    dtrain::Checkpointer checkpointer({.dir = dir}, group);
    checkpointer.add_state("laid_out", std::make_shared<dtrain::LayoutState>([&r] { return r.tensors(); }),
                           dtrain::StateScope::kSharded);
    checkpointer.save({.step = 1});
  });
  for (int world : {1, 2}) {
    dtrain::testing::run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
      auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(30)});
      dtrain::dist::DeviceMesh mesh(group, {{"dp_shard", world}});
      const Layout rows{.mesh = mesh.dims(), .placements = {Placement::shard(0)}, .global_shape = {5, 8}};
      at::Tensor w = at::full(rows.local_box(mesh.coordinates()).sizes, -1.0F);
      dtrain::Checkpointer checkpointer({.dir = dir}, group);
      add_laid_out_w(checkpointer, w, rows, mesh.coordinates());
      ASSERT_TRUE(checkpointer.load_latest().has_value());
      EXPECT_TRUE(at::equal(w, dtrain::dist::local_part(global_w8(), rows, mesh.coordinates())))
          << "world " << world << " rank " << rank << ": " << w;
    });
  }
  dtrain::testing::run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(30)});
    dtrain::dist::DeviceMesh mesh(group, {{"tp", 2}});
    FlatRangeRank r = flat_range_rank(mesh, 13, false);
    dtrain::Checkpointer checkpointer({.dir = dir}, group);
    checkpointer.add_state("laid_out", std::make_shared<dtrain::LayoutState>([&r] { return r.tensors(); }),
                           dtrain::StateScope::kSharded);
    ASSERT_TRUE(checkpointer.load_latest().has_value());
    const FlatRangeRank expected = flat_range_rank(mesh, 13, true);
    for (std::size_t i = 0; i < 2; ++i)
      EXPECT_TRUE(at::equal(r.pieces[i].second, expected.pieces[i].second)) << "rank " << rank << " piece " << i;
  });
  std::filesystem::remove_all(dir);
}

// ZeRO's pieces of whole tensors are saved flat (a 1-D global shape: runs of
// row-major elements); a tensor-parallel rank holds a box of the model's
// shape that is no run. Saved as [35] over 2 ranks (18 + 17 elements), "w"
// loads as columns over 2 ranks and as rows over 3, each rank exactly its
// part of the [5, 7] tensor (a ZeRO pipeline's checkpoint resumed under tp).
TEST(LayoutState, FlatPiecesLoadIntoPartsOfTheModelsShape) {
  const auto dir = layout_state_dir("flat-pieces");
  dtrain::testing::run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(30)});
    dtrain::dist::DeviceMesh mesh(group, {{"dp_shard", 2}});
    const Layout flat{.mesh = mesh.dims(), .placements = {Placement::shard(0)}, .global_shape = {35}};
    at::Tensor w = dtrain::dist::local_part(global_w().view({35}), flat, mesh.coordinates()).clone();
    dtrain::Checkpointer checkpointer({.dir = dir}, group);
    add_laid_out_w(checkpointer, w, flat, mesh.coordinates());
    checkpointer.save({.step = 1});
  });
  for (const auto& [world, dim] : std::vector<std::pair<int, std::int64_t>>{{2, 1}, {3, 0}}) {
    dtrain::testing::run_rank_threads(world, [&, world = world, dim = dim](int rank, dtrain::dist::Store store) {
      auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(30)});
      dtrain::dist::DeviceMesh mesh(group, {{"tp", world}});
      const Layout part{.mesh = mesh.dims(), .placements = {Placement::shard(dim)}, .global_shape = {5, 7}};
      at::Tensor w = at::full(part.local_box(mesh.coordinates()).sizes, -1.0F);
      dtrain::Checkpointer checkpointer({.dir = dir}, group);
      add_laid_out_w(checkpointer, w, part, mesh.coordinates());
      ASSERT_TRUE(checkpointer.load_latest().has_value());
      EXPECT_TRUE(at::equal(w, dtrain::dist::local_part(global_w(), part, mesh.coordinates())))
          << "world " << world << " dim " << dim << " rank " << rank << ": " << w;
    });
  }
  std::filesystem::remove_all(dir);
}
