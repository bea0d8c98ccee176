// Calibration fits and device files (calibration.h).
#include "dtrain/plan/calibration.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "dtrain/error.h"
#include "dtrain/plan/cost_model.h"
#include "layer_cost.h"

namespace dtrain::plan {

Link fit_ring_link(const std::vector<CollectiveSample>& samples) {
  // t = alpha x L + (1 / beta) x B, with L and B the ring's latency and byte
  // coefficients; weighted by 1 / t, the normal equations of a 2 x 2 system.
  double ll = 0, lb = 0, bb = 0, lt = 0, bt = 0;
  std::set<double> sizes;
  for (const auto& s : samples) {
    DTRAIN_CHECK(s.ranks >= 2 && s.seconds > 0 && s.bytes > 0, ConfigError,
                 "a calibration sample of " << s.op << " has " << s.ranks << " ranks, " << s.bytes << " bytes, "
                                            << s.seconds << " s.",
                 "time collectives of two or more ranks");
    const double k = s.ranks;
    const double factor = s.op == "all_reduce" ? 2 : 1;
    DTRAIN_CHECK(s.op == "all_reduce" || s.op == "all_gather" || s.op == "reduce_scatter", ConfigError,
                 "unknown collective '" << s.op << "' in a calibration sample.",
                 "use all_reduce, all_gather or reduce_scatter");
    const double w = 1 / s.seconds;
    const double l = factor * (k - 1) * w, b = factor * (k - 1) / k * s.bytes * w, t = s.seconds * w;
    ll += l * l;
    lb += l * b;
    bb += b * b;
    lt += l * t;
    bt += b * t;
    sizes.insert(s.bytes);
  }
  DTRAIN_CHECK(sizes.size() >= 2, ConfigError,
               "an alpha-beta fit needs two message sizes or more, not " << sizes.size() << ".",
               "time each collective at a small and a large size");
  const double det = ll * bb - lb * lb;
  const double alpha = (lt * bb - bt * lb) / det, inv_beta = (ll * bt - lb * lt) / det;
  DTRAIN_CHECK(std::isfinite(alpha) && std::isfinite(inv_beta) && alpha > 0 && inv_beta > 0, ConfigError,
               "the collectives' times do not fit latency + bytes / bandwidth (alpha " << alpha << " s, 1/beta "
                                                                                       << inv_beta << " s/B).",
               "calibrate again on a quieter machine, or with larger messages");
  return {.bandwidth = 1 / inv_beta, .latency = alpha};
}

// Note [Collectives after compute]
// Collectives that follow compute, as in training, against the same compute
// without them, on every rank at once. The synchronised samples (every rank
// entering together after a barrier) give the link's alpha and beta but
// leave out the wait for a peer that is not there yet: asleep, or, with more
// ranks than cores, switched out by time slicing; on 2 cores the 4-rank
// plans measured 15-40 % slower than predicted from them, HSDP (the most
// collectives per step) the most. That wait comes once per collective
// whatever its hops (a 2-rank gather among 4 time-sliced ranks waits as a
// 4-rank all-reduce does), so it is the link's `call_latency`: the seconds a
// collective after compute adds to the step, less what the synchronised link
// charges for it. What the calibration worker measures as "added"
// (calibrate_worker.cpp, collectives_after_compute) depends on the regime:
//  - a core per rank: per collective, the time from the last rank's start
//    of the compute before it to the last rank's return, less the ranks'
//    mean compute (their skew, the collective and its wake-ups), the median
//    over the run's collectives (`collective_seconds`). A waiting rank's core idles,
//    so that is the step's added wall; the median leaves out a vCPU's rare
//    stalls, which a sum over rounds does not: that sum (the time-sliced
//    measure below) read 9 to 666 us less the synchronised cost on an Intel
//    Xeon 6/167 VM in seven calibrations within minutes, the median 27-180
//    us in five (2026-11-28), and the GPT's 2-rank plans lose ~0.1 ms of
//    wall beyond their CPU time per collective.
//  - more ranks than cores: the whole run's wall time with the collectives
//    beyond the same compute's without, per collective (`wall_seconds`,
//    `compute_wall_seconds`). A waiting rank's core then runs a peer, so most
//    of a wait is not added; the per-collective measure (2.5-4 ms for 4 ranks
//    on 2 cores) would count it.
double collective_added_seconds(const AfterComputeRun& run, int cores) {
  DTRAIN_CHECK(run.ranks >= 2 && cores >= 1, ConfigError,
               "collectives after compute need 2+ ranks on 1+ cores (got " << run.ranks << " on " << cores << ").",
               "time them on a run of two or more processes");
  if (run.ranks <= cores) return run.collective_seconds;
  DTRAIN_CHECK(
      run.collectives >= 1, ConfigError,
      "a time-sliced run's collectives after compute need 1+ collectives per round (got " << run.collectives << ").",
      "rerun the calibration");
  return (run.wall_seconds - run.compute_wall_seconds) / run.collectives;
}

double collectives_after_compute_latency(int ranks, double seconds_per_collective, double bytes,
                                         const Link& synchronised) {
  DTRAIN_CHECK(ranks >= 2 && synchronised.bandwidth > 0, ConfigError,
               "collectives after compute need 2+ ranks and a fitted link (got " << ranks << ", "
                                                                                 << synchronised.bandwidth << " B/s).",
               "time them on a run of two or more processes");
  const double k = ranks;
  const double ring = 2 * (k - 1) * synchronised.latency + 2 * (k - 1) / k * bytes / synchronised.bandwidth;
  return std::max(0.0, seconds_per_collective - ring);
}

double optimizer_bandwidth(std::int64_t params, double seconds) {
  DTRAIN_CHECK(
      params > 0 && seconds > 0, ConfigError,
      "the optimizer phase's calibration needs parameters and a time (got " << params << ", " << seconds << " s).",
      "calibrate again");
  return kOptimizerBytesPerParam * static_cast<double>(params) / seconds;
}

double collectives_ahead_latency(const AfterComputeRun& run, const Link& sliced) {
  DTRAIN_CHECK(run.ranks >= 2 && run.ahead_collectives >= 1 && sliced.bandwidth > 0, ConfigError,
               "collectives issued ahead need 2+ ranks, 1+ collectives a round and a fitted link (got "
                   << run.ranks << ", " << run.ahead_collectives << ", " << sliced.bandwidth << " B/s).",
               "rerun the calibration with more ranks than cores");
  const double k = run.ranks;
  const double added = (run.ahead_wall_seconds - run.compute_wall_seconds) / run.ahead_collectives;
  return std::max(0.0, added - (k - 1) / k * run.ahead_bytes / sliced.bandwidth);
}

// Note [Split backward cost]
// The pipeline executor's split backward (ZB's I and W; Note [Weight
// backward from captured gradients] in split_backward.h) costs more than the
// same backward run whole (B): I walks the stage's graph to find the nodes
// whose output gradient W needs and hooks them (~0.03 ms per micro-batch
// here), and W runs the autograd engine once per such node over the
// retained graph (a graph task, the graph's dependencies counted again):
// ~0.04 ms each beyond the weight gradient's own products. Measured with
// bench_pipeline on one process (two stages of two GPT example layers and
// the output; 4 micro-batches of 6 sequences; 2026-11-25): the second
// stage's I + W 4.67-4.69 ms against B 4.08-4.14 per micro-batch (+14 %),
// its 14 captured nodes ~40 us each; ZB's F and its first stage's W (the
// whole backward) 2-4 % slower than the interleaved schedule's F and B (ZB
// holds twice the activations). On 2 ranks the second stage's I + W was
// 0.84 ms above its B (60 us per node). The calibration times, on rank 0
// alone (calibrate_worker.cpp: a pipeline of one rank), the second stage's
// I + W against its B from the executor's trace, each action in thread CPU
// time: ZB's slower forwards and first-stage W (its larger working set, not
// a cost per node) stay out, and so does concurrency, which the cost model
// applies through concurrency_factor. (Session 14's first version timed a
// whole ZB step against an interleaved one with every rank computing: 21-93
// us per node, the working set and concurrency counted in.) The excess per
// captured node (the executor's own count) is charged to each W of a stage
// with an input path (cost_model.cpp).
// Note [Concurrency of pipeline stages]
// DeviceSpec::concurrency_factor, a rank's time for the same work with every
// core running a rank over with the host to itself, was measured on a piece
// of four MLP blocks in thread CPU time (1.015-1.03 on quiet runs) while the
// GPT example's pipeline stages took 5-10 % longer per action with two ranks
// computing at once than the same layers alone (traces of 1F1B, p = 2). The
// calibration now measures it on what the stages run: a pipeline of GPT
// example layers (attention, norms, the MLP; calibrate_worker.cpp), an
// interleaved step in thread CPU time, rank 0 alone against every rank at
// once, the same steps in both (before session 14's fix the "together"
// phase alternated them with ZB steps; 1.00-1.12
// over session 14's calibrations; timed in wall time per traced action it
// read 2.2 while other sessions' work ran); the MLP piece stays the
// fallback and the time-slicing measure.
// Note [Meetings of time-sliced ranks]
// With more ranks on a CPU host than cores, every point where all of a
// plan's ranks must meet after a step's compute costs more than the
// collective there: the ranks arrive as their share of the cores let them,
// and while the first wait (asleep), the cores do not stay full until the
// last arrives; after the meeting, all wake at once and the scheduler
// spreads them again. The collectives' `call_latency` (Note [Collectives
// after compute]) is measured after ~2 ms pieces of compute, where the ranks
// barely drift apart; a step's compute is tens of ms. bench_pipeline's GPT
// on 4 ranks of 2 cores (AMD EPYC 25/17, 2026-12-03; 3 rounds each):
// independent runs 57 ms a step (batch 6), the same 4 ranks with one barrier
// per step (--data-parallel lockstep) 62.5-63.6 ms, i.e. 5-8 ms a meeting at
// batch 2, 6 and 12 (25-110 ms steps), where the synchronised barrier is
// ~0.1 ms; DDP added 4.4 ms more, what the model charges its gradient sync
// (3.4 ms). The calibration worker (meeting_seconds) times a piece of ~26 ms
// wall per iteration in rounds with a barrier after each iteration against
// rounds with one at the end, in turn; per barrier the difference, the
// median over rounds. `dtrain plan --calibrate` takes it from the runs with
// more ranks than cores (DeviceSpec::oversubscribed_meeting); the cost model
// charges it once per step to a plan whose ranks time-slice (every such
// plan's ranks meet at least once a step: the gradients' reduction, a
// pipeline's flush, tp's and cp's collectives).
// Ranks that each have a core meet at a cost too, smaller: they drift apart
// over a step's compute by a virtual CPU's jitter. On the Intel Xeon 6/167
// VM (2026-12-04) the 2-rank measure read 0.55-1.5 ms in two runs of 9
// rounds and 1.5-1.9 in two of 21, against a call_latency of 0-0.24 ms
// after 2 ms pieces, and examples/gpt's DDP on 2
// ranks stepped 2.9 ms slower than two independent processes at its batch
// (33.2-33.8 against 30.4-30.7 ms, four rounds in turn) where the model
// charged its gradients' sync 1.7. So the runs with a core per rank time it
// too (21 rounds: the measure is small against their noise), and the cost
// model charges it, less that call_latency (DeviceSpec::meeting), once per
// step to a plan of two or more such ranks.
double split_backward_overhead(double whole_seconds, double split_seconds, int captured) {
  // The worker asserts the executor's count itself: none here is dtrain's bug.
  DTRAIN_INTERNAL_ASSERT(captured >= 1, "the split backward's calibration counted " << captured << " captured nodes");
  DTRAIN_CHECK(
      whole_seconds > 0 && split_seconds > 0, ConfigError,
      "the split backward's calibration needs both times (got " << whole_seconds << " s, " << split_seconds << " s).",
      "calibrate again");
  return std::max(0.0, split_seconds - whole_seconds) / captured;
}

// Note [Element-wise passes on a calibrated host]
// The roofline counts a layer's element-wise passes in bytes and streams
// them at the calibrated cache bandwidth (a 3 MiB add), with eager
// training's per-token rest on top (Note [Element-wise passes] in
// layer_cost.cpp, fitted on the Intel 6/167 VM of session 21, 2026-11-29).
// How fast a host runs the real kernels at the real shapes against that
// add differs: on another VM of the same CPU model (2026-12-04, fp32
// products calibrated at 198 GFLOP/s, the add at 32 GB/s) one GPT layer's
// forward and backward (Python's torch, the same ATen kernels) measured
// 3.9, 7.7 and 14.3 ms at 6, 12 and 24 sequences where the model put 4.5,
// 8.9 and 17.7, and the GPT's norms, GELU, residual adds and head reshapes
// alone (with autograd, the products and attention left out) took 0.98,
// 1.6 and 3.6 ms against the model's 1.6, 3.2 and 6.2 for its passes; the
// one-process GPT was predicted 20 % slow in every table. With the factor
// (0.39-0.45 there) it came out -4.7 to -5.1 %, every plan of three tables
// within 15 % (docs/planner.md, Session 30). So the calibration runs the
// GPT example's layers as it does (calibrate_worker.cpp: a stack of 4, so
// that a layer's backward finds its operands as cold as in training;
// dtrain::nn::linear's products, dtrain::nn::causal_attention) and the
// factor on the passes is what makes the model's layer take that time per
// layer: (measured - the model's layer without passes) / its passes. What
// the products' in-training rate misses from their calibrated one (cold
// operands) falls into the factor too, so the layer's total is right at the
// calibrated micro-batch (12 sequences, between the one-process GPT's 24
// and the pipelines' 6).
double calibration_layer_seconds(const DeviceSpec& device, Attention attention, std::int64_t micro_batch) {
  // calibrate_worker.cpp's CalibrationLayer (the vocabulary is no part of a layer).
  ModelSpec layer =
      ModelSpec::parse("gpt:layers=1,hidden=128,heads=4,ffn=512,seq=64,vocab=64,kernels=eager,dropout=0,bias=0");
  layer.attention = attention;
  const detail::LayerShape shape{
      .micro_batch = micro_batch, .bytes_per_element = 4, .peak_flops = device.fp32_flops, .overlap_comm = false};
  const detail::PhaseTimes t = detail::layer_times(layer, shape, device);
  return t.forward + t.backward_input + t.backward_weight;
}

double elementwise_factor(const DeviceSpec& device, Attention attention, std::int64_t micro_batch,
                          double measured_seconds) {
  if (!(measured_seconds > 0)) return 1.0;
  DeviceSpec d = device;
  d.elementwise_factor = 0.0;
  const double without = calibration_layer_seconds(d, attention, micro_batch);
  d.elementwise_factor = 1.0;
  const double passes = calibration_layer_seconds(d, attention, micro_batch) - without;
  DTRAIN_INTERNAL_ASSERT(passes > 0, "the calibration layer's element-wise passes cost " << passes << " s");
  return std::clamp((measured_seconds - without) / passes, 0.25, 4.0);
}

namespace {

nlohmann::json link_json(const Link& l) {
  return {{"bandwidth", l.bandwidth}, {"latency", l.latency}, {"call_latency", l.call_latency}};
}

Link link_from(const nlohmann::json& j) {
  return {.bandwidth = j.at("bandwidth").get<double>(),
          .latency = j.at("latency").get<double>(),
          .call_latency = j.value("call_latency", 0.0)};  // older files: none
}

}  // namespace

std::string device_to_json(const DeviceSpec& d) {
  nlohmann::json j{{"name", d.name},
                   {"description", d.description},
                   {"memory_bytes", d.memory_bytes},
                   {"bf16_flops", d.bf16_flops},
                   {"fp8_flops", d.fp8_flops},
                   {"fp32_flops", d.fp32_flops},
                   {"memory_bandwidth", d.memory_bandwidth},
                   {"gemm_efficiency", d.gemm_efficiency},
                   {"attention_efficiency", d.attention_efficiency},
                   {"memory_efficiency", d.memory_efficiency},
                   {"intra_node", link_json(d.intra_node)},
                   {"inter_node", link_json(d.inter_node)},
                   {"gpus_per_node", d.gpus_per_node},
                   {"kernel_overhead", d.kernel_overhead},
                   {"compute_units", d.compute_units},
                   {"gemm_overhead", d.gemm_overhead},
                   {"materialized_attention_efficiency", d.materialized_attention_efficiency},
                   {"cache_bytes", d.cache_bytes},
                   {"cache_bandwidth", d.cache_bandwidth},
                   {"oversubscription_factor", d.oversubscription_factor},
                   {"concurrency_factor", d.concurrency_factor},
                   {"oversubscribed_link", link_json(d.oversubscribed_link)},
                   {"oversubscribed_meeting", d.oversubscribed_meeting},
                   {"meeting", d.meeting},
                   {"oversubscribed_ahead_latency", d.oversubscribed_ahead_latency},
                   {"optimizer_bandwidth", d.optimizer_bandwidth},
                   {"elementwise_factor", d.elementwise_factor},
                   {"split_backward_overhead", d.split_backward_overhead}};
  return j.dump(2);
}

DeviceSpec device_from_json(const std::string& text) {
  DeviceSpec d;
  const auto j = nlohmann::json::parse(text);  // nlohmann's parse_error names the offset
  d.name = j.at("name").get<std::string>();
  d.description = j.value("description", "");
  d.memory_bytes = j.at("memory_bytes").get<std::int64_t>();
  d.bf16_flops = j.at("bf16_flops").get<double>();
  d.fp8_flops = j.value("fp8_flops", 0.0);
  d.fp32_flops = j.at("fp32_flops").get<double>();
  d.memory_bandwidth = j.at("memory_bandwidth").get<double>();
  d.gemm_efficiency = j.value("gemm_efficiency", d.gemm_efficiency);
  d.attention_efficiency = j.value("attention_efficiency", d.attention_efficiency);
  d.memory_efficiency = j.value("memory_efficiency", d.memory_efficiency);
  d.intra_node = link_from(j.at("intra_node"));
  d.inter_node = link_from(j.at("inter_node"));
  d.gpus_per_node = j.at("gpus_per_node").get<int>();
  d.kernel_overhead = j.value("kernel_overhead", d.kernel_overhead);
  d.compute_units = j.value("compute_units", 0);
  d.gemm_overhead = j.value("gemm_overhead", 0.0);
  d.materialized_attention_efficiency = j.value("materialized_attention_efficiency", 0.0);
  d.cache_bytes = j.value("cache_bytes", std::int64_t{0});  // older files: no cache modelled
  d.cache_bandwidth = j.value("cache_bandwidth", 0.0);
  d.oversubscription_factor = j.value("oversubscription_factor", 1.0);            // older files: not measured
  d.concurrency_factor = j.value("concurrency_factor", 1.0);                      // older files: not measured
  d.split_backward_overhead = j.value("split_backward_overhead", 0.0);            // older files: not measured
  d.oversubscribed_meeting = j.value("oversubscribed_meeting", 0.0);              // older files: not measured
  d.meeting = j.value("meeting", 0.0);                                            // older files: not measured
  d.elementwise_factor = j.value("elementwise_factor", 1.0);                      // older files: not measured
  d.oversubscribed_ahead_latency = j.value("oversubscribed_ahead_latency", 0.0);  // older files: not measured
  d.optimizer_bandwidth = j.value("optimizer_bandwidth", 0.0);                    // older files: not measured
  if (j.contains("oversubscribed_link")) d.oversubscribed_link = link_from(j.at("oversubscribed_link"));
  return d;
}

void write_device_file(const std::string& path, const DeviceSpec& device) {
  std::ofstream out(path);
  out << device_to_json(device) << "\n";
  DTRAIN_CHECK(out.good(), ConfigError, "cannot write the device file " << path << ".",
               "check the folder exists and is writable");
}

DeviceSpec read_device_file(const std::string& path) {
  std::ifstream in(path);
  DTRAIN_CHECK(in.good(), ConfigError, "cannot read the device file " << path << ".",
               "run `dtrain plan --calibrate --device-file " << path << "` first, or check the path");
  std::stringstream text;
  text << in.rdbuf();
  try {
    return device_from_json(text.str());
  } catch (const nlohmann::json::exception& e) {
    DTRAIN_CHECK(false, ConfigError, "the device file " << path << " is not a device entry: " << e.what() << ".",
                 "write it with `dtrain plan --calibrate`, or give every field device_table.h lists");
  }
}

}  // namespace dtrain::plan
