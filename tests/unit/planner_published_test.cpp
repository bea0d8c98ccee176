// The planner against published large-scale results, with its own device
// table: every row printed (predicted, published, error), then the issue's
// goals checked: median absolute throughput error at most 15 %, none above
// 30 %, peak memory within 15 % where published. docs/planner.md copies the
// table this prints.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "dtrain/plan/search.h"

namespace dtrain::plan {
namespace {

struct Row {
  const char* source;
  const char* model;
  const char* device;
  int gpus;
  std::int64_t global_batch;
  const char* fixed;
  const char* metric;  // "tflops" (per GPU, hardware FLOPs) or "tokens" (per GPU and second)
  double published;
  double published_memory_gib;  // 0: not published
  bool megatron_2021;           // else torchtitan (FSDP2)
};

// How each code base keeps its weights and reduces its gradients:
// Megatron-LM 2021: fp16/bf16 weights and gradients with fp32 master copies
// in the optimizer, the gradient all-reduce after backward (its local DDP),
// pipeline sends waited on;
// torchtitan: fp32 sharded weights under bf16 autocast, reduce-scatters
// overlapped with backward.
CostOptions cost_of(const Row& row) {
  if (row.megatron_2021)
    return {.weights = WeightLayout::kMegatron, .overlap_grad_reduce = false, .blocking_p2p = true};
  return {.weights = WeightLayout::kFp32Master, .overlap_grad_reduce = true};
}

// Narayanan et al. 2021 (Megatron-LM on Selene, A100 80 GB, HDR), Table 1:
// sequence 2048, vocabulary 51200, activation recompute on, the interleaved
// schedule where pipelined. torchtitan docs/performance.md: Llama 3.1 8B on
// 8 H100 96 GB (FSDP 8, local batch 2, selective op-level recompute, seq
// 8192, no compile, bf16), and the earlier Llama 3 rows on 64 A100 80 GB
// (FSDP 64, local batch 1).
const Row kRows[] = {
    {"Megatron T1 1.7B", "gpt:layers=24,hidden=2304,heads=24,seq=2048,vocab=51200", "a100-80gb", 32, 512,
     "tp=1,pp=1,dp=32,zero=0,recompute=full", "tflops", 137, 0, true},
    {"Megatron T1 3.6B", "gpt:layers=30,hidden=3072,heads=32,seq=2048,vocab=51200", "a100-80gb", 64, 512,
     "tp=2,pp=1,dp=32,zero=0,recompute=full", "tflops", 138, 0, true},
    {"Megatron T1 7.5B", "gpt:layers=36,hidden=4096,heads=32,seq=2048,vocab=51200", "a100-80gb", 128, 512,
     "tp=4,pp=1,dp=32,zero=0,recompute=full", "tflops", 142, 0, true},
    {"Megatron T1 18.4B", "gpt:layers=40,hidden=6144,heads=48,seq=2048,vocab=51200", "a100-80gb", 256, 1024,
     "tp=8,pp=1,dp=32,zero=0,recompute=full", "tflops", 135, 0, true},
    {"Megatron T1 39.1B", "gpt:layers=48,hidden=8192,heads=64,seq=2048,vocab=51200", "a100-80gb", 512, 1536,
     "tp=8,pp=2,dp=32,zero=0,recompute=full,schedule=interleaved", "tflops", 138, 0, true},
    {"Megatron T1 76.1B", "gpt:layers=60,hidden=10240,heads=80,seq=2048,vocab=51200", "a100-80gb", 1024, 1792,
     "tp=8,pp=4,dp=32,zero=0,recompute=full,schedule=interleaved", "tflops", 140, 0, true},
    {"Megatron T1 145.6B", "gpt:layers=80,hidden=12288,heads=96,seq=2048,vocab=51200", "a100-80gb", 1536, 2304,
     "tp=8,pp=8,dp=24,zero=0,micro_batch=1,schedule=interleaved,recompute=full", "tflops", 148, 0, true},
    {"Megatron T1 310.1B", "gpt:layers=96,hidden=16384,heads=128,seq=2048,vocab=51200", "a100-80gb", 1920, 2160,
     "tp=8,pp=16,dp=15,zero=0,recompute=full,schedule=interleaved", "tflops", 155, 0, true},
    {"Megatron T1 529.6B", "gpt:layers=105,hidden=20480,heads=128,seq=2048,vocab=51200", "a100-80gb", 2520, 2520,
     "tp=8,pp=35,dp=9,zero=0,recompute=full,schedule=interleaved", "tflops", 163, 0, true},
    {"Megatron T1 1008B", "gpt:layers=128,hidden=25600,heads=160,seq=2048,vocab=51200", "a100-80gb", 3072, 3072,
     "tp=8,pp=64,dp=6,zero=0,recompute=full,schedule=interleaved", "tflops", 163, 0, true},
    {"torchtitan Llama3.1 8B H100", "llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=8192,vocab=128256",
     "h100-96gb", 8, 16, "tp=1,pp=1,cp=1,dp=8,zero=3,micro_batch=2,recompute=selective", "tokens", 5762, 82.4, false},
    {"torchtitan Llama3 8B A100x64", "llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=8192,vocab=128256",
     "a100-80gb", 64, 64, "tp=1,pp=1,cp=1,dp=64,zero=3,micro_batch=1,recompute=selective", "tokens", 2973, 0, false},
    {"torchtitan Llama3 70B A100x64", "llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,seq=8192,vocab=128256",
     "a100-80gb", 64, 64, "tp=1,pp=1,cp=1,dp=64,zero=3,micro_batch=1,recompute=full", "tokens", 331, 0, false},
};

TEST(PlannerPublished, ThroughputAndMemoryAgainstPublishedRuns) {
  std::vector<double> errors;
  std::printf("%-30s %12s %12s %8s %10s %10s %8s  plan\n", "row", "predicted", "published", "error", "memory",
              "published", "error");
  for (const Row& row : kRows) {
    const auto model = ModelSpec::parse(row.model);
    const Cluster cluster{.device = find_device(row.device), .gpus = row.gpus, .gpus_per_node = 8};
    const auto r =
        search(model, cluster,
               {.global_batch = row.global_batch, .fixed = FixedFields::parse(row.fixed), .cost = cost_of(row)});
    ASSERT_FALSE(r.fitting.empty()) << row.source << ": no plan fits; smallest needs "
                                    << (r.smallest ? format_bytes(r.smallest->peak()) : "?");
    const auto& best = r.fitting.front();
    const bool tflops = std::string(row.metric) == "tflops";
    const double predicted = tflops ? best.tflops_per_gpu : best.tokens_per_second_per_gpu;
    const double error = (predicted - row.published) / row.published;
    errors.push_back(std::abs(error));
    const double gib = best.peak() / (1024.0 * 1024 * 1024);
    char memory_error[16] = "-";
    if (row.published_memory_gib > 0)
      std::snprintf(memory_error, sizeof memory_error, "%+.1f%%",
                    100 * (gib - row.published_memory_gib) / row.published_memory_gib);
    std::printf("%-30s %12.1f %12.1f %+7.1f%% %10.1f %10s %8s  %s mb=%lld %s%s\n", row.source, predicted, row.published,
                100 * error, gib,
                row.published_memory_gib > 0 ? std::to_string(row.published_memory_gib).substr(0, 4).c_str() : "-",
                memory_error, row.metric, static_cast<long long>(best.micro_batch),
                best.plan.pp > 1
                    ? (best.plan.pipeline.schedule + " v=" + std::to_string(best.plan.pipeline.stages_per_rank)).c_str()
                    : "",
                (" " + to_string(best.plan.recompute)).c_str());
    EXPECT_LE(std::abs(error), 0.30) << row.source;
    if (row.published_memory_gib > 0) {
      EXPECT_NEAR(gib, row.published_memory_gib, 0.15 * row.published_memory_gib) << row.source;
    }
  }
  std::sort(errors.begin(), errors.end());
  const double median =
      errors.size() % 2 ? errors[errors.size() / 2] : (errors[errors.size() / 2 - 1] + errors[errors.size() / 2]) / 2;
  std::printf("median absolute throughput error %.1f%%, largest %.1f%%\n", 100 * median, 100 * errors.back());
  EXPECT_LE(median, 0.15);
}

}  // namespace
}  // namespace dtrain::plan
