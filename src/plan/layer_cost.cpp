// Alpha-beta collectives and per-layer times (layer_cost.h).
#include "layer_cost.h"

#include <algorithm>

namespace dtrain::plan::detail {

double all_reduce_seconds(double bytes, int ranks, const Link& link) {
  if (ranks <= 1 || bytes <= 0) return 0;
  const double k = ranks;
  return link.call_latency + 2 * (k - 1) * link.latency + 2 * (k - 1) / k * bytes / link.bandwidth;
}

double gather_seconds(double bytes, int ranks, const Link& link) {
  if (ranks <= 1 || bytes <= 0) return 0;
  return gather_latency_seconds(ranks, link) + gather_work_seconds(bytes, ranks, link);
}

double gather_latency_seconds(int ranks, const Link& link) {
  if (ranks <= 1) return 0;
  return link.call_latency + (ranks - 1) * link.latency;
}

double gather_work_seconds(double bytes, int ranks, const Link& link) {
  if (ranks <= 1 || bytes <= 0) return 0;
  const double k = ranks;
  return (k - 1) / k * bytes / link.bandwidth;
}

double p2p_seconds(double bytes, const Link& link) {
  return bytes <= 0 ? 0 : link.call_latency + link.latency + bytes / link.bandwidth;
}

// Note [Layer time]
// A layer's forward is its GEMMs, its attention core and its element-wise
// kernels, each costed on its own device roofline:
//  - GEMM (m x k) . (k x n): max(2mkn / (peak x gemm_efficiency),
//    bytes moved / (memory bandwidth x memory_efficiency)) + one call's fixed
//    cost (a launch; on a CPU oneDNN's per-call work, DeviceSpec::
//    gemm_overhead, which is what makes a small micro-batch cost more per
//    token there). Input-gradient and
//    weight-gradient GEMMs have the same FLOPs and bytes as the forward one.
//  - Attention, materialised (Megatron 2021): two batched GEMMs with the head
//    dimension as k (the roofline makes them slower per FLOP) plus the
//    scores' softmax / dropout traffic; backward twice the GEMMs and the
//    traffic again. Flash: the causal half of 4 s^2 h FLOPs at
//    attention_efficiency; backward 2.5 x forward (it recomputes scores).
//  - Element-wise: bytes per token moved by norms, residual adds, activation
//    functions, rotary embeddings and dropout, fused (Megatron's kernels) or
//    eager (one kernel per PyTorch op), over the memory bandwidth; backward
//    moves twice as much. On a device with a modelled cache (a CPU host:
//    DeviceSpec::cache_bytes) traffic whose largest kernel's operands fit in
//    a rank's share of it streams at the cache's bandwidth: the GPT
//    example's activations (0.4-3 MiB) never leave this CPU's L3, and costed
//    at DRAM's rate its element-wise work came out 2.7x the profiled time.
// Note [Element-wise passes]
// Eager kernels (one per PyTorch op, as dtrain's GPT and torchtitan run
// them) in the norms' and residuals' region per token and layer: each
// native LayerNorm reads and writes its row (2 x 2h elements), each
// residual add reads two and writes one (2 x 3h), 20 bytes x h at 2 bytes
// per element. The model charged that region 80 bytes x h, ~4x those
// passes (torch.profiler over the Python peer's GPT step: LayerNorm 2.9 ms
// and the adds 1.7 ms of 86 ms, Intel Xeon 6/167, 2026-11-29), and with
// it the one-process GPT's steps came out right: the rest stands for what
// an eager training step pays per token beyond its kernels' passes (the
// allocator, dispatch, operands gone cold between kernels; `perf` put ~20 %
// of a dtrain GPT step's samples there). Until 2026-11-29 all 80 were
// divided by sequence parallelism, which predicted tp 2 with SP level with
// tp 2 (0 to -1.7 ms) where it measured 5-8 ms slower: SP halves the
// norms' passes, not the step's per-token rest. Now only the 20 are; the
// 60 stay with every token of the rank. (Six tables of
// bench/plan/compare.py, each model against the same runs: SP's gap to tp
// 2 predicted +2.6 to +5.0 ms for +4.5 to +7.6 measured; docs/planner.md,
// Session 21.)
// Tensor parallelism divides the GEMMs' parallel dimension and the heads;
// the norms and residual work divide only with sequence parallelism; context
// parallelism divides the tokens.

namespace {

struct Roofline {
  const DeviceSpec& device;
  double peak;
  double bytes_per_element;

  double gemm(double m, double k, double n, double batch = 1) const {
    const double flops = 2 * m * k * n * batch;
    const double bytes = bytes_per_element * (m * k + k * n + m * n) * batch;
    const double call = device.gemm_overhead > 0 ? device.gemm_overhead : device.kernel_overhead;
    return std::max(flops / (peak * device.gemm_efficiency), traffic(bytes, bytes)) + call;
  }
  // `bytes` moved by kernels whose largest one touches `working_set` bytes:
  // from the cache when that fits in it (its producer, the kernel before,
  // just wrote it there), else from memory.
  double traffic(double bytes, double working_set) const {
    const bool cached = device.cache_bytes > 0 && working_set <= static_cast<double>(device.cache_bytes);
    return bytes / (cached ? device.cache_bandwidth : device.memory_bandwidth);
  }
};

}  // namespace

PhaseTimes layer_times(const ModelSpec& m, const LayerShape& sh, const DeviceSpec& dev) {
  const double e = sh.bytes_per_element, t = sh.tp, cp = sh.cp;
  const double h = m.hidden, kv = m.kv_width(), f = m.ffn, s = m.seq, a = m.heads, d = m.head_dim();
  const double tokens = static_cast<double>(sh.micro_batch) * s / cp;  // on this rank
  const Roofline roof{dev, sh.peak_flops, e};
  const double attention_peak = sh.attention_flops > 0 ? sh.attention_flops : sh.peak_flops;
  const bool eager = m.kernels == Kernels::kEager;

  // GEMMs of the layer.
  const double up = m.gated_mlp ? 2 : 1;
  const double gemms = roof.gemm(tokens, h, (h + 2 * kv) / t) + roof.gemm(tokens, h / t, h) +
                       roof.gemm(tokens, h, up * f / t) + roof.gemm(tokens, f / t, h);
  // Attention core.
  double attn_fwd = 0, attn_bwd = 0;
  const double score_elements = static_cast<double>(sh.micro_batch) * (a / t) * (s / cp) * s;
  if (m.attention == Attention::kFlash) {
    const double flops = 0.5 * 4 * tokens * s * h / t;
    attn_fwd = flops / (attention_peak * dev.attention_efficiency) + dev.kernel_overhead;
    attn_bwd = 2.5 * attn_fwd;
  } else {
    const double batch = static_cast<double>(sh.micro_batch) * a / t;
    DeviceSpec core_device = dev;  // its own rate where one is known (a CPU's small-k products)
    if (dev.materialized_attention_efficiency > 0) core_device.gemm_efficiency = dev.materialized_attention_efficiency;
    const Roofline core_roof{core_device, attention_peak, e};
    const double core = core_roof.gemm(s / cp, d, s, batch) + core_roof.gemm(s / cp, s, d, batch);
    const double per_score = (4 + (m.dropout ? 5 : 0)) * e / 2;
    const double score_set = 2 * score_elements * e;  // softmax: scores in, probabilities out
    attn_fwd = core + roof.traffic(score_elements * per_score, score_set);
    attn_bwd = 2 * core + roof.traffic(score_elements * per_score * 1.5, score_set);
  }
  // Element-wise traffic per token, in bytes at 2 bytes per element (Note
  // [Element-wise passes]): the norms' and residuals' region (divided by
  // sequence parallelism), eager training's per-token rest (divided by
  // nothing), and the work split over tp.
  const double replicated = eager ? 20 * h : (m.dropout ? 22 : 20) * h;
  const double eager_rest = eager ? 60 * h : 0;
  const double split =
      eager ? 20 * (h + kv) + 4 * (h + 2 * kv) + (m.gated_mlp ? 10 : 8) * f : (m.gated_mlp ? 6 : 4) * f;
  const double replicated_tokens = sh.sequence_parallel ? tokens / t : tokens;
  const double ew_bytes = (replicated * replicated_tokens + eager_rest * tokens + split * tokens / t) * e / 2;
  const double kernels = (eager ? 45 : 15) * dev.kernel_overhead;
  // The largest element-wise kernel: a residual add (two inputs, one output
  // of tokens x h) or the MLP's activation function (tokens x ffn in and
  // out; gated, two halves in).
  const double ew_set = std::max(3 * replicated_tokens * h, (m.gated_mlp ? 3 : 2) * tokens * f / t) * e;
  // A calibrated host's own rate for them (Note [Element-wise passes on a
  // calibrated host] in calibration.cpp).
  const double ew_fwd = dev.elementwise_factor * (roof.traffic(ew_bytes, ew_set) + kernels);

  PhaseTimes r;
  r.forward = gemms + attn_fwd + ew_fwd;
  r.backward_input = gemms + attn_bwd + 2 * ew_fwd;
  r.backward_weight = gemms;
  const double tp_bytes = tokens * h * e;
  const double tp_one = all_reduce_seconds(tp_bytes, sh.tp, sh.tp_link);
  r.tp_forward = 2 * tp_one;
  r.tp_backward = 2 * tp_one;
  if (sh.tp > 1 && eager) {
    // Note [Tensor-parallel copies]
    // PyTorch-style operators (dtrain's tp_comm, eager kernels) on [batch,
    // sequence, hidden] activations copy around each collective: an
    // all-reduce reduces a clone of its input; sequence parallelism's
    // all-gather along the sequence concatenates the gathered pieces and its
    // reduce-scatter stacks its input's pieces, each a read and a write of
    // tokens x h. Per layer: 2 all-reduces each way without SP; with SP 2
    // all-gathers and 2 reduce-scatters forward, and backward 2
    // reduce-scatters and 4 all-gathers, since a column layer gathers its
    // input again for its weight gradient (it kept only its sequence part),
    // a collective more on the critical path (Megatron overlaps that one with
    // the input-gradient product; dtrain waits for it). Megatron's fused
    // kernels on [sequence, batch, hidden] need neither copy.
    const double copy = roof.traffic(2 * tp_bytes, 2 * tp_bytes) + dev.kernel_overhead;
    if (sh.sequence_parallel) {
      // The norms' gains (and biases) see 1/t of the sequence under SP, so
      // each one's gradient is all-reduced over tp as its backward ends, one
      // small (latency-bound) all-reduce per parameter (Megatron sums them
      // in one bucket after backward instead).
      const double norm_params = m.biases ? 4 : 2;
      r.tp_forward += 4 * copy;
      r.tp_backward += 6 * copy + 2 * gather_seconds(tp_bytes, sh.tp, sh.tp_link) +
                       norm_params * all_reduce_seconds(h * 4, sh.tp, sh.tp_link);
    } else {
      r.tp_forward += 2 * copy;
      r.tp_backward += 2 * copy;
    }
  }
  switch (sh.recompute) {
    case Recompute::kNone: break;
    case Recompute::kFull:
      r.recompute = r.forward;
      r.tp_recompute = r.tp_forward;
      break;
    case Recompute::kSelective: r.recompute = m.attention == Attention::kFlash ? 0.5 * gemms + ew_fwd : attn_fwd; break;
  }
  if (sh.cp > 1) {
    // Ring attention (dtrain::nn::cp, Note [Context-parallel ring]): each
    // rank's K and V pass the other cp - 1 ranks; in backward they pass
    // again with an fp32 accumulator of their gradients beside them, sent cp
    // times (the last send takes it home). Overlapped with the core where
    // communication overlaps, else all of it adds.
    const double kv_bytes = tokens * 2 * kv / t * e;
    const double ring = (cp - 1) * p2p_seconds(kv_bytes, sh.cp_link);
    const double ring_back = ring + cp * p2p_seconds(kv_bytes * 4 / e, sh.cp_link);
    r.cp_exposed =
        sh.overlap_comm ? std::max(0.0, ring - attn_fwd) + std::max(0.0, ring_back - attn_bwd) : ring + ring_back;
    // Note [Context-parallel merges]
    // The element-wise work around the blocks, in units of one of this
    // rank's q, k, v (qe, at the activations' width) and of its fp32
    // accumulator (qf); the rank whose every block merges into all of its
    // rows (the last) is the slowest. Forward: K and V stacked for the ring
    // (4 qe), the first block's output copied to fp32 (qe + qf), each further
    // block's online-softmax merge (rescale the accumulator, scale the block's
    // output, add: 5 qf + qe), and the result back to the activations' type
    // (qf + qe, none in fp32). Backward: zeroed dq and dK/dV accumulators
    // (3 qf), K and V stacked again (4 qe), each block's dq, dk and dv added
    // into them (3 (2 qf + qe)), and the casts back (3 (qf + qe), none in
    // fp32). About a dozen small ops per merge and per block's backward.
    const double qe = tokens * h / t * e, qf = tokens * h / t * 4;
    const double cast = e == 4 ? 0 : qf + qe;
    const double merge_fwd = 4 * qe + qe + qf + (cp - 1) * (5 * qf + qe) + cast;
    const double merge_bwd = 3 * qf + 4 * qe + cp * 3 * (2 * qf + qe) + 3 * cast;
    const double merge_set = 3 * qf;
    const double merges = roof.traffic(merge_fwd, merge_set) + 12 * (cp - 1) * dev.kernel_overhead;
    r.forward += merges;
    if (sh.recompute == Recompute::kFull) r.recompute += merges;
    r.backward_input += roof.traffic(merge_bwd, merge_set) + 12 * cp * dev.kernel_overhead;
  }
  const double fwd_flops = (2 * tokens * static_cast<double>(m.layer_matmul_params()) + 4 * tokens * s * h) / t;
  r.model_flops = 3 * fwd_flops;
  double redo = 0;
  if (sh.recompute == Recompute::kFull) redo = fwd_flops;
  if (sh.recompute == Recompute::kSelective)
    redo = m.attention == Attention::kFlash ? tokens * static_cast<double>(m.layer_matmul_params()) / t
                                            : 4 * tokens * s * h / t;
  r.hardware_flops = r.model_flops + redo;
  return r;
}

PhaseTimes output_times(const ModelSpec& m, const LayerShape& sh, const DeviceSpec& dev) {
  const double e = sh.bytes_per_element, t = sh.tp, h = m.hidden, v = m.vocab;
  const double tokens = static_cast<double>(sh.micro_batch) * m.seq / sh.cp;
  const Roofline roof{dev, sh.peak_flops, e};
  const bool eager = m.kernels == Kernels::kEager;
  const double gemm = roof.gemm(tokens, h, v / t);
  // Cross-entropy over the logits: Megatron's fused vocab-parallel kernel
  // reads them and keeps an fp32 softmax; eager casts to fp32, log-softmaxes
  // and casts the gradient back.
  const double logits = tokens * v / t;
  const double ce_set = 2 * logits * 4;  // fp32 logits in, (log-)softmax out
  const double ce_fwd = roof.traffic(logits * (eager ? 14 : 6), ce_set);
  const double ce_bwd = ce_fwd;
  const double norm = roof.traffic(tokens * h * (eager ? 34 : 4) * e / 2, 3 * tokens * h * e);
  PhaseTimes r;
  r.forward = gemm + ce_fwd + norm;
  r.backward_input = gemm + ce_bwd + 2 * norm;
  r.backward_weight = gemm;
  const double tp_one = all_reduce_seconds(tokens * h * e, sh.tp, sh.tp_link);
  r.tp_forward = sh.sequence_parallel ? tp_one : 0;
  r.tp_backward = tp_one;
  // The vocabulary-parallel cross-entropy's row maxima and sums (fp32, one
  // per token each) are all-reduced over tp in forward: small, mostly latency.
  r.tp_forward += 2 * all_reduce_seconds(tokens * 4, sh.tp, sh.tp_link);
  if (sh.tp > 1 && eager) {
    // As a layer's (Note [Tensor-parallel copies]): the final norm's output
    // gathered along the sequence (SP; its gradient reduce-scattered back),
    // or its gradient all-reduced from a clone; under SP the final norm's
    // parameters' gradients all-reduced one by one.
    const double copy = roof.traffic(2 * tokens * h * e, 2 * tokens * h * e) + dev.kernel_overhead;
    r.tp_forward += sh.sequence_parallel ? copy : 0;
    r.tp_backward +=
        copy + (sh.sequence_parallel ? (m.biases ? 2 : 1) * all_reduce_seconds(h * 4, sh.tp, sh.tp_link) : 0);
  }
  r.model_flops = r.hardware_flops = 3 * 2 * tokens * h * v / t;
  return r;
}

PhaseTimes embedding_times(const ModelSpec& m, const LayerShape& sh, const DeviceSpec& dev) {
  const double e = sh.bytes_per_element, h = m.hidden;
  const double tokens = static_cast<double>(sh.micro_batch) * m.seq / sh.cp;
  const Roofline roof{dev, sh.peak_flops, e};
  const double set = 3 * tokens * h * e;
  PhaseTimes r;
  r.forward = roof.traffic(tokens * h * 3 * e, set) + 2 * dev.kernel_overhead;
  r.backward_weight = roof.traffic(tokens * h * (e + 8), set) + 2 * dev.kernel_overhead;
  r.tp_forward = all_reduce_seconds(tokens * h * e, sh.tp, sh.tp_link);
  return r;
}

}  // namespace dtrain::plan::detail
