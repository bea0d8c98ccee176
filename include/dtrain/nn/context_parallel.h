// Context parallelism: causal self-attention over a sequence split across the
// ranks of `group` (the mesh's `cp` dimension), each rank holding 1/c of every
// sequence. The split is zig-zag (load-balanced): the sequence is cut into 2c
// equal chunks and rank r holds chunks r and 2c-1-r, concatenated, so under
// the causal mask every rank does the same work. See Note [Context-parallel
// ring] in src/nn/context_parallel.cpp and docs/tp.md ("Context parallelism").
//
//   q, k, v: [B, H, T/c, D], this rank's zig-zag part (zigzag_shard along the
//   sequence dimension of the full tensors)
//   y = cp::causal_attention(q, k, v, mesh["cp"]);  // [B, H, T/c, D]
//
// y equals the rows of at::scaled_dot_product_attention(q_full, k_full,
// v_full, is_causal) this rank holds, and so do the gradients of q, k and v.
//
// Contracts:
//  - every rank of `group` calls it with the same shapes and options, in
//    forward and (through autograd) in backward, as for any collective;
//  - T/c is even (2c divides T); otherwise ConfigError before anything is sent;
//  - communication goes through dist::ProcessGroup (batched send/recv for the
//    ring, all-gather and reduce-scatter for kAllGather), so a dead peer is a
//    CommunicationError naming the operation, never a hang past the timeout;
//  - memory: backward keeps q, k, v, the output (this rank's part, in their
//    dtype) and the log-sum-exp (fp32, [B, H, T/c]): 1/c of the unsplit
//    attention's. Other ranks' K/V blocks are not kept; backward passes them
//    round again. Transient: two K/V blocks in flight (ring) or all c of them
//    (all-gather), plus fp32 gradient accumulators of the same size in backward;
//  - no attention mask besides the causal one; the scale is 1/sqrt(D)
//    unless given;
//  - attention dropout (AttentionOptions::dropout_scale): this rank's rows
//    of the mask one process applies to the probabilities, against every key
//    of the sequence; the blocks then take the math path (the per-block
//    kernels take no mask), and the mask is kept for backward
//    (B x H x T/c x T floats).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "dtrain/comm/process_group.h"

namespace dtrain::nn::cp {

// How the K/V blocks of the other ranks reach this one.
enum class KvExchange {
  // c - 1 steps, each sending this rank's current block to the next rank and
  // receiving the previous rank's, overlapped with the attention of the block
  // in hand; backward sends the K/V gradients round with them.
  kRing,
  // One all-gather of every rank's K/V in forward (and again in backward),
  // one reduce-scatter of their gradients in backward.
  kAllGather,
};

// The per-block attention kernel (an ATen kernel that returns the log-sum-exp).
enum class BlockKernel {
  // The CPU's flash attention (at::_scaled_dot_product_flash_attention_for_cpu
  // and its backward) on CPU tensors; on CUDA tensors the memory-efficient
  // kernel (at::_scaled_dot_product_efficient_attention with its log-sum-exp)
  // where it applies (fp32/fp16/bf16, head dimension a multiple of 8); math
  // attention elsewhere.
  kAuto,
  // Math attention from ATen ops (matmul, logsumexp, softmax), any device.
  kMath,
};

struct AttentionOptions {
  KvExchange exchange = KvExchange::kRing;
  BlockKernel kernel = BlockKernel::kAuto;
  std::optional<double> scale;  // unset: 1/sqrt(D)
  // Attention dropout: what the probabilities of this rank's query rows are
  // multiplied by, [B, H, T/c, T] (keys in sequence order), as at::dropout
  // multiplies (its kept-and-scaled noise, bernoulli(1 - p) / (1 - p)): the
  // zig-zag rows of one process's mask give one process's dropout exactly.
  // Undefined: no dropout. Not differentiated.
  at::Tensor dropout_scale;
};

// Causal attention of this rank's zig-zag part of q, k, v (see above).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, dist::ProcessGroup group,
                            const AttentionOptions& options = {});

// Rank `rank`'s zig-zag part of `x` along `dim` (size T, cut into 2 * cp
// chunks): chunks rank and 2cp-1-rank, concatenated. ConfigError when 2 * cp
// does not divide T.
at::Tensor zigzag_shard(const at::Tensor& x, int cp, int rank, std::int64_t dim);
// The global positions of that part: int64 [T / cp] on `options`' device.
at::Tensor zigzag_positions(std::int64_t seq, int cp, int rank, const at::TensorOptions& options);

// A loss whose value is the mean of `loss` over the ranks of `group` and
// whose gradient is that of this rank's `loss` alone: with equal token counts
// per rank the value is the loss of the whole sequence, and the gradients,
// averaged with the data-parallel ones over dp x cp, are the whole
// sequence's (each rank's backward already carries the other ranks' terms
// through the attention's K/V gradients). Collective over `group` (an
// all-reduce of one element).
at::Tensor mean_loss(const at::Tensor& loss, dist::ProcessGroup group);

}  // namespace dtrain::nn::cp
