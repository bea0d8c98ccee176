// The communication of tensor and sequence parallelism as differentiable
// operators: Megatron-LM's f and g (Shoeybi et al. 2019, section 3) and their
// sequence-parallel counterparts (Korthikanti et al. 2022, section 4.2.2).
// Each is an autograd Function whose backward is the forward's adjoint:
//
//   operator                       forward                 backward
//   copy_to_region          (f)    identity                all-reduce
//   reduce_from_region      (g)    all-reduce              identity
//   scatter_to_region              keep this rank's slice  all-gather
//   gather_from_region             all-gather              keep this rank's slice
//   gather_from_sequence    (SP f) all-gather              reduce-scatter
//   reduce_scatter_to_sequence (SP g) reduce-scatter       all-gather
//   scatter_to_sequence            keep this rank's slice  all-gather
//
// A column-parallel layer starts with f (or, with sequence parallelism, the
// all-gather along the sequence), a row-parallel layer ends with g (or the
// reduce-scatter): one collective per layer each way, nothing in between.
//
// Contracts:
//  - every rank of `group` calls the same operators in the same order, in
//    forward and (through autograd) in backward, as for any collective;
//  - slicing is along tensor dimension `dim` (negative counts from the end)
//    into group.size() equal pieces, rank r holding piece r; a size not
//    divisible by the group size is a ConfigError naming it (no padding);
//  - communication goes through dist::ProcessGroup, so a dead peer is a
//    CommunicationError naming the operation, never a hang past the timeout;
//  - a group of one rank makes every operator the identity.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "dtrain/comm/process_group.h"

namespace dtrain::nn::tp {

// f: identity forward, all-reduce (sum) of the gradient over `group` backward.
at::Tensor copy_to_region(const at::Tensor& x, dist::ProcessGroup group);
// g: all-reduce (sum) forward, identity backward.
at::Tensor reduce_from_region(const at::Tensor& x, dist::ProcessGroup group);
// This rank's slice along `dim` forward; all-gather of the gradient backward.
at::Tensor scatter_to_region(const at::Tensor& x, dist::ProcessGroup group, std::int64_t dim = -1);
// All-gather along `dim` forward; this rank's slice of the gradient backward.
at::Tensor gather_from_region(const at::Tensor& x, dist::ProcessGroup group, std::int64_t dim = -1);

// Sequence parallelism, `dim` the sequence dimension:
// all-gather forward, reduce-scatter (sum) of the gradient backward; used
// before a column-parallel layer, whose input gradient is a partial sum.
at::Tensor gather_from_sequence(const at::Tensor& x, dist::ProcessGroup group, std::int64_t dim);
// Reduce-scatter (sum) forward, all-gather backward; used after a
// row-parallel layer (its output is a partial sum) instead of g.
at::Tensor reduce_scatter_to_sequence(const at::Tensor& x, dist::ProcessGroup group, std::int64_t dim);
// This rank's slice forward, all-gather backward: to enter a
// sequence-parallel region from a replicated tensor.
at::Tensor scatter_to_sequence(const at::Tensor& x, dist::ProcessGroup group, std::int64_t dim);

// The sequence-parallel column product: gather_from_sequence(x) W^T in one
// Function that keeps only x, this rank's 1/t of the sequence, for backward
// and all-gathers it again there for dW (Korthikanti et al. 2022, 4.2.2;
// Megatron's LinearWithGradAccumulationAndAsyncCommunication). Chaining the
// two operators would keep the gathered [.., s, in] alive between forward and
// backward instead: t times the activation. Same values and gradients (the
// same products, summed in the same order); the bias is added by the caller.
// Under CPU autocast the products run in the autocast dtype, as at::linear's
// would. No higher-order gradients (create_graph is refused).
at::Tensor gathered_linear(const at::Tensor& x, const at::Tensor& weight, dist::ProcessGroup group, std::int64_t dim);

}  // namespace dtrain::nn::tp
