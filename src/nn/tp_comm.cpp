// Tensor- and sequence-parallel communication operators (see tp_comm.h).
//
// One autograd Function, RegionComm, carries a forward and a backward
// primitive (identity, all-reduce, all-gather, slice, reduce-scatter); each
// public operator is a pair of them. The group travels to backward inside a
// capsule in the context's saved data (group_capsule.h).
#include "dtrain/nn/tp_comm.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include "dtrain/error.h"
#include "dtrain/nn/linear.h"
#include "group_capsule.h"

namespace dtrain::nn::tp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

enum class Primitive : std::int64_t { kIdentity, kAllReduce, kAllGather, kSlice, kReduceScatter };

const char* name_of(Primitive p) {
  switch (p) {
    case Primitive::kIdentity: return "identity";
    case Primitive::kAllReduce: return "all_reduce";
    case Primitive::kAllGather: return "all_gather";
    case Primitive::kSlice: return "slice";
    case Primitive::kReduceScatter: return "reduce_scatter";
  }
  return "?";
}

std::int64_t wrap_dim(std::int64_t dim, const at::Tensor& x) {
  const std::int64_t n = x.dim();
  DTRAIN_CHECK(dim >= -n && dim < n, ConfigError,
               "tensor-parallel communication along dimension " << dim << " of a tensor of shape " << x.sizes(),
               "pass a dimension in " << -n << ".." << n - 1);
  return dim < 0 ? dim + n : dim;
}

void check_divisible(const at::Tensor& x, std::int64_t dim, int parts, Primitive p) {
  DTRAIN_CHECK(x.size(dim) % parts == 0, ConfigError,
               "tensor parallelism: " << name_of(p) << " splits dimension " << dim << " of size " << x.size(dim)
                                      << " (shape " << x.sizes() << ") into " << parts
                                      << " ranks, which does not divide it.",
               "make that size a multiple of the tensor-parallel degree " << parts);
}

at::Tensor all_reduce(const at::Tensor& x, dist::ProcessGroup& group) {
  at::Tensor out = x.contiguous().clone();
  group.all_reduce(out).wait();
  return out;
}

// Rank r's piece of the result is rank r's x, concatenated along `dim`.
at::Tensor all_gather(const at::Tensor& x, dist::ProcessGroup& group, std::int64_t dim) {
  const at::Tensor local = x.contiguous();
  const int parts = group.size();
  auto sizes = local.sizes().vec();
  at::Tensor flat = at::empty({parts * local.numel()}, local.options());
  group.all_gather_into(flat, local).wait();
  sizes.insert(sizes.begin(), parts);
  const at::Tensor pieces = flat.view(sizes);  // [parts, *local]
  if (dim == 0) {
    sizes.erase(sizes.begin());
    sizes[0] *= parts;
    return pieces.view(sizes);
  }
  return at::cat(pieces.unbind(0), dim);
}

at::Tensor slice(const at::Tensor& x, dist::ProcessGroup& group, std::int64_t dim) {
  check_divisible(x, dim, group.size(), Primitive::kSlice);
  return x.chunk(group.size(), dim)[static_cast<std::size_t>(group.rank())].contiguous();
}

// Rank r gets the sum over ranks of their piece r along `dim`.
at::Tensor reduce_scatter(const at::Tensor& x, dist::ProcessGroup& group, std::int64_t dim) {
  const int parts = group.size();
  check_divisible(x, dim, parts, Primitive::kReduceScatter);
  // The collective takes the pieces one after another in memory.
  const at::Tensor pieces = dim == 0 ? x.contiguous() : at::stack(x.chunk(parts, dim)).contiguous();
  auto sizes = x.sizes().vec();
  sizes[static_cast<std::size_t>(dim)] /= parts;
  at::Tensor out = at::empty(sizes, x.options());
  group.reduce_scatter(out, pieces).wait();
  return out;
}

at::Tensor run(Primitive p, const at::Tensor& x, dist::ProcessGroup& group, std::int64_t dim) {
  if (group.size() == 1) return x;
  switch (p) {
    case Primitive::kIdentity: return x;
    case Primitive::kAllReduce: return all_reduce(x, group);
    case Primitive::kAllGather: return all_gather(x, group, dim);
    case Primitive::kSlice: return slice(x, group, dim);
    case Primitive::kReduceScatter: return reduce_scatter(x, group, dim);
  }
  DTRAIN_INTERNAL_ASSERT(false, "unknown tensor-parallel primitive");
  return x;
}

struct RegionComm : torch::autograd::Function<RegionComm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const c10::IValue& group_capsule,
                            std::int64_t forward_op, std::int64_t backward_op, std::int64_t dim) {
    ctx->saved_data["group"] = group_capsule;
    ctx->saved_data["backward_op"] = backward_op;
    ctx->saved_data["dim"] = dim;
    dist::ProcessGroup group = detail::group_in(group_capsule);
    at::Tensor y = run(static_cast<Primitive>(forward_op), x, group, dim);
    // An identity forward returns a new tensor: autograd needs an output
    // that is not the input itself.
    return y.is_same(x) ? x.view(x.sizes()) : y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    dist::ProcessGroup group = detail::group_in(ctx->saved_data["group"]);
    const auto op = static_cast<Primitive>(ctx->saved_data["backward_op"].toInt());
    const std::int64_t dim = ctx->saved_data["dim"].toInt();
    at::Tensor dx = grads[0].defined() ? run(op, grads[0], group, dim) : at::Tensor();
    return {dx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor apply(const at::Tensor& x, dist::ProcessGroup group, Primitive forward, Primitive backward,
                 std::int64_t dim) {
  if (group.size() == 1) return x;
  const std::int64_t d = wrap_dim(dim, x);
  // Checked before any rank communicates, so a bad size fails on every rank
  // alike instead of leaving the others waiting.
  if (forward == Primitive::kSlice || forward == Primitive::kReduceScatter)
    check_divisible(x, d, group.size(), forward);
  const c10::IValue capsule = detail::capsule_of(std::move(group));
  return RegionComm::apply(x, capsule, static_cast<std::int64_t>(forward), static_cast<std::int64_t>(backward), d);
}

// Products of gathered_linear: oneDNN's where nn::linear would use it, at::mm
// otherwise (other dtypes, autocast's bf16).
at::Tensor product(const at::Tensor& a, const at::Tensor& b) {
  const bool fp32_cpu = a.device().is_cpu() && a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat;
  return fp32_cpu && onednn_linear_enabled() ? onednn_mm(a, b) : at::mm(a, b);
}

// See gathered_linear in tp_comm.h. Saved: the local input and the weight;
// the compute dtype (the autocast dtype or the input's) in saved_data.
struct GatheredLinear : torch::autograd::Function<GatheredLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const c10::IValue& group_capsule, std::int64_t dim) {
    dist::ProcessGroup group = detail::group_in(group_capsule);
    const bool autocast = at::autocast::is_autocast_enabled(at::kCPU) && x.device().is_cpu();
    const at::ScalarType dtype = autocast ? at::autocast::get_autocast_dtype(at::kCPU) : x.scalar_type();
    ctx->save_for_backward({x, weight});
    ctx->saved_data["group"] = group_capsule;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["dtype"] = static_cast<std::int64_t>(dtype);
    const at::Tensor total = run(Primitive::kAllGather, x, group, dim).to(dtype);
    auto sizes = total.sizes().vec();
    sizes.back() = weight.size(0);
    return product(total.reshape({-1, total.size(-1)}), weight.to(dtype).t()).view(sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    DTRAIN_CHECK(!at::GradMode::is_enabled(), ConfigError,
                 "higher-order gradients through a sequence-parallel column layer are not supported.",
                 "call backward without create_graph");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    dist::ProcessGroup group = detail::group_in(ctx->saved_data["group"]);
    const std::int64_t dim = ctx->saved_data["dim"].toInt();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    const at::Tensor dy = grads[0].to(dtype).reshape({-1, grads[0].size(-1)});
    at::Tensor dx, dweight;
    if (ctx->needs_input_grad(1)) {
      // The input again, gathered: the forward kept only this rank's part.
      const at::Tensor total = run(Primitive::kAllGather, x, group, dim).to(dtype);
      dweight = product(dy.t(), total.reshape({-1, total.size(-1)})).to(weight.scalar_type());
    }
    if (ctx->needs_input_grad(0)) {
      auto sizes = grads[0].sizes().vec();
      sizes.back() = weight.size(1);
      const at::Tensor dtotal = product(dy, weight.to(dtype)).view(sizes);
      dx = run(Primitive::kReduceScatter, dtotal, group, dim).to(x.scalar_type());
    }
    return {dx, dweight, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor gathered_linear(const at::Tensor& x, const at::Tensor& weight, dist::ProcessGroup group, std::int64_t dim) {
  const std::int64_t d = wrap_dim(dim, x);
  return GatheredLinear::apply(x, weight, detail::capsule_of(std::move(group)), d);
}

at::Tensor copy_to_region(const at::Tensor& x, dist::ProcessGroup group) {
  return apply(x, std::move(group), Primitive::kIdentity, Primitive::kAllReduce, -1);
}

at::Tensor reduce_from_region(const at::Tensor& x, dist::ProcessGroup group) {
  return apply(x, std::move(group), Primitive::kAllReduce, Primitive::kIdentity, -1);
}

at::Tensor scatter_to_region(const at::Tensor& x, dist::ProcessGroup group, std::int64_t dim) {
  return apply(x, std::move(group), Primitive::kSlice, Primitive::kAllGather, dim);
}

at::Tensor gather_from_region(const at::Tensor& x, dist::ProcessGroup group, std::int64_t dim) {
  return apply(x, std::move(group), Primitive::kAllGather, Primitive::kSlice, dim);
}

at::Tensor gather_from_sequence(const at::Tensor& x, dist::ProcessGroup group, std::int64_t dim) {
  return apply(x, std::move(group), Primitive::kAllGather, Primitive::kReduceScatter, dim);
}

at::Tensor reduce_scatter_to_sequence(const at::Tensor& x, dist::ProcessGroup group, std::int64_t dim) {
  return apply(x, std::move(group), Primitive::kReduceScatter, Primitive::kAllGather, dim);
}

at::Tensor scatter_to_sequence(const at::Tensor& x, dist::ProcessGroup group, std::int64_t dim) {
  return apply(x, std::move(group), Primitive::kSlice, Primitive::kAllGather, dim);
}

}  // namespace dtrain::nn::tp
