// DDP's built-in communication hooks (dtrain::hooks): plain averaging, fp16
// and bf16 compression, and PowerSGD, all on the public CommHook interface
// and talking only through dtrain's ProcessGroup.
//
// Note [PowerSGD worker]
// PowerSGD needs three dependent all-reduces per bucket (uncompressed
// tensors, P, Q) with local math between them. torch's Python hook chains
// them through future callbacks that block inside the backend's worker
// threads; with several buckets in flight that can exhaust Gloo's two
// threads. Here each bucket becomes a job for one dedicated worker thread
// (a SerialExecutor), which runs the jobs in arrival order (DDP hands buckets
// over in the same order on every rank, so collectives match across ranks)
// while the backward thread carries on. The hook returns the job's future;
// DDP waits on it when backward finalises.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/core/ivalue.h>

#include <map>

#include "../../core/serial_executor.h"
#include "dtrain/error.h"
#include "dtrain/parallel/ddp/comm_hook.h"

namespace dtrain {
namespace {

// Multiplies by 1/size, then sums: the rounding of torch DDP's default path
// (its Reducer without a hook, and DDP here without one: ddp.cpp); torch's
// Python allreduce_hook divides, which differs from this in the last bit for
// group sizes that are not powers of two.
dist::Future average(dist::ProcessGroup& group, at::Tensor& buffer) {
  buffer.mul_(1.0 / group.size());
  return group.all_reduce(buffer).future();
}

class AllReduceHook : public CommHook {
 public:
  dist::Future run(dist::ProcessGroup& group, GradBucket& bucket) override { return average(group, bucket.buffer); }
};

// Averages a copy of the bucket in `dtype`, then writes it back.
class CompressHook : public CommHook {
 public:
  explicit CompressHook(at::ScalarType dtype) : dtype_(dtype) {}

  dist::Future run(dist::ProcessGroup& group, GradBucket& bucket) override {
    // Divide before reducing, so the sum cannot overflow the narrow type.
    at::Tensor compressed = bucket.buffer.to(dtype_).div_(group.size());
    at::Tensor out = bucket.buffer;
    return group.all_reduce(compressed)
        .future()
        ->then(
            [out, compressed](c10::ivalue::Future&) {
              out.copy_(compressed);
              return c10::IValue(out);
            },
            c10::TensorType::get());
  }

 private:
  at::ScalarType dtype_;
};

// Orthonormalises the columns of `m` (n x r) in place.
void orthogonalize(at::Tensor& m) {
  auto [q, r] = at::linalg_qr(m, "reduced");
  m.copy_(q);
}

class PowerSgdHook : public CommHook {
 public:
  explicit PowerSgdHook(PowerSgdOptions options) : options_(options) {}

  dist::Future run(dist::ProcessGroup& group, GradBucket& bucket) override {
    if (iteration_ < options_.start_iteration) {
      // Warm-up: plain averaged all-reduce.
      if (bucket.is_last) ++iteration_;
      return average(group, bucket.buffer);
    }
    if (bucket.is_last) ++iteration_;
    return worker_.post(c10::IValue(bucket.buffer),
                        [this, group, job = bucket]() mutable { compress_and_reduce(group, job); });
  }

 private:
  struct Memory {
    at::Tensor error;
    at::Tensor p;
    at::Tensor q;
  };

  // torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook, one bucket.
  void compress_and_reduce(dist::ProcessGroup& group, GradBucket& job) {
    const int world = group.size();
    Memory& mem = memory_[job.index];
    at::Tensor& input = job.buffer;
    at::Tensor input_copy;
    if (options_.use_error_feedback) {
      if (mem.error.defined() && mem.error.sizes() == input.sizes()) {
        input.add_(mem.error);
      } else {
        mem.error = at::zeros_like(input);
      }
      input_copy = input.clone();
    }

    std::vector<at::Tensor> matrices, uncompressed;
    std::vector<std::int64_t> p_sizes, q_sizes;
    std::int64_t p_total = 0, q_total = 0;
    for (const auto& g : job.gradients) {
      if (g.dim() >= 2) {
        const std::int64_t n = g.size(0), m = g.numel() / n;
        const std::int64_t r = std::min<std::int64_t>({n, m, options_.matrix_approximation_rank});
        if (static_cast<double>(n * m) > static_cast<double>((n + m) * r) * options_.min_compression_rate) {
          matrices.push_back(g.view({n, m}));
          p_sizes.push_back(n * r);
          q_sizes.push_back(m * r);
          p_total += n * r;
          q_total += m * r;
          continue;
        }
      }
      uncompressed.push_back(g);
    }

    // Uncompressed tensors: one averaged all-reduce of their concatenation.
    if (!uncompressed.empty()) {
      std::vector<at::Tensor> flat_parts;
      flat_parts.reserve(uncompressed.size());
      for (const auto& t : uncompressed) flat_parts.push_back(t.reshape(-1));
      at::Tensor flat = at::cat(flat_parts).div_(world);
      group.all_reduce(flat).wait();
      std::int64_t offset = 0;
      for (auto& t : uncompressed) {
        t.copy_(flat.slice(0, offset, offset + t.numel()).view_as(t));
        offset += t.numel();
      }
    }

    if (!matrices.empty()) {
      const bool fresh = !mem.p.defined() || mem.p.numel() != p_total || mem.q.numel() != q_total;
      if (fresh) {
        mem.p = at::empty({p_total}, input.options());
        mem.q = at::empty({q_total}, input.options());
      }
      std::vector<at::Tensor> ps, qs;
      std::int64_t p_off = 0, q_off = 0;
      for (std::size_t i = 0; i < matrices.size(); ++i) {
        const std::int64_t n = matrices[i].size(0), m = matrices[i].size(1);
        const std::int64_t r = p_sizes[i] / n;
        ps.push_back(mem.p.slice(0, p_off, p_off + p_sizes[i]).view({n, r}));
        qs.push_back(mem.q.slice(0, q_off, q_off + q_sizes[i]).view({m, r}));
        p_off += p_sizes[i];
        q_off += q_sizes[i];
      }
      if (fresh || !options_.warm_start) {
        // The same seed on every rank: every rank starts from the same Q.
        auto generator = at::make_generator<at::CPUGeneratorImpl>(options_.seed + 7919 * (random_draws_++));
        for (auto& q : qs) {
          q.copy_(at::randn(q.sizes(), generator, at::TensorOptions().dtype(q.scalar_type())));
          orthogonalize(q);
        }
      }
      for (std::size_t i = 0; i < matrices.size(); ++i) at::matmul_out(ps[i], matrices[i], qs[i]);
      group.all_reduce(mem.p).wait();
      for (auto& p : ps) orthogonalize(p);
      for (std::size_t i = 0; i < matrices.size(); ++i) at::matmul_out(qs[i], matrices[i].t(), ps[i]);
      group.all_reduce(mem.q).wait();
      mem.q.div_(world);
      for (std::size_t i = 0; i < matrices.size(); ++i) at::matmul_out(matrices[i], ps[i], qs[i].t());
    }

    if (options_.use_error_feedback) mem.error = at::sub(input_copy, input);
    if (!options_.warm_start) {
      mem.p = at::Tensor();
      mem.q = at::Tensor();
    }
  }

  PowerSgdOptions options_;
  int iteration_ = 0;
  std::uint64_t random_draws_ = 0;
  std::map<std::size_t, Memory> memory_;  // by bucket index; touched by the worker only

  SerialExecutor worker_;  // last: destroyed (drained, joined) before what its jobs use
};

}  // namespace

namespace hooks {

std::shared_ptr<CommHook> all_reduce() {
  return std::make_shared<AllReduceHook>();
}
std::shared_ptr<CommHook> fp16_compress() {
  return std::make_shared<CompressHook>(at::kHalf);
}
std::shared_ptr<CommHook> bf16_compress() {
  return std::make_shared<CompressHook>(at::kBFloat16);
}

std::shared_ptr<CommHook> powersgd(const PowerSgdOptions& options) {
  DTRAIN_CHECK(options.matrix_approximation_rank >= 1, ConfigError,
               "PowerSGD matrix_approximation_rank=" << options.matrix_approximation_rank << " must be at least 1.",
               "use 1 to 4 for most models");
  DTRAIN_CHECK(options.start_iteration >= 2, ConfigError,
               "PowerSGD start_iteration=" << options.start_iteration << " must be at least 2.",
               "DDP rebuilds its gradient buckets after the first iteration; start compressing after that");
  DTRAIN_CHECK(options.min_compression_rate >= 1.0, ConfigError,
               "PowerSGD min_compression_rate=" << options.min_compression_rate << " must be at least 1.",
               "the default 2 compresses only tensors that at least halve");
  return std::make_shared<PowerSgdHook>(options);
}

}  // namespace hooks
}  // namespace dtrain
