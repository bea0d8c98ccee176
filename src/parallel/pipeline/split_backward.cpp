// See Note [Weight backward from captured gradients] in split_backward.h.
#include "split_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <unordered_map>
#include <unordered_set>

#include "../../core/torch_compat.h"

namespace dtrain::pipeline::detail {

namespace {

using compat::NodePtr;
using torch::autograd::Edge;
using torch::autograd::Node;

struct Captured {
  std::vector<at::Tensor> grads;
};

class CaptureHook : public torch::autograd::FunctionPreHook {
 public:
  explicit CaptureHook(std::shared_ptr<Captured> slot) : slot_(std::move(slot)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    slot_->grads = grads;
    return grads;
  }

 private:
  std::shared_ptr<Captured> slot_;
};

}  // namespace

struct SplitBackward::Impl {
  struct Intermediate {
    NodePtr node;
    std::shared_ptr<Captured> captured;
    std::vector<Edge> params;  // gradient edges of the parameters below it
  };
  std::vector<Intermediate> intermediates;
};

SplitBackward::SplitBackward(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SplitBackward::~SplitBackward() = default;

std::unique_ptr<SplitBackward> SplitBackward::prepare(const at::Tensor& output, const at::Tensor& input,
                                                      const std::vector<at::Tensor>& params) {
  if (!input.defined() || !input.requires_grad() || !output.grad_fn()) return nullptr;
  const Node* input_node = torch::autograd::impl::gradient_edge(input).function.get();
  std::unordered_map<const Node*, std::size_t> param_of;
  std::vector<Edge> param_edges;
  for (const at::Tensor& p : params) {
    Edge e = torch::autograd::impl::gradient_edge(p);
    if (!e.function) continue;
    param_of[e.function.get()] = param_edges.size();
    param_edges.push_back(std::move(e));
  }
  // reaches[n]: whether n lies on a path to the input (iterative post-order).
  std::unordered_map<const Node*, bool> reaches;
  std::vector<std::pair<NodePtr, std::size_t>> stack{{output.grad_fn(), 0}};
  std::vector<NodePtr> on_path;  // input-path nodes, in post-order
  while (!stack.empty()) {
    auto& [node, next] = stack.back();
    if (next < node->next_edges().size()) {
      const NodePtr child = node->next_edges()[next++].function;
      if (child && !reaches.count(child.get())) {
        if (child.get() == input_node) {
          reaches[child.get()] = true;
        } else {
          reaches[child.get()] = false;  // visiting; settled on the way back
          stack.emplace_back(child, 0);
        }
      }
      continue;
    }
    bool r = false;
    for (const Edge& e : node->next_edges()) r = r || (e.function && reaches[e.function.get()]);
    reaches[node.get()] = r;
    if (r) on_path.push_back(node);
    stack.pop_back();
  }
  if (on_path.empty()) return nullptr;
  // Parameters below each input-path node through edges off the path.
  auto impl = std::make_unique<Impl>();
  std::vector<int> times_reached(param_edges.size(), 0);
  for (const NodePtr& node : on_path) {
    std::vector<Edge> below;
    std::unordered_set<const Node*> seen;
    std::vector<NodePtr> todo;
    for (const Edge& e : node->next_edges()) {
      if (e.function && !reaches[e.function.get()]) todo.push_back(e.function);
    }
    while (!todo.empty()) {
      NodePtr n = todo.back();
      todo.pop_back();
      if (!seen.insert(n.get()).second) continue;
      if (auto it = param_of.find(n.get()); it != param_of.end()) {
        below.push_back(param_edges[it->second]);
        ++times_reached[it->second];
      }
      for (const Edge& e : n->next_edges()) {
        if (e.function) todo.push_back(e.function);
      }
    }
    if (below.empty()) continue;
    auto slot = std::make_shared<Captured>();
    impl->intermediates.push_back({.node = node, .captured = slot, .params = std::move(below)});
  }
  for (std::size_t k = 0; k < param_edges.size(); ++k) {
    if (times_reached[k] != 1) return nullptr;  // unreached or reached twice: fall back
  }
  for (auto& inter : impl->intermediates) inter.node->add_pre_hook(std::make_unique<CaptureHook>(inter.captured));
  return std::unique_ptr<SplitBackward>(new SplitBackward(std::move(impl)));
}

int SplitBackward::captured_nodes() const {
  return static_cast<int>(impl_->intermediates.size());
}

void SplitBackward::backward_weights() {
  auto& engine = torch::autograd::Engine::get_default_engine();
  for (auto& inter : impl_->intermediates) {
    torch::autograd::edge_list roots;
    torch::autograd::variable_list grads;
    for (std::size_t k = 0; k < inter.captured->grads.size(); ++k) {
      if (!inter.captured->grads[k].defined()) continue;
      roots.emplace_back(inter.node, static_cast<uint32_t>(k));
      grads.push_back(inter.captured->grads[k]);
    }
    if (roots.empty()) continue;
    engine.execute(roots, grads, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/true, inter.params);
  }
  impl_->intermediates.clear();
}

}  // namespace dtrain::pipeline::detail
