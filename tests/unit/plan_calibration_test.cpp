// The calibration's pieces without running a calibration: the alpha-beta fit
// recovers the latency and bandwidth that generated ring-collective times
// (exactly, and within 5 % under +-10 % noise), refuses samples of one size;
// a device entry survives its file; the cost model divides a host's cores
// and memory among the ranks it holds; fp8 plans run their GEMMs at the fp8
// rate. The memory pre-flight refuses a plan over its limit with the bytes
// it needs, the excess and the nearest plan that fits.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "dtrain/error.h"
#include "dtrain/plan/calibration.h"
#include "dtrain/plan/cost_model.h"
#include "dtrain/plan/preflight.h"

namespace dtrain::plan {
namespace {

double calibration_ring_time(const std::string& op, int k, double bytes, const Link& l) {
  const double f = op == "all_reduce" ? 2 : 1;
  return f * (k - 1) * l.latency + f * (k - 1) / k * bytes / l.bandwidth;
}

std::vector<CollectiveSample> calibration_samples(const Link& link, double noise, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> jitter(1 - noise, 1 + noise);
  std::vector<CollectiveSample> out;
  for (const char* op : {"all_reduce", "all_gather"})
    for (int k : {2, 4})
      for (double bytes : {16e3, 256e3, 4e6})
        out.push_back({.op = op,
                       .ranks = k,
                       .bytes = bytes,
                       .seconds = calibration_ring_time(op, k, bytes, link) * (noise > 0 ? jitter(gen) : 1.0)});
  return out;
}

// This project's 2-core CPU host (cpu-here with 2 cores, 8 GiB and a
// shared-memory link of 6 GB/s and 60 us) and the bench GPT's shape.
DeviceSpec two_core_host() {
  DeviceSpec d = find_device("cpu-here");
  d.compute_units = 2;
  d.memory_bytes = 8LL << 30;
  d.intra_node = {.bandwidth = 6e9, .latency = 60e-6};
  return d;
}
ModelSpec bench_gpt_model() {
  return ModelSpec::parse(
      "gpt:layers=4,hidden=128,heads=4,seq=64,vocab=84,attention=flash,kernels=eager,dropout=0,bias=0");
}

TEST(PlanCalibration, FitRecoversTheLinkThatMadeTheTimes) {
  const Link truth{.bandwidth = 1.5e9, .latency = 120e-6};
  const Link exact = fit_ring_link(calibration_samples(truth, 0, 0));
  EXPECT_NEAR(exact.bandwidth / truth.bandwidth, 1, 1e-9);
  EXPECT_NEAR(exact.latency / truth.latency, 1, 1e-9);
  const Link noisy = fit_ring_link(calibration_samples(truth, 0.1, 7));
  EXPECT_NEAR(noisy.bandwidth / truth.bandwidth, 1, 0.05);
  EXPECT_NEAR(noisy.latency / truth.latency, 1, 0.05);
}

TEST(PlanCalibration, FitRefusesOneMessageSize) {
  std::vector<CollectiveSample> one{{.op = "all_reduce", .ranks = 2, .bytes = 1e6, .seconds = 1e-3},
                                    {.op = "all_reduce", .ranks = 4, .bytes = 1e6, .seconds = 2e-3}};
  EXPECT_THROW(fit_ring_link(one), ConfigError);
}

// Note [Collectives after compute]: what a collective after compute added,
// less what the synchronised link charges for it.
TEST(PlanCalibration, CollectivesAfterComputePayWhatTheSynchronisedLinkDoesNotCharge) {
  const Link sync{.bandwidth = 4e9, .latency = 60e-6};
  const double bytes = 16 << 10;
  // 4 ranks: each all-reduce its synchronised ring (6 hops) and 500 us more.
  const double ring4 = 6 * sync.latency + 1.5 * bytes / sync.bandwidth;
  EXPECT_NEAR(collectives_after_compute_latency(4, ring4 + 500e-6, bytes, sync), 500e-6, 1e-12);
  // 2 ranks: 2 hops each, 30 us more.
  const double ring2 = 2 * sync.latency + bytes / sync.bandwidth;
  EXPECT_NEAR(collectives_after_compute_latency(2, ring2 + 30e-6, bytes, sync), 30e-6, 1e-12);
  // Less than the ring (noise): no wait, never a negative one.
  EXPECT_EQ(collectives_after_compute_latency(4, ring4 / 2, bytes, sync), 0);
  EXPECT_THROW(collectives_after_compute_latency(1, 1e-3, bytes, sync), ConfigError);
}

// Note [Optimizer phase] (cost_model.cpp): kOptimizerBytesPerParam per local
// parameter at the calibrated optimizer rate where there is one, else at the
// memory's; a host's ranks share it as they share the memory's.
TEST(PlanCalibration, OptimizerPhaseAtItsCalibratedRate) {
  EXPECT_DOUBLE_EQ(optimizer_bandwidth(800'000, 1e-3), 40 * 800'000 / 1e-3);
  EXPECT_THROW(optimizer_bandwidth(0, 1e-3), ConfigError);
  EXPECT_THROW(optimizer_bandwidth(800'000, 0), ConfigError);
  DeviceSpec d = find_device("cpu-here");
  d.compute_units = 2;
  d.memory_bandwidth = 16e9;
  const auto model = ModelSpec::parse("gpt:layers=4,hidden=128,heads=4,seq=64,vocab=65");
  auto optimizer = [&](const DeviceSpec& dev, ParallelPlan p, int ranks) {
    p.precision = "fp32";
    return estimate(p, model, {.device = dev, .gpus = ranks, .gpus_per_node = 8}).time.optimizer;
  };
  const double params = static_cast<double>(model.params());
  const ParallelPlan single{.global_batch = 24}, ddp4{.dp_replicate = 4, .global_batch = 24},
      zero2{.dp_shard = 2, .zero_stage = 2, .global_batch = 24};
  EXPECT_NEAR(optimizer(d, single, 1), 40 * params / 16e9, 1e-12);
  DeviceSpec fast = d;
  fast.optimizer_bandwidth = 40e9;
  EXPECT_NEAR(optimizer(fast, single, 1), 40 * params / 40e9, 1e-12);
  EXPECT_NEAR(optimizer(fast, zero2, 2), 40 * params / 2 / 40e9, 1e-12);  // its shard's
  // 4 ranks on 2 cores: half the rate each, as the memory's.
  EXPECT_NEAR(optimizer(fast, ddp4, 4) / optimizer(fast, single, 1), 2, 1e-9);
  EXPECT_NEAR(optimizer(d, ddp4, 4) / optimizer(d, single, 1), 2, 1e-9);
}

// Note [Collectives issued ahead on time-sliced ranks] (cost_model.cpp): per
// all_gather issued ahead of compute, the rounds' wall beyond the compute
// alone, less the time-sliced link's work for its bytes.
TEST(PlanCalibration, CollectivesIssuedAheadPayWhatTheirWorkDoesNot) {
  const Link sliced{.bandwidth = 3e9, .latency = 50e-6, .call_latency = 700e-6};
  const double bytes = 16 << 10, work = 0.75 * bytes / sliced.bandwidth;  // 4 ranks
  const AfterComputeRun run{.ranks = 4,
                            .compute_wall_seconds = 0.035,
                            .bytes = 4 * bytes,  // the after-compute all-reduce's: not these
                            .ahead_wall_seconds = 0.035 + 8 * (work + 400e-6),
                            .ahead_collectives = 8,
                            .ahead_bytes = bytes};
  EXPECT_NEAR(collectives_ahead_latency(run, sliced), 400e-6, 1e-12);
  // Faster than the compute alone (noise): nothing added, never less.
  AfterComputeRun quick = run;
  quick.ahead_wall_seconds = 0.034;
  EXPECT_EQ(collectives_ahead_latency(quick, sliced), 0);
  AfterComputeRun none = run;
  none.ahead_collectives = 0;
  EXPECT_THROW(collectives_ahead_latency(none, sliced), ConfigError);
  EXPECT_THROW(collectives_ahead_latency(run, Link{}), ConfigError);
}

// Note [Collectives after compute]: with a core per rank the clocks' median
// collective, with more ranks than cores the rounds' wall difference.
TEST(PlanCalibration, CollectiveAddedSecondsTakesTheMeasureOfItsRegime) {
  const AfterComputeRun run{.ranks = 2,
                            .collective_seconds = 150e-6,
                            .wall_seconds = 0.05 + 7 * 600e-6,
                            .compute_wall_seconds = 0.05,
                            .collectives = 7,
                            .bytes = 16 << 10};
  EXPECT_DOUBLE_EQ(collective_added_seconds(run, 2), 150e-6);
  EXPECT_DOUBLE_EQ(collective_added_seconds(run, 4), 150e-6);
  EXPECT_NEAR(collective_added_seconds(run, 1), 600e-6, 1e-12);  // 2 ranks time-slice one core
  AfterComputeRun four = run;
  four.ranks = 4;
  EXPECT_NEAR(collective_added_seconds(four, 2), 600e-6, 1e-12);
  EXPECT_DOUBLE_EQ(collective_added_seconds(four, 4), 150e-6);
  AfterComputeRun none = four;
  none.collectives = 0;
  EXPECT_THROW(collective_added_seconds(none, 2), ConfigError);
  EXPECT_THROW(collective_added_seconds({.ranks = 1}, 2), ConfigError);
}

TEST(PlanCalibration, DeviceFileRoundTrips) {
  DeviceSpec d = find_device("cpu-here");
  d.fp32_flops = 31.5e9;
  d.intra_node = {.bandwidth = 2.5e9, .latency = 33e-6};
  d.gemm_overhead = 9.5e-6;
  d.materialized_attention_efficiency = 0.35;
  d.cache_bytes = 32LL << 20;
  d.cache_bandwidth = 95e9;
  d.oversubscription_factor = 1.22;
  d.concurrency_factor = 1.07;
  d.oversubscribed_link = {.bandwidth = 3.3e9, .latency = 91e-6, .call_latency = 420e-6};
  d.split_backward_overhead = 41e-6;
  d.oversubscribed_meeting = 5.5e-3;
  d.elementwise_factor = 0.61;
  d.oversubscribed_ahead_latency = 0.42e-3;
  d.optimizer_bandwidth = 41e9;
  d.meeting = 0.7e-3;
  const std::string path = ::testing::TempDir() + "/plan_calibration_device.json";
  write_device_file(path, d);
  const DeviceSpec back = read_device_file(path);
  EXPECT_EQ(back.name, d.name);
  EXPECT_EQ(back.memory_bytes, d.memory_bytes);
  EXPECT_EQ(back.fp32_flops, d.fp32_flops);
  EXPECT_EQ(back.intra_node.latency, d.intra_node.latency);
  EXPECT_EQ(back.compute_units, d.compute_units);
  EXPECT_EQ(back.gemm_overhead, d.gemm_overhead);
  EXPECT_EQ(back.materialized_attention_efficiency, d.materialized_attention_efficiency);
  EXPECT_EQ(back.cache_bytes, d.cache_bytes);
  EXPECT_EQ(back.cache_bandwidth, d.cache_bandwidth);
  EXPECT_EQ(back.oversubscription_factor, d.oversubscription_factor);
  EXPECT_EQ(back.concurrency_factor, d.concurrency_factor);
  EXPECT_EQ(back.oversubscribed_link.latency, d.oversubscribed_link.latency);
  EXPECT_EQ(back.oversubscribed_link.bandwidth, d.oversubscribed_link.bandwidth);
  EXPECT_EQ(back.oversubscribed_link.call_latency, d.oversubscribed_link.call_latency);
  EXPECT_EQ(back.split_backward_overhead, d.split_backward_overhead);
  EXPECT_EQ(back.oversubscribed_meeting, d.oversubscribed_meeting);
  EXPECT_EQ(back.elementwise_factor, d.elementwise_factor);
  EXPECT_EQ(back.oversubscribed_ahead_latency, d.oversubscribed_ahead_latency);
  EXPECT_EQ(back.optimizer_bandwidth, d.optimizer_bandwidth);
  EXPECT_EQ(back.meeting, d.meeting);
  EXPECT_EQ(back.intra_node.call_latency, 0);
  std::remove(path.c_str());
  EXPECT_THROW(read_device_file(path), ConfigError);
  // A file from before the split was calibrated charges none; so do the GPUs.
  nlohmann::json older = nlohmann::json::parse(device_to_json(d));
  ASSERT_EQ(older.erase("split_backward_overhead"), 1U);
  EXPECT_EQ(device_from_json(older.dump()).split_backward_overhead, 0);
  EXPECT_EQ(device_from_json(older.dump()).fp32_flops, d.fp32_flops);
  ASSERT_EQ(older.erase("elementwise_factor"), 1U);
  EXPECT_EQ(device_from_json(older.dump()).elementwise_factor, 1.0);
  ASSERT_EQ(older.erase("oversubscribed_ahead_latency"), 1U);
  EXPECT_EQ(device_from_json(older.dump()).oversubscribed_ahead_latency, 0);
  ASSERT_EQ(older.erase("optimizer_bandwidth"), 1U);
  EXPECT_EQ(device_from_json(older.dump()).optimizer_bandwidth, 0);
  ASSERT_EQ(older.erase("meeting"), 1U);
  EXPECT_EQ(device_from_json(older.dump()).meeting, 0);
  for (const DeviceSpec& gpu : device_table()) {
    if (gpu.compute_units == 0) {
      EXPECT_EQ(gpu.split_backward_overhead, 0) << gpu.name;
      EXPECT_EQ(gpu.meeting, 0) << gpu.name;
      EXPECT_EQ(gpu.oversubscribed_ahead_latency, 0) << gpu.name;
      EXPECT_EQ(gpu.optimizer_bandwidth, 0) << gpu.name;
    }
  }
}

TEST(PlanCalibration, HostRanksShareItsCoresAndMemory) {
  DeviceSpec d = find_device("cpu-here");
  d.compute_units = 2;
  d.memory_bytes = 8LL << 30;
  const auto model = ModelSpec::parse("gpt:layers=4,hidden=128,heads=4,seq=64,vocab=65");
  auto run = [&](int ranks) {
    ParallelPlan p{.dp_replicate = ranks, .precision = "fp32", .global_batch = 12 * ranks};
    return estimate(p, model, {.device = d, .gpus = ranks, .gpus_per_node = d.gpus_per_node});
  };
  const auto two = run(2), four = run(4);
  // Same work per rank; four ranks on two cores take twice the compute time.
  EXPECT_NEAR(four.time.compute / two.time.compute, 2.0, 1e-9);
  EXPECT_EQ(two.device_memory_bytes, 4LL << 30);
  EXPECT_EQ(four.device_memory_bytes, 2LL << 30);
}

// Note [Element-wise passes on a calibrated host]: the factor is the one
// that makes the model's calibration layer take the measured time; a layer
// measured faster than the passes allow, or slower, clamps; no measure
// leaves the count as it is. On a plan the factor scales each layer's
// passes: the one-process GPT's step moves by the four layers' passes at
// its micro-batch, nothing else.
TEST(PlanCalibration, ElementWisePassesFromTheMeasuredLayer) {
  DeviceSpec d = two_core_host();
  d.fp32_flops = 198e9;
  d.cache_bytes = 32LL << 20;
  d.cache_bandwidth = 32e9;
  d.attention_efficiency = 0.19;
  for (const Attention a : {Attention::kFlash, Attention::kMaterialized}) {
    DeviceSpec faster = d;
    faster.elementwise_factor = 0.6;
    const double measured = calibration_layer_seconds(faster, a, 12);
    EXPECT_LT(measured, calibration_layer_seconds(d, a, 12));
    EXPECT_NEAR(elementwise_factor(d, a, 12, measured), 0.6, 1e-9);
    faster.elementwise_factor = 0.0;
    EXPECT_EQ(elementwise_factor(d, a, 12, 0.5 * calibration_layer_seconds(faster, a, 12)), 0.25);
    EXPECT_EQ(elementwise_factor(d, a, 12, 10 * calibration_layer_seconds(d, a, 12)), 4.0);
    EXPECT_EQ(elementwise_factor(d, a, 12, 0.0), 1.0);
  }
  const auto model = bench_gpt_model();
  auto step = [&](double factor, std::int64_t batch) {
    DeviceSpec dev = d;
    dev.elementwise_factor = factor;
    return estimate({.global_batch = batch}, model, {.device = dev, .gpus = 1, .gpus_per_node = dev.gpus_per_node})
        .step_seconds;
  };
  auto passes = [&](std::int64_t batch) {
    DeviceSpec none = d;
    none.elementwise_factor = 0.0;
    return calibration_layer_seconds(d, Attention::kFlash, batch) -
           calibration_layer_seconds(none, Attention::kFlash, batch);
  };
  for (const std::int64_t batch : {12, 24})
    EXPECT_NEAR(step(1.0, batch) - step(0.6, batch), 4 * 0.4 * passes(batch), 1e-9) << batch;
}

// A CPU host's two calibrated terms (Note [Layer time]), each against what
// it stands for in the GPT example's step (bench_gpt_ops profiles 17
// dtrain::nn::linear calls and 4 attention cores per step: 4 blocks of 4
// Linears and the head; each Linear runs 3 products, each materialised
// attention core 2 in forward and 4 in backward):
//  - a GEMM's per-call cost is paid once per product whatever the tokens:
//    raising it by dt adds 75 dt to a step of 1 or of 24 sequences alike;
//  - element-wise traffic streams from the cache while a kernel's operands
//    fit in a rank's share of it: a cache as fast as memory changes
//    nothing, a faster one shortens only models whose activations fit.
// Note [Communication on a CPU host] and the oversubscription factor: more
// ranks than cores cost each rank the calibrated factor on top of the
// shared cores; with no core to spare, DDP's gradient all-reduce and the cp
// ring add to the step instead of hiding behind backward and attention.
TEST(PlanCalibration, TimeSlicingAndNoSpareCoreAddToTheStep) {
  DeviceSpec d = two_core_host();
  const auto model = bench_gpt_model();
  auto run = [&](const DeviceSpec& dev, ParallelPlan p, int ranks) {
    p.precision = "fp32";
    // Buckets of 256 KiB: the gradients (3.2 MB) fill several, so with
    // overlap only the last one's reduction is left after backward.
    return estimate(p, model, {.device = dev, .gpus = ranks, .gpus_per_node = dev.gpus_per_node},
                    {.ddp_bucket_bytes = 256 << 10});
  };
  const ParallelPlan ddp2{.dp_replicate = 2, .global_batch = 24}, ddp4{.dp_replicate = 4, .global_batch = 48};
  DeviceSpec sliced = d;
  sliced.oversubscription_factor = 1.25;
  EXPECT_NEAR(run(sliced, ddp4, 4).time.compute / run(d, ddp4, 4).time.compute, 1.25, 1e-9);
  EXPECT_NEAR(run(sliced, ddp2, 2).time.compute, run(d, ddp2, 2).time.compute, 1e-12);  // no more ranks than cores
  // Ranks computing at once: every plan with two or more ranks on the host
  // pays the concurrency factor, on top of time slicing; one process none.
  DeviceSpec busy = sliced;
  busy.concurrency_factor = 1.1;
  const ParallelPlan single{.global_batch = 24};
  EXPECT_NEAR(run(busy, ddp2, 2).time.compute / run(sliced, ddp2, 2).time.compute, 1.1, 1e-9);
  EXPECT_NEAR(run(busy, ddp4, 4).time.compute / run(d, ddp4, 4).time.compute, 1.1 * 1.25, 1e-9);
  EXPECT_NEAR(run(busy, single, 1).time.compute, run(d, single, 1).time.compute, 1e-12);
  // Their collectives run on the link measured with more ranks than cores.
  sliced.oversubscribed_link = {.bandwidth = 3e9, .latency = 90e-6};
  const double grad_bytes = 4.0 * static_cast<double>(model.params());
  const Link& o = sliced.oversubscribed_link;
  EXPECT_NEAR(run(sliced, ddp4, 4).time.grad_sync, 6 * o.latency + 1.5 * grad_bytes / o.bandwidth, 1e-9);
  EXPECT_NEAR(run(sliced, ddp2, 2).time.grad_sync, run(d, ddp2, 2).time.grad_sync, 1e-12);
  // The wait for peers switched out comes once per collective where the
  // ranks meet, whatever its ranks: DDP's one all-reduce; ZeRO-3's root
  // gather, the first layer's gather and the end of backward (3; its other
  // gathers are prefetched, the last layer stays gathered into backward,
  // and its reduce-scatters run beside backward: Note [Collectives issued
  // ahead on time-sliced ranks]); HSDP 2 x 2 as many over its shard pairs
  // and one replica all-reduce per unit (5) more.
  DeviceSpec waits = sliced;
  waits.oversubscribed_link.call_latency = 1e-3;
  EXPECT_NEAR(run(waits, ddp4, 4).time.grad_sync - run(sliced, ddp4, 4).time.grad_sync, 1e-3, 1e-9);
  const ParallelPlan zero3_4{.dp_shard = 4, .zero_stage = 3, .global_batch = 48};
  const ParallelPlan hsdp{.dp_replicate = 2, .dp_shard = 2, .zero_stage = 3, .global_batch = 48};
  EXPECT_NEAR(run(waits, zero3_4, 4).time.zero3_comm - run(sliced, zero3_4, 4).time.zero3_comm, 3e-3, 1e-9);
  EXPECT_NEAR(run(waits, hsdp, 4).time.zero3_comm - run(sliced, hsdp, 4).time.zero3_comm, 3e-3, 1e-9);
  // Each collective issued ahead of compute (Note [Collectives issued ahead
  // on time-sliced ranks]) adds its measured cost: every layer's gather but
  // the first in forward, every one but the last in backward, every layer's
  // reduce-scatter (not the root's, waited for as backward ends): 3 layers -
  // 2; not DDP's, and nothing where each rank has a core.
  DeviceSpec ahead = sliced;
  ahead.oversubscribed_ahead_latency = 1e-3;
  const double issued_ahead = 3.0 * model.layers - 2;
  for (const ParallelPlan& p : {zero3_4, hsdp}) {
    EXPECT_NEAR(run(ahead, p, 4).time.zero3_comm - run(sliced, p, 4).time.zero3_comm, issued_ahead * 1e-3, 1e-9)
        << p.to_json();
  }
  EXPECT_EQ(run(ahead, ddp4, 4).step_seconds, run(sliced, ddp4, 4).step_seconds);
  DeviceSpec ahead_fitting = d;
  ahead_fitting.oversubscribed_ahead_latency = 1e-3;
  const ParallelPlan zero3_two{.dp_shard = 2, .zero_stage = 3, .global_batch = 24};
  EXPECT_EQ(run(ahead_fitting, zero3_two, 2).step_seconds, run(d, zero3_two, 2).step_seconds);
  // Meeting after a step's compute (Note [Meetings of time-sliced ranks]):
  // once a step, beside the gradients' sync, to every plan whose ranks
  // time-slice, whatever its collectives; nothing where each rank has a core
  // or for one process.
  DeviceSpec meets = sliced;
  meets.oversubscribed_meeting = 6e-3;
  ParallelPlan pp4{.pp = 4, .global_batch = 48};
  pp4.pipeline = {.schedule = "1f1b", .micro_batches = 4};
  for (const ParallelPlan& p : {ddp4, zero3_4, hsdp, pp4}) {
    const PlanEstimate with = run(meets, p, 4), without = run(sliced, p, 4);
    EXPECT_EQ(with.time.grad_sync, without.time.grad_sync) << p.to_json();
    EXPECT_NEAR(with.time.meeting, 6e-3, 1e-12) << p.to_json();
    EXPECT_EQ(without.time.meeting, 0) << p.to_json();
    EXPECT_NEAR(with.step_seconds - without.step_seconds, 6e-3, 1e-9) << p.to_json();
  }
  EXPECT_NEAR(run(meets, ddp2, 2).step_seconds, run(sliced, ddp2, 2).step_seconds, 1e-12);
  EXPECT_NEAR(run(meets, single, 1).step_seconds, run(sliced, single, 1).step_seconds, 1e-12);
  // Ranks with a core each meet at their own (smaller) cost, once a step;
  // one process meets no one, time-sliced ranks pay theirs instead.
  DeviceSpec drift = sliced;
  drift.meeting = 1e-3;
  for (const ParallelPlan& p : {ddp2, zero3_two}) {
    EXPECT_NEAR(run(drift, p, 2).time.meeting, 1e-3, 1e-12) << p.to_json();
    EXPECT_NEAR(run(drift, p, 2).step_seconds - run(sliced, p, 2).step_seconds, 1e-3, 1e-9) << p.to_json();
  }
  EXPECT_EQ(run(drift, single, 1).step_seconds, run(sliced, single, 1).step_seconds);
  EXPECT_EQ(run(drift, ddp4, 4).step_seconds, run(sliced, ddp4, 4).step_seconds);
  DeviceSpec gpu = find_device("h100-80gb");  // a GPU's ranks: no CPU host's drift
  gpu.meeting = 1e-3;
  EXPECT_EQ(run(gpu, ddp2, 2).time.meeting, 0);
  // Without latencies what is left is the transport's work: every layer
  // gathered in forward and all but the last again in backward, every unit
  // reduce-scattered, the root gathered once (it stays gathered through
  // backward).
  DeviceSpec work = sliced;
  work.oversubscribed_link.latency = 0;
  const double layer_bytes = 4.0 * static_cast<double>(model.layer_params());
  const double root_bytes = 4.0 * static_cast<double>(model.embedding_params() + model.output_params());
  EXPECT_NEAR(run(work, zero3_4, 4).time.zero3_comm,
              0.75 * (2 * root_bytes + (3 * model.layers - 1) * layer_bytes) / o.bandwidth, 1e-9);
  // Two ranks on two cores wait at every collective, as before.
  const ParallelPlan zero3_2{.dp_shard = 2, .zero_stage = 3, .global_batch = 24};
  DeviceSpec intra_waits = d;
  intra_waits.intra_node.call_latency = 1e-3;
  EXPECT_NEAR(run(intra_waits, zero3_2, 2).time.zero3_comm - run(d, zero3_2, 2).time.zero3_comm, 15e-3, 1e-9);
  EXPECT_NEAR(run(waits, hsdp, 4).time.grad_sync - run(sliced, hsdp, 4).time.grad_sync, 5e-3, 1e-9);
  EXPECT_EQ(run(waits, ddp2, 2).time.grad_sync, run(sliced, ddp2, 2).time.grad_sync);  // no more ranks than cores
  // Two ranks on two cores: the whole all-reduce of the gradients (fp32)
  // is exposed; with cores to spare only what backward does not cover.
  DeviceSpec spare = d;
  spare.compute_units = 8;
  EXPECT_NEAR(run(d, ddp2, 2).time.grad_sync, 2 * d.intra_node.latency + grad_bytes / d.intra_node.bandwidth, 1e-9);
  EXPECT_LT(run(spare, ddp2, 2).time.grad_sync, run(d, ddp2, 2).time.grad_sync);
  // cp 2: each layer's K/V forward, again with their fp32 gradients (sent
  // twice) backward; hidden behind the attention core where a core is spare.
  const ParallelPlan cp2{.cp = 2, .global_batch = 24};
  const double kv = 24.0 * 32 * 2 * 128 * 4;  // 24 sequences of 32 local tokens, K and V, fp32
  const double p2p = d.intra_node.latency + kv / d.intra_node.bandwidth;
  EXPECT_NEAR(run(d, cp2, 2).time.cp_comm, 4 * (p2p + p2p + 2 * p2p), 1e-9);
  EXPECT_EQ(run(spare, cp2, 2).time.cp_comm, 0);
}

// Note [Tensor-parallel copies]: with eager kernels sequence parallelism
// costs each layer's backward two all-gathers more (the column layers'
// inputs gathered again) and one small all-reduce per norm parameter; the
// tp collectives also copy their tensors.
// Note [Split backward cost]: ZB's I + W over B, per captured node; ZB's W
// pays it per node of a stage with an input path (the first stage's input is
// token ids: its W is the whole backward), and no other schedule does.
TEST(PlanCalibration, ZeroBubbleWeightPassPaysTheSplitPerCapturedNode) {
  EXPECT_NEAR(split_backward_overhead(4.1e-3, 4.7e-3, 12), 0.05e-3, 1e-12);
  EXPECT_EQ(split_backward_overhead(4.7e-3, 4.1e-3, 12), 0);  // noise: none left over
  EXPECT_THROW(split_backward_overhead(4.1e-3, 4.7e-3, 0), InternalError);
  EXPECT_THROW(split_backward_overhead(0, 4.7e-3, 12), ConfigError);
  DeviceSpec d = two_core_host();
  const auto model = bench_gpt_model();
  auto run = [&](const DeviceSpec& dev, const std::string& schedule) {
    ParallelPlan p{.pp = 2, .precision = "fp32", .global_batch = 24};
    p.pipeline = {.schedule = schedule, .micro_batches = 4};
    return estimate(p, model, {.device = dev, .gpus = 2, .gpus_per_node = dev.gpus_per_node});
  };
  DeviceSpec split = d, twice = d;
  split.split_backward_overhead = 1e-3;  // large: the last stage's rank is the critical one
  twice.split_backward_overhead = 2e-3;
  // 4 micro-batches x (2 layers x 6 nodes + the final norm and the output layer).
  EXPECT_NEAR(run(twice, "zb").time.compute - run(split, "zb").time.compute, 4 * (2 * 6 + 2) * 1e-3, 1e-9);
  EXPECT_GT(run(split, "zb").step_seconds, run(d, "zb").step_seconds);
  EXPECT_NEAR(run(split, "1f1b").step_seconds, run(d, "1f1b").step_seconds, 1e-12);
  // 5 layers: stage 0 holds 3 and its rank, ending last, is the critical
  // one; its W is the whole backward (no input path), so it pays none.
  const auto five = ModelSpec::parse(
      "gpt:layers=5,hidden=128,heads=4,seq=64,vocab=84,attention=flash,kernels=eager,dropout=0,bias=0");
  auto run_five = [&](const DeviceSpec& dev) {
    ParallelPlan p{.pp = 2, .precision = "fp32", .global_batch = 24};
    p.pipeline = {.schedule = "zb", .micro_batches = 4};
    return estimate(p, five, {.device = dev, .gpus = 2, .gpus_per_node = dev.gpus_per_node}).time.compute;
  };
  DeviceSpec small = d;
  small.split_backward_overhead = 1e-6;  // stage 1's 4 x 14 us leave rank 0 the critical one
  EXPECT_NEAR(run_five(small), run_five(d), 1e-12);
}

// Note [Pipeline exchanges per step]: the batch shape, the clipping norm and
// the loss (three small collectives over pp) and the tied embedding's
// gradient (a send each way) beside the schedule's own sends.
TEST(PlanCalibration, PipelineStepsPayTheirSmallExchanges) {
  DeviceSpec d = two_core_host();
  d.intra_node.call_latency = 0.2e-3;
  const auto model = bench_gpt_model();
  ParallelPlan p{.pp = 2, .precision = "fp32", .global_batch = 24};
  p.pipeline = {.schedule = "1f1b", .micro_batches = 4};
  const auto e = estimate(p, model, {.device = d, .gpus = 2, .gpus_per_node = d.gpus_per_node});
  const Link& l = d.intra_node;
  const double tie = l.call_latency + l.latency + 84.0 * 128 * 4 / l.bandwidth;
  // The norm's all-reduce (a ring: 2 (p - 1) alpha) and the shape's and the
  // loss's broadcasts ((p - 1) alpha each).
  auto exchanges = [&](int pp) {
    const double k = pp;
    return (l.call_latency + 2 * (k - 1) * l.latency + 2 * (k - 1) / k * 80 / l.bandwidth) +
           2 * (l.call_latency + (k - 1) * l.latency + (k - 1) / k * 80 / l.bandwidth);
  };
  EXPECT_NEAR(e.time.grad_sync, exchanges(2) + tie, 1e-12);
  // Untied: no embedding gradient to send.
  ModelSpec untied = model;
  untied.tied_embeddings = false;
  EXPECT_NEAR(estimate(p, untied, {.device = d, .gpus = 2, .gpus_per_node = d.gpus_per_node}).time.grad_sync,
              exchanges(2), 1e-12);
  // pp = 4, one host of 4 cores: the same exchanges over 4 ranks.
  DeviceSpec four = d;
  four.compute_units = 4;
  ParallelPlan p4 = p;
  p4.pp = 4;
  EXPECT_NEAR(estimate(p4, model, {.device = four, .gpus = 4, .gpus_per_node = 4}).time.grad_sync, exchanges(4) + tie,
              1e-12);
}

TEST(PlanCalibration, SequenceParallelEagerKernelsCostTheirExtraCollectives) {
  DeviceSpec d = find_device("cpu-here");
  d.compute_units = 2;
  d.memory_bytes = 8LL << 30;
  d.intra_node = {.bandwidth = 6e9, .latency = 60e-6};
  auto tp_comm = [&](const std::string& kernels, bool sp) {
    const auto model = ModelSpec::parse(
        "gpt:layers=4,hidden=128,heads=4,seq=64,vocab=84,attention=flash,kernels=" + kernels + ",dropout=0,bias=0");
    const ParallelPlan p{.tp = 2, .sequence_parallel = sp, .precision = "fp32", .global_batch = 24};
    return estimate(p, model, {.device = d, .gpus = 2, .gpus_per_node = d.gpus_per_node}).time.tp_comm;
  };
  const double act = 24.0 * 64 * 128 * 4;  // one activation, fp32
  const double regather = d.intra_node.latency + act / 2 / d.intra_node.bandwidth;
  const double norm_reduce = 2 * d.intra_node.latency + 128 * 4 / d.intra_node.bandwidth;
  // The layers' two regathers and two norm all-reduces, the final norm's
  // one; the copies (SP: 10 per layer, 2 at the end; tp alone: 4 and 1)
  // come on top.
  EXPECT_GT(tp_comm("eager", true) - tp_comm("eager", false), 4 * (2 * regather + 2 * norm_reduce) + norm_reduce);
  EXPECT_GT(tp_comm("eager", false), tp_comm("fused", false));
}

TEST(PlanCalibration, CpuCallCostAndCacheAreTheGptExamplesTerms) {
  DeviceSpec d = find_device("cpu-here");
  d.compute_units = 2;
  d.memory_bandwidth = 30e9;
  const auto gpt = ModelSpec::parse(
      "gpt:layers=4,hidden=128,heads=4,seq=64,vocab=84,attention=materialized,kernels=eager,dropout=0,bias=0");
  auto step = [&](const ModelSpec& model, const DeviceSpec& dev, std::int64_t sequences) {
    const ParallelPlan p{.precision = "fp32", .global_batch = sequences};
    return estimate(p, model, {.device = dev, .gpus = 1, .gpus_per_node = dev.gpus_per_node}).time.compute;
  };
  DeviceSpec slower = d;
  d.gemm_overhead = 5e-6;
  slower.gemm_overhead = 15e-6;
  for (const std::int64_t sequences : {1, 24}) {
    EXPECT_NEAR((step(gpt, slower, sequences) - step(gpt, d, sequences)) / 10e-6, 75, 1e-6) << sequences;
  }
  DeviceSpec cached = d, same = d;
  cached.cache_bytes = same.cache_bytes = 32LL << 20;
  cached.cache_bandwidth = 3 * d.memory_bandwidth;
  same.cache_bandwidth = d.memory_bandwidth;
  EXPECT_NEAR(step(gpt, same, 24), step(gpt, d, 24), 1e-12);
  EXPECT_LT(step(gpt, cached, 24), step(gpt, d, 24));
  // Width 4096, 8 sequences of 2048: a residual add's operands are 384 MiB.
  const auto large = ModelSpec::parse("gpt:layers=2,hidden=4096,heads=32,seq=2048,vocab=50304");
  EXPECT_NEAR(step(large, cached, 8), step(large, d, 8), 1e-12);
}

// Note [Element-wise passes]: sequence parallelism halves the norms' and
// residuals' passes, not an eager step's per-token rest, so its extra
// copies and collectives make tp 2 with SP slower than without on the GPT
// example (measured 5-8 ms per step on 2 cores, Intel 6/167, 2026-11-29;
// the model that divided the whole region put SP level or ahead); fused
// kernels (Megatron's) have no rest, so SP saves them the same passes.
TEST(PlanCalibration, SequenceParallelHalvesTheNormsPassesNotTheEagerRest) {
  DeviceSpec d = two_core_host();
  d.fp32_flops = d.bf16_flops = 140e9;
  d.memory_bandwidth = 20e9;
  d.cache_bytes = 32LL << 20;
  d.cache_bandwidth = 30e9;
  d.kernel_overhead = 3e-6;
  d.gemm_overhead = 8e-6;
  d.attention_efficiency = 0.4;
  auto tp2 = [&](const std::string& kernels, bool sp) {
    const auto model = ModelSpec::parse(
        "gpt:layers=4,hidden=128,heads=4,seq=64,vocab=84,attention=flash,kernels=" + kernels + ",dropout=0,bias=0");
    const ParallelPlan p{.tp = 2, .sequence_parallel = sp, .precision = "fp32", .global_batch = 24};
    return estimate(p, model, {.device = d, .gpus = 2, .gpus_per_node = d.gpus_per_node});
  };
  // Compute alone: SP saves the norms' and residuals' 20 bytes x h per
  // token on half the tokens, 3 passes (forward, backward twice), fp32.
  const double tokens = 24.0 * 64, region = 20 * 128 * 2;
  const double saved = 4 * 3 * region * tokens / 2 / d.cache_bandwidth;
  EXPECT_NEAR(tp2("eager", false).time.compute - tp2("eager", true).time.compute, saved, 1e-12);
  EXPECT_NEAR(tp2("fused", false).time.compute - tp2("fused", true).time.compute, saved, 1e-12);
  EXPECT_GT(tp2("eager", true).step_seconds, tp2("eager", false).step_seconds);
}

TEST(PlanCalibration, Fp8PlansRunTheirGemmsAtTheFp8Rate) {
  const auto model =
      ModelSpec::parse("llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=8192,vocab=128256");
  const Cluster cluster{.device = find_device("h100-80gb"), .gpus = 8, .gpus_per_node = 8};
  ParallelPlan p{.dp_shard = 8, .zero_stage = 3, .recompute = Recompute::kFull, .precision = "bf16", .global_batch = 8};
  const auto bf16 = estimate(p, model, cluster);
  p.precision = "fp8";
  const auto fp8 = estimate(p, model, cluster);
  EXPECT_LT(fp8.time.compute, bf16.time.compute);
  EXPECT_GT(fp8.time.compute, bf16.time.compute / 2);  // attention and element-wise stay bf16
  EXPECT_EQ(fp8.peak(), bf16.peak());
  p.precision = "fp8";
  EXPECT_THROW(estimate(p, model, {.device = find_device("a100-80gb"), .gpus = 8, .gpus_per_node = 8}), ConfigError);
  try {  // planned, not trained
    p.validate({.world = 8, .model = {.layers = 32, .heads = 32, .width = 4096, .seq = 8192}});
    ADD_FAILURE() << "an fp8 plan validated for running";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("fp8"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dtrain::plan

namespace dtrain::plan {
namespace {

const char* kPreflightModel =
    "gpt:layers=4,hidden=128,heads=4,seq=64,vocab=65,attention=flash,kernels=eager,dropout=0,bias=0";

TEST(PlanPreflight, RefusesWhatExceedsTheLimitWithTheFigureAndTheNearestFit) {
  const auto model = ModelSpec::parse(kPreflightModel);
  const Cluster cluster{.device = find_device("cpu-here"), .gpus = 2, .gpus_per_node = 2};
  const ParallelPlan p{.dp_replicate = 2, .precision = "fp32", .global_batch = 48};
  const CostOptions o{.weights = WeightLayout::kFp32Master, .ddp_buckets_copy_gradients = true};
  const auto fits = check_plan_memory(p, model, cluster, o, {.bytes = 4LL << 30, .source = "test"});
  const auto needed = static_cast<std::int64_t>(fits.peak());
  // Between what ZeRO-3 with full recompute needs and what this plan needs.
  const std::int64_t limit = needed - needed / 4;
  try {
    check_plan_memory(p, model, cluster, o, {.bytes = limit, .source = "test limit"});
    ADD_FAILURE() << "a plan needing " << needed << " bytes passed a limit of " << limit;
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(std::to_string(needed) + " bytes"), std::string::npos) << what;
    EXPECT_NE(what.find(std::to_string(needed - limit) + " bytes) more"), std::string::npos) << what;
    EXPECT_NE(what.find("test limit"), std::string::npos) << what;
    EXPECT_NE(what.find("nearest plan that fits"), std::string::npos) << what;
  }
  EXPECT_EQ(parse_bytes("300M"), 300LL << 20);
  EXPECT_EQ(parse_bytes("2G"), 2LL << 30);
  EXPECT_EQ(parse_bytes("4096"), 4096);
  EXPECT_THROW(parse_bytes("lots"), ConfigError);
  EXPECT_EQ(rank_memory_limit(4, "1G").bytes, 1LL << 30);
  ::setenv("DTRAIN_MEMORY_LIMIT", "300M", 1);
  EXPECT_EQ(rank_memory_limit(4).bytes, 300LL << 20);
  ::unsetenv("DTRAIN_MEMORY_LIMIT");
  const auto one = rank_memory_limit(1), four = rank_memory_limit(4);
  EXPECT_NEAR(4.0 * static_cast<double>(four.bytes) / static_cast<double>(one.bytes), 1.0, 0.05);
  EXPECT_NE(four.source.find("/ 4 local ranks"), std::string::npos) << four.source;
}

}  // namespace
}  // namespace dtrain::plan
