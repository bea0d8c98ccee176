// Backward split into input and weight gradients without recomputation
// (torch.distributed.pipelining's stage_backward_input / stage_backward_weight,
// _backward.py), private to the pipeline executor.
//
// Note [Weight backward from captured gradients]
// The nodes of a stage's graph that lie on a path from its output to its
// input ("input path") run in I. Where such a node also feeds a subgraph that
// leads only to parameters (e.g. a matmul's weight operand), it is an
// "intermediate": a pre-hook captures the gradient it receives during I.
// W then runs, per intermediate, the engine from that node with the captured
// gradient and only that node's parameters as outputs, so the engine computes
// just the weight side (the input side is not needed for those outputs) and
// nothing of the input path again. When a parameter hangs below two
// intermediates (used twice), or the stage has no input path (the first
// stage, whose input is token ids), W falls back to one backward from the
// output restricted to the parameters, which recomputes the path.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace dtrain::pipeline::detail {

class SplitBackward {
 public:
  // Call after forward, before I. nullptr when the graph has no input path
  // (or a parameter is reached twice): then run the fallback.
  static std::unique_ptr<SplitBackward> prepare(const at::Tensor& output, const at::Tensor& input,
                                                const std::vector<at::Tensor>& params);
  ~SplitBackward();
  // W: accumulates the parameters' gradients from what I captured. Once.
  void backward_weights();
  // The nodes whose output gradient I captures (W runs the engine once each).
  int captured_nodes() const;

  struct Impl;

 private:
  explicit SplitBackward(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::pipeline::detail
