// The planner's cluster: one kind of accelerator, its links, and how many
// sit in a node. The table holds the devices `dtrain plan --device` knows;
// every figure is a data-sheet peak or an assumed achievable fraction of one,
// listed in docs/planner.md with its source.
//
//   auto d = dtrain::plan::find_device("a100-80gb");   // ConfigError lists the names
//   dtrain::plan::Cluster c{.device = d, .gpus = 1536, .gpus_per_node = 8};
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::plan {

// A link level for the alpha-beta model: a message of n bytes between two
// ranks takes latency + n / bandwidth; a ring collective over k ranks moves
// (k - 1) / k of the buffer per step through each rank's link.
struct Link {
  double bandwidth = 0;  // achievable bytes/s per GPU and direction (NCCL bus bandwidth)
  double latency = 0;    // seconds per hop
  // Seconds each collective or send pays once, whatever its hops: on a CPU
  // host whose ranks time-slice its cores, the wait for a peer switched out
  // (Note [Collectives after compute] in calibration.cpp). 0 elsewhere.
  double call_latency = 0;
};

struct DeviceSpec {
  std::string name;
  std::string description;
  std::int64_t memory_bytes = 0;  // what the framework may allocate
  double bf16_flops = 0;          // dense peak FLOP/s (also fp16)
  double fp8_flops = 0;           // dense peak; 0: none
  double fp32_flops = 0;          // dense peak without tensor cores' TF32
  double memory_bandwidth = 0;    // bytes/s
  // Achievable fraction of the peak on large GEMMs, and on attention kernels.
  double gemm_efficiency = 0.75;
  double attention_efficiency = 0.5;
  // The materialised attention core's products (k = head dim or sequence,
  // batched over heads) as a fraction of the peak; 0: gemm_efficiency. On a
  // CPU they reach ~35 % of the wide products' rate (measured by
  // `dtrain plan --calibrate`); a GPU's table entry leaves it 0.
  double materialized_attention_efficiency = 0;
  // Achievable fraction of the memory bandwidth for streaming kernels.
  double memory_efficiency = 0.8;
  Link intra_node;  // NVLink / shared memory
  Link inter_node;  // InfiniBand / RoCE / TCP, per GPU
  int gpus_per_node = 8;
  double kernel_overhead = 5e-6;  // seconds per kernel launch a layer pays
  // Seconds a GEMM call pays beyond its FLOPs (0: kernel_overhead). A CPU's
  // oneDNN product costs ~10 us per call (its primitive lookup and operand
  // setup), ten times an element-wise op; `dtrain plan --calibrate` fits it.
  double gemm_overhead = 0;
  // Cores a node's ranks share (CPU hosts); 0: each rank has its own device.
  // When a node holds more ranks than this, each rank's FLOP/s and memory
  // bandwidth are the device's x compute_units / ranks on the node.
  int compute_units = 0;
  // A CPU host's ranks time-slice its cores when a node holds more ranks
  // than compute_units: each rank's CPU time for the same work rises (its
  // caches and predictors refilled after another rank ran on its core), on
  // top of the cores being shared. This factor (>= 1) is that rise, measured
  // by `dtrain plan --calibrate` (a fixed mix of training's kernels, per-rank
  // CPU time with more ranks than cores over the same with no more); the
  // cost model multiplies such a plan's compute and overheads by it. 1: none
  // (GPUs, an uncalibrated host).
  double oversubscription_factor = 1.0;
  // A CPU host's ranks computing at once share its last-level cache and
  // memory (and, on a virtual machine, whatever the host's other guests
  // leave): each rank's CPU time for the same work is higher with every core
  // busy than with the host to itself. This factor (>= 1) is that rise,
  // measured by `dtrain plan --calibrate` (the same mix of training's
  // kernels, each rank's CPU time with all ranks of a run with no more ranks
  // than cores computing at once over rank 0's alone); the cost model
  // multiplies the compute and overheads of a plan with two or more ranks on
  // a host by it (one process runs alone). 1: none (GPUs, an uncalibrated
  // host).
  double concurrency_factor = 1.0;
  // The node's link when it holds more ranks than compute_units (a CPU
  // host's collectives then wait for peers switched out of a core: the
  // calibration measured a 16 KiB all-reduce over 4 ranks on 2 cores ~7x
  // its time over 2, where the ring formula says 3x); fitted by
  // `dtrain plan --calibrate` from its runs with more ranks than cores.
  // Bandwidth 0: none measured, intra_node serves.
  Link oversubscribed_link;
  // Seconds a step costs a CPU host's time-sliced ranks (more on a node than
  // compute_units) each time they all meet after a step's compute: the ranks
  // arrive as their share of the cores let them, and once some wait, the
  // cores do not stay full (Note [Meetings of time-sliced ranks] in
  // calibration.cpp). Measured by `dtrain plan --calibrate` (lockstep against
  // free-running rounds of one piece of training); the cost model charges it
  // once per step of a plan whose ranks time-slice. 0: none (GPUs, a run
  // with a core per rank, an uncalibrated host).
  double oversubscribed_meeting = 0;
  // The same for ranks that each have a core (no more on a node than
  // compute_units, two or more): they drift apart over a step's compute (a
  // virtual CPU's jitter, the host's other guests), so where they meet the
  // first waits for the last; measured as oversubscribed_meeting is, less
  // the `call_latency` the collective there already pays (Note [Meetings of
  // time-sliced ranks]). 0: none (GPUs, an uncalibrated host).
  double meeting = 0;
  // Seconds each collective issued ahead of compute and waited for after it
  // (ZeRO-3's prefetched gathers, its reduce-scatters beside the rest of
  // backward) adds to a step of a CPU host's time-sliced ranks beyond its
  // transport's work: a peer behind by more than the piece between issue and
  // wait holds the waiter, and the wake-ups cost the cores (Note [Collectives
  // issued ahead on time-sliced ranks] in cost_model.cpp). Measured by
  // `dtrain plan --calibrate` (rounds of compute with a 16 KiB all_gather
  // issued before each piece against the same compute alone); 0: none
  // (GPUs, a run with a core per rank, an uncalibrated host).
  double oversubscribed_ahead_latency = 0;
  // Seconds the pipeline executor's split backward (ZB's I and W, Note
  // [Weight backward from captured gradients] in split_backward.h) costs
  // beyond the same backward run whole, per node whose output gradient it
  // captures, per micro-batch: W runs the autograd engine once from each such
  // node over the retained graph. Measured by `dtrain plan --calibrate` (Note
  // [Split backward cost] in calibration.cpp: 36-43 us per node here, the
  // split stage alone, on a stage of two GPT example layers); 0: none (the
  // GPU entries, whose host work runs ahead of the device's kernels; an
  // uncalibrated host).
  double split_backward_overhead = 0;
  // Multiplies a layer's element-wise passes (norms, activations, residual
  // adds and eager training's per-token rest, Note [Element-wise passes])
  // on this device: what a GPT-example layer's forward and backward (per
  // layer of a stack of 4) measured by `dtrain plan --calibrate`, less its
  // modelled products and attention, over those passes as the roofline
  // counts them (Note
  // [Element-wise passes on a calibrated host] in calibration.cpp). 1: the
  // count as it is (the built-in entries, an uncalibrated host).
  double elementwise_factor = 1;
  // A CPU host's last-level cache (0: none modelled, as for the GPUs, whose
  // activations stream from HBM): an element-wise kernel whose operands fit
  // in a rank's share of `cache_bytes` streams at `cache_bandwidth`, not at
  // memory_bandwidth (Note [Layer time]). The GPT example's activations on
  // this CPU (0.4-3 MiB per tensor) fit in its 32 MiB L3, where an add
  // streams ~3x faster than from DRAM; `dtrain plan --calibrate` measures both.
  std::int64_t cache_bytes = 0;
  double cache_bandwidth = 0;  // bytes/s per rank
  // Bytes/s at which the optimizer phase moves its 40 bytes per local fp32
  // parameter (AdamW's 28 and clipping's 12, Note [Optimizer phase] in
  // cost_model.cpp), as a training step finds them after its backward:
  // measured by `dtrain plan --calibrate` (clipping and fused AdamW over a
  // GPT-sized stack of layers, after its forward and backward). 0: the
  // state streams at memory_bandwidth (the built-in entries, an
  // uncalibrated host).
  double optimizer_bandwidth = 0;
};

// The built-in table: a100-40gb, a100-80gb, h100-80gb, h100-96gb, h200,
// b200, cpu-here (this host's cores and memory, from /proc, and assumed
// rates; `dtrain plan --calibrate` measures them, calibration.h).
const std::vector<DeviceSpec>& device_table();
// ConfigError naming the known devices when `name` is not one.
DeviceSpec find_device(const std::string& name);

struct Cluster {
  DeviceSpec device;
  int gpus = 1;
  int gpus_per_node = 8;
  // Which link a group of `size` ranks, `stride` ranks apart in the world's
  // row-major order, crosses: the node's when all its members share a node.
  const Link& link(int size, int stride) const;
};

}  // namespace dtrain::plan
