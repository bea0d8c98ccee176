// `dtrain plan` (plan_command.h).
#include "plan_command.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "dtrain/error.h"
#include "dtrain/plan/calibration.h"
#include "dtrain/plan/search.h"

namespace dtrain::tools {

void add_plan_options(CLI::App& c, PlanCommandOptions& o) {
  c.add_option("--model", o.model,
               "gpt:layers=..,hidden=..,heads=..,seq=..,vocab=.. or "
               "llama:layers=..,hidden=..,heads=..,kv_heads=..,ffn=..,seq=..,vocab=..");
  c.add_option("--device", o.device, "Device of the table (--list-devices)")->capture_default_str();
  c.add_option("--gpus", o.gpus, "Ranks (GPUs) in all")->check(CLI::PositiveNumber);
  c.add_option("--gpus-per-node", o.gpus_per_node, "GPUs per node (default: the device's)");
  c.add_option("--global-batch", o.global_batch, "Sequences per optimizer step")->check(CLI::PositiveNumber);
  c.add_option("--precision", o.precision, "bf16, fp16, fp32 or fp8 (planned only: the GEMMs at the device's fp8 rate)")
      ->capture_default_str();
  c.add_option("--fixed", o.fixed,
               "Pin fields: tp, pp, cp, dp, dp_replicate, dp_shard, zero, micro_batch, schedule, stages_per_rank, "
               "recompute, sequence_parallel (e.g. tp=8,pp=8,dp=24)");
  c.add_flag("--json", o.json, "One JSON object per plan and line");
  c.add_option("--top", o.top, "Plans to print, best first (0: all that fit)")->capture_default_str();
  c.add_option("--output,-o", o.output, "Write the best plan to this plan file");
  c.add_option("--weights", o.weights, "Mixed-precision copies: megatron (2+2+12 B/param) or fp32-master (4+4+8)")
      ->capture_default_str();
  c.add_option("--allocator-factor", o.allocator_factor, "Reserved / allocated memory of the caching allocator")
      ->capture_default_str();
  c.add_flag("--no-grad-overlap", o.no_grad_overlap,
             "Gradient reduction after backward instead of during it (Megatron-LM 2021's DDP)");
  c.add_flag("--blocking-p2p", o.blocking_p2p, "Pipeline senders wait for their transfers (Megatron-LM 2021)");
  c.add_flag("--ddp-bucket-copy", o.ddp_bucket_copy,
             "DDP buckets hold a copy of the gradients (dtrain's and PyTorch's DDP; default: Megatron's views)");
  c.add_flag("--list-devices", o.list_devices, "Print the device table and exit");
  c.add_option("--device-file", o.device_file,
               "A device entry (JSON, as --calibrate writes) instead of --device; with --calibrate, where to write it");
  c.add_flag("--calibrate", o.calibrate,
             "Measure this host (matrix products, memory bandwidth, shared-memory and Gloo collectives) and write "
             "its device entry (default: " +
                 default_calibration_file() + ", which --device cpu-here then reads)");
  c.add_option("--calibrate-ranks", o.calibrate_ranks, "Process counts to time the collectives on")
      ->capture_default_str();
}

std::string default_calibration_file() {
  const char* cache = std::getenv("DTRAIN_CACHE");
  const char* home = std::getenv("HOME");
  const std::string dir = cache != nullptr ? cache : std::string(home != nullptr ? home : "/tmp") + "/.cache/dtrain";
  return dir + "/cpu-here.json";
}

namespace {

std::string row(const plan::PlanEstimate& e) {
  const auto& p = e.plan;
  std::ostringstream s;
  std::string sched = p.pp > 1 ? p.pipeline.schedule : "-";
  if (p.pp > 1 && p.pipeline.stages_per_rank > 1) sched += "x" + std::to_string(p.pipeline.stages_per_rank);
  const int steps = p.pp > 1 ? p.pipeline.micro_batches : p.accumulate;
  s << std::setw(3) << p.tp << std::setw(4) << p.pp << std::setw(4) << p.cp << std::setw(6) << p.dp_replicate
    << std::setw(6) << p.dp_shard << std::setw(5) << p.zero_stage << std::setw(15) << sched << std::setw(4)
    << e.micro_batch << std::setw(6) << steps << std::setw(10) << to_string(p.recompute) << std::setw(4)
    << (p.sequence_parallel ? "y" : "n") << std::setw(10) << std::fixed << std::setprecision(1)
    << e.peak() / (1024.0 * 1024 * 1024) << std::setw(11) << std::setprecision(3) << e.step_seconds << std::setw(11)
    << std::setprecision(0) << e.tokens_per_second_per_gpu << std::setw(9) << std::setprecision(1) << e.tflops_per_gpu
    << std::setw(7) << std::setprecision(1) << 100 * e.mfu << "%";
  return s.str();
}

const char* kHeader =
    " tp  pp  cp  dp_r  dp_s zero       schedule  mb steps recompute  sp  peak GiB     step s  tok/s/gpu   "
    "TFLOP/s    MFU";

void breakdown(const plan::PlanEstimate& e, std::ostream& out) {
  const auto& m = e.memory;
  const auto& t = e.time;
  out << "memory (worst rank): params " << plan::format_bytes(m.params) << ", grads " << plan::format_bytes(m.grads)
      << ", optimizer " << plan::format_bytes(m.optimizer) << ", activations " << plan::format_bytes(m.activations)
      << ", logits " << plan::format_bytes(m.logits) << ", captured gradients " << plan::format_bytes(m.captured)
      << ", buffers " << plan::format_bytes(m.buffers) << ", backward working memory " << plan::format_bytes(m.backward)
      << " of " << plan::format_bytes(static_cast<double>(e.device_memory_bytes)) << "\n";
  out << std::fixed << std::setprecision(3) << "time (critical rank, s): compute " << t.compute << ", recompute "
      << t.recompute << ", tp " << t.tp_comm << ", cp " << t.cp_comm << ", zero3 " << t.zero3_comm << ", pipeline idle "
      << t.pipeline_idle << ", grad sync " << t.grad_sync << ", meeting " << t.meeting << ", optimizer " << t.optimizer
      << "\n";
}

// Runs the calibration worker under `dtrain run` (this binary) on `ranks`
// processes; its JSON result.
nlohmann::json run_calibration(int ranks, const std::string& scratch) {
  const auto here = std::filesystem::read_symlink("/proc/self/exe").parent_path();
  const auto worker = here / "dtrain_plan_calibrate";
  DTRAIN_CHECK(std::filesystem::exists(worker), ConfigError,
               "the calibration worker " << worker.string() << " is missing.",
               "build the dtrain_plan_calibrate target (it is installed beside dtrain)");
  const std::string out = scratch + "/calibration-" + std::to_string(ranks) + ".json";
  const std::string cmd = "'" + (here / "dtrain").string() + "' run --standalone --nproc-per-node " +
                          std::to_string(ranks) + " '" + worker.string() + "' --out '" + out + "' > '" + out +
                          ".log' 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream in(out);
  DTRAIN_CHECK(rc == 0 && in.good(), ConfigError,
               "the calibration run on " << ranks << " processes failed; its log: " << out << ".log.",
               "read the log; run `dtrain run --nproc-per-node 2 dtrain_plan_calibrate --out F` by hand to see it");
  return nlohmann::json::parse(in);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The size of this host's last-level cache (Linux's sysfs; the highest
// level cpu0 lists), 0 when it cannot be read: then no cache is modelled.
std::int64_t last_level_cache_bytes() {
  std::int64_t bytes = 0;
  int best_level = 0;
  for (int i = 0; i < 8; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream level_file(dir + "level"), size_file(dir + "size");
    int level = 0;
    std::string size;
    if (!(level_file >> level) || !(size_file >> size) || level <= best_level) continue;
    const std::int64_t unit = size.back() == 'K' ? 1024 : size.back() == 'M' ? 1024 * 1024 : 1;
    best_level = level;
    bytes = std::stoll(size) * unit;
  }
  return bytes;
}

// Note [Calibration]
// The compute rates are one rank's with the host to itself (rank 0 of a run
// with no more ranks than cores, the others asleep), so that the entry is
// one rank's own core: the cost model runs a one-process plan at them,
// divides them by concurrency_factor where ranks compute at once, and
// divides the cores when a plan puts more ranks on the host
// (DeviceSpec::compute_units). The
// measured rates are achieved rates, so the GEMM and memory efficiencies are
// 1; the attention kernels' are their measured rates over the products'.
// Each is the rate of the kernel dtrain runs in training (oneDNN's products,
// not at::mm's; see calibrate_worker.cpp), with operands where training
// finds them (the last-level cache). The runs with more ranks than cores
// give one figure more: how much more CPU time a rank takes for the same
// work when ranks time-slice the cores (DeviceSpec::oversubscription_factor);
// those with no more, one other: how much more it takes when every core
// runs a rank at once than with the host to itself (the shared last-level
// cache and memory; DeviceSpec::concurrency_factor).
// The collectives' alpha and beta are one fit per transport over its
// samples: shared memory is the node's link (dtrain's CPU collectives and
// pipeline sends between ranks of one host), fitted apart for the runs with
// no more ranks than cores and those with more (oversubscribed_link); Gloo
// over loopback TCP stands for the link between hosts (what dtrain uses
// there), one fit over all process counts.
int calibrate(const PlanCommandOptions& o, std::ostream& out, std::ostream& err) {
  const std::string path = o.device_file.empty() ? default_calibration_file() : o.device_file;
  std::vector<int> counts;
  std::stringstream list(o.calibrate_ranks);
  for (std::string item; std::getline(list, item, ',');) counts.push_back(std::stoi(item));
  DTRAIN_CHECK(!counts.empty() && *std::min_element(counts.begin(), counts.end()) >= 2, ConfigError,
               "--calibrate-ranks '" << o.calibrate_ranks << "' needs process counts of 2 or more.", "e.g. 2,4");
  plan::DeviceSpec d = plan::find_device("cpu-here");
  const auto scratch = std::filesystem::temp_directory_path() / ("dtrain-calibrate-" + std::to_string(::getpid()));
  std::filesystem::create_directories(scratch);
  std::vector<plan::CollectiveSample> shm, shm_oversubscribed, gloo;
  std::vector<double> fp32, bf16, bandwidth, overhead, cache_bandwidth, gemm_overhead, attention, materialized;
  std::vector<double> work_fitting, work_oversubscribed;  // time_sliced_work_seconds by ranks <= or > cores
  std::vector<double> work_alone;                         // alone_work_seconds of the runs with ranks <= cores
  std::vector<double> meetings_oversubscribed;            // meeting_seconds of the runs with ranks > cores
  std::vector<double> meetings_fitting;                   // ... with 2 <= ranks <= cores
  std::vector<nlohmann::json> after_compute;              // collectives after compute, every run
  std::vector<double> split_overhead;                     // per captured node, runs with ranks <= cores
  std::vector<double> layers_quotient;                    // layer pipelines' together / alone, runs with ranks <= cores
  std::vector<double> layer_seconds;                      // per GPT layer, the runs whose rates are taken
  std::int64_t layer_micro_batch = 0;                     // ... on this many sequences
  plan::Attention layer_attention = plan::Attention::kFlash;
  std::vector<double> optimizer_rates;  // Note [Optimizer phase] (cost_model.cpp)
  const auto start = std::chrono::steady_clock::now();
  for (const int n : counts) {
    const auto r = run_calibration(n, scratch.string());
    for (const auto& s : r.at("samples"))
      (s.at("transport") == "gloo" ? gloo
       : n <= d.compute_units      ? shm
                                   : shm_oversubscribed)
          .push_back({.op = s.at("op"), .ranks = s.at("ranks"), .bytes = s.at("bytes"), .seconds = s.at("seconds")});
    (n <= d.compute_units ? work_fitting : work_oversubscribed).push_back(r.at("time_sliced_work_seconds"));
    if (n <= d.compute_units && r.contains("alone_work_seconds")) work_alone.push_back(r.at("alone_work_seconds"));
    if (r.contains("meeting_seconds") && n >= 2)
      (n <= d.compute_units ? meetings_fitting : meetings_oversubscribed).push_back(r.at("meeting_seconds"));
    if (n <= d.compute_units && r.contains("split_backward")) {
      const auto& sb = r.at("split_backward");
      split_overhead.push_back(
          plan::split_backward_overhead(sb.at("whole_seconds"), sb.at("split_seconds"), sb.at("captured")));
    }
    if (n <= d.compute_units && r.contains("layer_pipeline")) {
      layers_quotient.push_back(r.at("layer_pipeline").at("together_over_alone"));
    }
    if (r.contains("after_compute")) {
      nlohmann::json ac = r.at("after_compute");
      ac["ranks"] = n;
      after_compute.push_back(ac);
    }
    if (n <= d.compute_units || counts.size() == 1) {
      fp32.push_back(r.at("fp32_flops"));
      bf16.push_back(r.at("bf16_flops"));
      bandwidth.push_back(r.at("memory_bandwidth"));
      overhead.push_back(r.at("kernel_overhead"));
      cache_bandwidth.push_back(r.at("cache_bandwidth"));
      gemm_overhead.push_back(r.at("gemm_overhead"));
      attention.push_back(r.at("attention_flops"));
      materialized.push_back(r.at("materialized_attention_flops"));
      if (r.contains("layer")) {
        layer_seconds.push_back(r.at("layer").at("seconds"));
        layer_micro_batch = r.at("layer").at("micro_batch");
        layer_attention =
            r.at("layer").at("attention") == "materialized" ? plan::Attention::kMaterialized : plan::Attention::kFlash;
      }
      if (r.contains("optimizer"))
        optimizer_rates.push_back(
            plan::optimizer_bandwidth(r.at("optimizer").at("params"), r.at("optimizer").at("seconds")));
    }
    err << "dtrain plan --calibrate: " << n << " processes done\n";
  }
  DTRAIN_CHECK(!fp32.empty(), ConfigError,
               "no calibration run had at most " << d.compute_units << " processes (this host's cores).",
               "include a count up to the cores in --calibrate-ranks");
  std::filesystem::remove_all(scratch);
  d.fp32_flops = median(fp32);
  d.bf16_flops = median(bf16);
  d.memory_bandwidth = median(bandwidth);
  d.kernel_overhead = median(overhead);
  d.cache_bandwidth = median(cache_bandwidth);
  d.gemm_overhead = median(gemm_overhead);
  d.cache_bytes = last_level_cache_bytes();
  d.gemm_efficiency = d.memory_efficiency = 1.0;
  // Flash attention's achieved rate as a fraction of the products' (the
  // cost model applies it to the peak at the plan's precision).
  d.attention_efficiency = median(attention) / d.fp32_flops;
  d.materialized_attention_efficiency = median(materialized) / d.fp32_flops;
  // Note [Element-wise passes on a calibrated host] (calibration.cpp): the
  // layer's element-wise passes at what this host's layer took.
  if (!layer_seconds.empty())
    d.elementwise_factor = plan::elementwise_factor(d, layer_attention, layer_micro_batch, median(layer_seconds));
  // Note [Optimizer phase] (cost_model.cpp): clipping and AdamW as training runs them.
  if (!optimizer_rates.empty()) d.optimizer_bandwidth = median(optimizer_rates);
  // Time slicing: a rank's CPU time for the same work with more ranks than
  // cores over with no more (1 when the counts do not give both).
  if (!work_fitting.empty() && !work_oversubscribed.empty())
    d.oversubscription_factor = std::max(1.0, median(work_oversubscribed) / median(work_fitting));
  // Note [Meetings of time-sliced ranks] (calibration.cpp): what all ranks
  // meeting once after a step's compute costs when they time-slice the cores.
  if (!meetings_oversubscribed.empty()) d.oversubscribed_meeting = median(meetings_oversubscribed);
  // Contention: a rank's CPU time for the same work with every rank of a
  // run with no more ranks than cores computing at once, over rank 0's alone.
  // Note [Concurrency of pipeline stages] (calibration.cpp): measured on
  // pipelines of GPT example layers where the worker ran them, else on the
  // MLP piece.
  if (!layers_quotient.empty()) {
    d.concurrency_factor = std::max(1.0, median(layers_quotient));  // drift cancelled per round (the worker's)
  } else if (!work_fitting.empty() && !work_alone.empty()) {
    d.concurrency_factor = std::max(1.0, median(work_fitting) / median(work_alone));
  }
  // Note [Split backward cost] (calibration.cpp): ZB's I + W over B, per captured node.
  if (!split_overhead.empty()) d.split_backward_overhead = median(split_overhead);
  // What no run measured, and why: both need a run whose ranks each have a
  // core (with more, time slicing, not the work, would be timed).
  const std::string why = std::string(" not measured: no run with at most ") + std::to_string(d.compute_units) +
                          " processes (this host's cores) in --calibrate-ranks\n";
  if (layers_quotient.empty())
    err << "dtrain plan --calibrate: concurrency_factor on the GPT-layer pipelines"
        << (work_alone.empty() ? " (1, none)" : " (the MLP piece's instead)") << why;
  if (split_overhead.empty()) err << "dtrain plan --calibrate: split_backward_overhead (0)" << why;
  if (meetings_oversubscribed.empty())
    err << "dtrain plan --calibrate: oversubscribed_meeting (0) not measured: no run with more than " << d.compute_units
        << " processes (this host's cores) in --calibrate-ranks\n";
  // The node's link from the runs with no more ranks than cores; those with
  // more have their own (DeviceSpec::oversubscribed_link): time slicing
  // makes their collectives wait for peers switched out, which no single
  // alpha-beta of the ring formulas fits together with the others.
  if (shm.empty()) shm.swap(shm_oversubscribed);
  d.intra_node = plan::fit_ring_link(shm);
  if (!shm_oversubscribed.empty()) d.oversubscribed_link = plan::fit_ring_link(shm_oversubscribed);
  // Note [Collectives after compute] (calibration.cpp): the wait for a peer
  // not yet there (asleep, or switched out with more ranks than cores), once
  // per collective, beyond the synchronised fit; each link from its own runs.
  std::vector<double> waits, sliced_waits, ahead;
  for (const auto& ac : after_compute) {
    const plan::AfterComputeRun run{.ranks = ac.at("ranks"),
                                    .collective_seconds = ac.at("collective_seconds"),
                                    .wall_seconds = ac.at("wall_seconds"),
                                    .compute_wall_seconds = ac.at("compute_wall_seconds"),
                                    .collectives = ac.at("collectives"),
                                    .bytes = ac.at("bytes"),
                                    .ahead_wall_seconds = ac.value("ahead_wall_seconds", 0.0),
                                    .ahead_collectives = ac.value("ahead_collectives", 0),
                                    .ahead_bytes = ac.value("ahead_bytes", 0.0)};
    // The measure by the run's regime (more ranks than cores or not); the
    // link it calibrates: the time-sliced one where such runs have their own.
    const bool sliced = run.ranks > d.compute_units && !shm_oversubscribed.empty();
    (sliced ? sliced_waits : waits)
        .push_back(plan::collectives_after_compute_latency(run.ranks,
                                                           plan::collective_added_seconds(run, d.compute_units),
                                                           run.bytes, sliced ? d.oversubscribed_link : d.intra_node));
    // Note [Collectives issued ahead on time-sliced ranks] (cost_model.cpp):
    // from the time-sliced runs, on their own link.
    if (sliced && run.ahead_collectives > 0)
      ahead.push_back(plan::collectives_ahead_latency(run, d.oversubscribed_link));
  }
  if (!waits.empty()) d.intra_node.call_latency = median(waits);
  if (!sliced_waits.empty()) d.oversubscribed_link.call_latency = median(sliced_waits);
  if (!ahead.empty()) d.oversubscribed_ahead_latency = median(ahead);
  // Note [Meetings of time-sliced ranks] (calibration.cpp): ranks with a
  // core each, beyond the wait a collective after compute already pays.
  if (!meetings_fitting.empty()) d.meeting = std::max(0.0, median(meetings_fitting) - d.intra_node.call_latency);
  d.inter_node = plan::fit_ring_link(gloo);
  std::ostringstream what;
  what << "this host, calibrated: " << d.compute_units << " cores, " << std::setprecision(3) << d.fp32_flops / 1e9
       << " GFLOP/s fp32 per core";
  d.description = what.str();
  plan::write_device_file(path, d);
  out << plan::device_to_json(d) << "\n";
  err << "dtrain plan --calibrate: wrote " << path << " in " << std::fixed << std::setprecision(1)
      << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() << " s\n";
  return 0;
}

// --device-file, else --device (cpu-here: the calibrated entry when there is one).
plan::DeviceSpec chosen_device(const PlanCommandOptions& o, std::ostream& err) {
  if (!o.device_file.empty()) return plan::read_device_file(o.device_file);
  if (o.device == "cpu-here" && std::filesystem::exists(default_calibration_file())) {
    err << "dtrain plan: cpu-here from " << default_calibration_file() << " (dtrain plan --calibrate)\n";
    return plan::read_device_file(default_calibration_file());
  }
  return plan::find_device(o.device);
}

}  // namespace

int plan_command(const PlanCommandOptions& o, std::ostream& out, std::ostream& err) {
  if (o.calibrate) return calibrate(o, out, err);
  if (o.list_devices) {
    for (const auto& d : plan::device_table())
      out << std::left << std::setw(11) << d.name << " " << plan::format_bytes(static_cast<double>(d.memory_bytes))
          << ", " << d.bf16_flops / 1e12 << " TFLOP/s bf16, " << d.description << "\n";
    return 0;
  }
  DTRAIN_CHECK(!o.model.empty(), ConfigError, "dtrain plan needs a model.",
               "give --model gpt:layers=..,hidden=..,heads=..,seq=..,vocab=..");
  DTRAIN_CHECK(o.gpus > 0 && o.global_batch > 0, ConfigError, "dtrain plan needs --gpus and --global-batch.",
               "e.g. --gpus 8 --global-batch 16");
  DTRAIN_CHECK(o.weights == "megatron" || o.weights == "fp32-master", ConfigError, "--weights " << o.weights << "?",
               "use megatron or fp32-master");
  const auto model = plan::ModelSpec::parse(o.model);
  plan::Cluster cluster{.device = chosen_device(o, err), .gpus = o.gpus, .gpus_per_node = o.gpus_per_node};
  if (cluster.gpus_per_node == 0) cluster.gpus_per_node = std::min(o.gpus, cluster.device.gpus_per_node);
  const plan::CostOptions cost{
      .weights = o.weights == "megatron" ? plan::WeightLayout::kMegatron : plan::WeightLayout::kFp32Master,
      .ddp_buckets_copy_gradients = o.ddp_bucket_copy,
      .overlap_grad_reduce = !o.no_grad_overlap,
      .blocking_p2p = o.blocking_p2p,
      .allocator_factor = o.allocator_factor};
  const auto fixed = plan::FixedFields::parse(o.fixed);
  const auto start = std::chrono::steady_clock::now();
  const auto result = plan::search(
      model, cluster, {.global_batch = o.global_batch, .precision = o.precision, .fixed = fixed, .cost = cost});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  err << "dtrain plan: " << result.considered << " plans costed in " << std::fixed << std::setprecision(2) << seconds
      << " s; " << result.fitting.size() << " fit " << cluster.device.name << " ("
      << plan::format_bytes(static_cast<double>(cluster.device.memory_bytes)) << "), " << result.too_big << " do not\n";
  if (result.fitting.empty()) {
    DTRAIN_CHECK(result.smallest.has_value(), ConfigError,
                 "no well-formed plan for " << o.gpus << " GPUs and a global batch of " << o.global_batch
                                            << " with --fixed '" << o.fixed << "'.",
                 "the degrees must multiply to --gpus and the data-parallel degree divide the batch");
    const auto& s = *result.smallest;
    err << "dtrain plan: nothing fits. The smallest plan needs " << plan::format_bytes(s.peak()) << " per GPU, "
        << plan::format_bytes(s.peak() - static_cast<double>(s.device_memory_bytes)) << " more than "
        << cluster.device.name << " has.\n";
    if (o.json)
      out << s.to_json() << "\n";
    else {
      out << kHeader << "\n" << row(s) << "\n";
      breakdown(s, out);
    }
    if (!o.fixed.empty()) {
      if (auto change = plan::cheapest_fitting_change(s.plan, model, cluster, cost))
        err << "  the nearest plan that fits: " << plan::describe_change(s.plan, change->plan) << " ("
            << plan::format_bytes(change->peak()) << ", " << std::setprecision(3) << change->step_seconds
            << " s per step)\n";
      else
        err << "  no plan of any shape fits: use more GPUs, a device with more memory or a smaller model\n";
    }
    return 1;
  }
  const std::size_t shown =
      o.top <= 0 ? result.fitting.size() : std::min(result.fitting.size(), static_cast<std::size_t>(o.top));
  if (o.json) {
    for (std::size_t k = 0; k < shown; ++k) out << result.fitting[k].to_json() << "\n";
  } else {
    out << model.to_string() << " on " << o.gpus << " x " << cluster.device.name << " (" << cluster.gpus_per_node
        << " per node), global batch " << o.global_batch << ", " << o.precision << "\n"
        << kHeader << "\n";
    for (std::size_t k = 0; k < shown; ++k) out << row(result.fitting[k]) << "\n";
    out << "\nbest plan:\n" << result.fitting.front().plan.table();
    breakdown(result.fitting.front(), out);
  }
  if (!o.output.empty()) {
    std::ofstream file(o.output);
    file << result.fitting.front().plan.to_json() << "\n";
    DTRAIN_CHECK(file.good(), ConfigError, "cannot write the plan file " << o.output << ".",
                 "check the folder exists and is writable");
    err << "dtrain plan: wrote the best plan to " << o.output << "\n";
  }
  return 0;
}

}  // namespace dtrain::tools
