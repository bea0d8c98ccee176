// Context-parallel causal attention (see context_parallel.h).
//
// Note [Context-parallel ring]
// Rank r of c holds chunks r and 2c-1-r of the 2c chunks of the sequence
// (zig-zag), L = T/c rows: its first half (chunk r) comes before its second
// half (chunk 2c-1-r) in the sequence, so its own block is plain causal
// attention over the L rows. Against the K/V block of another rank j:
//   j < r: both query chunks come after chunk j and before chunk 2c-1-j, so
//          all L queries attend the first half of j's keys, unmasked;
//   j > r: chunk r comes before both of j's chunks (it sees nothing), and
//          chunk 2c-1-r after both: the second half of the queries attends
//          all L keys, unmasked.
// Every step but the first is L x L/2 (or L/2 x L) scores on every rank, so
// the causal work is balanced (a contiguous split leaves the last rank c
// times the first's).
//
// Each block gives its output O_b and the log-sum-exp l_b of each query row
// (block_attention.h). Rows are merged with online softmax, in fp32:
//   l = logaddexp(l_acc, l_b),  O = O_acc exp(l_acc - l) + O_b exp(l_b - l).
// Backward uses the merged O and l with each block again (the flash backward
// of a block, given the row's final O and l, is the block's exact share of
// dq, dk, dv), so only q, k, v, O and l are kept from forward.
//
// Ring (kRing): at step s rank r holds the block of rank (r - s) mod c and,
// while computing with it, sends it to rank r+1 and receives the next one
// from rank r-1 (one batched send/recv of K and V stacked, [2, B, H, L, D]).
// Backward passes the blocks round again with an fp32 accumulator of their
// dK, dV beside them: each rank adds its share and sends the accumulator on;
// after c steps (c sends of the accumulator) each comes home complete.
// All-gather (kAllGather): one all-gather of the stacked K/V in forward and
// again in backward; the dK/dV of all c blocks in one reduce-scatter (sum).
#include "dtrain/nn/context_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <optional>
#include <vector>

#include "block_attention.h"
#include "dtrain/error.h"
#include "group_capsule.h"

namespace dtrain::nn::cp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int kKvTag = 0;
constexpr int kGradTag = 1;

// Which rows of this rank's queries attend which rows of a block (see the Note).
struct Task {
  std::int64_t q_begin, q_length, k_begin, k_length;
  bool causal;
};

Task task_for(int rank, int source, std::int64_t local) {
  const std::int64_t half = local / 2;
  if (source == rank) return {0, local, 0, local, true};
  if (source < rank) return {0, local, 0, half, false};
  return {half, half, 0, local, false};
}

at::Tensor rows(const at::Tensor& x, std::int64_t begin, std::int64_t length) {
  return x.narrow(2, begin, length);
}

// Task `t`'s block of the attention dropout `z` ([B, H, L, T]: this rank's
// rows against every key in sequence order): its query rows, and the
// columns of the keys it attends, rows [k_begin, k_begin + k_length) of
// rank `source`'s zig-zag part. Undefined without dropout.
at::Tensor dropout_block(const at::Tensor& z, const Task& t, int cp, int source, std::int64_t local) {
  if (!z.defined()) return {};
  const at::Tensor keys =
      zigzag_positions(local * cp, cp, source, z.options().dtype(at::kLong)).narrow(0, t.k_begin, t.k_length);
  return rows(z, t.q_begin, t.q_length).index_select(3, keys);
}

// One ring step: `block` to the next rank, the previous rank's into a new tensor.
class RingShift {
 public:
  RingShift(dist::ProcessGroup& group, const at::Tensor& block, int tag) : received_(at::empty_like(block)) {
    const int c = group.size(), r = group.rank();
    ops_ = {{.kind = dist::P2POp::Kind::kSend, .tensor = block, .peer = (r + 1) % c, .tag = tag},
            {.kind = dist::P2POp::Kind::kRecv, .tensor = received_, .peer = (r + c - 1) % c, .tag = tag}};
    works_ = group.batch_isend_irecv(ops_);
  }
  at::Tensor wait() {
    for (auto& w : works_) w.wait();
    return received_;
  }

 private:
  at::Tensor received_;
  std::vector<dist::P2POp> ops_;
  std::vector<dist::Work> works_;
};

// Every rank's stacked K/V, [c, 2, B, H, L, D], rank j's at j.
at::Tensor gather_blocks(dist::ProcessGroup& group, const at::Tensor& kv) {
  auto sizes = kv.sizes().vec();
  sizes.insert(sizes.begin(), group.size());
  at::Tensor all = at::empty(sizes, kv.options());
  group.all_gather_into(all, kv).wait();
  return all;
}

struct Config {
  KvExchange exchange;
  BlockKernel kernel;
  double scale;
};

// The merged output and log-sum-exp of this rank's rows (see the Note).
class Merged {
 public:
  void add(const Task& t, const detail::BlockResult& b) {
    if (!out_.defined()) {  // the first block, its own, covers every row
      out_ = b.out.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
      lse_ = b.lse;
      return;
    }
    at::Tensor o = rows(out_, t.q_begin, t.q_length);
    at::Tensor l = lse_.narrow(2, t.q_begin, t.q_length);
    const at::Tensor merged = at::logaddexp(l, b.lse);
    o.mul_((l - merged).exp_().unsqueeze(-1)).add_(b.out.to(at::kFloat) * (b.lse - merged).exp_().unsqueeze(-1));
    l.copy_(merged);
  }
  at::Tensor out() const { return out_; }
  at::Tensor lse() const { return lse_; }

 private:
  at::Tensor out_, lse_;
};

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& dropout, dist::ProcessGroup& group,
                                                     const Config& config) {
  const int c = group.size(), r = group.rank();
  const std::int64_t local = q.size(2);
  Merged merged;
  auto attend = [&](int source, const at::Tensor& kv) {
    const Task t = task_for(r, source, local);
    merged.add(t, detail::block_forward(rows(q, t.q_begin, t.q_length), rows(kv[0], t.k_begin, t.k_length),
                                        rows(kv[1], t.k_begin, t.k_length), t.causal, config.scale, config.kernel,
                                        dropout_block(dropout, t, c, source, local)));
  };
  const at::Tensor kv = at::stack({k, v});
  if (config.exchange == KvExchange::kAllGather && c > 1) {
    const at::Tensor all = gather_blocks(group, kv);
    for (int s = 0; s < c; ++s) attend((r + c - s) % c, all[(r + c - s) % c]);
  } else {
    at::Tensor current = kv;
    for (int s = 0; s < c; ++s) {
      std::optional<RingShift> next;
      if (s + 1 < c) next.emplace(group, current, kKvTag);  // overlaps this step's attention
      attend((r + c - s) % c, current);
      if (next) current = next->wait();
    }
  }
  return {merged.out().to(q.scalar_type()), merged.lse()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const at::Tensor& dout, const at::Tensor& q,
                                                                  const at::Tensor& k, const at::Tensor& v,
                                                                  const at::Tensor& out, const at::Tensor& lse,
                                                                  const at::Tensor& dropout, dist::ProcessGroup& group,
                                                                  const Config& config) {
  const int c = group.size(), r = group.rank();
  const std::int64_t local = q.size(2);
  at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
  // Adds this rank's share of block `source`'s gradients into dkv ([2, B, H, L, D], fp32).
  auto attend = [&](int source, const at::Tensor& kv, at::Tensor& dkv) {
    const Task t = task_for(r, source, local);
    auto [dq_b, dk_b, dv_b] = detail::block_backward(
        rows(dout, t.q_begin, t.q_length), rows(q, t.q_begin, t.q_length), rows(kv[0], t.k_begin, t.k_length),
        rows(kv[1], t.k_begin, t.k_length), rows(out, t.q_begin, t.q_length), lse.narrow(2, t.q_begin, t.q_length),
        t.causal, config.scale, config.kernel, dropout_block(dropout, t, c, source, local));
    rows(dq, t.q_begin, t.q_length).add_(dq_b);
    rows(dkv[0], t.k_begin, t.k_length).add_(dk_b);
    rows(dkv[1], t.k_begin, t.k_length).add_(dv_b);
  };
  const at::Tensor kv = at::stack({k, v});
  at::Tensor dkv;
  if (config.exchange == KvExchange::kAllGather && c > 1) {
    const at::Tensor all = gather_blocks(group, kv);
    at::Tensor grads = at::zeros(all.sizes(), all.options().dtype(at::kFloat));
    for (int s = 0; s < c; ++s) {
      const int source = (r + c - s) % c;
      at::Tensor g = grads[source];
      attend(source, all[source], g);
    }
    dkv = at::empty(kv.sizes(), grads.options());
    group.reduce_scatter(dkv, grads).wait();
  } else {
    at::Tensor current = kv;
    dkv = at::zeros(kv.sizes(), kv.options().dtype(at::kFloat));
    for (int s = 0; s < c; ++s) {
      std::optional<RingShift> next_kv;
      if (s + 1 < c) next_kv.emplace(group, current, kKvTag);
      attend((r + c - s) % c, current, dkv);
      if (c == 1) break;
      RingShift next_grad(group, dkv, kGradTag);  // after the last step, each accumulator goes home
      if (next_kv) current = next_kv->wait();
      dkv = next_grad.wait();
    }
  }
  const auto type = q.scalar_type();
  return {dq.to(type), dkv[0].to(type), dkv[1].to(type)};
}

struct ContextParallelAttention : torch::autograd::Function<ContextParallelAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::IValue& dropout_scale, const c10::IValue& group_capsule, std::int64_t exchange,
                            std::int64_t kernel, double scale) {
    dist::ProcessGroup group = nn::detail::group_in(group_capsule);
    const Config config{static_cast<KvExchange>(exchange), static_cast<BlockKernel>(kernel), scale};
    // The dropout (None without it) is no input autograd tracks: a detached
    // tensor kept in saved_data.
    const at::Tensor dropout = dropout_scale.isTensor() ? dropout_scale.toTensor() : at::Tensor();
    auto [out, lse] = attention_forward(q, k, v, dropout, group, config);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["dropout"] = dropout_scale;
    ctx->saved_data["group"] = group_capsule;
    ctx->saved_data["exchange"] = exchange;
    ctx->saved_data["kernel"] = kernel;
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    dist::ProcessGroup group = nn::detail::group_in(ctx->saved_data["group"]);
    const Config config{static_cast<KvExchange>(ctx->saved_data["exchange"].toInt()),
                        static_cast<BlockKernel>(ctx->saved_data["kernel"].toInt()),
                        ctx->saved_data["scale"].toDouble()};
    // Every rank passes the ring in backward even with no gradient here, so
    // the others are not left waiting.
    const at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(saved[3]);
    const c10::IValue& dropout_scale = ctx->saved_data["dropout"];
    const at::Tensor dropout = dropout_scale.isTensor() ? dropout_scale.toTensor() : at::Tensor();
    auto [dq, dk, dv] =
        attention_backward(dout, saved[0], saved[1], saved[2], saved[3], saved[4], dropout, group, config);
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void check_part(const at::Tensor& x, const char* what, const at::Tensor& q) {
  DTRAIN_CHECK(x.dim() == 4 && x.sizes() == q.sizes(), ConfigError,
               "context-parallel attention: " << what << " has shape " << x.sizes() << ", q " << q.sizes() << ".",
               "pass q, k and v as [batch, heads, local sequence, head dim], all of one shape");
}

}  // namespace

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, dist::ProcessGroup group,
                            const AttentionOptions& options) {
  check_part(q, "q", q);
  check_part(k, "k", q);
  check_part(v, "v", q);
  DTRAIN_CHECK(q.size(2) % 2 == 0, ConfigError,
               "context-parallel attention: this rank's part of the sequence has " << q.size(2)
                                                                                   << " rows, which is not two equal "
                                                                                      "zig-zag chunks.",
               "make the sequence length a multiple of 2 x cp (" << 2 * group.size() << ")");
  if (const at::Tensor& z = options.dropout_scale; z.defined()) {
    const std::vector<std::int64_t> want{q.size(0), q.size(1), q.size(2), q.size(2) * group.size()};
    DTRAIN_CHECK(z.sizes() == at::IntArrayRef(want), ConfigError,
                 "context-parallel attention: dropout_scale has shape " << z.sizes() << ", this rank's rows against "
                                                                        << "the whole sequence are "
                                                                        << at::IntArrayRef(want) << ".",
                 "pass this rank's zig-zag rows of the whole sequence's [B, H, T, T] dropout (zigzag_shard on dim 2)");
  }
  const double scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  const c10::IValue capsule = nn::detail::capsule_of(std::move(group));
  const c10::IValue dropout =
      options.dropout_scale.defined() ? c10::IValue(options.dropout_scale.detach()) : c10::IValue();
  return ContextParallelAttention::apply(q, k, v, dropout, capsule, static_cast<std::int64_t>(options.exchange),
                                         static_cast<std::int64_t>(options.kernel), scale);
}

at::Tensor zigzag_shard(const at::Tensor& x, int cp, int rank, std::int64_t dim) {
  const std::int64_t d = dim < 0 ? dim + x.dim() : dim;
  DTRAIN_CHECK(d >= 0 && d < x.dim() && x.size(d) % (2 * cp) == 0, ConfigError,
               "context parallelism cuts dimension " << dim << " of a tensor of shape " << x.sizes() << " into "
                                                     << 2 * cp << " zig-zag chunks, which does not divide it.",
               "make the sequence length a multiple of 2 x cp (" << 2 * cp << ")");
  if (cp == 1) return x;
  const auto chunks = x.chunk(2 * cp, d);
  return at::cat({chunks[static_cast<std::size_t>(rank)], chunks[static_cast<std::size_t>(2 * cp - 1 - rank)]}, d);
}

at::Tensor zigzag_positions(std::int64_t seq, int cp, int rank, const at::TensorOptions& options) {
  return zigzag_shard(at::arange(seq, options.dtype(at::kLong)), cp, rank, 0);
}

at::Tensor mean_loss(const at::Tensor& loss, dist::ProcessGroup group) {
  if (group.size() == 1) return loss;
  at::Tensor total = loss.detach().to(group.device(), at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  group.all_reduce(total).wait();
  const at::Tensor mean = total.div_(group.size()).to(loss.device(), loss.scalar_type());
  return loss + (mean - loss.detach());
}

}  // namespace dtrain::nn::cp
