// Checkpoint state keyed by layouts: each rank saves the tensors it holds
// together with where they sit in the global tensor (dist::Layout: global
// shape and this rank's box), and a rank loading under another plan (another
// tp degree, pipeline cut, data-parallel width; ZeRO through
// trainer/resharding.h) fills each of its
// tensors from every saved box that meets its own (dist::intersect,
// dist::copy_intersection). Nothing here knows a strategy: it serves any
// state that can say, per tensor, its layout.
//
//   auto state = std::make_shared<LayoutState>([&] { return my_laid_out_tensors(); });
//   checkpointer.add_state("tp", state, StateScope::kSharded);
//
// Contracts:
//  - a tensor replicated over some mesh dimensions is written once, by the
//    rank at coordinate 0 of those dimensions, so the saved boxes of a
//    tensor are disjoint; Partial placements (unreduced sums) are refused;
//  - at load every element of every target must be covered by the saved
//    boxes of its name, else DataError naming the tensor and the count; a
//    name absent from the checkpoint is a DataError too, unless the tensor
//    is marked optional (optimizer state a fresh optimizer does not have);
//  - shapes: the global shapes must agree, or have as many elements with
//    one side whole (a tensor-parallel [3, C, C] read by one process's
//    [3C, C], and back); `local` may have any shape with its box's number of
//    elements (a fused QKV weight [3C/t, C] under the layout [3, C, C]), and
//    is read and written through a view of the box;
//  - a tensor may hold a contiguous range of its box's elements in row-major
//    order (LaidOutTensor::flat_range: a ZeRO piece of a tensor-parallel
//    part); it is saved and loaded as the few boxes that range is made of
//    (flat_range_boxes), one entry each under the same name;
//  - a load checks everything (every name present, every global shape, every
//    element covered, no saved name the model does not know) before it
//    writes into any tensor: a checkpoint that does not fit changes nothing.
// Format of a part (one rank's file): "laid_out.names" (the names, one per
// line), and per name i "laid_out.<i>.values" (the box's shape),
// "laid_out.<i>.box" (int64 [2, dims]: offsets, sizes) and
// "laid_out.<i>.global_shape".
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/checkpoint/checkpointer.h"
#include "dtrain/dist/layout.h"

namespace dtrain {

// A tensor this rank holds, with its layout at this rank's coordinates.
struct LaidOutTensor {
  at::Tensor local;
  dist::Layout layout;
  std::vector<int> coordinates;
  bool optional = false;  // may be absent from a checkpoint (left untouched then)
  // The piece this rank holds when it is not the layout's box at
  // `coordinates` (e.g. pieces cut by another rule); the layout's global
  // shape still applies.
  std::optional<dist::Box> box;
  // Whether this rank writes the tensor (false: a copy that another rank
  // writes, such as a pipeline's borrowed tied weight); it is still loaded.
  bool saved = true;
  // Set: `local` (contiguous, `size` elements) holds only elements [begin,
  // begin + size) of the box above (`box`, else the layout's at
  // `coordinates`) in the box's row-major order, as ZeRO's flat chunk of a
  // tp part does. Written and read as flat_range_boxes' boxes.
  struct FlatRange {
    std::int64_t begin = 0, size = 0;
  };
  std::optional<FlatRange> flat_range;
};
using LaidOutTensors = std::vector<std::pair<std::string, LaidOutTensor>>;

// The boxes that elements [begin, begin + size) of `box` (row-major) are
// made of, in that order: at most 2 x dims - 1, each a contiguous run of the
// range (none for an empty range).
std::vector<dist::Box> flat_range_boxes(const dist::Box& box, std::int64_t begin, std::int64_t size);

class LayoutState : public ShardedStateful {
 public:
  // `collect` gives this rank's tensors by name: at save the values to
  // write; at load the tensors to fill in place (no autograd). `after_load`
  // runs once they are filled (e.g. to move scalars into optimizer state).
  explicit LayoutState(std::function<LaidOutTensors()> collect, std::function<void()> after_load = {});
  void save_state(torch::serialize::OutputArchive& archive) const override;
  void load_parts(const std::function<torch::serialize::InputArchive&(int)>& part, int saved_world) override;
  // Fills every tensor from whole global tensors by name (`whole(name)`
  // undefined: absent), with load_parts's checks, `saved` being every name
  // the source holds (a name this model does not have is a DataError): how
  // state saved in another format (ZeRO's flat shards, consolidated) is loaded.
  void load_whole(const std::function<at::Tensor(const std::string&)>& whole, const std::vector<std::string>& saved);
  // Whether the last checkpoint loaded had `name` (for optional tensors).
  bool loaded(const std::string& name) const;
  // The names a checkpoint may hold (null: any). A saved name it rejects is
  // a DataError naming it (a checkpoint of another model). A rank may load
  // only some of the names (a pipeline stage), so this is the whole model's.
  void set_known(std::function<bool(const std::string&)> known) { known_ = std::move(known); }

 protected:
  // Called before a load collects its targets, and after it ends (`loaded`:
  // whether it succeeded; also when it threw).
  virtual void begin_load() {}
  virtual void end_load(bool /*loaded*/) {}

 private:
  struct Piece {
    dist::Box box;
    std::vector<std::int64_t> global_shape;
    std::function<at::Tensor()> values;
  };
  using Pieces = std::map<std::string, std::vector<Piece>>;
  // Where a target is read from its pieces: its box in the frame's global
  // shape, and whether the pieces are read reshaped to it (Note [Another
  // shape of the same tensor]).
  struct Frame {
    dist::Box mine;
    std::vector<std::int64_t> shape;
    bool reshape_pieces = false;
    dist::Box box_of(const Piece& piece) const {
      return reshape_pieces ? dist::Box{.offsets = std::vector<std::int64_t>(shape.size(), 0), .sizes = shape}
                            : piece.box;
    }
  };
  static Frame frame_of(const std::string& name, const LaidOutTensor& t, const dist::Box& mine,
                        const std::vector<Piece>& pieces);
  // Pieces saved flat (a 1-D global shape: ZeRO's chunks of whole tensors)
  // of a tensor the model holds in `model` (more dimensions, as many
  // elements), as boxes of `model`: each flat run split by flat_range_boxes.
  // Other pieces are returned as they are.
  static std::vector<Piece> in_model_shape(const std::vector<Piece>& pieces, const std::vector<std::int64_t>& model);
  // `find(name)`: the saved pieces of a target (null: none); `saved`: every
  // saved name, for set_known's check (empty: not enumerable).
  void load_pieces(const std::function<const std::vector<Piece>*(const std::string&)>& find,
                   const std::vector<std::string>& saved, const std::string& source);

  std::function<LaidOutTensors()> collect_;
  std::function<void()> after_load_;
  std::function<bool(const std::string&)> known_;
  std::vector<std::string> loaded_;
};

// One parameter (or buffer) of a model by its global name, with this rank's
// tensor and layout (LaidOutTensor::local is the parameter).
struct LaidOutParameter {
  std::string name;
  LaidOutTensor tensor;
  bool buffer = false;  // no optimizer state; optional at load (not every format keeps buffers)
};

// A model's parameters ("model.<name>") and, if given, the per-parameter
// state of `optimizer` ("optimizer.<name>.<field>", with its parameter's
// layout) as one LayoutState: Adam and AdamW (exp_avg, exp_avg_sq,
// max_exp_avg_sq, step) and SGD (momentum_buffer); other optimizers are a
// ConfigError. At load, a parameter without optimizer state gets a fresh one
// (zeros, step 0: what these optimizers create at their first step), filled
// from the checkpoint where it has that state; a failed load creates none.
// The optimizer's options (learning rate, ...) are not saved: set them as the
// run does (ScheduledLR sets the rate of the resumed step). `model_names`,
// when not empty, are every parameter and buffer name of the whole model: a
// checkpoint naming another is a DataError. `optimizer` must outlive the state.
std::shared_ptr<LayoutState> parameter_state(std::function<std::vector<LaidOutParameter>()> parameters,
                                             torch::optim::Optimizer* optimizer,
                                             std::vector<std::string> model_names = {});

// Whether a saved name ("model.<n>", "optimizer.<n>.<field>") is of one of
// `model_names` (every parameter and buffer of the whole model): the check
// parameter_state makes with its `model_names`, for other states of the
// same names (LayoutState::set_known).
std::function<bool(const std::string&)> known_model_names(const std::vector<std::string>& model_names);

// parameter_state over the parameters of `module` (layouts from
// dist::named_layouts(module, mesh)), named `name_prefix` + their names in
// `module` (the whole model's names when `module` holds a part of it under
// another root). `module`, `mesh` and `optimizer` must outlive the state.
std::shared_ptr<LayoutState> layout_state(torch::nn::Module& module, const dist::DeviceMesh& mesh,
                                          torch::optim::Optimizer* optimizer, const std::string& name_prefix = "");

}  // namespace dtrain
