// DDP communication hooks that c10d ships only in Python: bf16 compression
// and PowerSGD. (fp16 compression and plain all-reduce are c10d built-ins.)
//
// Note [PowerSGD worker]
// PowerSGD needs three dependent all-reduces per bucket (uncompressed
// tensors, P, Q) with local math between them. torch's Python hook chains
// them through future callbacks that block inside the backend's worker
// threads; with several buckets in flight that can exhaust Gloo's two
// threads. Here each bucket becomes a job for one dedicated worker thread,
// which runs the jobs in arrival order (the Reducer hands buckets over in the
// same order on every rank, so collectives match across ranks) while the
// autograd thread carries on with backward. The hook returns a future the
// worker completes; the Reducer waits on it when backward finalises.
#include "comm_hooks.h"

#include "bucket_worker.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <map>

#include "dtrain/error.h"
#include "dtrain/log.h"

namespace dtrain::detail {
namespace {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

class Bf16CompressHook : public c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>> {
 public:
  using CppCommHookInterface::CppCommHookInterface;

  FuturePtr runHook(c10d::GradBucket& bucket) override {
    at::Tensor compressed = bucket.getBufferRef().to(at::kBFloat16).div_(state_->getSize());
    std::vector<at::Tensor> tensors{compressed};
    auto reduced = state_->allreduce(tensors)->getFuture();
    at::Tensor out = bucket.getBufferRef();
    return reduced->then(
        [out](c10::ivalue::Future& f) {
          out.copy_(f.value().toTensorVector().at(0));
          return c10::IValue(out);
        },
        c10::TensorType::get());
  }
};

// Orthonormalises the columns of `m` (n x r) in place.
void orthogonalize(at::Tensor& m) {
  auto [q, r] = at::linalg_qr(m, "reduced");
  m.copy_(q);
}

class PowerSgdHook : public c10d::CommHookInterface {
 public:
  PowerSgdHook(c10::intrusive_ptr<c10d::ProcessGroup> group, PowerSgdOptions options)
      : group_(std::move(group)), options_(options) {}

  FuturePtr runHook(c10d::GradBucket& bucket) override {
    if (iteration_ < options_.start_iteration) {
      // Warm-up: plain averaged all-reduce.
      if (bucket.isLast()) ++iteration_;
      std::vector<at::Tensor> tensors{bucket.getBufferRef().div_(group_->getSize())};
      auto reduced = group_->allreduce(tensors)->getFuture();
      at::Tensor out = bucket.getBufferRef();
      return reduced->then([out](c10::ivalue::Future&) { return c10::IValue(out); }, c10::TensorType::get());
    }
    Job job{bucket.getIndex(), bucket.getBufferRef(), bucket.getGradients()};
    if (bucket.isLast()) ++iteration_;
    return worker_.post(job.buffer, [this, job]() mutable { compress_and_reduce(job); });
  }

  at::Tensor parseHookResult(const c10::IValue& result) override { return result.toTensor(); }

 private:
  struct Job {
    std::size_t index;
    at::Tensor buffer;
    std::vector<at::Tensor> gradients;  // views into buffer
  };
  struct Memory {
    at::Tensor error;
    at::Tensor p;
    at::Tensor q;
  };

  void all_reduce(at::Tensor& t) {
    std::vector<at::Tensor> tensors{t};
    group_->allreduce(tensors)->wait();
  }

  // torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook, one bucket.
  void compress_and_reduce(Job& job) {
    const int world = group_->getSize();
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
      for (const auto& t : uncompressed) flat_parts.push_back(t.reshape(-1));
      at::Tensor flat = at::cat(flat_parts).div_(world);
      all_reduce(flat);
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
      all_reduce(mem.p);
      for (auto& p : ps) orthogonalize(p);
      for (std::size_t i = 0; i < matrices.size(); ++i) at::matmul_out(qs[i], matrices[i].t(), ps[i]);
      all_reduce(mem.q);
      mem.q.div_(world);
      for (std::size_t i = 0; i < matrices.size(); ++i) at::matmul_out(matrices[i], ps[i], qs[i].t());
    }

    if (options_.use_error_feedback) mem.error = input_copy - input;
    if (!options_.warm_start) {
      mem.p = at::Tensor();
      mem.q = at::Tensor();
    }
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  PowerSgdOptions options_;
  int iteration_ = 0;
  std::uint64_t random_draws_ = 0;
  std::map<std::size_t, Memory> memory_;  // by bucket index; touched by the worker only

  BucketWorker worker_;  // last: destroyed (drained, joined) before what its jobs use
};

}  // namespace

std::unique_ptr<c10d::CommHookInterface> make_bf16_hook(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  return std::make_unique<Bf16CompressHook>(std::move(group));
}

std::unique_ptr<c10d::CommHookInterface> make_powersgd_hook(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                            const PowerSgdOptions& options) {
  DTRAIN_CHECK(options.matrix_approximation_rank >= 1, ConfigError,
               "PowerSGD matrix_approximation_rank=" << options.matrix_approximation_rank << " must be at least 1.",
               "use 1 to 4 for most models");
  DTRAIN_CHECK(options.start_iteration >= 2, ConfigError,
               "PowerSGD start_iteration=" << options.start_iteration << " must be at least 2.",
               "DDP rebuilds its gradient buckets after the first iteration; start compressing after that");
  DTRAIN_CHECK(options.min_compression_rate >= 1.0, ConfigError,
               "PowerSGD min_compression_rate=" << options.min_compression_rate << " must be at least 1.",
               "the default 2 compresses only tensors that at least halve");
  return std::make_unique<PowerSgdHook>(std::move(group), options);
}

}  // namespace dtrain::detail
