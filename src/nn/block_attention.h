// Attention of one block of queries against one block of keys, returning the
// log-sum-exp of each query row, and its backward given the *merged* output
// and log-sum-exp of all blocks: the pieces context-parallel attention
// (context_parallel.cpp) merges with online softmax. Private to src/nn/.
//
// Shapes: q [B, H, Lq, D], k and v [B, H, Lk, D]; out [B, H, Lq, D] in q's
// dtype, lse [B, H, Lq] fp32. `causal` masks key j > query i (top-left
// aligned; used only with Lq == Lk). Backward with the final out and lse of a
// row gives exactly this block's share of the row's gradients (the flash
// attention backward: P = exp(S - lse), dS = P * (dP - rowsum(dO * O))).
// `dropout` (defined: [B, H, Lq, Lk], what the block's probabilities are
// multiplied by after the softmax) takes the math path: out = (P * Z) V with
// the log-sum-exp of the undropped scores, so blocks merge as without it;
// backward dV = (P * Z)^T dO, dP = (dO V^T) * Z, and rowsum(dO * O) of the
// dropped output is still the softmax's correction term.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "dtrain/nn/context_parallel.h"

namespace dtrain::nn::cp::detail {

struct BlockResult {
  at::Tensor out, lse;
};

BlockResult block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                          BlockKernel kernel, const at::Tensor& dropout = {});

// dq, dk, dv of this block, in q's dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward(const at::Tensor& dout, const at::Tensor& q,
                                                              const at::Tensor& k, const at::Tensor& v,
                                                              const at::Tensor& out, const at::Tensor& lse, bool causal,
                                                              double scale, BlockKernel kernel,
                                                              const at::Tensor& dropout = {});

}  // namespace dtrain::nn::cp::detail
