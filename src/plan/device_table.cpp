// The device table (device_table.h). Peaks from NVIDIA's data sheets (dense,
// no sparsity); achievable fractions and bus bandwidths as docs/planner.md
// states, from public nccl-tests and cuBLAS measurements.
#include "dtrain/plan/device_table.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "dtrain/error.h"

namespace dtrain::plan {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::int64_t gib(double g) {
  return static_cast<std::int64_t>(g * kGiB);
}

// This host: its memory and cores, shared by all the ranks on it (any
// number of processes make one "node"); an assumed 20 GFLOP/s per core of
// fp32 GEMM and shared-memory links. `dtrain plan --calibrate` measures them.
DeviceSpec cpu_here() {
  std::int64_t mem = gib(8);
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    std::istringstream fields(line);
    std::string key;
    std::int64_t kib = 0;
    if (fields >> key >> kib && key == "MemAvailable:") {
      mem = kib * 1024;
      break;
    }
  }
  const long cores = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  const double flops = 20e9 * static_cast<double>(cores);
  return {.name = "cpu-here",
          .description = "this host's CPU (" + std::to_string(cores) + " cores, assumed 20 GFLOP/s each)",
          .memory_bytes = mem,
          .bf16_flops = flops,
          .fp8_flops = 0,
          .fp32_flops = flops,
          .memory_bandwidth = 10e9,
          .gemm_efficiency = 1.0,
          .attention_efficiency = 0.5,
          .memory_efficiency = 1.0,
          .intra_node = {.bandwidth = 2e9, .latency = 20e-6},
          .inter_node = {.bandwidth = 1e9, .latency = 50e-6},
          .gpus_per_node = 64,
          .kernel_overhead = 2e-5,
          .compute_units = static_cast<int>(cores)};
}

std::vector<DeviceSpec> make_table() {
  // NVLink 3 (A100): 300 GB/s per direction, ~235 GB/s all-reduce bus
  // bandwidth in nccl-tests; NVLink 4 (H100/H200): 450 GB/s, ~370 GB/s;
  // NVLink 5 (B200): 900 GB/s, ~720 GB/s. Inter-node: one NIC per GPU,
  // HDR 200 Gb/s (A100 clusters) or NDR 400 Gb/s, at ~90 % of line rate.
  const Link nvlink3{.bandwidth = 235e9, .latency = 8e-6}, nvlink4{.bandwidth = 370e9, .latency = 6e-6},
      nvlink5{.bandwidth = 720e9, .latency = 6e-6};
  const Link hdr{.bandwidth = 22.5e9, .latency = 15e-6}, ndr{.bandwidth = 45e9, .latency = 12e-6};
  std::vector<DeviceSpec> t;
  t.push_back({.name = "a100-40gb",
               .description = "NVIDIA A100 SXM4 40 GB, NVLink 3, HDR InfiniBand",
               .memory_bytes = gib(39.4),
               .bf16_flops = 312e12,
               .fp8_flops = 0,
               .fp32_flops = 19.5e12,
               .memory_bandwidth = 1.555e12,
               .gemm_efficiency = 0.75,
               .attention_efficiency = 0.55,
               .intra_node = nvlink3,
               .inter_node = hdr});
  t.push_back(t.back());
  t.back().name = "a100-80gb";
  t.back().description = "NVIDIA A100 SXM4 80 GB, NVLink 3, HDR InfiniBand";
  t.back().memory_bytes = gib(79.2);
  t.back().memory_bandwidth = 2.039e12;
  t.push_back({.name = "h100-80gb",
               .description = "NVIDIA H100 SXM5 80 GB (700 W), NVLink 4, NDR InfiniBand",
               .memory_bytes = gib(79.1),
               .bf16_flops = 989e12,
               .fp8_flops = 1979e12,
               .fp32_flops = 67e12,
               .memory_bandwidth = 3.35e12,
               .gemm_efficiency = 0.70,
               .attention_efficiency = 0.40,
               .intra_node = nvlink4,
               .inter_node = ndr});
  // Meta's Grand Teton H100 (torchtitan's benchmarks): 96 GB HBM2e at
  // 2.4 TB/s and a 500 W power limit, which lowers sustained clocks.
  t.push_back(t.back());
  t.back().name = "h100-96gb";
  t.back().description = "NVIDIA H100 96 GB HBM2e (500 W), NVLink 4, 400 Gb/s RDMA";
  t.back().memory_bytes = gib(94.5);
  t.back().memory_bandwidth = 2.4e12;
  t.back().gemm_efficiency = 0.57;  // 0.70 x ~0.82, the 500 W cap's clock
  t.back().attention_efficiency = 0.33;
  t.push_back(t[2]);
  t.back().name = "h200";
  t.back().description = "NVIDIA H200 SXM 141 GB, NVLink 4, NDR InfiniBand";
  t.back().memory_bytes = gib(131.0);
  t.back().memory_bandwidth = 4.8e12;
  t.push_back({.name = "b200",
               .description = "NVIDIA B200 180 GB, NVLink 5, 400 Gb/s InfiniBand",
               .memory_bytes = gib(178.0),
               .bf16_flops = 2250e12,
               .fp8_flops = 4500e12,
               .fp32_flops = 80e12,
               .memory_bandwidth = 8e12,
               .gemm_efficiency = 0.70,
               .attention_efficiency = 0.40,
               .intra_node = nvlink5,
               .inter_node = ndr});
  t.push_back(cpu_here());
  return t;
}

}  // namespace

const std::vector<DeviceSpec>& device_table() {
  static const std::vector<DeviceSpec> table = make_table();
  return table;
}

DeviceSpec find_device(const std::string& name) {
  std::ostringstream names;
  for (const auto& d : device_table()) {
    if (d.name == name) return d;
    names << (names.tellp() > 0 ? ", " : "") << d.name;
  }
  DTRAIN_CHECK(false, ConfigError, "unknown device '" << name << "'.", "use one of " << names.str());
}

const Link& Cluster::link(int size, int stride) const {
  const long long span = static_cast<long long>(size) * stride;
  const bool inside = size <= 1 || (span <= gpus_per_node && gpus_per_node % span == 0);
  return inside ? device.intra_node : device.inter_node;
}

}  // namespace dtrain::plan
